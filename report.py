"""
Paired-seed statistics and routing diagnostics for a grid written by train.py.

$ python report.py out                         # every arm against the first arm
$ python report.py out --reference=attnres --cell=rd_attnres/seed0

Reads out/<arm>/seed<k>/{result.json,log.jsonl} and writes out/report.md and out/paired.json,
plus PNG plots when matplotlib is installed (the tables never need it): validation loss (with the
second half of training zoomed in), the paired delta during training, the QK/V divergence of
arms with a value route, and one cell's depth weights.

Each arm is paired with the reference seed by seed: a seed counts for an arm when the arm's cell
and the reference's both finished and their `pairing` records agree: init and data hashes,
evaluated tokens, code fingerprint, init checkpoint, and every setting both cells record (a setting
only one of them records is that arm's own). The arm's other seeds are listed with the reason and
left out of its n; diverged cells are listed apart. Per arm against the reference, over its paired
seeds: delta_s = NLL_arm - NLL_reference, wins (delta < 0), mean, sample std, 95%
CI (t), paired t-test and exact sign-test p-values (two-sided), the perplexity change
exp(mean delta) - 1, and the mean delta with its 95% CI at every evaluation during training.
"""

import argparse
import itertools
import json
import math
import os
import re
import sys

import numpy as np
from scipy import stats

from data.prepare import DataError, write_json

MISSING = object()  # a pairing key one cell does not record


def is_number(x):
    """A real number (JSON true/false load as bools, which Python would count as 1 and 0)."""
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def is_seed(x):
    return isinstance(x, int) and not isinstance(x, bool) and x >= 0


def read_json(path):
    """The file's dict, or None when it cannot be read (half-written, not JSON, not a dict)."""
    try:
        with open(path) as f:
            obj = json.load(f)
        return obj if isinstance(obj, dict) else None
    except (OSError, ValueError):
        return None


def read_log(path):
    """(records of a log.jsonl, numbers of the lines that do not parse (a torn last line) or whose
    tokens or val_loss is not a number)"""
    records, bad = [], []
    with open(path, errors="replace") as f:
        for number, line in enumerate(f, 1):
            try:
                record = json.loads(line)
            except ValueError:
                record = None
            if isinstance(record, dict) and all(record.get(k) is None or is_number(record[k])
                                                for k in ("tokens", "val_loss")):
                records.append(record)
            elif line.strip():
                bad.append(number)
    return records, bad


def result_problem(result):
    """Why a result.json's fields cannot be used (a wrong type), or None; an absent or null field is allowed."""
    pairing = result.get("pairing")
    for key, ok, kind in (("val_loss", is_number, "a number"), ("wall_time_s", is_number, "a number"),
                          ("pairing", lambda v: isinstance(v, dict), "a dict")):
        if result.get(key) is not None and not ok(result[key]):
            value = json.dumps(result[key])
            return f"{key} is {value if len(value) <= 20 else value[:16] + '...'}, not {kind}"
    if isinstance(pairing, dict) and not isinstance(pairing.get("settings", {}), dict):
        return "pairing.settings is not a dict"
    return None


def load_grid(out_dir):
    """(arms, seeds, {(arm, seed): result or None if unreadable}, {(arm, seed): log records}, notes on skips)"""
    notes = []
    config = read_json(os.path.join(out_dir, "config.json"))
    if config is None and os.path.exists(os.path.join(out_dir, "config.json")):
        notes.append("config.json: unreadable (arms taken from the folders)")
    config = config or {}
    listed = config.get("seeds", [])
    listed = listed if isinstance(listed, list) else [listed]
    arms, seeds = list(config.get("arms", {})), {s for s in listed if is_seed(s)}
    if bad := [json.dumps(s) for s in listed if not is_seed(s)]:
        notes.append(f"config.json: seeds {', '.join(bad)} ignored (not non-negative integers)")
    folders = sorted(f for f in os.listdir(out_dir) if os.path.isdir(os.path.join(out_dir, f)))
    results, logs = {}, {}
    for arm in arms + [f for f in folders if f not in arms]:
        arm_dir = os.path.join(out_dir, arm)
        cells = sorted(c for c in os.listdir(arm_dir) if os.path.isdir(os.path.join(arm_dir, c))) \
            if os.path.isdir(arm_dir) else []
        cell_seeds = {c: int(c[4:]) for c in cells if re.fullmatch(r"seed(0|[1-9][0-9]*)", c)}
        if arm not in arms:
            if not cell_seeds:
                notes.append(f"folder {arm}/: not an arm (no seed<k> cells)")
                continue
            arms.append(arm)
        notes += [f"folder {arm}/{c}/: not a seed<k> cell" for c in cells if c not in cell_seeds]
        for cell, seed in cell_seeds.items():
            seeds.add(seed)
            result, log = (os.path.join(arm, cell, name) for name in ("result.json", "log.jsonl"))
            if os.path.exists(os.path.join(out_dir, result)):
                results[arm, seed] = read_json(os.path.join(out_dir, result))
                problem = results[arm, seed] and result_problem(results[arm, seed])
                if results[arm, seed] is None or problem:
                    results[arm, seed] = None
                    notes.append(f"{result}: unreadable" + (f" ({problem})" if problem else ""))
            if os.path.exists(os.path.join(out_dir, log)):
                logs[arm, seed], bad = read_log(os.path.join(out_dir, log))
                if bad:
                    notes.append(f"{log}: unreadable or non-numeric line {', '.join(map(str, bad))}")
    return arms, sorted(seeds), results, logs, notes


def divergence(result):
    """Why a cell diverged (one line), or None."""
    loss = result.get("val_loss")
    if result.get("status") == "diverged":
        return result.get("reason") or "diverged"
    if not isinstance(loss, (int, float)) or not math.isfinite(loss):
        return f"val_loss is {loss}"
    return None


def cell_problem(results, arm, seed):
    """Why a cell cannot be paired, or None."""
    if (arm, seed) not in results:
        return "missing"
    result = results[arm, seed]
    if result is None:
        return "unreadable result.json"
    if divergence(result):
        return "diverged"
    if not isinstance(result.get("pairing"), dict):
        return "no pairing record"
    return None


def shorten(x, y):
    """Two differing values as short strings that still show where they differ."""
    a, b = ("missing" if v is MISSING else v if isinstance(v, str) else json.dumps(v) for v in (x, y))
    start = max(0, len(os.path.commonprefix([a, b])) - 10)
    return [("..." if start else "") + s[start:start + 16] + ("..." if len(s) > start + 16 else "") for s in (a, b)]


def pairing_difference(p, q):
    """The first key on which two pairing records differ, with both values; None when they agree."""
    ps, qs = p.get("settings", {}), q.get("settings", {})
    keys = [(k, p.get(k, MISSING), q.get(k, MISSING)) for k in sorted((set(p) | set(q)) - {"settings"})]
    keys += [(f"settings.{k}", ps[k], qs[k]) for k in sorted(set(ps) & set(qs))]  # one-sided: an arm's own
    for key, x, y in keys:
        if x != y:
            return "{} ({} vs {})".format(key, *shorten(x, y))
    return None


def unpaired_reason(arms, seed, results):
    """Why a seed cannot be paired across these arms, or None when it can."""
    problems = [f"{arm}/seed{seed} {p}" for arm in arms if (p := cell_problem(results, arm, seed))]
    if problems:
        return "; ".join(problems)
    for a, b in itertools.combinations(arms, 2):
        difference = pairing_difference(results[a, seed]["pairing"], results[b, seed]["pairing"])
        if difference:
            return f"{a} and {b} differ in {difference}"
    return None


def paired_statistics(deltas):
    """Statistics of per-seed deltas (arm - reference; negative = the arm is better)."""
    d = np.asarray(deltas, dtype=np.float64)
    n = len(d)
    mean = float(d.mean()) if n else float("nan")
    std = float(d.std(ddof=1)) if n > 1 else float("nan")
    if n > 1:
        half = stats.t.ppf(0.975, n - 1) * std / math.sqrt(n)
        ci95 = [mean - half, mean + half]
        if np.all(d == d[0]):  # no spread: the t statistic is infinite (or 0/0 for all-zero deltas)
            p_ttest = 0.0 if mean != 0 else 1.0
        else:
            p_ttest = float(stats.ttest_1samp(d, 0.0).pvalue)
    else:
        ci95, p_ttest = [float("nan")] * 2, float("nan")
    wins, losses = int((d < 0).sum()), int((d > 0).sum())
    if wins + losses:  # ties dropped
        p_sign = float(stats.binomtest(wins, wins + losses, 0.5).pvalue)
    else:  # all ties: no evidence either way; no seeds: nothing to test
        p_sign = 1.0 if n else float("nan")
    return dict(deltas=d.tolist(), n=n, wins=wins, mean=mean, std=std, ci95=ci95, p_ttest=p_ttest,
                p_sign=p_sign, ppl_change=math.exp(mean) - 1 if n else float("nan"))


def val_curve(log):
    """{training tokens: validation loss} of one cell's evaluations."""
    return {r["tokens"]: r["val_loss"] for r in log if r.get("val_loss") is not None and "tokens" in r}


def loss_curves(logs, arm, seeds):
    """(tokens every seed evaluated at, array seeds x tokens of validation losses)"""
    curves = [val_curve(logs.get((arm, s), [])) for s in seeds]
    tokens = sorted(set.intersection(*(set(c) for c in curves))) if curves else []
    return np.array(tokens), np.array([[c[t] for t in tokens] for c in curves]).reshape(len(curves), len(tokens))


def delta_curve(logs, arm, reference, seeds):
    """NLL(arm) - NLL(reference) at the evaluations every seed has: tokens, mean and 95% t-interval over seeds."""
    (tokens, values), (ref_tokens, ref_values) = loss_curves(logs, arm, seeds), loss_curves(logs, reference, seeds)
    common = np.intersect1d(tokens, ref_tokens)
    d = values[:, np.isin(tokens, common)] - ref_values[:, np.isin(ref_tokens, common)]
    n = len(seeds)
    mean = d.mean(0) if n else np.full(len(common), np.nan)
    half = stats.t.ppf(0.975, n - 1) * d.std(0, ddof=1) / math.sqrt(n) if n > 1 else np.full(len(common), np.nan)
    return dict(tokens=common, mean=mean, ci95_low=mean - half, ci95_high=mean + half, n=n)


def fmt(x, spec="+.4f"):
    return "nan" if x is None or (isinstance(x, float) and math.isnan(x)) else format(x, spec)


def plots(out_dir, arms, reference, paired_seeds, curves, logs, cell):
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
    val = {arm: loss_curves(logs, arm, paired_seeds[arm]) for arm in arms}
    val = {arm: (t, v) for arm, (t, v) in val.items() if len(t)}
    if val:
        fig, axes = plt.subplots(1, 2, figsize=(10, 4))
        half = max(t[-1] for t, _ in val.values()) / 2
        for ax in axes:
            for arm, (tokens, values) in val.items():
                line, = ax.plot(tokens, values.mean(0), label=f"{arm} (n={len(values)})")
                ax.fill_between(tokens, values.min(0), values.max(0), color=line.get_color(), alpha=0.2)
        late = np.concatenate([v[:, t >= half].ravel() for t, v in val.values()])
        pad = 0.05 * (late.max() - late.min()) or 0.01
        axes[1].set(xlim=(half, None), ylim=(late.min() - pad, late.max() + pad), title="second half of training")
        axes[0].set(title="validation loss")
        for ax in axes:
            ax.set(xlabel="training tokens", ylabel="validation NLL (nats/token)")
        axes[0].legend()
        figures.append(save(fig, out_dir, "val_loss.png",
                            "Validation loss against tokens (mean, min-max band over each arm's paired seeds)"))
    # paired delta against the reference at every evaluation, one panel per arm
    shown = {arm: c for arm, c in curves.items() if len(c["tokens"])}
    if shown:
        fig, axes = plt.subplots(1, len(shown), figsize=(5 * len(shown), 3.5), squeeze=False)
        for ax, (arm, c) in zip(axes[0], shown.items()):
            ax.plot(c["tokens"], c["mean"], marker=".")
            ax.fill_between(c["tokens"], c["ci95_low"], c["ci95_high"], alpha=0.25)
            ax.axhline(0, color="black", linewidth=0.8)
            ax.set(xlabel="training tokens", ylabel="delta NLL (nats/token)", title=f"{arm} - {reference} (n={c['n']})")
        figures.append(save(fig, out_dir, "delta_curve.png",
                            f"Paired delta NLL(arm) - NLL({reference}) during training (mean, 95% t-interval)"))
    # QK/V Jensen-Shannon divergence per layer over training, for arms with a value route
    arm, seed = cell
    for jsd_arm in arms:
        records = [r for r in logs.get((jsd_arm, seed), []) if (r.get("routing") or {}).get("qk_v_jsd")]
        if not records:
            continue
        fig, ax = plt.subplots(figsize=(6, 4))
        for layer in records[0]["routing"]["qk_v_jsd"]:
            ax.plot([r["tokens"] for r in records], [r["routing"]["qk_v_jsd"][layer] for r in records],
                    label=f"layer {layer}")
        ax.set(xlabel="training tokens", ylabel="JSD (nats)", title=f"{jsd_arm} seed{seed}: QK vs V depth routes")
        ax.legend(fontsize=7, ncol=2)
        figures.append(save(fig, out_dir, f"jsd_{jsd_arm}.png",
                            f"{jsd_arm}: QK/V Jensen-Shannon divergence per layer over training"))
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
                grid[i, :len(w)] = w
            image = ax.imshow(grid, aspect="auto", cmap="viridis", vmin=0, vmax=1)
            ax.set(title=route, xlabel="source (embedding first)", ylabel="read")
            ax.set_yticks(range(len(rows)), [n for n, _ in rows], fontsize=6)
            ax.set_xticks(range(width))
            fig.colorbar(image, ax=ax)
        figures.append(save(fig, out_dir, f"routing_{arm}_seed{seed}.png",
                            f"Depth weights of {arm} seed{seed} at the end"))
    return figures


def save(fig, out_dir, name, title):
    import matplotlib.pyplot as plt
    fig.tight_layout()
    path = os.path.join(out_dir, name)
    fig.savefig(path + ".tmp", dpi=110, format="png")
    os.replace(path + ".tmp", path)
    plt.close(fig)
    return title, name


def parse_cell(text, arms, seeds, results, logs):
    """--cell=arm/seedK as (arm, seed), or one error line."""
    match = re.fullmatch(r"(.+)/seed([0-9]+)", text)
    if not match:
        sys.exit(f"error: --cell={text}: give arm/seedK, e.g. --cell={arms[-1]}/seed{seeds[0] if seeds else 0}")
    cell = match[1], int(match[2])
    if cell not in results and cell not in logs:
        sys.exit(f"error: --cell={text}: no such cell; cells: "
                 + ", ".join(f"{a}/seed{s}" for a in arms for s in seeds if (a, s) in results or (a, s) in logs))
    return cell


def main(argv):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out_dir")
    parser.add_argument("--reference", help="reference arm (default: the first arm)")
    parser.add_argument("--cell", help="arm/seedK whose depth weights to plot (default: last arm, first paired seed)")
    args = parser.parse_args(argv)
    if not os.path.isdir(args.out_dir):
        sys.exit(f"error: {args.out_dir} is not a directory; give the out_dir of a train.py grid")
    if not os.access(args.out_dir, os.W_OK):  # before any work: the report and plots are written there
        sys.exit(f"error: cannot write to {args.out_dir} (no write permission or a read-only file system); "
                 f"copy the grid somewhere writable and run report.py on the copy")
    arms, seeds, results, logs, notes = load_grid(args.out_dir)
    if not arms:
        sys.exit(f"error: {args.out_dir} holds no arms; give the out_dir of a train.py grid")
    reference = args.reference or arms[0]
    if reference not in arms:
        sys.exit(f"error: reference arm {reference!r} not found; arms: {', '.join(arms)}")
    others = [arm for arm in arms if arm != reference]
    left_out = {arm: {s: r for s in seeds if (r := unpaired_reason([reference, arm], s, results))} for arm in others}
    paired_seeds = {arm: [s for s in seeds if s not in left_out[arm]] for arm in others}
    # the reference's own curve: the seeds it is paired in with any arm (its finished ones when it is alone)
    paired_seeds[reference] = sorted(set().union(*paired_seeds.values())) if others else \
        [s for s in seeds if not cell_problem(results, reference, s)]
    cell = parse_cell(args.cell, arms, seeds, results, logs) if args.cell else \
        (arms[-1], (paired_seeds[arms[-1]] or seeds or [0])[0])
    diverged = [dict(arm=a, seed=s, step=r.get("steps") if r.get("diverged_at") is None else r["diverged_at"],
                     reason=divergence(r)) for s in seeds for a in arms if (r := results.get((a, s))) and divergence(r)]

    lines = [f"# Paired report: {args.out_dir}", "",
             f"Reference arm: `{reference}`. delta = NLL(arm) - NLL(reference) on the fixed validation set "
             f"(nats/token; negative = better). Each arm is paired with the reference seed by seed: a seed counts "
             f"for an arm when both cells finished and their pairing records agree.", ""]
    if any(left_out.values()):
        lines += ["**Seeds left out** (not counted in that arm's n):", "",
                  *(f"- {arm}, seed {s}: {r}" for arm in others for s, r in left_out[arm].items()), ""]
    lines += ["Final validation loss:", "",
              "| arm | " + " | ".join(f"seed {s}" for s in seeds) + " |",
              "|---" * (len(seeds) + 1) + "|"]
    for arm in arms:
        lines.append(f"| {arm} | " + " | ".join("-" if not (r := results.get((arm, s))) else "diverged" if divergence(r)
                                                 else fmt(r["val_loss"], ".4f") for s in seeds) + " |")
    lines.append("")
    paired, curves = {}, {}
    table = ["| arm | n | wins | mean delta | std | 95% CI | p (t-test) | p (sign) | ppl change |",
             "|---|---|---|---|---|---|---|---|---|"]
    for arm in others:
        seeds_of = paired_seeds[arm]
        st = paired_statistics([results[arm, s]["val_loss"] - results[reference, s]["val_loss"] for s in seeds_of])
        curves[arm] = delta_curve(logs, arm, reference, seeds_of)
        paired[arm] = dict(st, seeds=seeds_of, left_out=[dict(seed=s, reason=r) for s, r in left_out[arm].items()],
                           delta_curve={k: np.asarray(v).tolist() for k, v in curves[arm].items()})
        table.append(f"| {arm} | {st['n']} | {st['wins']}/{st['n']} | {fmt(st['mean'])} | {fmt(st['std'], '.4f')} | "
                     f"[{fmt(st['ci95'][0])}, {fmt(st['ci95'][1])}] | {fmt(st['p_ttest'], '.3g')} | "
                     f"{fmt(st['p_sign'], '.3g')} | {fmt(100 * st['ppl_change'], '+.2f')}% |")
        lines.append(f"Per-seed deltas, {arm}: "
                     + (", ".join(f"seed {s}: {fmt(d)}" for s, d in zip(seeds_of, st["deltas"])) or "none"))
    lines += ["", *table, ""]
    if diverged:
        lines += ["**Diverged cells** (never in the statistics):", "",
                  "| arm | seed | step | reason |", "|---|---|---|---|",
                  *(f"| {d['arm']} | {d['seed']} | {d['step']} | {d['reason']} |" for d in diverged), ""]
    wall = {f"{a}/seed{s}": results[a, s].get("wall_time_s") for a in arms for s in seeds if results.get((a, s))}
    if any(t is not None for t in wall.values()):
        lines += ["Wall time per cell (s; training and evaluation, compile included):", "",
                  "| arm | " + " | ".join(f"seed {s}" for s in seeds) + " | total |", "|---" * (len(seeds) + 2) + "|"]
        for arm in arms:
            times = [wall.get(f"{arm}/seed{s}") for s in seeds]
            lines.append(f"| {arm} | " + " | ".join("-" if t is None else f"{t:.0f}" for t in times)
                         + f" | {sum(t for t in times if t is not None):.0f} |")
        lines.append("")
    if notes:
        lines += ["Skipped:", "", *(f"- {n}" for n in notes), ""]
    summary = "\n".join(lines)
    for title, name in plots(args.out_dir, arms, reference, paired_seeds, curves, logs, cell):
        lines += [f"### {title}", "", f"![{title}]({name})", ""]
    path = os.path.join(args.out_dir, "report.md")
    with open(path + ".tmp", "w") as f:
        f.write("\n".join(lines))
    os.replace(path + ".tmp", path)
    write_json(os.path.join(args.out_dir, "paired.json"),
               dict(reference=reference, arms=paired, diverged=diverged, wall_time_s=wall, skipped=notes))
    print(summary)


if __name__ == "__main__":
    try:
        main(sys.argv[1:])
    except DataError as e:  # a file that could not be written (full disk): one line
        sys.exit(f"error: {e}")
