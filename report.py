"""
Paired-seed statistics and routing diagnostics for a grid written by train.py.

$ python report.py out                         # every arm against the first arm
$ python report.py out --reference=attnres --cell=rd_attnres/seed0

Reads out/<arm>/seed<k>/{result.json,log.jsonl} and writes out/report.md and out/paired.json,
plus PNG plots when matplotlib is installed (the tables never need it). Per arm against the
reference, over the seeds where both cells finished: delta_s = NLL_arm - NLL_reference, wins
(delta < 0), mean, sample std, 95% CI (t), paired t-test and exact sign-test p-values (two-sided),
and the perplexity change exp(mean delta) - 1.
"""

import argparse
import json
import math
import os
import sys

import numpy as np
from scipy import stats


def load_grid(out_dir):
    """(arms in order, seeds, {(arm, seed): result}, [missing 'arm/seedk'], {(arm, seed): log records})"""
    config_path = os.path.join(out_dir, "config.json")
    config = json.load(open(config_path)) if os.path.exists(config_path) else {}
    arms = list(config.get("arms", {}))
    arms += sorted(a for a in os.listdir(out_dir) if os.path.isdir(os.path.join(out_dir, a)) and a not in arms)
    results, logs, seeds = {}, {}, set(config.get("seeds", []))
    for arm in arms:
        arm_dir = os.path.join(out_dir, arm)
        for cell in sorted(os.listdir(arm_dir)) if os.path.isdir(arm_dir) else []:
            if not cell.startswith("seed"):
                continue
            seed = int(cell[4:])
            seeds.add(seed)
            result_path, log_path = (os.path.join(arm_dir, cell, f) for f in ("result.json", "log.jsonl"))
            if os.path.exists(result_path):
                results[arm, seed] = json.load(open(result_path))
            if os.path.exists(log_path):
                logs[arm, seed] = [json.loads(line) for line in open(log_path) if line.strip()]
    seeds = sorted(seeds)
    missing = [f"{a}/seed{s}" for s in seeds for a in arms if (a, s) not in results]
    return arms, seeds, results, missing, logs


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
    p_sign = float(stats.binomtest(wins, wins + losses, 0.5).pvalue) if wins + losses else 1.0  # ties dropped
    return dict(deltas=d.tolist(), n=n, wins=wins, mean=mean, std=std, ci95=ci95, p_ttest=p_ttest,
                p_sign=p_sign, ppl_change=math.exp(mean) - 1 if n else float("nan"))


def pairing_problems(arms, seeds, results):
    """Cells of one seed must share the init of shared parameters and the data order."""
    problems = []
    for seed in seeds:
        cells = [results[a, seed] for a in arms if (a, seed) in results]
        for key in ("init_hash", "data_hash"):
            if len({c.get(key) for c in cells}) > 1:
                problems.append(f"seed {seed}: arms differ in {key.replace('_hash', '')} - not paired")
    return problems


def fmt(x, spec="+.4f"):
    return "nan" if x is None or (isinstance(x, float) and math.isnan(x)) else format(x, spec)


def plots(out_dir, arms, seeds, logs, cell):
    """PNG figures, or [] without matplotlib. Returns (title, file name) pairs."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return []
    figures = []
    # validation loss against tokens: mean over seeds, band from min to max
    fig, ax = plt.subplots(figsize=(6, 4))
    for arm in arms:
        curves = [{r["tokens"]: r["val_loss"] for r in logs.get((arm, s), []) if "val_loss" in r} for s in seeds]
        curves = [c for c in curves if c]
        if not curves:
            continue
        tokens = sorted(set.intersection(*(set(c) for c in curves)))
        values = np.array([[c[t] for t in tokens] for c in curves])
        line, = ax.plot(tokens, values.mean(0), label=f"{arm} (n={len(curves)})")
        ax.fill_between(tokens, values.min(0), values.max(0), color=line.get_color(), alpha=0.2)
    ax.set(xlabel="training tokens", ylabel="validation NLL (nats/token)", title="validation loss")
    ax.legend()
    figures.append(save(fig, out_dir, "val_loss.png", "Validation loss against tokens (mean, min-max band over seeds)"))
    # QK/V Jensen-Shannon divergence per layer over training, for arms with a value route
    for arm in arms:
        records = [r for r in logs.get((arm, seeds[0] if seeds else 0), []) if r.get("routing", {}).get("qk_v_jsd")]
        if not records:
            continue
        fig, ax = plt.subplots(figsize=(6, 4))
        for layer in records[0]["routing"]["qk_v_jsd"]:
            ax.plot([r["tokens"] for r in records], [r["routing"]["qk_v_jsd"][layer] for r in records], label=f"layer {layer}")
        ax.set(xlabel="training tokens", ylabel="JSD (nats)", title=f"{arm} seed{seeds[0]}: QK vs V depth routes")
        ax.legend(fontsize=7, ncol=2)
        figures.append(save(fig, out_dir, f"jsd_{arm}.png", f"{arm}: QK/V Jensen-Shannon divergence per layer over training"))
    # depth-weight heatmaps of one cell's final evaluation, one panel per route
    arm, seed = cell
    final = [r for r in logs.get((arm, seed), []) if r.get("routing", {}).get("weights")]
    if final:
        weights = final[-1]["routing"]["weights"]
        routes = {}
        for name, w in weights.items():
            route = name.split(".")[0] + ("." + name.split(".")[2] if name.count(".") == 2 else "")
            routes.setdefault(route, []).append((name, w))
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
        figures.append(save(fig, out_dir, f"routing_{arm}_seed{seed}.png", f"Depth weights of {arm} seed{seed} at the end"))
    return figures


def save(fig, out_dir, name, title):
    fig.tight_layout()
    fig.savefig(os.path.join(out_dir, name), dpi=110)
    import matplotlib.pyplot as plt
    plt.close(fig)
    return title, name


def main(argv):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out_dir")
    parser.add_argument("--reference", help="reference arm (default: the first arm)")
    parser.add_argument("--cell", help="arm/seedK whose depth weights to plot (default: the last arm's first seed)")
    args = parser.parse_args(argv)
    if not os.path.isdir(args.out_dir):
        sys.exit(f"error: {args.out_dir} is not a directory; give the out_dir of a train.py grid")
    arms, seeds, results, missing, logs = load_grid(args.out_dir)
    if not arms:
        sys.exit(f"error: {args.out_dir} holds no arms; give the out_dir of a train.py grid")
    reference = args.reference or arms[0]
    if reference not in arms:
        sys.exit(f"error: reference arm {reference!r} not found; arms: {', '.join(arms)}")

    lines = [f"# Paired report: {args.out_dir}", "",
             f"Reference arm: `{reference}`. delta = NLL(arm) - NLL(reference) on the fixed validation set "
             f"(nats/token; negative = better).", ""]
    lines += ["| arm | " + " | ".join(f"seed {s}" for s in seeds) + " |", "|---" * (len(seeds) + 1) + "|"]
    for arm in arms:
        lines.append(f"| {arm} | " + " | ".join(fmt(results[arm, s]["val_loss"], ".4f") if (arm, s) in results
                                                 else "-" for s in seeds) + " |")
    lines.append("")
    paired = {}
    table = ["| arm | n | wins | mean delta | std | 95% CI | p (t-test) | p (sign) | ppl change |",
             "|---|---|---|---|---|---|---|---|---|"]
    for arm in arms:
        if arm == reference:
            continue
        both = [s for s in seeds if (arm, s) in results and (reference, s) in results]
        st = paired_statistics([results[arm, s]["val_loss"] - results[reference, s]["val_loss"] for s in both])
        st["seeds"] = both
        paired[arm] = st
        table.append(f"| {arm} | {st['n']} | {st['wins']}/{st['n']} | {fmt(st['mean'])} | {fmt(st['std'], '.4f')} | "
                     f"[{fmt(st['ci95'][0])}, {fmt(st['ci95'][1])}] | {fmt(st['p_ttest'], '.3g')} | "
                     f"{fmt(st['p_sign'], '.3g')} | {fmt(100 * st['ppl_change'], '+.2f')}% |")
        lines.append(f"Per-seed deltas, {arm}: " + ", ".join(f"seed {s}: {fmt(d)}" for s, d in zip(both, st["deltas"])))
    lines += ["", *table, ""]
    problems = pairing_problems(arms, seeds, results)
    if missing:
        lines += ["Missing or unfinished cells (not paired): " + ", ".join(missing), ""]
    if problems:
        lines += ["**Pairing problems:** " + "; ".join(problems), ""]
    if args.cell:
        arm, seed = args.cell.split("/seed")
        cell = (arm, int(seed))
    else:
        cell = (arms[-1], seeds[0] if seeds else 0)
    summary = "\n".join(lines)
    for title, name in plots(args.out_dir, arms, seeds, logs, cell):
        lines += [f"### {title}", "", f"![{title}]({name})", ""]
    with open(os.path.join(args.out_dir, "report.md"), "w") as f:
        f.write("\n".join(lines))
    with open(os.path.join(args.out_dir, "paired.json"), "w") as f:
        json.dump(dict(reference=reference, arms=paired, missing=missing, pairing_problems=problems), f, indent=1)
    print(summary)


if __name__ == "__main__":
    main(sys.argv[1:])
