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
no better than shown). An arm with no finished cell (diverged on every seed) has a row that says so. Given two or
more grids, each row also says whether its verdict against each baseline holds on every corpus: the same *ahead*
or *behind* on all of them.

Under each table, whether the grid measures training rather than plateau escape: `standard`'s validation loss per
seed at the evaluations nearest 10%, 20%, 30%, 50% and 100% of the budget, the seeds' spread there, and the Spearman
correlation of their ranking there with their final one (a seed that escapes the plateau late shows as a late
spread that does not shrink, and a ranking set only at the end).

--cost=BENCH_JSON takes each scheme's step-time ratio from a bench.py run at the grid's shape (every row says what
made it: compiled or eager, the machine) instead of the grid's own cells, for the step-time column and the gain at
equal wall time; rows of another shape are refused, and a scheme the file lacks gets no cost:

$ python bench.py --n_layer=12 --n_embd=64 --n_head=4 --block_size=128 --batch_size=8 --vocab_size=320 \
      --compile=True --dtype=float32 --peak_mem=False --out=compiled.json
$ python dev/leaderboard.py out/leaderboard_shakespeare --cost=compiled.json

Rank a scheme of model.RESIDUALS among a stored grid's rows, training only what it must:

$ python dev/leaderboard.py --add=myscheme out/leaderboard_shakespeare [--dry_run] [--seeds=0,1 ...]

in GRID's neighbour rank_<scheme>_<GRID's name> (the stored grid is never written). Where this code computes
`standard`, `scaled_residual` and the scheme as the grid's recorded code did (records.code_changes) and this machine
is the one its baselines' cells recorded: a copy of the grid without checkpoints, to which train.py adds the
scheme's arm under the grid's recorded config (its tuning cells, then its seeds), paired with the stored baselines.
Otherwise (said in one line): a grid of both baselines and the scheme afresh under the grid's settings, tuning
included, so that its deltas and step-time ratio are of one machine and one code. train.py's main runs in one
worker per core, two at most, sharing the grid; other --key=value go to it (a tiny test: --max_iters=8, which makes
the grid a fresh one). --dry_run says what it would run and how long it takes at the stored cells' speeds. Then it
prints the scheme's row among the stored rows, ordered by the mean delta against `standard`.
"""

import dataclasses
import json
import math
import multiprocessing
import os
import re
import shlex
import shutil
import signal
import sys
import types

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from common import Parser, UserError, run  # noqa: E402
from configurator import parse_literal  # noqa: E402
from grid_files import code_fingerprints, duration, pairing_record, read_log  # noqa: E402
from paired_stats import paired_statistics, verdict  # noqa: E402
from reporting.cost import machine_name, machine_of, step_time  # noqa: E402

BASELINES = ("standard", "scaled_residual")


def read(path):
    with open(path) as f:
        return json.load(f)


def ms_per_step(cell):
    """A cell's training ms/step, as report.md's step-time table has it."""
    return step_time(read_log(os.path.join(cell, "log.jsonl"))[0])


def results(grid, arm):
    """{seed: result.json} of an arm's cells that have one."""
    folder = os.path.join(grid, arm)
    return {
        int(name[4:]): read(path)
        for name in (os.listdir(folder) if os.path.isdir(folder) else [])
        if re.fullmatch(r"seed\d+", name) and os.path.exists(path := os.path.join(folder, name, "result.json"))
    }


def final_losses(grid, arm, machines=None):
    """{seed: final val_loss} of an arm's finished cells, and the budget (max_iters) they trained (None where none
    finished); machines, a dict given, gets each cell's recorded machine by seed."""
    losses, steps = {}, set()
    for seed, r in results(grid, arm).items():
        if r["status"] == "finished":
            losses[seed] = r["val_loss"]
            steps.add(r["steps"])
            if machines is not None:
                machines[seed] = machine_of(r)
    if len(steps) > 1:
        sys.exit(f"error: {grid}/{arm}: cells of {sorted(steps)} steps; one budget per grid")
    return losses, next(iter(steps), None)


def unfinished(grid, arm, seeds):
    """What an arm without a finished cell has instead: how many of its seeds diverged, how many have no result."""
    diverged = sum(r["status"] == "diverged" for r in results(grid, arm).values())
    if diverged == len(seeds):
        return f"diverged on every seed ({diverged}/{len(seeds)})"
    return f"no finished cell ({diverged} of {len(seeds)} seeds diverged, the others have no result)"


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


def check_grid(grid):
    """One line, and exit, for a folder the table cannot be read from: not there (where results/ stores it, the
    commands that extract it), no config.json or paired.json, no arm `standard` to pair the rows with."""
    name = os.path.basename(os.path.normpath(grid))
    archive = os.path.relpath(os.path.join(ROOT, "results", name, "grids.tar.xz"))
    if not os.path.isdir(grid):
        parent = os.path.dirname(os.path.normpath(grid)) or "."
        sys.exit(
            f"error: {grid} does not exist; "
            + (
                f"results/ stores it: mkdir -p {parent} && tar xJf {archive} -C {parent}"
                if os.path.exists(archive)
                else "give a grid folder that train.py wrote"
            )
        )
    for file, remedy in (("config.json", "not a grid train.py wrote"), ("paired.json", f"python report.py {grid}")):
        if not os.path.exists(os.path.join(grid, file)):
            sys.exit(f"error: {grid} has no {file}: {remedy}")
    if "standard" not in (arms := read(os.path.join(grid, "config.json"))["arms"]):
        sys.exit(
            f"error: {grid} has no arm `standard` (its arms: {', '.join(arms)}), which every row is paired with; add "
            f"it: train.py with the grid's config and --out_dir={grid} --arms=standard (a grid accepts added arms)"
        )


RATES = ("learning_rate", "min_lr", "routing_lr_scale")  # what tuning chooses; none changes a step's time


def bench_ratios(path, config):
    """{bench.py variant: its time ratio to `standard`} from a bench.py output measured at the grid's shape."""
    try:
        rows = read(path)
        made = {json.dumps(r["made"], sort_keys=True) for r in rows}
    except (OSError, ValueError, TypeError, KeyError) as e:
        sys.exit(f"error: --cost={path} is not a bench.py output that records what made it ({e}); rerun bench.py")
    shape = ("n_layer", "n_head", "n_embd", "block_size", "batch_size", "vocab_size", "dtype")
    bench = json.loads(made.pop()) if len(made) == 1 else None
    if bench is None or (differ := [k for k in shape if bench[k] != config.get(k)]):
        sys.exit(
            f"error: --cost={path} was measured at another shape than the grid's ("
            + (", ".join(f"{k} {bench[k]} there, {config.get(k)} here" for k in differ) if bench else "several")
            + "); rerun bench.py with the grid's settings (dev/leaderboard.py's docstring)"
        )
    return {r["variant"]: r["time_ratio"] for r in rows}


def variant_of(settings):
    """The bench.py variant (bench.VARIANTS) whose model settings an arm's are, or None: an arm of other settings
    was not benchmarked. Rates (a routing rate's scale too) change no step time; a setting at GPTConfig's default
    is no setting."""
    import bench  # torch and train.py: only for --cost
    from model import GPTConfig

    default = {f.name: f.default for f in dataclasses.fields(GPTConfig)}
    model = lambda s: {k: v for k, v in s.items() if k not in RATES and v != default.get(k)}
    return next((name for name, v in bench.VARIANTS.items() if model(v) == model(settings)), None)


def grid_config(grid):
    """A grid's config.json with every arm its report paired: cells copied in, which a run found done and so never
    recorded there, by their own record."""
    config = read(os.path.join(grid, "config.json"))
    for arm in read(os.path.join(grid, "paired.json"))["arms"]:
        if arm not in config["arms"]:
            config["arms"][arm] = read(os.path.join(grid, arm, f"seed{config['seeds'][0]}", "config.json"))["arms"][arm]
    return config


def rows(grid, longer=None, cost=None):
    """{arm: (cell vs each baseline, verdict vs each baseline, step-time ratio, gain at equal wall time, mean delta
    vs `standard`)}; longer: the grids of `standard` at longer budgets (default: those beside grid); cost: a
    bench.py output whose ratios replace the grid's own step times (bench_ratios)."""
    config, paired = grid_config(grid), read(os.path.join(grid, "paired.json"))
    arms = list(config["arms"])
    machines = {arm: {} for arm in arms}
    loss = {arm: final_losses(grid, arm, machines[arm])[0] for arm in arms}
    max_iters = final_losses(grid, "standard")[1]
    if max_iters is None:
        sys.exit(
            f"error: {grid}/standard: {unfinished(grid, 'standard', config['seeds'])}, and every row is paired with "
            f"it: train its cells (train.py with the grid's config and --out_dir={grid}) before the table"
        )
    budgets = {max_iters: loss["standard"]}
    for g in longer_grids(grid) if longer is None else longer:
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
    if cost:  # one ratio for every seed, from the bench at the grid's shape
        measured = bench_ratios(cost, config)
        speed = {arm: {s: measured.get(variant_of(config["arms"][arm])) for s in loss[arm]} for arm in arms}
        speed = {arm: {s: r for s, r in seeds_.items() if r is not None} for arm, seeds_ in speed.items()}
        speed["standard"] = {s: 1.0 for s in loss["standard"]}
    out = {}
    for arm in arms:
        if not loss[arm]:
            why = f"**{unfinished(grid, arm, config['seeds'])}**"
            out[arm] = ([why, why], [None, None], None, "-", None)
            continue
        stats = [paired["by_reference"].get(ref, {}).get("arms", {}).get(arm) for ref in BASELINES]
        ratios = {s: speed[arm][s] / speed["standard"][s] for s in speed[arm] if s in speed["standard"]}
        gains, beyond = [], False
        for s in seeds:
            if s in loss[arm] and s in ratios:
                base, past = at_steps({b: budgets[b][s] for b in budgets}, ratios[s] * max_iters)
                gains.append(loss[arm][s] - base)
                beyond |= past
        st = paired_statistics(gains)
        equal = (
            "-"
            if arm == "standard" or not gains  # no seed with a step time (another host, or not in --cost's file)
            else f"{st['mean']:+.4f} [{st['ci95'][0]:+.4f}, {st['ci95'][1]:+.4f}], {st['wins']}/{st['n']}"
            if st["n"] > 1
            else f"{st['mean']:+.4f}, {st['wins']}/{st['n']}"
        ) + (f" (beyond {max(budgets)} steps: at best this)" if beyond else "")
        out[arm] = (
            [cell(x) if x else "-" for x in stats],
            [verdict(x)[0] if x else None for x in stats],
            float(np.mean(list(ratios.values()))) if ratios else None,  # None: no seed whose two cells share a host
            equal,
            0.0 if arm == "standard" else stats[0]["mean"] if stats[0] else None,
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


# what may differ between the corpora's grids: where they lie, the text itself, the code (the report of each grid
# checks its own cells' code) and the run flag --allow_changes; and, in a tuned grid, what its tuning chose (setting)
PER_CORPUS = {"out_dir", "data_dir", "train_data_sha256", "code", "changes", "allow_changes"}


def setting(config):
    """A grid's config.json less what its tuning chose: each corpus's tuning picks its own rates (and routing scales)
    for the same arms."""
    if not config.get("tune_learning_rates"):
        return config
    return config | {"arms": {arm: {k: v for k, v in a.items() if k not in RATES} for arm, a in config["arms"].items()}}


HEADER = "| scheme | vs `standard`: mean [95% CI], seeds in favour, p, detectable | vs `scaled_residual` | "
COST_HEADER = "step time / `standard` | gain at equal wall time vs `standard`: mean [95% CI t], seeds in favour |"


def row_line(name, row, across=""):
    against, _, ratio, equal, _ = row
    return f"| {name} | {against[0]} | {against[1]} |{across} {'-' if ratio is None else f'{ratio:.2f}'} | {equal} |"


def main(*grids, cost=None):
    for g in grids:
        check_grid(g)
    configs = [setting(grid_config(g)) for g in grids]
    # an arm one grid lacks has no verdict there ("-"); an arm both have must be the same arm
    arms = lambda c: {a: s for a, s in c["arms"].items() if all(a in other["arms"] for other in configs)}
    configs = [dict(c, arms=arms(c)) for c in configs]
    if differ := sorted(
        {k for c in configs[1:] for k in (c.keys() | configs[0].keys()) - PER_CORPUS if c.get(k) != configs[0].get(k)}
    ):
        sys.exit(
            f"error: {grids[0]} and the other grids differ in {', '.join(differ)}; a table across corpora "
            "compares one setting: rerun a grid with the other's values (config/leaderboard.py)"
        )
    tables = {g: rows(g, cost=cost) for g in grids}
    corpora = " / ".join(os.path.basename(os.path.normpath(c["data_dir"])) for c in configs)  # the verdicts' order
    where = "both corpora" if len(grids) == 2 else "every corpus"
    across = f"holds on {where} (verdicts on {corpora}; vs `standard`; vs `scaled_residual`)"
    for grid, table in tables.items():
        cfg = read(os.path.join(grid, "config.json"))
        longer = ", ".join(os.path.relpath(g) for g in longer_grids(grid)) or "no longer grid"
        where = f"; step times from {cost}, every cell's seeds at one ratio" if cost else ""
        print(f"\n{grid} ({cfg['data_dir']}; equal time from {longer}{where})\n")
        print(HEADER + (f"{across} | " if len(grids) > 1 else "") + COST_HEADER)
        print("|---|---|---|" + ("---|" if len(grids) > 1 else "") + "---|---|")
        for arm, row in table.items():
            both = ""
            if len(grids) > 1:
                per = [[t[arm][1][i] if arm in t else None for t in tables.values()] for i in range(len(BASELINES))]
                both = f" {holds(per[0])}; {holds(per[1])} |"
            print(row_line(f"`{arm}`", row, both))
        if lines := plateau(grid):
            print(f"\n`standard`'s seeds through the budget ({grid}):\n")
            print("\n".join(lines))


# -----------------------------------------------------------------------------
# --add: rank a scheme among a stored grid's rows


def flag(key, value):
    """--key=value as train.py's configurator reads it back: a string as itself where it reads as that string."""
    text = value if isinstance(value, str) and parse_literal(value) == value else repr(value).replace(", ", ",")
    return f"--{key}={text}"


def this_machine(device):
    """The machine record a cell trained here on device would have (machine.machine_record); None where this
    machine has no such device."""
    import torch
    from machine import machine_record

    if device.startswith("cuda") and not torch.cuda.is_available():
        return None
    return machine_record(types.SimpleNamespace(device=device))


def machines_of(grid, arms):
    """The machines these arms' cells of a grid recorded, each once (None: a cell of a version that recorded none)."""
    found = [machine_of(r) for arm in arms for r in results(grid, arm).values()]
    return list({json.dumps(m, sort_keys=True): m for m in found}.values())


def names(machines):
    return " and ".join(machine_name(m) if m else "a machine not recorded" for m in machines) or "no machine"


def code_of(grid):
    code = read(os.path.join(grid, "config.json")).get("code") or {}
    edits = " plus edits" if code.get("git_dirty") else ""
    return f"code {(code.get('git_commit') or 'of no git commit')[:12]}{edits}"


def plan(scheme, grid, passed):
    """What ranking scheme against grid trains: (why the stored baselines cannot be reused, [] where they can; the
    rank grid's folder; train.py's arguments; the rank grid's config). The arguments are the grid's recorded
    config where it differs from train.py's defaults, the rank grid's folder and arms, then passed."""
    import records
    import train
    from configurator import configure

    recorded = read(os.path.join(grid, "config.json"))
    settings = {k: recorded[k] for k in train.DEFAULTS if k in recorded and k not in ("arms", "out_dir")}
    if not os.path.isdir(settings["data_dir"]):  # recorded absolute: a clone elsewhere has the corpus in its data/
        settings["data_dir"] = os.path.join("data", os.path.basename(os.path.normpath(settings["data_dir"])))
    base = train.DEFAULTS | settings
    given = configure(base, passed)
    why = []
    code = records.code_record()
    if changes := records.described_changes(recorded.get("code"), code, {*BASELINES, scheme}):
        why.append(f"this code computes otherwise than {grid}'s ({changes})")
    # what the report pairs on: each cell's shared-code fingerprint, from the code that cell records
    elif (
        recorded_code := {
            pairing_record(r).get("code") if isinstance(r.get("pairing"), dict) else None
            for a in BASELINES
            for r in results(grid, a).values()
        }
    ) and recorded_code != {code_fingerprints(code, scheme)[0]}:
        why.append("its baselines' cells record code that computes otherwise than this code (what report.py pairs on)")
    here, there = this_machine(recorded["device"]), machines_of(grid, BASELINES)
    if there != [here]:
        why.append(f"this machine ({names([here])}) is not the one its baselines recorded ({names(there)})")
    if changed := [k for k in given if given[k] != base[k] and k not in records.NOT_RESULT_KEYS]:
        why.append(f"{', '.join(changed)} differ from {grid}'s")
    parent, name = os.path.split(os.path.normpath(grid))
    rank_dir = os.path.join(parent, f"rank_{scheme}_{name}")
    arms = [*BASELINES, scheme] if why else [scheme]
    argv = [flag(k, v) for k, v in settings.items() if v != train.DEFAULTS[k]]
    argv += [f"--out_dir={rank_dir}", f"--arms={','.join(arms)}", *passed]
    return why, rank_dir, argv, dict(given, out_dir=rank_dir, arms={a: {"residual": a} for a in arms})


def is_copy(rank_dir, grid):
    """Whether a rank grid is a copy of the stored grid: its `standard` cells are the stored ones, byte for byte."""
    copied = results(rank_dir, "standard")
    return bool(copied) and copied == results(grid, "standard")


def copy_grid(grid, rank_dir):
    """The stored grid less its checkpoints, locks and report (the rank grid writes its own when it is done), at
    rank_dir through a temporary name: an interrupted copy is never taken for a grid."""
    tmp = rank_dir + ".tmp"
    shutil.rmtree(tmp, ignore_errors=True)  # an interrupted copy's
    skip = shutil.ignore_patterns("ckpt.pt", "lock", "*.lock", "*.tmp", "report.md", "paired.json", "*.png")
    shutil.copytree(grid, tmp, ignore=skip)
    os.rename(tmp, rank_dir)


def estimate(grid, cfg, workers, scheme):
    """The cells the rank grid trains and their time at the stored cells' speeds: each arm's mean training ms/step
    and seconds per evaluation over its stored cells' log.jsonl; the new scheme's, unknown, at `standard`'s and at
    the slowest stored arm's."""
    import tune

    speed = {}  # arm: (ms a step, s an evaluation, s a cell spends before it steps at its pace: compiling, chiefly)
    for arm in read(os.path.join(grid, "config.json"))["arms"]:
        logs = [read_log(os.path.join(grid, arm, f"seed{s}", "log.jsonl"))[0] for s in results(grid, arm)]
        timed = [(log, t) for log in logs if (t := step_time(log))]
        later_evals = [r["eval_s"] for log, _ in timed for r in [r for r in log if "eval_s" in r][1:]]
        if timed and later_evals:
            eval_s = float(np.median(later_evals))
            startup = float(np.median([start_s(log, t, eval_s) for log, t in timed]))
            speed[arm] = (float(np.mean([t for _, t in timed])), float(np.mean(later_evals)), startup)
    if "standard" not in speed:
        return f"no time estimate: {grid}'s `standard` cells logged no step time"
    paired = [(a, cfg["max_iters"]) for a in cfg["arms"] for _ in cfg["seeds"]]
    tuning = tune.tuning_config(cfg) if cfg["tune_learning_rates"] else dict(arms={}, seeds=[], max_iters=0)
    tuned = [(s["residual"], tuning["max_iters"]) for s in tuning["arms"].values() for _ in tuning["seeds"]]
    evals = lambda steps: steps // cfg["eval_interval"] + 1 + (steps % cfg["eval_interval"] > 0)
    slowest, cells = max(speed, key=lambda a: speed[a][0]), paired + tuned
    cell_s = lambda ms, eval_s, startup, n: n * ms / 1000 + evals(n) * eval_s + startup
    total = {  # seconds of one process, the new scheme stepping (and compiling) as `standard` does or as the slowest
        like: sum(cell_s(*speed.get(a, speed[like]), n) for a, n in cells) for like in ("standard", slowest)
    }
    return (
        (f"{len(tuned)} tuning cells of {tuning['max_iters']} steps, then " if tuned else "")
        + f"{len(paired)} cells of {cfg['max_iters']} steps: about {duration(total['standard'] / workers)} with "
        f"{workers} worker(s) ({duration(total['standard'])} of one process) if `{scheme}` steps as fast as "
        f"`standard` ({speed['standard'][0]:.0f} ms/step), {duration(total[slowest] / workers)} if as slow as the "
        f"slowest stored arm, `{slowest}` ({speed[slowest][0]:.0f} ms/step, {speed[slowest][2]:.0f} s a cell to start: "
        f"compiling, in a compiled grid); at the stored cells' speeds, on "
        f"{names(machines_of(grid, BASELINES))}"
    )


def start_s(log, ms, eval_s):
    """What a cell spent before it stepped at its pace (compiling, chiefly, when compiled): its first logged
    interval's time over its mean step's, and its first evaluation's over a later one's (eval_s)."""
    steps, evals = [r for r in log if "ms_per_step" in r], [r["eval_s"] for r in log if "eval_s" in r]
    first = (steps[0]["ms_per_step"] - ms) * steps[0]["step"] / 1000 if steps else 0.0
    return max(0.0, first + (evals[0] - eval_s if evals else 0.0))


def train_worker(argv, threads):
    """One worker of the rank grid: train.py's main as `python train.py` runs it (stop signals, one-line errors),
    forked, so that it trains every scheme this process has registered (the tests register one outside model.py)."""
    import torch

    import train
    from cells import PREEMPTED, STOP_SIGNALS, Preempted, stop_on_signals

    if threads:
        torch.set_num_threads(threads)  # the grid's recorded count: compiled CPU kernels round otherwise on another
    try:
        with stop_on_signals():
            signal.pthread_sigmask(signal.SIG_UNBLOCK, STOP_SIGNALS)  # blocked by train_workers until handled here
            train.main(argv)
    except UserError as e:
        sys.exit(f"error: {e}")
    except Preempted as e:
        print(f"stopped by a signal: {e}", file=sys.stderr)
        sys.exit(PREEMPTED)


def train_workers(argv, threads, workers):
    """train_worker in `workers` processes sharing the rank grid (train.py's cell locks), until each is done."""
    from cells import PREEMPTED, STOP_SIGNALS

    fork = multiprocessing.get_context("fork")
    processes = [fork.Process(target=train_worker, args=(argv, threads)) for _ in range(workers)]
    # a scheduler's or kill's stop reaches this process alone: pass it on, so each worker checkpoints at its next step;
    # held back (blocked, and so in the workers until their own handler is in) while the workers start
    forward = lambda signum, frame: [os.kill(w.pid, signum) for w in processes if w.exitcode is None]  # noqa: E731
    signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)
    for p in processes:
        p.start()
    before = {sig: signal.signal(sig, forward) for sig in STOP_SIGNALS}
    signal.pthread_sigmask(signal.SIG_UNBLOCK, STOP_SIGNALS)
    try:
        for p in processes:
            p.join()
    except KeyboardInterrupt:  # the workers got it too
        for p in processes:
            p.join()
        sys.exit("interrupted: run the same command again to go on (finished cells are kept, a killed one resumes)")
    finally:
        for sig, handler in before.items():
            signal.signal(sig, handler)
    if PREEMPTED in (codes := {p.exitcode for p in processes}) and codes <= {0, PREEMPTED}:
        print("stopped by a signal: run the same command again to go on (stopped cells resume)", file=sys.stderr)
        sys.exit(PREEMPTED)  # train.py's and launch.py's status for stopped and checkpointed
    if failed := [p.exitcode for p in processes if p.exitcode]:
        sys.exit(
            f"error: {len(failed)} of {workers} worker(s) stopped (exit {', '.join(map(str, failed))}; the lines "
            f"above say why): run the same command again to go on (finished cells are kept)"
        )


def print_rank(scheme, grid, rank_dir, reused):
    """The stored grid's rows and the scheme's from the rank grid (and, in a fresh one, its `scaled_residual`
    against its `standard`), ordered by the mean delta against `standard`; which baselines each was paired with."""
    stored, stored_config = rows(grid), read(os.path.join(grid, "config.json"))
    new = rows(rank_dir, longer_grids(grid) if reused else None)  # reused: the stored `standard`'s longer grids
    new_config = read(os.path.join(rank_dir, "config.json"))
    name = f"**`{scheme}`** (new)"
    table = {f"`{arm}`": row for arm, row in stored.items()} | {name: new[scheme]}
    if not reused:
        table[f"`scaled_residual` ({rank_dir})"] = new["scaled_residual"]
    order = sorted(table, key=lambda n: (table[n][4] is None, table[n][4] or 0.0))
    where = f"on {names(machines_of(grid, BASELINES))}, {code_of(grid)}"
    print(f"\n`{scheme}` among {grid}'s rows ({stored_config['data_dir']}), by the mean delta against `standard`:")
    print(f"- {grid}'s rows: paired with its `standard` and `scaled_residual`, {where}")
    if reused:
        print(
            f"- `{scheme}`: paired with the same cells (copied into {rank_dir}); trained on "
            f"{names(machines_of(rank_dir, [scheme]))}, {code_of(rank_dir)}"
        )
    else:
        print(
            f"- `{scheme}` and the second `scaled_residual` row: paired with `standard` and `scaled_residual` trained "
            f"anew in {rank_dir}, on {names(machines_of(rank_dir, BASELINES))}, {code_of(rank_dir)}: a delta of that "
            f"grid beside the deltas of {grid}, not paired with them"
        )
    if new_config.get("train_data_sha256") != stored_config.get("train_data_sha256"):
        print(f"- note: {rank_dir} trained on other text than {grid} (train_data_sha256): its row is of another corpus")
    print("\n" + HEADER + COST_HEADER + "\n|---|---|---|---|---|")
    for n in order:
        print(row_line(n, table[n]))
    words = [f"**{v}**" if v else "-" for v in new[scheme][1]]
    print(
        f"\n`{scheme}` is {order.index(name) + 1} of {len(order)} by its mean delta against `standard`; against "
        f"`standard` {words[0]}, against `scaled_residual` {words[1]} (a verdict says what the grid detects; a place "
        f"in this order alone does not)"
    )


def rank(scheme, grid, passed, dry_run):
    """--add: rank scheme among grid's rows, training only what it must (the module's docstring)."""
    from model import RESIDUALS

    if scheme not in RESIDUALS:
        sys.exit(
            f"error: --add={scheme}: no such scheme in model.RESIDUALS ({', '.join(RESIDUALS)}); register yours "
            f"there first (README.md, 'Add a scheme')"
        )
    check_grid(grid)
    recorded = read(os.path.join(grid, "config.json"))
    if scheme in recorded["arms"]:
        sys.exit(f"error: {grid} has an arm {scheme} already: python dev/leaderboard.py {grid} prints its row")
    if own := [a for a in passed if a.partition("=")[0] in ("--arms", "--out_dir")]:
        sys.exit(f"error: {own[0]}: --add sets the rank grid's arms and folder; give the scheme as --add=NAME")
    why, rank_dir, argv, cfg = plan(scheme, grid, passed)
    if os.path.exists(os.path.join(rank_dir, "config.json")) and is_copy(rank_dir, grid) != (not why):
        sys.exit(
            f"error: {rank_dir} holds {'a copy of' if why else 'a grid made afresh beside'} {grid} from an earlier "
            f"--add, and this one would {'train afresh' if why else 'reuse the stored baselines'}; remove it "
            f"(rm -r {rank_dir}) and run again"
        )
    threads, workers = recorded.get("cpu_threads"), min(2, os.cpu_count() or 1)
    if why:
        print(
            f"{'; '.join(why)}: so `standard`, `scaled_residual` and `{scheme}` train afresh under {grid}'s settings "
            f"in {rank_dir}, so that its pairing and step-time ratios are of one machine and one code"
        )
    else:
        print(
            f"{grid} was trained by this code on this machine: `{scheme}` is added to a copy of it without "
            f"checkpoints, {rank_dir} (the stored grid is not written), paired with the stored baselines"
        )
    print(
        f"{workers} worker(s) sharing it, each as: {f'OMP_NUM_THREADS={threads} ' if threads else ''}"
        f"python train.py {shlex.join(argv)}"
    )
    print(estimate(grid, cfg, workers, scheme))
    if dry_run:
        return
    if not why and not os.path.exists(rank_dir):
        copy_grid(grid, rank_dir)
    train_workers(argv, threads, workers)
    print_rank(scheme, grid, rank_dir, reused=not why)


def cli(argv):
    parser = Parser("dev/leaderboard.py", __doc__)
    parser.allow_abbrev = False  # --a=... is train.py's, never --add's
    parser.add_argument("grids", nargs="+", metavar="GRID")
    parser.add_argument("--add", metavar="SCHEME", help="rank this scheme of model.RESIDUALS among GRID's rows")
    parser.add_argument("--dry_run", action="store_true", help="with --add: say what it would train and how long")
    parser.add_argument("--cost", metavar="BENCH_JSON", help="step-time ratios from a bench.py run at the grid's shape")
    args, passed = parser.parse_known_args(argv)
    if bad := [a for a in passed if not args.add or not re.fullmatch(r"--\w+=.*", a, re.S)]:
        parser.error(f"{bad[0]}: only --add passes train.py's settings on, as --key=value")
    if args.add:
        if len(args.grids) != 1:
            parser.error("--add ranks a scheme among one grid's rows; give one GRID")
        rank(args.add, args.grids[0], passed, args.dry_run)
    elif args.dry_run:
        parser.error("--dry_run goes with --add")
    else:
        main(*args.grids, cost=args.cost)


if __name__ == "__main__":
    run(cli)
