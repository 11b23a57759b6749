"""
Paired-seed statistics and routing diagnostics for a grid written by train.py.

$ python report.py out                         # every arm against each baseline arm (else the first arm)
$ python report.py out --reference=attnres --cell=rd_attnres/seed0 --effect=0.02
$ python report.py out --reference=standard,scaled_residual

Reads out/<arm>/seed<k>/{result.json,log.jsonl} and writes out/report.md and out/paired.json,
plus PNG plots when matplotlib is installed (the tables never need it): validation loss (with the
second half of training zoomed in), the paired delta during training, the QK/V divergence of
arms with a value route, and one cell's depth weights.

The references are --reference's arms, by default every arm named after a baseline scheme
(standard, scaled_residual), else the first arm. Each gets a section of report.md and an entry of
paired.json's by_reference, pairing every arm with it but the references before it (each pair
once); paired.json's reference, arms and downstream are the first reference's, as in a report of one.
Each arm is paired with the reference seed by seed: a seed counts for an arm when the arm's cell
and the reference's both finished and their `pairing` records agree: init and data hashes,
evaluated tokens, the fingerprint of the code every scheme computes with (an arm's own scheme code is
its own), init checkpoint, and every setting both cells record (a setting only one of them records is
that arm's own). The arm's other seeds are listed with the reason and
left out of its n; diverged cells are listed apart. Per arm against the reference, over its paired
seeds: delta_s = NLL_arm - NLL_reference, wins (delta < 0), mean, sample std, 95%
CI (t), paired t-test and exact sign-test p-values (two-sided), the perplexity change
exp(mean delta) - 1, and the mean delta with its 95% CI at every evaluation during training.
Its power, from the s.d. of those deltas: the smallest mean delta the t-test detects at its n
(alpha 0.05, power 0.8), the seeds it needs for a delta of --effect nats, and whether the sign
test can reach p < 0.05 at all (from 6 seeds).

Each arm's learning rate (its own where it sets one, else the grid's) is a column of the final-loss
table; an arm whose seeds trained at different rates is named under mixed versions. A grid of the
tuned protocol (train.py's tune_learning_rates, tune.py) gets a tuning section from
out/tune/choice.json: the mean (s.d.) tuning-seed loss per arm and rate with the chosen rate marked,
each choice's reason, the tuning seeds, budget and validation text, the tuning's cost beside the
grid's, choices at the edge of the rates tried, arms that did not train at their choice. The
choice.json is checked against the tuning cells in out/tune (every loss as they hold it, the choice
and its reason as tune.py's rule gives them), else one line says why.

Cells that hold a downstream.json (downstream.py) get a downstream section: CORE and each task's
accuracy, arm - reference, with the same statistics, over the seeds paired above whose two
downstream results are of the cells' final step and of one task bundle, scoring code, precision and
set of items; and each task's bits per byte of its right answers, arm - reference, lower is better.

A cell is the arm and seed its result.json records: a copied, moved or linked cell folder, or two
cells of one arm with the same init and data hashes, is listed under "Skipped" and never counted.
Every file is written to a temporary name of this process and renamed (two reports on one grid
never share one); paired.json is strict JSON, null for a number that is not finite. Text from
files and folder names is escaped in report.md, and plot names of long arm names are shortened
with a hash.
"""

import hashlib
import itertools
import json
import math
import os
import re
import sys
import unicodedata

import numpy as np
from scipy import stats

from common import DataError, Parser, remove_stale_temporaries, run, write_atomic, write_text
from grid_files import (
    ABSENT_MEANS,
    TUNE_DIR,
    as_compared,
    close,
    described,
    grid_record,
    is_finite,
    is_seed,
    load_downstream,
    load_grid,
    read_paired,
    read_tuning,
    tuning_results,
)
from paired_stats import (
    ALPHA,
    BOOTSTRAP_CALIBRATED_SEEDS,
    BOOTSTRAP_RESAMPLES,
    FEW_SEQUENCES,
    POWER,
    paired_statistics,
    perplexity_change,
    power_analysis,
    text_uncertainty,
    verdict,
)

MISSING = object()  # a pairing key one cell does not record


# -----------------------------------------------------------------------------
# pairing: which seeds of an arm and a reference compare, and why the others do not


def divergence(result):
    """Why a cell diverged (one line), or None."""
    loss = result.get("val_loss")
    if result.get("status") == "diverged":
        return result.get("reason") or "diverged"
    if not isinstance(loss, (int, float)) or not math.isfinite(loss):
        return f"val_loss is {loss}"
    return None


def cell_problem(results, unusable, arm, seed):
    """Why a cell cannot be paired, or None."""
    if (arm, seed) in unusable:
        return unusable[arm, seed]
    if (arm, seed) not in results:
        return "missing"
    result = results[arm, seed]
    if divergence(result):
        return "diverged"
    if not isinstance(result.get("pairing"), dict):
        return "no pairing record"
    return None


def shorten(x, y):
    """Two differing values as short strings that still show where they differ."""
    a, b = ("missing" if v is MISSING else v if isinstance(v, str) else json.dumps(v) for v in (x, y))
    start = max(0, len(os.path.commonprefix([a, b])) - 10)
    return [("..." if start else "") + s[start : start + 16] + ("..." if len(s) > start + 16 else "") for s in (a, b)]


def pairing_difference(p, q):
    """The first key on which two pairing records differ, with both values; None when they agree."""
    ps, qs = p.get("settings", {}), q.get("settings", {})
    own = {"settings", "arm_settings", "scheme_code"}  # an arm's own settings and scheme code may differ
    keys = [(k, p.get(k, MISSING), q.get(k, MISSING)) for k in sorted((set(p) | set(q)) - own)]
    # the settings both record (one that only one of them records is that arm's own)
    keys += [(f"settings.{k}", as_compared(k, ps[k]), as_compared(k, qs[k])) for k in sorted(set(ps) & set(qs))]
    for key, x, y in keys:
        if x != y:
            return "{} ({} vs {})".format(key, *shorten(x, y))
    return None


def unpaired_reason(arms, seed, results, unusable):
    """Why a seed cannot be paired across these arms, or None when it can."""
    problems = [f"{arm}/seed{seed} {p}" for arm in arms if (p := cell_problem(results, unusable, arm, seed))]
    if problems:
        return "; ".join(problems)
    for a, b in itertools.combinations(arms, 2):
        difference = pairing_difference(results[a, seed]["pairing"], results[b, seed]["pairing"])
        if difference:
            return f"{a} and {b} differ in {difference}"
    return None


def mixed_versions(results, arms, seeds):
    """What differs between the seeds of a comparison, beyond the seed itself (init and data hashes):
    each seed is paired fairly, but a mean over seeds trained under other code or settings
    (--allow_changes) mixes versions. ["key: seeds 0, 1: value; seed 2: value", ...]."""

    def values(pairing):
        v = {k: pairing.get(k) for k in ("code", "scheme_code", "eval_tokens", "val_hash", "init_from", "changes")}
        for group in ("settings", "arm_settings"):  # the arm's own settings (its learning rate) may not differ either
            v |= {f"{group}.{k}": as_compared(k, x) for k, x in (pairing.get(group) or {}).items()}
        return {f"settings.{k}": old for k, old in ABSENT_MEANS.items()} | v  # recorded before the key: as then

    per_seed = {s: {arm: values(results[arm, s]["pairing"]) for arm in arms} for s in seeds}
    notes = []
    for key in sorted({k for s in seeds for arm in arms for k in per_seed[s][arm]}):
        groups = {}
        for s in seeds:
            groups.setdefault(json.dumps([per_seed[s][arm].get(key) for arm in arms], sort_keys=True), []).append(s)
        if len(groups) > 1:
            brief = lambda v: " / ".join(dict.fromkeys(json.dumps(x)[:18] for x in json.loads(v)))  # reference / arm
            notes.append(
                f"{key}: "
                + "; ".join(
                    f"seed{'s' if len(g) > 1 else ''} {', '.join(map(str, g))}: {brief(v)}" for v, g in groups.items()
                )
            )
    return notes


# -----------------------------------------------------------------------------
# downstream: the cells' CORE results (downstream.json), checked, paired and tabled


def evaluation(record):
    """What a downstream result was measured on: two results pair only when this agrees key by key."""
    # not max_per_task: the items scored are (500 items of a task of 400 are every item, its prompts the same)
    return dict(
        bundle_sha256=record["bundle_sha256"],
        scoring_code=record.get("scoring_code"),  # None: written before downstream.json recorded it
        dtype=record.get("dtype"),  # None: as scoring_code
        **{f"tasks.{label}.items": task["items"] for label, task in record["tasks"].items()},
    )


def downstream_unpaired_reason(reference, arm, seed, results, downstream, problems):
    """Why two cells' downstream results of one seed cannot be paired, or None: each must be of its cell's final
    step, and both of one evaluation (task bundle, scoring code, precision, tasks and their items)."""
    reasons = []
    for a in (reference, arm):
        where = f"{a}/seed{seed}"
        if (a, seed) in problems:
            reasons.append(f"{where} {problems[a, seed]}")
        elif (a, seed) not in downstream:
            reasons.append(f"{where} has no downstream.json")
        elif downstream[a, seed]["step"] != results[a, seed].get("steps"):
            reasons.append(
                f"{where} downstream.json is of step {downstream[a, seed]['step']}, its result.json of "
                f"step {described(results[a, seed].get('steps'))}"
            )
    if reasons:
        return "; ".join(reasons)
    difference = pairing_difference(evaluation(downstream[reference, seed]), evaluation(downstream[arm, seed]))
    return f"{reference} and {arm} differ in {difference}" if difference else None


def downstream_comparison(reference, arm, seeds, results, downstream, problems):
    """An arm's downstream results against the reference's over the seeds paired for the loss: the seeds that pair
    and why the others do not, CORE and each task's accuracy deltas with their statistics, and the evaluations
    that differ between seeds (each seed paired fairly, but a mean that mixes them)."""
    left_out = {
        s: r for s in seeds if (r := downstream_unpaired_reason(reference, arm, s, results, downstream, problems))
    }
    paired = [s for s in seeds if s not in left_out]
    core = paired_statistics([downstream[arm, s]["core"] - downstream[reference, s]["core"] for s in paired], True)
    with_bits = [s for s in paired if "bits_per_byte" in downstream[reference, s]]  # both or neither (scoring_code)
    bits = paired_statistics(
        [downstream[arm, s]["bits_per_byte"] - downstream[reference, s]["bits_per_byte"] for s in with_bits]
    ) | dict(seeds=with_bits)  # lower is better
    tasks = {}
    for label in dict.fromkeys(label for s in paired for label in downstream[reference, s]["tasks"]):
        with_task = [s for s in paired if label in downstream[reference, s]["tasks"]]
        of = {a: [downstream[a, s]["tasks"][label] for s in with_task] for a in (reference, arm)}
        st = paired_statistics([t["accuracy"] - r["accuracy"] for t, r in zip(of[arm], of[reference])], True)
        kinds = dict.fromkeys(t["icl_task_type"] for t in of[reference])
        tasks[label] = dict(
            st, seeds=with_task, icl_task_type=" / ".join(kinds), items=sorted({t["items"] for t in of[reference]})
        )
        if all("bits_per_byte" in t for t in of[reference]):
            tasks[label]["bits_per_byte"] = paired_statistics(
                [t["bits_per_byte"] - r["bits_per_byte"] for t, r in zip(of[arm], of[reference])]
            )
    groups = {}
    for s in paired:
        record = downstream[reference, s]
        groups.setdefault(
            f"bundle {record['bundle_sha256'][:12]}, {sum(t['items'] for t in record['tasks'].values())} "
            f"items, scoring code {str(record.get('scoring_code'))[:12]}, {record.get('dtype')}",
            [],
        ).append(s)
    mixed = (
        ["; ".join(f"seed{'s' if len(g) > 1 else ''} {', '.join(map(str, g))}: {e}" for e, g in groups.items())]
        if len(groups) > 1
        else []
    )
    return dict(
        seeds=paired,
        left_out=[dict(seed=s, reason=r) for s, r in left_out.items()],
        mixed_evaluations=mixed,
        core=core,
        bits_per_byte=bits,
        tasks=tasks,
    )


def downstream_lines(arms, seeds, downstream, problems, compared):
    """The report's downstream section: CORE per cell, then against each reference (compared: {reference: {arm:
    downstream_comparison}}) each arm's CORE and task accuracy deltas."""
    lines = [
        "## Downstream tasks",
        "",
        "delta = arm - reference in CORE (the mean over tasks of (accuracy - random baseline) / "
        "(1 - random baseline)) and in each task's accuracy, positive = better; and in bits per byte of the right "
        "answers (each task's, and their mean), negative = better; a win is a delta on the better side of 0. Of "
        "the seeds paired above, a seed counts when both cells' downstream.json are of their final step and of "
        "one evaluation (task bundle, scoring code, precision, tasks and items).",
        "",
        "CORE per cell:",
        "",
        "| arm | " + " | ".join(f"seed {s}" for s in seeds) + " |",
        "|---" * (len(seeds) + 1) + "|",
    ]
    for arm in arms:
        lines.append(
            table_row(
                arm,
                *(
                    fmt(downstream[arm, s]["core"], ".4f")
                    if (arm, s) in downstream
                    else "unreadable"
                    if (arm, s) in problems
                    else "-"
                    for s in seeds
                ),
            )
        )
    lines.append("")
    for reference, against in compared.items():
        if against:
            lines += [f"**Against {md(reference)}**:", "", *downstream_comparison_lines(reference, against)]
    return lines


def downstream_comparison_lines(reference, compared):
    """One reference's part of the downstream section: the seeds left out, CORE deltas, task accuracy deltas."""
    lines = []
    if left_out := [
        f"- {md(arm)}, seed {d['seed']}: {md(d['reason'])}" for arm, c in compared.items() for d in c["left_out"]
    ]:
        lines += ["**Downstream seeds left out** (of this section only):", "", *left_out, ""]
    lines += [
        "| arm | n | wins | mean CORE delta | std | 95% CI | p (t-test) | p (sign) |",
        "|---|---|---|---|---|---|---|---|",
        *(table_row(arm, *statistics_cells(c["core"])) for arm, c in compared.items()),
        "",
        *identical_lines({arm: c["core"] for arm, c in compared.items()}),
    ]
    for arm, c in compared.items():
        lines.append(
            f"Per-seed CORE deltas, {md(arm)}: "
            + (", ".join(f"seed {s}: {fmt(d)}" for s, d in zip(c["seeds"], c["core"]["deltas"])) or "none")
        )
    lines.append("")
    if bits := {arm: c["bits_per_byte"] for arm, c in compared.items() if c["bits_per_byte"]["n"]}:
        lines += [
            "| arm | n | wins | mean bits-per-byte delta | std | 95% CI | p (t-test) | p (sign) |",
            "|---|---|---|---|---|---|---|---|",
            *(table_row(arm, *statistics_cells(st)) for arm, st in bits.items()),
            "",
            *identical_lines({f"{arm}, bits per byte": st for arm, st in bits.items()}),
        ]
    if mixed := [f"- {md(arm)}: {md(note)}" for arm, c in compared.items() for note in c["mixed_evaluations"]]:
        lines += [
            "**Mixed evaluations**: each seed is paired fairly, but an arm's seeds were evaluated on different "
            "task bundles, items, scoring code or precision, so its means mix them; read the seeds apart:",
            "",
            *mixed,
            "",
        ]
    for arm, c in compared.items():
        if c["tasks"]:
            lines += [
                f"Task accuracy, {md(arm)} - {md(reference)}:",
                "",
                "| task | type | items | n | wins | mean delta | std | 95% CI | p (t-test) | p (sign) |",
                "|---|---|---|---|---|---|---|---|---|---|",
                *(
                    table_row(label, md(t["icl_task_type"]), ", ".join(map(str, t["items"])), *statistics_cells(t))
                    for label, t in c["tasks"].items()
                ),
                "",
                *identical_lines({f"{arm}, {label}": t for label, t in c["tasks"].items()}),
            ]
        if bits := {label: t["bits_per_byte"] for label, t in c["tasks"].items() if "bits_per_byte" in t}:
            lines += [
                f"Task bits per byte, {md(arm)} - {md(reference)} (lower is better):",
                "",
                "| task | n | wins | mean delta | std | 95% CI | p (t-test) | p (sign) |",
                "|---|---|---|---|---|---|---|---|",
                *(table_row(label, *statistics_cells(st)) for label, st in bits.items()),
                "",
                *identical_lines({f"{arm}, {label} bits per byte": st for label, st in bits.items()}),
            ]
    return lines


# -----------------------------------------------------------------------------
# validation curves during training


def val_curve(log):
    """{training tokens: validation loss} of one cell's evaluations."""
    return {r["tokens"]: r["val_loss"] for r in log if r.get("val_loss") is not None and r.get("tokens") is not None}


def loss_curves(logs, arm, seeds):
    """(tokens every seed evaluated at, array seeds x tokens of validation losses)"""
    curves = [val_curve(logs.get((arm, s), [])) for s in seeds]
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


# -----------------------------------------------------------------------------
# text: numbers, text from files as inert markdown or plot text, file names


def fmt(x, spec="+.4f"):
    """x by spec; a fixed-point spec turns exponent past 1e6 (a diverging arm's loss would print 300 digits); a
    number that is not defined (None, NaN: no seed, one seed) is the word, never nan."""
    if x is None or isinstance(x, float) and math.isnan(x):
        return "undefined"
    return format(x, spec[:-1] + "e" if spec.endswith("f") and abs(x) >= 1e6 else spec)


MARKUP = re.compile(r"[\\`*\[\]<>|#&~$]|(?<![A-Za-z0-9])_|_(?![A-Za-z0-9])")  # an inner_word's _ is no markup
BLOCK_START = re.compile(r"^([0-9]{0,9})([-+=.)])")  # a list marker ("-", "1.") where text begins a list item


def visible(text):
    """text with line breaks, other control characters and lone surrogates (a folder name that is not UTF-8)
    written as escapes: one line that any file or font takes."""
    return "".join(
        c.encode("unicode_escape").decode() if unicodedata.category(c) in ("Cc", "Cf", "Cs", "Zl", "Zp") else c
        for c in str(text)
    )


def md(text):
    """Text from a file or a folder name as inert markdown: markup escaped, control characters visible (a reason or
    a folder name would otherwise forge lines, table cells or links)."""
    return visible(BLOCK_START.sub(r"\1\\\2", MARKUP.sub(lambda m: "\\" + m[0], str(text))))


def plot_text(text):
    """Text from a file or a folder name for a plot: visible, and its $ literal (matplotlib reads $...$ as math)."""
    return visible(text).replace("$", r"\$")


def file_stem(name):
    """A file name part for an arm or a cell: the name itself when short and plain, else its plain first characters
    and a hash of the whole (a 250-character arm name would make a file name past the file system's limit)."""
    if re.fullmatch(r"[A-Za-z0-9_.-]{1,64}", name):
        return name
    return re.sub(r"[^A-Za-z0-9_.-]", "_", name[:40]) + "-" + hashlib.sha256(os.fsencode(name)).hexdigest()[:12]


def jsd_name(arm):
    return f"jsd_{file_stem(arm)}.png"


def routing_name(cell):
    return f"routing_{file_stem(f'{cell[0]}_seed{cell[1]}')}.png"


# -----------------------------------------------------------------------------
# plots (with matplotlib, when installed)


def plots(out_dir, arms, comparisons, logs, cell):
    """PNG figures, or [] without matplotlib. Returns (title, file name) pairs."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return []
    figures = []
    # validation loss against tokens over each arm's paired seeds: all of training, and its second half zoomed in
    # (the early drop from ln(vocab) would otherwise squash the arms into one line)
    paired_seeds = next(iter(comparisons.values()))["paired_seeds"]  # each arm's seeds paired with the first reference
    val = {arm: loss_curves(logs, arm, paired_seeds[arm]) for arm in arms}
    val = {arm: (t, v) for arm, (t, v) in val.items() if len(t)}
    if val:
        fig, axes = plt.subplots(1, 2, figsize=(10, 4))
        half = max(t[-1] for t, _ in val.values()) / 2
        for ax in axes:
            for arm, (tokens, values) in val.items():
                (line,) = ax.plot(tokens, values.mean(0), label=f"{plot_text(arm)} (n={len(values)})")
                ax.fill_between(tokens, values.min(0), values.max(0), color=line.get_color(), alpha=0.2)
        late = np.concatenate([v[:, t >= half].ravel() for t, v in val.values()])
        late = late[np.isfinite(late)]  # a non-finite evaluation would make the limits NaN
        axes[1].set(xlim=(half, None), title="second half of training")
        if len(late):
            pad = 0.05 * (late.max() - late.min()) or 0.01
            axes[1].set(ylim=(late.min() - pad, late.max() + pad))
        axes[0].set(title="validation loss")
        for ax in axes:
            ax.set(xlabel="training tokens", ylabel="validation NLL (nats/token)")
        axes[0].legend()
        figures.append(
            save(
                fig,
                out_dir,
                "val_loss.png",
                "Validation loss against tokens (mean, min-max band over each arm's paired seeds)",
            )
        )
    # paired delta against each reference at every evaluation: a row per reference, a panel per arm
    shown = {
        ref: {arm: c for arm, c in comparison["curves"].items() if len(c["tokens"])}
        for ref, comparison in comparisons.items()
    }
    shown = {ref: curves for ref, curves in shown.items() if curves}
    if shown:
        width = max(len(curves) for curves in shown.values())
        fig, axes = plt.subplots(len(shown), width, figsize=(5 * width, 3.5 * len(shown)), squeeze=False)
        for row, (reference, curves) in zip(axes, shown.items()):
            for ax, (arm, c) in zip(row, curves.items()):
                ax.plot(c["tokens"], c["mean"], marker=".")
                ax.fill_between(c["tokens"], c["ci95_low"], c["ci95_high"], alpha=0.25)
                ax.axhline(0, color="black", linewidth=0.8)
                ax.set(
                    xlabel="training tokens",
                    ylabel="delta NLL (nats/token)",
                    title=f"{plot_text(arm)} - {plot_text(reference)} (n={c['n']})",
                )
            for ax in row[len(curves) :]:
                ax.axis("off")
        against = next(iter(shown)) if len(shown) == 1 else f"reference), a row per reference ({', '.join(shown)}"
        figures.append(
            save(
                fig,
                out_dir,
                "delta_curve.png",
                f"Paired delta NLL(arm) - NLL({against}) during training (mean, 95% t-interval)",
            )
        )
    # QK/V Jensen-Shannon divergence per layer over training, for arms with a value route
    arm, seed = cell
    for jsd_arm in arms:
        records = [
            r
            for r in logs.get((jsd_arm, seed), [])
            if (r.get("routing") or {}).get("qk_v_jsd") and r.get("tokens") is not None
        ]
        if not records:
            continue
        fig, ax = plt.subplots(figsize=(6, 4))
        for layer in records[0]["routing"]["qk_v_jsd"]:  # a layer a later record lacks is a gap, not an error
            ax.plot(
                [r["tokens"] for r in records],
                [r["routing"]["qk_v_jsd"].get(layer, np.nan) for r in records],
                label=f"layer {plot_text(layer)}",
            )
        ax.set(
            xlabel="training tokens",
            ylabel="JSD (nats)",
            title=f"{plot_text(jsd_arm)} seed{seed}: QK vs V depth routes",
        )
        ax.legend(fontsize=7, ncol=2)
        figures.append(
            save(fig, out_dir, jsd_name(jsd_arm), f"{jsd_arm}: QK/V Jensen-Shannon divergence per layer over training")
        )
    # depth-weight heatmaps of one cell's final evaluation, one panel per route (a read's name without its layer)
    final = [r for r in logs.get((arm, seed), []) if (r.get("routing") or {}).get("weights")]
    if final:
        routes = {}
        for name, w in final[-1]["routing"]["weights"].items():
            routes.setdefault(".".join(p for p in name.split(".") if not p.isdigit()), []).append((name, w))
        fig, axes = plt.subplots(1, len(routes), figsize=(4 * len(routes), 3.5), squeeze=False)
        for ax, (route, rows) in zip(axes[0], routes.items()):
            width = max(len(w) for _, w in rows)
            grid = np.full((len(rows), width), np.nan)
            for i, (_, w) in enumerate(rows):
                grid[i, : len(w)] = w
            image = ax.imshow(grid, aspect="auto", cmap="viridis", vmin=0, vmax=1)
            ax.set(title=plot_text(route), xlabel="source (embedding first)", ylabel="read")
            ax.set_yticks(range(len(rows)), [plot_text(n) for n, _ in rows], fontsize=6)
            ax.set_xticks(range(width))
            fig.colorbar(image, ax=ax)
        figures.append(save(fig, out_dir, routing_name(cell), f"Depth weights of {arm} seed{seed} at the end"))
    return figures


def save(fig, out_dir, name, title):
    import matplotlib.pyplot as plt

    fig.tight_layout()
    try:
        write_atomic(os.path.join(out_dir, name), lambda tmp: fig.savefig(tmp, dpi=110, format="png"))
    finally:
        plt.close(fig)
    return title, name


# -----------------------------------------------------------------------------
# report.md's statistics tables and paired.json's numbers: deltas, text uncertainty, power


def strict(x):
    """x with every non-finite float as None: paired.json is strict JSON (an arm with one seed has no std)."""
    if isinstance(x, float):
        return x if math.isfinite(x) else None
    if isinstance(x, dict):
        return {k: strict(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [strict(v) for v in x]
    return x


def interval(ci):
    """A 95% interval as a table cell: [low, high], or undefined where either end is (no seeds to draw it from)."""
    return "undefined" if any(x is None or math.isnan(x) for x in ci) else f"[{fmt(ci[0])}, {fmt(ci[1])}]"


def statistics_cells(st):
    """n, wins, mean, s.d., 95% CI and both p-values of paired_statistics, as markdown table cells; what is not
    defined (no seed, one seed, identical deltas) is "undefined", said why under the table (identical_lines)."""
    t_test = st["n"] > 1 and not st["identical"]
    return [
        str(st["n"]),
        f"{st['wins']}/{st['n']}",
        fmt(st["mean"]),
        fmt(st["std"], ".4f"),
        interval(st["ci95"]) if t_test else "undefined",
        fmt(st["p_ttest"], ".3g") if t_test else "undefined",
        fmt(st["p_sign"], ".3g"),
    ]


def identical_lines(statistics):
    """A line per comparison ({name: paired_statistics}) whose statistics are not all defined, saying why: no paired
    seed, one, or every seed the same delta."""

    def why(st):
        if st["n"] == 0:
            return "no paired seed: its mean, s.d., interval and p-values are undefined (see the seeds left out)"
        if st["n"] == 1:
            return (
                "1 paired seed: no s.d., so the t-test's p and interval are undefined; a sign test of one seed "
                "cannot go below p = 1"
            )
        return (
            (
                f"every seed has the same delta ({fmt(st['mean'])}): the t-test's p and interval are undefined "
                f"(s.d. 0), not p = 0; the sign test still counts"
            )
            if st["identical"]
            else None
        )

    lines = [f"- {md(name)}: {reason}" for name, st in statistics.items() if (reason := why(st))]
    return lines + [""] if lines else []


def sequence_losses_of(result):
    """(a finished result's per-sequence validation losses, None) or (None, why they cannot be used)."""
    losses = result.get("val_sequence_losses")
    if losses is None:
        return None, "no per-sequence validation losses (a cell of an earlier version)"
    if not isinstance(losses, list) or len(losses) < 2 or not all(is_finite(x) for x in losses):
        return None, "val_sequence_losses is not a list of 2 or more finite numbers"
    if not close(math.fsum(losses) / len(losses), result["val_loss"]):
        return None, "val_sequence_losses do not average to its val_loss (an edited result?)"
    return losses, None


def text_comparison(results, reference, arm, seeds):
    """The arm's mean delta over seeds and validation text together (paired_stats.text_uncertainty), or why it is
    unavailable: it needs every paired seed's per-sequence losses (never a part of the seeds: that would mix)."""
    if len(seeds) < 2:
        return dict(unavailable=f"{len(seeds)} paired seed{'s' * (len(seeds) != 1)}: it needs 2 or more")
    rows, problems = [], []
    for s in seeds:
        (ours, why), (theirs, their_why) = (sequence_losses_of(results[a, s]) for a in (arm, reference))
        problems += [f"{a}/seed{s}: {w}" for a, w in ((arm, why), (reference, their_why)) if w]
        if not (why or their_why):
            rows.append(np.subtract(ours, theirs))
    if problems:
        return dict(unavailable="; ".join(problems))
    if len({len(r) for r in rows}) > 1:
        return dict(unavailable="the cells' validation sets hold different numbers of sequences")
    return text_uncertainty(np.stack(rows))


def disagreement(st, text):
    """Why an arm's intervals disagree on whether 0 is inside (the seeds' t, the t over seeds and text, the bootstrap),
    and which one the verdict quotes; None where they agree."""
    intervals = {
        "the seeds' t interval": st["ci95"],
        "the t interval over seeds and text": text["ci95_t"],
        "the bootstrap": text["ci95"],
    }
    excludes = {
        name: ci[1] < 0 or ci[0] > 0
        for name, ci in intervals.items()
        if not any(x is None or math.isnan(x) for x in ci)
    }
    if len(set(excludes.values())) < 2:
        return None
    why = []
    if "the bootstrap" in excludes and text["n"] < BOOTSTRAP_CALIBRATED_SEEDS:
        why.append(
            f"the bootstrap draws only from the {text['n']} seeds seen and is too narrow below "
            f"{BOOTSTRAP_CALIBRATED_SEEDS} seeds"
        )
    if "the seeds' t interval" in excludes and excludes["the seeds' t interval"] != excludes.get(
        "the t interval over seeds and text", excludes["the seeds' t interval"]
    ):
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


def text_lines(others, paired):
    """The report's table of each arm's mean delta over seeds and validation text together, beside the seeds-only
    t interval, with each source's share of the variance; why it is unavailable where it is."""
    lines = [
        f"Seeds and validation text together: the share of the mean delta's variance that each source carries "
        f"(two-way random-effects estimates): the seeds, the text (which sequences were evaluated) and how the "
        f"seeds' deltas differ by sequence; the 95% interval from that variance (t, the seeds' n - 1 degrees of "
        f"freedom), beside the seeds-only t interval; and a two-way bootstrap's ({BOOTSTRAP_RESAMPLES:,} "
        f"resamples of seeds and sequences, a fixed generator seed), which draws only from the seeds seen: "
        f"at few seeds it is the narrower.",
        "",
        "| arm | n | sequences | mean delta | 95% CI, seeds (t) | 95% CI, seeds and text (t) | bootstrap | "
        "share: seeds | share: text | share: seed x text |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    notes = []
    for arm in others:
        st, text = paired[arm], paired[arm]["text"]
        seeds_only = "undefined" if st["identical"] else interval(st["ci95"])
        if "unavailable" in text:
            lines.append(table_row(arm, str(st["n"]), "-", fmt(st["mean"]), seeds_only, "unavailable", *["-"] * 4))
            notes.append(f"- {md(arm)}: unavailable: {md(text['unavailable'])}")
            continue
        share = text["share"]
        shares = (
            ["-"] * 3
            if text.get("identical")
            else [fmt(100 * share[k], ".0f") + "%" for k in ("seeds", "text", "seed_x_text")]
        )
        lines.append(
            table_row(
                arm,
                str(text["n"]),
                str(text["sequences"]),
                fmt(text["mean"]),
                seeds_only,
                interval(text["ci95_t"]),
                interval(text["ci95"]),
                *shares,
            )
        )
        if text.get("identical"):
            notes.append(
                f"- {md(arm)}: every seed and sequence has the same delta: no variance, so the intervals "
                f"over seeds and text are undefined (not zero wide) and no source has a share"
            )
        if reason := disagreement(st, text):
            notes.append(f"- {md(arm)}: {reason}")
        if text["sequences"] < FEW_SEQUENCES:
            notes.append(
                f"- {md(arm)}: the validation set holds only {text['sequences']} sequences (fewer than "
                f"{FEW_SEQUENCES}): the text's share is estimated from little text; raise eval_tokens"
            )
    return lines + [""] + (notes + [""] if notes else [])


def table_row(name, *cells):
    """A markdown table row: name (an arm, a task: text from files) escaped, cells already markdown."""
    return "| " + " | ".join([md(name), *cells]) + " |"


def power_lines(others, paired, effect):
    """The report's power table: what each arm's n can detect, and why where it cannot be said."""
    lines = [
        f"Power of the paired t-test (two-sided, alpha {ALPHA:g}, power {POWER:g}) at each arm's n, sized from "
        f"the s.d. of its per-seed deltas (itself an estimate from those seeds):",
        "",
        f"| arm | n | s.d. of deltas | smallest detectable mean delta | seeds to detect {effect:g} nats | "
        f"smallest sign-test p |",
        "|---|---|---|---|---|---|",
    ]
    for arm in others:
        p = paired[arm]["power"]
        lines.append(
            table_row(
                arm,
                str(paired[arm]["n"]),
                fmt(p["std"], ".4f"),
                "-" if p["detectable_effect"] is None else fmt(p["detectable_effect"], ".4f"),
                "-" if p["seeds_needed"] is None else str(p["seeds_needed"]),
                fmt(p["sign_test_min_p"], ".3g"),
            )
        )
    lines.append("")
    if notes := [f"- {md(arm)}: {note}" for arm in others for note in paired[arm]["power"]["notes"]]:
        lines += [*notes, ""]
    return lines


# -----------------------------------------------------------------------------
# learning rates and the tuned protocol's tuning grid (tune/choice.json)


def learning_rate_of(result):
    """The learning rate a cell trained at: its arm's own where the arm sets one, else the grid's; None unrecorded."""
    pairing = result.get("pairing") or {}
    rate = (pairing.get("arm_settings") or {}).get(
        "learning_rate", (pairing.get("settings") or {}).get("learning_rate")
    )
    return rate if is_finite(rate) else None


def arm_learning_rates(results, arm):
    """The learning rates an arm's cells trained at, sorted: one, several (the seeds differ), or none recorded."""
    return sorted({rate for (a, _), r in results.items() if a == arm and (rate := learning_rate_of(r)) is not None})


def grid_cost(results):
    """Cells, steps and wall time (s) of results {(arm, seed): result.json}; a time unrecorded counts 0."""
    return dict(
        cells=len(results),
        steps=sum(r["steps"] for r in results.values() if is_seed(r.get("steps"))),
        wall_time_s=round(sum(r["wall_time_s"] for r in results.values() if is_finite(r.get("wall_time_s"))), 1),
    )


def tuning_cost(out_dir, record):
    """grid_cost of the tuning cells of a checked choice.json."""
    return grid_cost(tuning_results(out_dir, record))


def tuning_lines(record, arms, results, cost):
    """The report's tuning section: mean (s.d.) tuning-seed loss per arm and rate, the chosen rate in bold, each
    choice's reason, the rates that did not finish, the tuning's cost beside the grid's; and notes (in the section
    and in paired.json) where a choice lies at the edge of the rates tried or is not what an arm trained at."""
    rates = sorted({row["learning_rate"] for rows in record["table"].values() for row in rows.values()})
    text, seeds = record["tuning_text"], record["tune_seeds"]
    where = (
        "the validation sequences between the reported ones (the odd of 2 x n slots spread evenly over the "
        "validation shard; the reported ones are the even)"
        if text.get("layout") == "spread"
        else f"the validation shard's {text['tokens']:,} tokens from token {text['first_token']:,} (the reported "
        f"validation set is its first {record['test_tokens']:,})"
    )
    lines = [
        "## Learning-rate tuning",
        "",
        f"Each arm's learning rate was chosen before the compared seeds trained, on text they are not judged on: "
        f"every arm ran at each rate below on tuning seeds {', '.join(map(str, seeds))} (never a compared seed) "
        f"for {record['tune_iters']} of the {record['max_iters']} steps (the whole schedule in them, min_lr "
        f"{record['min_lr_ratio']:g} x the rate), evaluated on {where}. "
        f"A rate counts only where every tuning seed finished below its step-0 loss; a larger rate beats a "
        f"smaller one only when it is better on every tuning seed and its mean is lower by more than the s.d. of "
        f"its own seeds' losses; each arm's choice is the smallest rate no larger one beats (never above the "
        f"lowest mean; an exact tie goes to the smaller). The paired result below compares each arm at its own "
        f"chosen rate.",
        "",
        "Mean (s.d.) final validation loss on the tuning seeds (the chosen rate in bold):",
        "",
        "| arm | " + " | ".join(f"lr {r:g}" for r in rates) + " |",
        "|---" * (len(rates) + 1) + "|",
    ]
    notes, unfinished = [], []
    for arm, rows in record["table"].items():
        by_rate, chosen = {row["learning_rate"]: row for row in rows.values()}, record["choice"][arm]
        shown = [
            "-"
            if r not in by_rate
            else "not finished"
            if by_rate[r]["problem"]
            else f"{fmt(by_rate[r]['mean'], '.4f')} ({fmt(by_rate[r]['sd'], '.4f')})"
            for r in rates
        ]
        lines.append(table_row(arm, *(f"**{text}**" if r == chosen else text for r, text in zip(rates, shown))))
        unfinished += [f"{arm} at {r:g}: {row['problem']}" for r, row in by_rate.items() if row["problem"]]
        if len(by_rate) > 1 and chosen in (min(by_rate), max(by_rate)):
            notes.append(
                f"{arm}: the chosen rate {chosen:g} is the {'smallest' if chosen == min(by_rate) else 'largest'} "
                f"tried; the best may lie beyond it (widen tune_learning_rates)"
            )
    lines += [
        "",
        "Choices:",
        "",
        *(f"- {md(arm)}: {rate:g}, {md(record['reason'][arm])}" for arm, rate in record["choice"].items()),
        "",
    ]
    if unfinished:
        lines += [
            "Rates never chosen (not finished: a seed diverged, or ended at or above its step-0 loss):",
            "",
            *(f"- {md(line)}" for line in unfinished),
            "",
        ]
    grid = grid_cost(results)
    cells = lambda n: f"{n} cell{'s' * (n != 1)}"
    lines += [
        f"Cost: the tuning {cells(cost['cells'])}, {cost['steps']:,} steps, {cost['wall_time_s']:,.0f} s wall; "
        f"the paired grid {cells(grid['cells'])}, {grid['steps']:,} steps, {grid['wall_time_s']:,.0f} s wall"
        + (f" (the tuning {100 * cost['steps'] / grid['steps']:.0f}% of the grid's steps)." if grid["steps"] else "."),
        "",
    ]
    for arm in arms:
        trained = {rate for (a, _), r in results.items() if a == arm and (rate := learning_rate_of(r)) is not None}
        if arm not in record["choice"]:
            notes.append(f"{arm}: not in tune/choice.json (not tuned)")
        elif trained - {record["choice"][arm]}:
            notes.append(
                f"{arm}: trained at {', '.join(f'{r:g}' for r in sorted(trained))}, tune/choice.json chose "
                f"{record['choice'][arm]:g}"
            )
    return lines + [f"- {md(note)}" for note in notes] + ([""] if notes else []), notes


def tuning_summary(record, why, notes, cost, results):
    """paired.json's tuning: the choice and its reasons, its tuning seeds, budget and text, the mean and s.d. per arm
    and rate, the cost of the tuning and of the grid; the problem of an unusable choice.json; or None without one."""
    if why:
        return dict(problem=why)
    if record is None:
        return None
    return dict(
        choice=record["choice"],
        reason=record["reason"],
        tune_seeds=record["tune_seeds"],
        tune_iters=record["tune_iters"],
        max_iters=record["max_iters"],
        min_lr_ratio=record["min_lr_ratio"],
        tuning_text=record["tuning_text"],
        test_tokens=record["test_tokens"],
        notes=notes,
        mean={
            arm: {f"{row['learning_rate']:g}": row["mean"] for row in rows.values()}
            for arm, rows in record["table"].items()
        },
        sd={
            arm: {f"{row['learning_rate']:g}": row["sd"] for row in rows.values()}
            for arm, rows in record["table"].items()
        },
        cost=dict(tuning=cost, grid=grid_cost(results)),
    )


# -----------------------------------------------------------------------------
# what the cells share: the model, the machines; another grid beside this one (--beside)

SIZE_KEYS = ("n_layer", "n_head", "n_embd", "block_size", "vocab_size")


def shared_model(results):
    """The model settings every counted cell records alike (its size; its MLP, dense or MoE), and the
    keys among those that differ between cells: a reader of the report sees what was compared."""
    settings = [
        s for r in results.values() if (s := (r.get("pairing") or {}).get("settings"))
    ]  # an old cell may have none
    if not settings:
        return {}, []
    moe = sorted({k for s in settings for k in s if k.startswith("moe_")})  # model.py's MoE options, as recorded
    keys = [k for k in (*SIZE_KEYS, "n_experts", *moe) if any(k in s for s in settings)]
    alike = {k: settings[0].get(k) for k in keys if all(s.get(k) == settings[0].get(k) for s in settings)}
    return alike, [k for k in keys if k not in alike]


def model_line(alike, differ):
    size = ", ".join(f"{k} {alike[k]}" for k in SIZE_KEYS if k in alike)
    if alike.get("n_experts", 1) == 1:
        mlp = "dense MLP" if "n_experts" not in differ else ""
    else:
        width = alike.get("moe_expert_hidden")
        mlp = (
            f"MoE MLP: {alike['n_experts']} experts, top-{alike.get('moe_top_k')}, "
            f"{alike.get('moe_shared_experts', 0)} shared, expert width {width or 'auto'}, "
            f"balancing bias rate {alike.get('moe_bias_rate')}"
        )
    parts = [p for p in (size, mlp) if p] + ([f"differing between cells: {', '.join(differ)}"] if differ else [])
    return "Model shared by every cell: " + "; ".join(parts) + "."


def machine_of(result):
    """The machine a cell recorded (cells.open_cell: machine.machine_record), or None for an older cell."""
    machine = (result.get("config") or {}).get("machine")
    return machine if isinstance(machine, dict) else None


def machine_name(machine):
    where = machine.get("gpu") or f"{machine.get('cpu')} ({machine.get('cpu_capability')} kernels)"
    return f"{where}, torch {machine.get('torch')}"


def machines(arms, seeds, results):
    """The machines the cells ran on (each once) and, per seed whose cells ran on more than one, each cell's:
    they pair (another machine rounds differently; it computes the same thing), but their deltas carry rounding."""
    recorded = {(a, s): m for a in arms for s in seeds if (r := results.get((a, s))) and (m := machine_of(r))}
    distinct = list({json.dumps(m, sort_keys=True): m for m in recorded.values()}.values())
    several = {}
    for s in seeds:
        cells = {a: m for (a, seed), m in recorded.items() if seed == s}
        if len({json.dumps(m, sort_keys=True) for m in cells.values()}) > 1:
            several[s] = {a: distinct.index(m) for a, m in cells.items()}
    return dict(machines=distinct, seeds_on_several=several)


def machine_lines(summary):
    distinct, several = summary["machines"], summary["seeds_on_several"]
    if not distinct:
        return []
    if len(distinct) == 1:
        return [f"Every cell that records its machine ran on: {md(machine_name(distinct[0]))}.", ""]
    lines = [
        "Machines (a result's last digits hold on its machine only: other instruction sets round differently):",
        "",
        *(f"- machine {i}: {md(machine_name(m))}" for i, m in enumerate(distinct)),
        "",
    ]
    if several:
        lines += [
            "**Seeds trained on different machines** (paired all the same: a machine changes rounding, not "
            "what is computed):",
            "",
            *(
                f"- seed {s}: " + ", ".join(f"{md(a)} on machine {i}" for a, i in cells.items())
                for s, cells in several.items()
            ),
            "",
        ]
    return lines


GRID_ONLY_KEYS = (
    "out_dir",
    "code",
    "changes",
    "arms",
    "seeds",
    "reference_arm",
    "wandb_run_name",
)  # not the grid's setup


def beside(out_dir, other, comparisons):
    """Each comparison of this grid beside the same comparison in another grid (its paired.json, from its own
    report), with the grid settings the two differ in (config.json): the same grid on two corpora differs in the
    data alone (data_dir, train_data_sha256, tokenizer)."""
    theirs, why = read_paired(other)
    if why:
        raise DataError(f"--beside={other}: its paired.json cannot be read ({why}); run python report.py {other} first")
    by_reference = theirs.get("by_reference") or {theirs.get("reference"): dict(arms=theirs.get("arms") or {})}
    if not isinstance(by_reference, dict) or not all(
        isinstance(c, dict) and isinstance(c.get("arms", {}), dict) for c in by_reference.values()
    ):
        raise DataError(
            f"--beside={other}: its paired.json's by_reference is not a report's (comparisons by "
            f"reference, each with its arms); run python report.py {other} again"
        )
    configs = [grid_record(d) for d in (out_dir, other)]
    unrecorded = [d for d, c in zip((out_dir, other), configs) if not c]
    differ = (
        []
        if unrecorded
        else sorted(
            k
            for k in set(configs[0]) | set(configs[1])
            if k not in GRID_ONLY_KEYS and configs[0].get(k) != configs[1].get(k)
        )
    )
    rows = []
    for reference, comparison in comparisons.items():
        there = (by_reference.get(reference) or {}).get("arms") or {}
        rows += [
            dict(
                arm=arm, reference=reference, here=here, there=there[arm] if isinstance(there.get(arm), dict) else None
            )
            for arm, here in comparison["paired"].items()
        ]
    arms = dict.fromkeys(a for row in rows for a in (row["reference"], row["arm"]))
    return dict(
        out_dir=other,
        differ=differ,
        rows=rows,
        unrecorded=unrecorded,
        arm_differ={} if unrecorded else arm_differences(configs, arms),
    )


def arm_differences(configs, arms):
    """{arm: ["key (here vs there)", ...]} for the arms whose own settings (each over its grid's) differ between two
    grids' config.json: one arm name for two methods (Block AttnRes here, Full AttnRes there) compares nothing alike."""
    differ = {}
    for arm in arms:
        own = [c["arms"].get(arm) if isinstance(c.get("arms"), dict) else None for c in configs]
        if not all(isinstance(o, dict) for o in own):
            differ[arm] = ["not recorded in both grids' config.json"]
            continue
        values = [{k: o.get(k, c.get(k)) for k in sorted(set(own[0]) | set(own[1]))} for o, c in zip(own, configs)]
        if keys := [k for k in values[0] if values[0][k] != values[1][k]]:
            differ[arm] = ["{} ({} vs {})".format(k, *shorten(values[0][k], values[1][k])) for k in keys]
    return differ


def beside_lines(side):
    """The report's side-by-side table of this grid's comparisons and the other grid's (beside)."""

    def cells(st):
        if st is None:
            return ["-"] * 4
        text = st.get("text") or {}
        ci = "unavailable" if "ci95_t" not in text else interval(text["ci95_t"])
        return [fmt(st.get("mean")), f"{st.get('wins')}/{st.get('n')}", fmt(st.get("p_ttest"), ".3g"), ci]

    if side["unrecorded"]:
        settings = (
            f"The grids' settings cannot be compared: {md(' and '.join(side['unrecorded']))} holds no readable "
            f"config.json."
        )
    else:
        arms = "; ".join(f"{arm}: {', '.join(keys)}" for arm, keys in side["arm_differ"].items())
        grid = f"differ in: {md(', '.join(side['differ']))}" if side["differ"] else "are alike"
        settings = f"The grids' settings {grid}" + (
            f"; **arms of one name with other settings** (their rows compare different methods or rates): {md(arms)}."
            if arms
            else "; every compared arm's own settings are alike."
        )
    lines = [
        f"## Beside {md(side['out_dir'])}",
        "",
        f"Each comparison here and the same one there (from its paired.json): mean delta, wins, p (t-test) and the "
        f"95% interval over seeds and text (t). {settings}",
        "",
        "| arm | reference | here: mean delta | wins | p | CI, seeds and text | there: mean delta | wins | p | "
        "CI, seeds and text |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    lines += [
        table_row(row["arm"], md(row["reference"]), *cells(row["here"]), *cells(row["there"])) for row in side["rows"]
    ]
    if missing := [f"{row['arm']} against {row['reference']}" for row in side["rows"] if row["there"] is None]:
        lines += ["", f"Not in {md(side['out_dir'])}: {md(', '.join(missing))}."]
    return lines + [""]


# -----------------------------------------------------------------------------
# the report: its arguments, the references, one comparison per reference, report.md and paired.json

BASELINES = ("standard", "scaled_residual")  # by default every arm named after a baseline scheme is a reference


def parse_args(argv):
    parser = Parser("report.py", __doc__)
    parser.add_argument("out_dir")
    parser.add_argument(
        "--reference",
        help="reference arms, comma-separated (default: the arms named standard and "
        "scaled_residual, else the first arm)",
    )
    parser.add_argument("--cell", help="arm/seedK whose depth weights to plot (default: last arm, first paired seed)")
    parser.add_argument(
        "--effect",
        type=float,
        default=0.03,
        help="mean delta (nats) to count the seeds needed for (default 0.03: RD-AttnRes's gain)",
    )
    parser.add_argument(
        "--beside",
        help="another grid's out_dir (the same grid on another corpus, with its own report) "
        "whose paired results to set beside these",
    )
    args = parser.parse_args(argv)
    if not (math.isfinite(args.effect) and args.effect > 0):
        sys.exit(f"error: --effect={args.effect}: give a positive number of nats, e.g. --effect=0.03")
    if not os.path.isdir(args.out_dir):
        sys.exit(f"error: {args.out_dir} is not a directory; give the out_dir of a train.py grid")
    if not os.access(args.out_dir, os.W_OK):  # before any work: the report and plots are written there
        sys.exit(
            f"error: cannot write to {args.out_dir} (no write permission or a read-only file system); "
            f"copy the grid somewhere writable and run report.py on the copy"
        )
    return args


def references_of(given, arms):
    """The reference arms: --reference's list, else every arm named after a baseline scheme, else the first arm."""
    references = given.split(",") if given else [arm for arm in arms if arm in BASELINES] or arms[:1]
    if unknown := [r for r in references if r not in arms]:
        sys.exit(f"error: reference arm {unknown[0]!r} not found; arms: {', '.join(arms)}")
    if len(set(references)) < len(references):
        sys.exit(f"error: --reference={given} names an arm twice; name each reference once")
    return references


def output_names(arms, cell):
    """Every file report.py may write into out_dir for these arms and this cell."""
    return ["report.md", "paired.json", "val_loss.png", "delta_curve.png", *map(jsd_name, arms), routing_name(cell)]


def parse_cell(text, arms, seeds, results, logs):
    """--cell=arm/seedK as (arm, seed), or one error line."""
    match = re.fullmatch(r"(.+)/seed([0-9]+)", text)
    if not match:
        sys.exit(f"error: --cell={text}: give arm/seedK, e.g. --cell={arms[-1]}/seed{seeds[0] if seeds else 0}")
    cell = match[1], int(match[2])
    if cell not in results and cell not in logs:
        sys.exit(
            f"error: --cell={text}: no such cell; cells: "
            + ", ".join(f"{a}/seed{s}" for a in arms for s in seeds if (a, s) in results or (a, s) in logs)
        )
    return cell


def compare(reference, earlier, arms, seeds, results, unusable, logs, effect):
    """Every arm paired with one reference seed by seed, but the earlier references (each already paired with this
    one): the seeds left out and why, each arm's paired statistics, power, delta curve and mixed versions."""
    others = [arm for arm in arms if arm != reference and arm not in earlier]
    left_out = {
        arm: {s: r for s in seeds if (r := unpaired_reason([reference, arm], s, results, unusable))} for arm in others
    }
    paired_seeds = {arm: [s for s in seeds if s not in left_out[arm]] for arm in others}
    # the reference's own curve: the seeds it is paired in with any arm (its finished ones when it is alone)
    paired_seeds[reference] = (
        sorted(set().union(*paired_seeds.values()))
        if others
        else [s for s in seeds if not cell_problem(results, unusable, reference, s)]
    )
    paired, curves, mixed = {}, {}, {}
    for arm in others:
        seeds_of = paired_seeds[arm]
        st = paired_statistics([results[arm, s]["val_loss"] - results[reference, s]["val_loss"] for s in seeds_of])
        st["ppl_change"] = perplexity_change(st["mean"])
        curves[arm] = delta_curve(logs, arm, reference, seeds_of)
        mixed[arm] = mixed_versions(results, [reference, arm], seeds_of)
        paired[arm] = dict(
            st,
            seeds=seeds_of,
            left_out=[dict(seed=s, reason=r) for s, r in left_out[arm].items()],
            mixed_versions=mixed[arm],
            delta_curve={k: np.asarray(v).tolist() for k, v in curves[arm].items()},
            power=power_analysis(st, effect),
            text=text_comparison(results, reference, arm, seeds_of),
        )
    return dict(others=others, left_out=left_out, paired_seeds=paired_seeds, paired=paired, curves=curves, mixed=mixed)


def comparison_lines(reference, comparison, earlier, effect):
    """One reference's section of report.md: the seeds left out, each arm's per-seed deltas and statistics, power,
    and the seeds of other versions its means mix."""
    others, paired, left_out, mixed = (comparison[k] for k in ("others", "paired", "left_out", "mixed"))
    lines = [f"## Paired against {md(reference)}", ""]
    if earlier:
        lines += [f"({', '.join(map(md, earlier))}: paired with {md(reference)} above; each pair once.)", ""]
    if not others:
        return lines + ["No other arm to pair with.", ""]
    if any(left_out.values()):
        lines += [
            "**Seeds left out** (not counted in that arm's n):",
            "",
            *(f"- {md(arm)}, seed {s}: {md(r)}" for arm in others for s, r in left_out[arm].items()),
            "",
        ]
    table = [
        "| arm | n | wins | mean delta | std | 95% CI | p (t-test) | p (sign) | ppl change |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for arm in others:
        st = paired[arm]
        percent = 100 * st["ppl_change"]
        table.append(
            table_row(
                arm,
                *statistics_cells(st),
                "off scale"
                if math.isinf(percent)
                else "undefined"
                if math.isnan(percent)
                else fmt(percent, "+.2f") + "%",
            )
        )
        lines.append(
            f"Per-seed deltas, {md(arm)}: "
            + (", ".join(f"seed {s}: {fmt(d)}" for s, d in zip(st["seeds"], st["deltas"])) or "none")
        )
    lines += ["", *table, "", *identical_lines({arm: paired[arm] for arm in others})]
    if any(math.isinf(paired[arm]["ppl_change"]) for arm in others):
        lines += [
            "ppl change off scale: exp(mean delta) - 1 is past a float (a mean delta above 709 nats: a diverging arm).",
            "",
        ]
    lines += power_lines(others, paired, effect) + text_lines(others, paired)
    if any(mixed.values()):
        lines += [
            "**Mixed versions**: each seed below is paired fairly, but these seeds were trained under other "
            "code or settings (--allow_changes), so an arm's mean mixes them; read the seeds apart, or rerun "
            "the grid in a new out_dir:",
            "",
            *(f"- {md(arm)}: {md(note)}" for arm in others for note in mixed[arm]),
            "",
        ]
    return lines


# -----------------------------------------------------------------------------
# the report's opening: what was compared (settings, size, data, code) and one verdict per pair

RATE_KEYS = ("learning_rate", "min_lr", "muon_learning_rate")


def recorded_cell(results, arm):
    """An arm's first counted result, the one its opening describes (its seeds share settings: mixed_versions says
    where they do not), or None."""
    return next((r for (a, _), r in sorted(results.items()) if a == arm), None)


def cell_settings(result, config):
    """A cell's model and rates as recorded: its record's model (every GPTConfig key) and learning rates, else what
    its pairing record holds over its arm's settings and the grid's (config.json); {} when none is."""
    record = result.get("config") if isinstance(result.get("config"), dict) else {}
    if isinstance(record.get("model"), dict):
        return record["model"] | {k: record[k] for k in RATE_KEYS if k in record}
    pairing = result.get("pairing") or {}
    own = (config.get("arms") or {}).get(result["arm"]) if isinstance(config.get("arms"), dict) else None
    grid = {k: v for k, v in config.items() if k != "arms"} | (own if isinstance(own, dict) else {})
    return grid | (pairing.get("settings") or {}) | (pairing.get("arm_settings") or {})  # the cell's own last


def differing_settings(results, config, arm, reference):
    """'key value (reference's)' for each recorded setting where an arm's cell differs from its reference's."""
    mine, theirs = (recorded_cell(results, a) for a in (arm, reference))
    if mine is None or theirs is None:
        return "not recorded (no counted cell)"
    a, b = cell_settings(mine, config), cell_settings(theirs, config)
    if not a or not b:
        return "not recorded"
    keys = [k for k in dict.fromkeys([*a, *b]) if k not in GRID_ONLY_KEYS and a.get(k) != b.get(k)]
    return ", ".join(f"{k} {described(a.get(k))} ({described(b.get(k))})" for k in keys) or "none"


def size_cells(result, config):
    """[parameters, non-embedding parameters, active FLOPs per token] of a cell, as recorded: training FLOPs per
    token as model.flops_per_token counts them (6 x active parameters + 12 x n_layer x n_embd x block_size for
    attention), computed here from the recorded counts and shape; 'not recorded' where they are not."""
    if result is None:
        return ["-"] * 3
    settings = cell_settings(result, config)
    counts = [result.get(k) for k in ("params", "non_embedding_params", "active_params")]
    dense = settings.get("n_experts", 1) == 1
    active = counts[2] if is_seed(counts[2]) else counts[0] if dense and is_seed(counts[0]) else None
    shape = [settings.get(k) for k in ("n_layer", "n_embd", "block_size")]
    flops = (
        "not recorded (no active_params)"
        if active is None
        else "not recorded (no n_layer, n_embd, block_size)"
        if not all(map(is_seed, shape))
        else f"{6 * active + 12 * shape[0] * shape[1] * shape[2]:,}"
    )
    return [f"{c:,}" if is_seed(c) else "not recorded" for c in counts[:2]] + [flops]


def recorded_values(results, read):
    """The distinct values read(result) gives over the counted cells (None where a cell records none), in order."""
    return list(dict.fromkeys(json.dumps(read(r), sort_keys=True) for r in results.values()))


def validation_words(described):
    """A cell's record of its validation text (records.ValidationText.described) in words."""
    if not isinstance(described, dict):
        return "validation text not described (a cell made before that record)"
    where = (
        "spread evenly over the validation shard"
        if described.get("layout") == "spread"
        else "the first of the validation shard (eval_layout 'first')"
    )
    words = f"{described.get('sequences')} sequences {where}"
    if is_seed(described.get("documents")) and is_seed(described.get("held_out_documents")):
        words += f", in {described['documents']} of its {described['held_out_documents']} documents"
    if is_seed(described.get("bytes")):
        words += f", {described['bytes']:,} bytes of text"
    return words


def data_lines(results, config):
    """The data the cells were trained and evaluated on, as their records say: corpus, tokens trained, the
    validation text; and the code commit."""
    record = lambda r: r.get("config") if isinstance(r.get("config"), dict) else config
    field = lambda key: lambda r: record(r).get(key)
    said = lambda values: "; ".join(
        "not recorded" if v == "null" else md(json.loads(v)) if v.startswith('"') else md(v) for v in values
    )
    corpus = said(recorded_values(results, field("data_dir")))
    shards = ", ".join(
        md(str(json.loads(v))[:12]) for v in recorded_values(results, field("train_data_sha256")) if v != "null"
    )
    tokenizer = said(recorded_values(results, field("tokenizer")))
    trained = recorded_values(results, lambda r: r.get("tokens") if is_seed(r.get("tokens")) else None)
    tokens = ", ".join(f"{json.loads(v):,}" if v != "null" else "not recorded" for v in trained)
    evaluated = recorded_values(
        results,
        lambda r: [
            (r.get("pairing") or {}).get("eval_tokens"),
            len(r["val_sequence_losses"]) if isinstance(r.get("val_sequence_losses"), list) else None,
            (r.get("pairing") or {}).get("val_hash"),
        ],
    )
    validation = "; ".join(
        f"{'not recorded' if n is None else f'{n:,} tokens'} of the validation shard evaluated"
        + (f", {m} sequences" if m else "")
        + (f", val_hash {str(h)[:12]}" if h else "")
        for n, m, h in map(json.loads, evaluated)
    )
    described = [json.loads(v) for v in recorded_values(results, lambda r: r.get("validation"))]
    if any(isinstance(d, dict) for d in described):  # what the text was, where the cells record it
        validation += "; " + "; ".join(validation_words(d) for d in described)
    commits = recorded_values(
        results,
        lambda r: [((r.get("code") or record(r).get("code") or {}).get(k)) for k in ("git_commit", "git_dirty")],
    )
    code = "; ".join(
        "not recorded" if not c else f"git commit {c[:12]}" + (", plus uncommitted edits" if dirty else "")
        for c, dirty in map(json.loads, commits)
    )
    return [
        f"Data: corpus {corpus}"
        + (f" (train shards sha256 {shards}...)" if shards else "")
        + f", tokenizer {tokenizer}; tokens trained per cell: {tokens}; validation text: {validation}.",
        "",
        f"Code: {code}" + (" (cells of several versions: see Mixed versions)" if len(commits) > 1 else "") + ".",
        "",
    ]


def verdict_lines(comparisons, references):
    """One line per pair: ahead, behind or not detectable at this size, on the one interval quoted (quoted_interval),
    with the mean delta, the seeds in favour and the smallest delta the grid detects."""
    lines = []
    for reference in references:
        for arm, st in comparisons[reference]["paired"].items():
            word, ci, what = verdict(st)
            detects = st["power"]["detectable_effect"]
            lines.append(
                f"- {md(arm)} against {md(reference)}: **{word}**: "
                + (
                    f"mean delta {fmt(st['mean'])} nats, 95% CI {interval(ci)} ({what}), "
                    if ci
                    else f"{what}, "
                    if st["n"] == 0
                    else f"mean delta {fmt(st['mean'])} nats ({what}), "
                )
                + f"{st['wins']}/{st['n']} seeds in favour"
                + (f"; this grid detects {detects:.4f} nats (power {POWER:g})" if detects else "")
            )
    return lines


def opening_lines(arms, references, results, comparisons, config):
    """What the report compared, first: a grid without a baseline arm says so; each arm's settings that differ from
    its reference, its size and FLOPs; the data and the code; one verdict per pair."""
    lines = []
    if not any(arm in BASELINES for arm in arms):
        lines += [
            f"**No baseline arm**: none of the arms is a baseline scheme ({', '.join(BASELINES)}); every delta "
            f"below is against {', '.join(map(md, references))}, not against a baseline.",
            "",
        ]
    lines += [
        "| arm | settings that differ from its reference (the reference's) | parameters | non-embedding | "
        "active FLOPs per token (training) |",
        "|---|---|---|---|---|",
    ]
    for arm in arms:
        reference = references[0] if arm != references[0] else None
        lines.append(
            table_row(
                arm,
                "(the reference)" if reference is None else md(differing_settings(results, config, arm, reference)),
                *size_cells(recorded_cell(results, arm), config),
            )
        )
    lines += ["", *data_lines(results, config)] if results else [""]
    if verdicts := verdict_lines(comparisons, references):
        lines += [
            f"Verdicts (ahead: the 95% interval of the mean delta below 0; behind: above; else not detectable "
            f"at this size). One interval is quoted: the t interval over seeds and text (the seeds' t interval "
            f"where the cells record no per-sequence losses); the two-way bootstrap only from "
            f"{BOOTSTRAP_CALIBRATED_SEEDS} seeds, where it is calibrated (below, it draws from too few seeds "
            f"and its interval is too narrow):",
            "",
            *verdicts,
            "",
        ]
    return lines


def intro_lines(out_dir, references):
    return [
        f"# Paired report: {md(out_dir)}",
        "",
        f"Reference arm{'s' if len(references) > 1 else ''}: {', '.join(map(md, references))}. "
        f"delta = NLL(arm) - NLL(reference) on the fixed validation set (nats/token; negative = better). Each arm "
        f"is paired with each reference seed by seed: a seed counts for an arm when both cells finished and their "
        f"pairing records agree.",
        "",
    ]


def diverged_cells(arms, seeds, results):
    """The cells that diverged: arm, seed, the step and the reason."""
    return [
        dict(
            arm=a,
            seed=s,
            step=r.get("steps") if r.get("diverged_at") is None else r["diverged_at"],
            reason=divergence(r),
        )
        for s in seeds
        for a in arms
        if (r := results.get((a, s))) and divergence(r)
    ]


def diverged_lines(diverged):
    if not diverged:
        return []
    return [
        "**Diverged cells** (never in the statistics):",
        "",
        "| arm | seed | step | reason |",
        "|---|---|---|---|",
        *(table_row(d["arm"], str(d["seed"]), md(d["step"]), md(d["reason"])) for d in diverged),
        "",
    ]


def final_loss_lines(arms, seeds, results):
    """Each cell's final validation loss and each arm's learning rate."""
    lines = [
        "Final validation loss:",
        "",
        "| arm | " + " | ".join(f"seed {s}" for s in seeds) + " | learning rate |",
        "|---" * (len(seeds) + 2) + "|",
    ]
    for arm in arms:
        lines.append(
            table_row(
                arm,
                *(
                    "-"
                    if not (r := results.get((arm, s)))
                    else "diverged"
                    if divergence(r)
                    else fmt(r["val_loss"], ".4f")
                    for s in seeds
                ),
                ", ".join(f"{rate:g}" for rate in arm_learning_rates(results, arm)) or "-",
            )
        )
    return lines + [""]


def wall_time_lines(arms, seeds, wall):
    lines = [
        "Wall time per cell (s; training and evaluation, compile included):",
        "",
        "| arm | " + " | ".join(f"seed {s}" for s in seeds) + " | total |",
        "|---" * (len(seeds) + 2) + "|",
    ]
    for arm in arms:
        times = [wall.get(f"{arm}/seed{s}") for s in seeds]
        lines.append(
            f"| {md(arm)} | "
            + " | ".join("-" if t is None else f"{t:.0f}" for t in times)
            + f" | {sum(t for t in times if t is not None):.0f} |"
        )
    return lines + [""]


def step_time(log):
    """A cell's training ms/step: the mean of its log's intervals, the first (allocation, warm-up) left out; or None."""
    times = [r["ms_per_step"] for r in log if is_finite(r.get("ms_per_step"))]
    return float(np.mean(times[1:] or times)) if times else None


def step_time_lines(arms, seeds, logs, reference, results):
    """Each arm's training ms/step per seed and its step time over the reference's, the mean over the seeds both
    logged of arm / reference: what a gain costs, measured in the same grid (so on its machine and under its load).
    A seed whose two cells recorded different machines (machine_of) is left out of the ratio, with a note: a
    grid continued on another host would otherwise price a scheme by the hosts' speeds."""
    times = {(a, s): step_time(logs.get((a, s), [])) for a in arms for s in seeds}
    if all(t is None for t in times.values()):
        return []
    logged = lambda a, s: times[a, s] and times.get((reference, s))
    lines = [
        f"Training step time (ms/step, each cell's logged intervals but the first; ratio: the mean over seeds of "
        f"the arm's over {md(reference)}'s, measured in this grid):",
        "",
        "| arm | " + " | ".join(f"seed {s}" for s in seeds) + f" | ratio to {md(reference)} |",
        "|---" * (len(seeds) + 2) + "|",
    ]
    apart, used = {}, set()
    for arm in arms:
        both = []
        for s in seeds:
            if not logged(arm, s):
                continue
            here, there = (machine_of(results.get((a, s)) or {}) for a in (arm, reference))  # None: not recorded
            if here and there and here != there:
                apart.setdefault(arm, []).append(s)
                continue
            both.append(times[arm, s] / times[reference, s])
            used.add(json.dumps(there, sort_keys=True))
        lines.append(
            f"| {md(arm)} | "
            + " | ".join("-" if times[arm, s] is None else f"{times[arm, s]:.1f}" for s in seeds)
            + f" | {f'{np.mean(both):.2f}' if both else '-'} |"
        )
    lines.append("")
    for arm, left in apart.items():
        lines.append(
            f"{md(arm)}: seed(s) {', '.join(map(str, left))} left out of its ratio: its cell and {md(reference)}'s "
            "trained on different machines (their result.json's config.machine); rerun one of the two beside the "
            "other to price it."
        )
    if len(used) > 1:
        lines.append(f"The ratios come from {len(used)} machines (each seed's two cells on one).")
    return lines + ([""] if apart or len(used) > 1 else [])


def main(argv):
    args = parse_args(argv)
    remove_stale_temporaries(os.path.join(args.out_dir, "report.md"), every=True)  # a killed report's, any file's
    arms, seeds, results, unusable, logs, notes = load_grid(args.out_dir)
    if not arms:
        sys.exit(f"error: {args.out_dir} holds no arms; give the out_dir of a train.py grid")
    references = references_of(args.reference, arms)
    comparisons = {
        ref: compare(ref, references[:i], arms, seeds, results, unusable, logs, args.effect)
        for i, ref in enumerate(references)
    }
    first = comparisons[references[0]]  # the curves of val_loss.png and the default --cell
    cell = (
        parse_cell(args.cell, arms, seeds, results, logs)
        if args.cell
        else (arms[-1], (first["paired_seeds"][arms[-1]] or seeds or [0])[0])
    )
    for name in output_names(arms, cell):  # before anything is written: a folder there would stop the report half way
        if os.path.isdir(path := os.path.join(args.out_dir, name)):
            raise DataError(f"{path} is a folder, where report.py writes its {name}; move or delete it")
    diverged = diverged_cells(arms, seeds, results)
    lines = intro_lines(args.out_dir, references) + opening_lines(
        arms, references, results, comparisons, grid_record(args.out_dir)
    )
    model, differ = shared_model(results) if results else ({}, [])
    if results:
        lines += [md(model_line(model, differ)), ""]
    tuning, tuning_why = read_tuning(args.out_dir)
    tuning_notes, cost = [], tuning and tuning_cost(args.out_dir, tuning)
    if tuning:
        section, tuning_notes = tuning_lines(tuning, arms, results, cost)
        lines += section
    elif tuning_why:
        lines += [
            "## Learning-rate tuning",
            "",
            f"{TUNE_DIR}/choice.json: unreadable ({md(tuning_why)}); the arms' "
            f"rates cannot be traced to a tuning: the learning rate column below is what each arm trained at.",
            "",
        ]
    lines += final_loss_lines(arms, seeds, results)
    ran_on = machines(arms, seeds, results)
    lines += machine_lines(ran_on)
    for i, ref in enumerate(references):
        lines += comparison_lines(ref, comparisons[ref], references[:i], args.effect)
    side = args.beside and beside(args.out_dir, args.beside, comparisons)
    if side:
        lines += beside_lines(side)
    lines += diverged_lines(diverged)
    downstream, problems, downstream_notes = load_downstream(args.out_dir, results)
    notes += downstream_notes
    compared = None
    if downstream or problems:
        compared = {
            ref: {
                arm: downstream_comparison(ref, arm, c["paired_seeds"][arm], results, downstream, problems)
                for arm in c["others"]
            }
            for ref, c in comparisons.items()
        }
        lines += downstream_lines(arms, seeds, downstream, problems, compared)
    wall = {f"{a}/seed{s}": results[a, s].get("wall_time_s") for a in arms for s in seeds if results.get((a, s))}
    if any(t is not None for t in wall.values()):
        lines += wall_time_lines(arms, seeds, wall)
    lines += step_time_lines(arms, seeds, logs, references[0], results)
    if notes:
        lines += ["Skipped:", "", *(f"- {md(n)}" for n in notes), ""]
    summary = "\n".join(lines)
    for title, name in plots(args.out_dir, arms, comparisons, logs, cell):
        lines += [f"### {md(title)}", "", f"![{md(title)}]({name})", ""]
    write_text(os.path.join(args.out_dir, "report.md"), "\n".join(lines))
    core = downstream and {f"{a}/seed{s}": r["core"] for (a, s), r in downstream.items()}
    # reference and arms (and downstream's arms): the first reference's, as a report of one reference writes them
    write_text(
        os.path.join(args.out_dir, "paired.json"),
        json.dumps(
            strict(
                dict(
                    reference=references[0],
                    references=references,
                    model=dict(model, differing=differ),
                    arms=first["paired"],
                    by_reference={
                        ref: dict(arms=c["paired"], downstream=compared and compared[ref])
                        for ref, c in comparisons.items()
                    },
                    diverged=diverged,
                    downstream=compared and dict(core=core, arms=compared[references[0]]),
                    tuning=tuning_summary(tuning, tuning_why, tuning_notes, cost, results),
                    learning_rates={arm: arm_learning_rates(results, arm) for arm in arms},
                    wall_time_s=wall,
                    machines=ran_on,
                    beside=side,
                    skipped=notes,
                )
            ),
            indent=1,
            allow_nan=False,
        ),
    )
    print(summary)


if __name__ == "__main__":
    run(main)
