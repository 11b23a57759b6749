"""
docs/leaderboard.md's tables, one per corpus, from finished leaderboard grids (config/leaderboard.py, one per
corpus) and, beside each, the grids of `standard` alone at longer budgets that give each scheme's gain at equal
wall time: the folders named GRID_standardN (N = their max_iters). Reads only what the grids wrote.

$ python dev/leaderboard.py out/leaderboard_pydoc out/leaderboard_shakespeare

Per scheme: its paired delta against `standard` and against `scaled_residual` as report.py computed it (paired.json:
the mean, the one 95% interval the report quotes, seeds in favour, the t-test's p, the delta the grid detects, the
verdict); its step-time ratio to `standard` in the same grid (report.md's: each cell's mean training ms/step from
its log.jsonl, the first interval left out, the mean over the seeds whose two cells recorded one machine of the
ratios); and its gain at equal wall time:
per seed, the scheme's final loss minus the loss `standard` reaches in ratio x max_iters steps, read off
`standard`'s final losses of that seed at max_iters and the longer budgets (linear in log steps). Where ratio x
max_iters is beyond the longest budget the longest is used and the cell says so (the gain at equal time is then
no better than shown). Given two or more grids, each row also says whether its verdict against each baseline holds
on every corpus: the same *ahead* or *behind* on all of them.

Under each table, whether the grid measures training rather than plateau escape: `standard`'s validation loss per
seed at the evaluations nearest 10%, 20%, 30%, 50% and 100% of the budget, the seeds' spread there, and the Spearman
correlation of their ranking there with their final one (a seed that escapes the plateau late shows as a late
spread that does not shrink, and a ranking set only at the end).
"""

import json
import math
import os
import re
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from grid_files import read_log  # noqa: E402
from paired_stats import paired_statistics, verdict  # noqa: E402
from report import machine_of, step_time  # noqa: E402

BASELINES = ("standard", "scaled_residual")


def read(path):
    with open(path) as f:
        return json.load(f)


def ms_per_step(cell):
    """A cell's training ms/step, as report.md's step-time table has it."""
    return step_time(read_log(os.path.join(cell, "log.jsonl"))[0])


def final_losses(grid, arm, machines=None):
    """{seed: final val_loss} of an arm's finished cells, and the budget (max_iters) they trained; machines, a
    dict given, gets each cell's recorded machine by seed."""
    losses, steps = {}, set()
    for name in os.listdir(os.path.join(grid, arm)):
        path = os.path.join(grid, arm, name, "result.json")
        if name.startswith("seed") and os.path.exists(path) and (r := read(path))["status"] == "finished":
            losses[int(name[4:])] = r["val_loss"]
            steps.add(r["steps"])
            if machines is not None:
                machines[int(name[4:])] = machine_of(r)
    if len(steps) != 1:
        sys.exit(f"error: {grid}/{arm}: cells of {sorted(steps)} steps; one budget per grid")
    return losses, steps.pop()


def at_steps(points, n):
    """Loss at n steps, linear in log steps between the measured budgets; beyond the longest, the longest's."""
    budgets = sorted(points)
    if n >= budgets[-1]:
        return points[budgets[-1]], n > budgets[-1]
    return float(np.interp(math.log(n), [math.log(b) for b in budgets], [points[b] for b in budgets])), False


def cell(st):
    word, ci, _ = verdict(st)
    p = st.get("p_ttest")
    detects, needed = st["power"]["detectable_effect"], st["power"]["seeds_needed"]
    return (
        f"{st['mean']:+.4f} [{ci[0]:+.4f}, {ci[1]:+.4f}], {st['wins']}/{st['n']}, p {p:.2g}"
        + (f", detects {detects:.3f}" if detects else "")
        + (f" ({st['power']['effect']:g}: {needed} seeds)" if needed else "")
        + f": **{word}**"
        if ci
        else f"{st['mean']:+.4f}, {st['wins']}/{st['n']}: **{word}**"
    )


def longer_grids(grid):
    """The grids of `standard` alone beside a leaderboard grid, longest last: GRID_standardN."""
    parent, name = os.path.split(os.path.abspath(grid))
    found = [f for f in os.listdir(parent) if re.fullmatch(re.escape(name) + r"_standard\d+", f)]
    return [os.path.join(parent, f) for f in sorted(found, key=lambda f: int(f.rsplit("standard", 1)[1]))]


def rows(grid):
    """{arm: (cell vs each baseline, verdict vs each baseline, step-time ratio, gain at equal wall time)}."""
    paired = read(os.path.join(grid, "paired.json"))
    arms = list(read(os.path.join(grid, "config.json"))["arms"])
    machines = {arm: {} for arm in arms}
    loss = {arm: final_losses(grid, arm, machines[arm])[0] for arm in arms}
    max_iters = final_losses(grid, "standard")[1]
    budgets = {max_iters: loss["standard"]}
    for g in longer_grids(grid):
        losses, steps = final_losses(g, "standard")
        budgets[steps] = losses
    seeds = sorted(set.intersection(*(set(b) for b in budgets.values())))
    speed = {
        arm: {
            s: ms_per_step(os.path.join(grid, arm, f"seed{s}"))
            for s in loss[arm]
            if s in loss["standard"] and machines[arm][s] == machines["standard"][s]  # a host's speed is no cost
        }
        for arm in arms
    }
    out = {}
    for arm in arms:
        stats = [paired["by_reference"].get(ref, {}).get("arms", {}).get(arm) for ref in BASELINES]
        ratios = {s: speed[arm][s] / speed["standard"][s] for s in speed[arm]}
        gains, beyond = [], False
        for s in seeds:
            if s in loss[arm] and s in ratios:
                base, past = at_steps({b: budgets[b][s] for b in budgets}, ratios[s] * max_iters)
                gains.append(loss[arm][s] - base)
                beyond |= past
        st = paired_statistics(gains)
        equal = (
            "-"
            if arm == "standard"
            else f"{st['mean']:+.4f} [{st['ci95'][0]:+.4f}, {st['ci95'][1]:+.4f}], {st['wins']}/{st['n']}"
            if st["n"] > 1
            else f"{st['mean']:+.4f}, {st['wins']}/{st['n']}"
        ) + (f" (beyond {max(budgets)} steps: at best this)" if beyond else "")
        out[arm] = (
            [cell(x) if x else "-" for x in stats],
            [verdict(x)[0] if x else None for x in stats],
            float(np.mean(list(ratios.values()))) if ratios else None,  # None: no seed whose two cells share a host
            equal,
        )
    return out


def ranks(values):
    return np.argsort(np.argsort(values))


def plateau(grid):
    """`standard`'s validation loss per seed at the evaluations nearest 10/20/30/50/100% of the budget, as a table:
    a row per seed, then the seeds' spread and the Spearman correlation of their ranking with the final one."""
    curves = {
        seed: {
            r["step"]: r["val_loss"]
            for r in read_log(os.path.join(grid, "standard", f"seed{seed}", "log.jsonl"))[0]
            if "val_loss" in r
        }
        for seed in sorted(final_losses(grid, "standard")[0])  # the finished seeds, seed 10 after seed 9
    }
    if len(curves) < 2:
        return []
    last = min(max(c) for c in curves.values())
    steps = sorted(
        {
            min(set.intersection(*(set(c) for c in curves.values())), key=lambda s: abs(s - f * last))
            for f in (0.1, 0.2, 0.3, 0.5, 1.0)
        }
    )
    at = np.array([[curves[seed][s] for s in steps] for seed in curves])  # seeds x steps
    spearman = [float(np.corrcoef(ranks(at[:, i]), ranks(at[:, -1]))[0, 1]) for i in range(len(steps) - 1)]
    return (
        ["| seed | " + " | ".join(f"step {s}" for s in steps) + " |", "|---" * (len(steps) + 1) + "|"]
        + [f"| {seed} | " + " | ".join(f"{v:.4f}" for v in row) + " |" for seed, row in zip(curves, at)]
        + ["| spread (max - min) | " + " | ".join(f"{v:.3f}" for v in np.ptp(at, axis=0)) + " |"]
        + [f"| Spearman with step {steps[-1]} | " + " | ".join(f"{r:+.2f}" for r in spearman) + " | |"]
    )


def holds(verdicts):
    """Whether one verdict against a baseline holds on every corpus: the same ahead or behind on each."""
    if None in verdicts:
        return "-"
    if verdicts[0] != "not detectable at this size" and len(set(verdicts)) == 1:
        return f"yes ({verdicts[0]})"
    return "no (" + " / ".join("n.d." if v.startswith("not") else v for v in verdicts) + ")"


# what may differ between the corpora's grids: where they lie, the text itself, and the code (the report of each
# grid checks its own cells' code); and, in a tuned grid, the rates its tuning chose (setting)
PER_CORPUS = {"out_dir", "data_dir", "train_data_sha256", "code", "changes"}


def setting(config):
    """A grid's config.json less what its tuning chose: each corpus's tuning picks its own rates for the same arms."""
    if not config.get("tune_learning_rates"):
        return config
    chosen = {"learning_rate", "min_lr"}
    return config | {
        "arms": {arm: {k: v for k, v in a.items() if k not in chosen} for arm, a in config["arms"].items()}
    }


def main(*grids):
    configs = [setting(read(os.path.join(g, "config.json"))) for g in grids]
    if differ := sorted(
        {k for c in configs[1:] for k in (c.keys() | configs[0].keys()) - PER_CORPUS if c.get(k) != configs[0].get(k)}
    ):
        sys.exit(
            f"error: {grids[0]} and the other grids differ in {', '.join(differ)}; a table across corpora "
            "compares one setting: rerun a grid with the other's values (config/leaderboard.py)"
        )
    tables = {g: rows(g) for g in grids}
    corpora = " / ".join(os.path.basename(os.path.normpath(c["data_dir"])) for c in configs)  # the verdicts' order
    where = "both corpora" if len(grids) == 2 else "every corpus"
    across = f"holds on {where} (verdicts on {corpora}; vs `standard`; vs `scaled_residual`)"
    for grid, table in tables.items():
        cfg = read(os.path.join(grid, "config.json"))
        longer = ", ".join(os.path.relpath(g) for g in longer_grids(grid)) or "no longer grid"
        print(f"\n{grid} ({cfg['data_dir']}; equal time from {longer})\n")
        print(
            "| scheme | vs `standard`: mean [95% CI], seeds in favour, p, detectable | vs `scaled_residual` | "
            + (f"{across} | " if len(grids) > 1 else "")
            + "step time / `standard` | gain at equal wall time vs `standard`: mean [95% CI t], seeds in favour |"
        )
        print("|---|---|---|" + ("---|" if len(grids) > 1 else "") + "---|---|")
        for arm, (against, _, ratio, equal) in table.items():
            both = ""
            if len(grids) > 1:
                per = [[t[arm][1][i] if arm in t else None for t in tables.values()] for i in range(len(BASELINES))]
                both = f" {holds(per[0])}; {holds(per[1])} |"
            cost = "-" if ratio is None else f"{ratio:.2f}"
            print(f"| `{arm}` | {against[0]} | {against[1]} |{both} {cost} | {equal} |")
        if lines := plateau(grid):
            print(f"\n`standard`'s seeds through the budget ({grid}):\n")
            print("\n".join(lines))


if __name__ == "__main__":
    if len(sys.argv) < 2:
        sys.exit(__doc__)
    main(*sys.argv[1:])
