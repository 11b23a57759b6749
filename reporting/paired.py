"""The paired comparison: which seeds of an arm and a reference pair and why the others do not, the statistics of their
deltas (paired_stats.py), over seeds and over seeds and validation text, the power, the delta during training, and the
verdicts; and report.md's section per reference.

A seed counts for an arm when its cell and the reference's both finished and their `pairing` records agree: init and
data hashes, evaluated tokens, the fingerprint of the code every scheme computes with (recomputed from the code the cell
records: grid_files.pairing_record; an arm's own scheme code is its own), init checkpoint, and every setting both cells
record (one that only one of them records is that arm's own). Diverged cells are listed apart; seeds trained under other
code or settings (--allow_changes) pair, and are named as mixed versions."""

import itertools
import json
import math
import os

import numpy as np
from scipy import stats

from grid_files import ABSENT_MEANS, as_compared, close, is_finite, pairing_record
from paired_stats import ALPHA, BOOTSTRAP_CALIBRATED_SEEDS, BOOTSTRAP_RESAMPLES, FEW_SEQUENCES, POWER, verdict
from paired_stats import interval_detects, paired_statistics, perplexity_change, power_analysis, text_uncertainty
from reporting.text import arm_notes, block, bullets, cell_name, fmt, interval, left_out_lines, md, per_seed, plural
from reporting.text import seed_groups, statistics_table, table, undefined

MISSING = object()  # a pairing key one cell does not record


def divergence(result):
    """Why a cell diverged (one line), or None."""
    loss = result.get("val_loss")
    if result.get("status") == "diverged":
        return result.get("reason") or "diverged"
    if not isinstance(loss, (int, float)) or not math.isfinite(loss):
        return f"val_loss is {loss}"


def difference(key, x, y):
    """'key (x vs y)', the two values shortened to where they differ."""
    a, b = ("missing" if v is MISSING else v if isinstance(v, str) else json.dumps(v) for v in (x, y))
    start = max(0, len(os.path.commonprefix([a, b])) - 10)
    a, b = (("..." if start else "") + s[start : start + 16] + ("..." if len(s) > start + 16 else "") for s in (a, b))
    return f"{key} ({a} vs {b})"


def pairing_difference(p, q):
    """The first key on which two pairing records differ, with both values; None when they agree."""
    ps, qs = p.get("settings", {}), q.get("settings", {})
    own = {"settings", "arm_settings", "scheme_code"}  # an arm's own settings and scheme code may differ
    keys = [(k, p.get(k, MISSING), q.get(k, MISSING)) for k in sorted((set(p) | set(q)) - own)]
    # the settings both record (one that only one of them records is that arm's own)
    keys += [(f"settings.{k}", as_compared(k, ps[k]), as_compared(k, qs[k])) for k in sorted(set(ps) & set(qs))]
    return next((difference(key, x, y) for key, x, y in keys if x != y), None)


def pair_seeds(reference, arm, seeds, problem, record):
    """The seeds whose cells of reference and arm pair, and the others as paired.json's left_out, each with why: each
    cell's problem(arm, seed), else the first key on which their record(arm, seed)s differ."""
    left_out = []
    for s in seeds:
        if problems := [f"{cell_name(a, s)} {p}" for a in (reference, arm) if (p := problem(a, s))]:
            left_out.append(dict(seed=s, reason="; ".join(problems)))
        elif differs := pairing_difference(record(reference, s), record(arm, s)):
            left_out.append(dict(seed=s, reason=f"{reference} and {arm} differ in {differs}"))
    return [s for s in seeds if s not in [d["seed"] for d in left_out]], left_out


def mixed_versions(results, arms, seeds):
    """["key: seeds 0, 1: value; seed 2: value", ...] for each pairing key, but the seed's own (init and data
    hashes), whose value differs between the seeds: each seed pairs, but a mean over them mixes versions."""

    def values(pairing):
        v = {k: pairing.get(k) for k in ("code", "scheme_code", "eval_tokens", "val_hash", "init_from", "changes")}
        for group in ("settings", "arm_settings"):  # the arm's own settings (its learning rate) may not differ either
            v |= {f"{group}.{k}": as_compared(k, x) for k, x in (pairing.get(group) or {}).items()}
        return {f"settings.{k}": old for k, old in ABSENT_MEANS.items()} | v  # recorded before the key: as then

    per_seed = {s: {arm: values(pairing_record(results[arm, s])) for arm in arms} for s in seeds}
    brief = lambda v: " / ".join(dict.fromkeys(json.dumps(x)[:18] for x in json.loads(v)))  # reference / arm
    value = lambda key, s: json.dumps([per_seed[s][arm].get(key) for arm in arms], sort_keys=True)
    keys = sorted({k for s in seeds for arm in arms for k in per_seed[s][arm]})
    return [f"{key}: {groups}" for key in keys if (groups := seed_groups(seeds, lambda s: value(key, s), brief))]


def loss_curves(logs, arm, seeds):
    """(tokens every seed evaluated at, array seeds x tokens of validation losses)"""
    evaluated = lambda r: r.get("val_loss") is not None and r.get("tokens") is not None
    curves = [{r["tokens"]: r["val_loss"] for r in logs.get((arm, s), []) if evaluated(r)} for s in seeds]
    tokens = sorted(set.intersection(*(set(c) for c in curves))) if curves else []
    return np.array(tokens), np.array([[c[t] for t in tokens] for c in curves]).reshape(len(curves), len(tokens))


def delta_curve(logs, arm, reference, seeds):
    """NLL(arm) - NLL(reference) at the evaluations every seed has: tokens, mean and 95% t-interval over seeds (NaN
    where fewer than 2 seeds or every seed has the same delta: undefined)."""
    (tokens, values), (ref_tokens, ref_values) = loss_curves(logs, arm, seeds), loss_curves(logs, reference, seeds)
    common = np.intersect1d(tokens, ref_tokens)
    d = values[:, np.isin(tokens, common)] - ref_values[:, np.isin(ref_tokens, common)]
    n = len(seeds)
    with np.errstate(over="ignore", invalid="ignore"):  # a diverging arm's losses past 1e308: inf, null in paired.json
        mean = d.mean(0) if n else np.full(len(common), np.nan)
        half = stats.t.ppf(0.975, n - 1) * d.std(0, ddof=1) / math.sqrt(n) if n > 1 else np.full(len(common), np.nan)
        half = np.where((d == d[:1]).all(0), np.nan, half)  # every seed the same delta: no interval, not zero wide
        return dict(tokens=common, mean=mean, ci95_low=mean - half, ci95_high=mean + half, n=n)


def compare(reference, earlier, arms, seeds, results, unusable, logs, effect):
    """Every arm paired with one reference seed by seed, but the earlier references (each already paired with this
    one): the seeds left out and why, each arm's paired statistics, power, delta curve and mixed versions."""
    others = [arm for arm in arms if arm != reference and arm not in earlier]

    def problem(a, s):  # why a cell cannot be paired, or None
        if (a, s) in unusable:
            return unusable[a, s]
        if (a, s) not in results:
            return "missing"
        if divergence(results[a, s]):
            return "diverged"
        if not isinstance(results[a, s].get("pairing"), dict):
            return "no pairing record"

    pairing = lambda a, s: pairing_record(results[a, s])
    paired, paired_seeds, curves = {}, {}, {}
    for arm in others:
        seeds_of, left_out = pair_seeds(reference, arm, seeds, problem, pairing)
        paired_seeds[arm] = seeds_of
        st = paired_statistics([results[arm, s]["val_loss"] - results[reference, s]["val_loss"] for s in seeds_of])
        curves[arm] = delta_curve(logs, arm, reference, seeds_of)
        paired[arm] = dict(
            st,
            ppl_change=perplexity_change(st["mean"]),
            seeds=seeds_of,
            left_out=left_out,
            mixed_versions=mixed_versions(results, [reference, arm], seeds_of),
            delta_curve={k: np.asarray(v).tolist() for k, v in curves[arm].items()},
            power=power_analysis(st, effect),
            text=text_comparison(results, reference, arm, seeds_of),
        )
    # the reference's own curve: the seeds it is paired in with any arm (its finished ones when it is alone)
    paired_seeds[reference] = (
        sorted(set().union(*paired_seeds.values())) if others else [s for s in seeds if not problem(reference, s)]
    )
    return dict(others=others, paired_seeds=paired_seeds, paired=paired, curves=curves)


def sequence_losses_problem(result):
    """Why a finished result's per-sequence validation losses cannot be used, or None."""
    losses = result.get("val_sequence_losses")
    if losses is None:
        return "no per-sequence validation losses (a cell of an earlier version)"
    if not isinstance(losses, list) or len(losses) < 2 or not all(is_finite(x) for x in losses):
        return "val_sequence_losses is not a list of 2 or more finite numbers"
    if not close(math.fsum(losses) / len(losses), result["val_loss"]):
        return "val_sequence_losses do not average to its val_loss (an edited result?)"


def text_comparison(results, reference, arm, seeds):
    """The arm's mean delta over seeds and validation text together (paired_stats.text_uncertainty), or why it is
    unavailable: it needs every paired seed's per-sequence losses (never a part of the seeds: that would mix)."""
    if len(seeds) < 2:
        return dict(unavailable=f"{len(seeds)} paired {plural('seed', len(seeds))}: it needs 2 or more")
    cells = [(a, s) for s in seeds for a in (arm, reference)]
    if problems := [f"{cell_name(a, s)}: {why}" for a, s in cells if (why := sequence_losses_problem(results[a, s]))]:
        return dict(unavailable="; ".join(problems))
    losses = lambda a, s: results[a, s]["val_sequence_losses"]
    rows = [np.subtract(losses(arm, s), losses(reference, s)) for s in seeds]
    if len({len(r) for r in rows}) > 1:
        return dict(unavailable="the cells' validation sets hold different numbers of sequences")
    return text_uncertainty(np.stack(rows))


def disagreement(st, text):
    """Why an arm's intervals disagree on whether 0 is inside (the seeds' t, the t over seeds and text, the bootstrap),
    and which one the verdict quotes; None where they agree."""
    seeds_t, text_t, bootstrap = "the seeds' t interval", "the t interval over seeds and text", "the bootstrap"
    intervals = {seeds_t: st["ci95"], text_t: text["ci95_t"], bootstrap: text["ci95"]}
    excludes = {name: ci[1] < 0 or ci[0] > 0 for name, ci in intervals.items() if not any(map(undefined, ci))}
    if len(set(excludes.values())) < 2:
        return None
    why = []
    if bootstrap in excludes and text["n"] < BOOTSTRAP_CALIBRATED_SEEDS:
        why.append(
            f"the bootstrap draws only from the {text['n']} seeds seen and is too narrow below "
            f"{BOOTSTRAP_CALIBRATED_SEEDS} seeds"
        )
    if seeds_t in excludes and excludes[seeds_t] != excludes.get(text_t, excludes[seeds_t]):
        why.append(
            "the t interval over seeds and text counts the text's variance (which sequences were evaluated) "
            "beside the seeds'"
        )
    inside = [name for name, out in excludes.items() if not out]
    outside = [name for name, out in excludes.items() if out]
    return (
        f"{' and '.join(outside)} exclude{'s' * (len(outside) == 1)} 0, {' and '.join(inside)} "
        f"do{'es' * (len(inside) == 1)} not: {'; '.join(why) or 'they are estimated apart'}; "
        f"the verdict quotes {verdict(st | dict(text=text))[2]}"
    )


def comparison_lines(reference, comparison, earlier, effect):
    """One reference's section of report.md."""
    paired = comparison["paired"]
    lines = [f"## Paired against {md(reference)}", ""]
    if earlier:
        lines += [f"({', '.join(map(md, earlier))}: paired with {md(reference)} above; each pair once.)", ""]
    if not paired:
        return lines + ["No other arm to pair with.", ""]
    lines += left_out_lines("**Seeds left out** (not counted in that arm's n):", paired)
    lines += [per_seed(f"Per-seed deltas, {md(arm)}", st["seeds"], st["deltas"]) for arm, st in paired.items()]
    percent = lambda x: "off scale" if math.isinf(x) else "undefined" if math.isnan(x) else fmt(100 * x, "+.2f") + "%"
    ppl = lambda st: percent(st["ppl_change"])
    lines += ["", *statistics_table("arm", "mean delta", paired, after=[("ppl change", ppl)])]
    if any(math.isinf(st["ppl_change"]) for st in paired.values()):
        lines += [
            "ppl change off scale: exp(mean delta) - 1 is past a float (a mean delta above 709 nats: a diverging arm).",
            "",
        ]
    lines += power_lines(paired, effect) + text_lines(paired)
    return lines + arm_notes(
        "**Mixed versions**: each seed below is paired fairly, but these seeds were trained under other "
        "code or settings (--allow_changes), so an arm's mean mixes them; read the seeds apart, or rerun "
        "the grid in a new out_dir:",
        paired,
        lambda st: map(md, st["mixed_versions"]),
    )


def power_lines(paired, effect):
    """The report's power table: what each arm's n can detect, and why where it cannot be said."""
    head = ["arm", "n", "s.d. of deltas", "smallest detectable mean delta", f"seeds to detect {effect:g} nats"]
    rows = []
    for arm, st in paired.items():
        p = st["power"]
        detects = "-" if p["detectable_effect"] is None else fmt(p["detectable_effect"], ".4f")
        needed = "-" if p["seeds_needed"] is None else str(p["seeds_needed"])
        rows.append([arm, str(st["n"]), fmt(p["std"], ".4f"), detects, needed, fmt(p["sign_test_min_p"], ".3g")])
    return block(
        f"Power of the paired t-test (two-sided, alpha {ALPHA:g}, power {POWER:g}) at each arm's n, sized from "
        f"the s.d. of its per-seed deltas (itself an estimate from those seeds):",
        table([*head, "smallest sign-test p"], rows),
    ) + arm_notes(None, paired, lambda st: st["power"]["notes"])


def text_lines(paired):
    """Each arm's mean delta over seeds and validation text together, and why where it is unavailable."""
    rows, notes = [], []
    for arm, st in paired.items():
        text, seeds_only = st["text"], interval(st["ci95"])
        if "unavailable" in text:
            rows.append([arm, str(st["n"]), "-", fmt(st["mean"]), seeds_only, "unavailable", *["-"] * 4])
            notes.append(f"{md(arm)}: unavailable: {md(text['unavailable'])}")
            continue
        shares = ["-"] * 3
        if not text.get("identical"):
            shares = [fmt(100 * text["share"][k], ".0f") + "%" for k in ("seeds", "text", "seed_x_text")]
        rows.append(
            [arm, str(text["n"]), str(text["sequences"]), fmt(text["mean"]), seeds_only, interval(text["ci95_t"])]
            + [interval(text["ci95"]), *shares]
        )
        if text.get("identical"):
            notes.append(
                f"{md(arm)}: every seed and sequence has the same delta: no variance, so the intervals "
                f"over seeds and text are undefined (not zero wide) and no source has a share"
            )
        if reason := disagreement(st, text):
            notes.append(f"{md(arm)}: {reason}")
        if text["sequences"] < FEW_SEQUENCES:
            notes.append(
                f"{md(arm)}: the validation set holds only {text['sequences']} sequences (fewer than "
                f"{FEW_SEQUENCES}): the text's share is estimated from little text; raise eval_tokens"
            )
    head = ["arm", "n", "sequences", "mean delta", "95% CI, seeds (t)", "95% CI, seeds and text (t)", "bootstrap"]
    return block(
        f"Seeds and validation text together: the share of the mean delta's variance that each source carries "
        f"(two-way random-effects estimates): the seeds, the text (which sequences were evaluated) and how the "
        f"seeds' deltas differ by sequence; the 95% interval from that variance (t, the seeds' n - 1 degrees of "
        f"freedom), beside the seeds-only t interval; and a two-way bootstrap's ({BOOTSTRAP_RESAMPLES:,} "
        f"resamples of seeds and sequences, a fixed generator seed), which draws only from the seeds seen: "
        f"at few seeds it is the narrower.",
        table([*head, "share: seeds", "share: text", "share: seed x text"], rows),
    ) + bullets(None, notes)


def verdict_lines(comparisons, references):
    """One item per pair: ahead, behind or not detectable at this size, on the one interval quoted."""
    lines = []
    for reference in references:
        for arm, st in comparisons[reference]["paired"].items():
            word, ci, what = verdict(st)
            mean = f"mean delta {fmt(st['mean'])} nats"
            said = f"{mean}, 95% CI {interval(ci)} ({what})" if ci else what if st["n"] == 0 else f"{mean} ({what})"
            detects = interval_detects(ci, st["n"])
            lines.append(
                f"{md(arm)} against {md(reference)}: **{word}**: {said}, {st['wins']}/{st['n']} seeds in favour"
                + (f"; this interval detects {detects:.4f} nats (power {POWER:g})" if detects else "")
            )
    return lines


def diverged_cells(arms, seeds, results):
    """The cells that diverged: arm, seed, the step and the reason."""
    step = lambda r: r.get("steps") if r.get("diverged_at") is None else r["diverged_at"]
    cells = [(a, s, r) for s in seeds for a in arms if (r := results.get((a, s))) and divergence(r)]
    return [dict(arm=a, seed=s, step=step(r), reason=divergence(r)) for a, s, r in cells]


def diverged_lines(diverged):
    rows = [[d["arm"], str(d["seed"]), md(d["step"]), md(d["reason"])] for d in diverged]
    head = "**Diverged cells** (never in the statistics):"
    return block(head, rows and table(["arm", "seed", "step", "reason"], rows))


# a rise between two consecutive evaluations after warmup that flags a cell: in the stored leaderboard grids (12 x 64,
# 600 steps, evaluations every 60) no arm but MUDDFormer rose by more than 0.062 nats (validation 0.019, training
# loss at the evaluations' steps 0.062: Post-LN, Python docs), and MUDDFormer's spikes were 0.75-1.35
SPIKE_NATS = 0.1


def spikes(arms, seeds, logs, warmup, tuned_steps):
    """Each rise of more than SPIKE_NATS between two consecutive evaluations after warmup, of the validation loss or
    the training loss logged at those steps; past_tuning: after tuned_steps (None: untuned), unseen by the tuning."""
    found = []
    for arm, s in itertools.product(arms, seeds):
        log = [r for r in logs.get((arm, s), []) if is_finite(r.get("step"))]
        evals = [(r["step"], r["val_loss"]) for r in log if is_finite(r.get("val_loss")) and r["step"] >= warmup]
        train = {r["step"]: r["loss"] for r in log if is_finite(r.get("loss"))}
        for (a, va), (b, vb) in zip(evals, evals[1:]):
            for what, rise in (("validation", vb - va), ("training", train.get(b, math.nan) - train.get(a, math.nan))):
                if rise > SPIKE_NATS:
                    past = tuned_steps is not None and b > tuned_steps
                    found.append(dict(arm=arm, seed=s, steps=[a, b], loss=what, rise=rise, past_tuning=past))
    return found


def spike_lines(found, warmup, tuned_steps):
    head = (
        f"**Loss spikes**: a rise of more than {SPIKE_NATS:g} nats between two consecutive evaluations after the "
        f"{warmup} warmup steps, in the validation loss or the training loss logged at those steps"
    )
    if tuned_steps is not None:
        head += (
            f" (well above the noise: in the stored leaderboard grids no other arm rose by more than 0.062); a spike "
            f"past the tuning's {tuned_steps} steps is one its choice of rate never saw"
        )
    items = [
        f"{md(d['arm'])}, seed {d['seed']}: {d['loss']} loss {fmt(d['rise'], '+.3f')} nats between steps "
        f"{d['steps'][0]} and {d['steps'][1]}" + (" (past the tuning's budget)" if d["past_tuning"] else "")
        for d in found
    ]
    return bullets(head + ":", items)
