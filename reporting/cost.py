"""What a result cost and where it ran: the machines the cells recorded, each cell's wall time, and each arm's training
step time over the reference's in the same grid."""

import numpy as np

from grid_files import is_finite
from reporting.text import block, bullets, cell_name, cell_table, distinct, md, seed_list


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
    each = distinct(recorded.values())
    by_seed = {s: {a: m for (a, seed), m in recorded.items() if seed == s} for s in seeds}
    several = {s: {a: each.index(m) for a, m in c.items()} for s, c in by_seed.items() if len(distinct(c.values())) > 1}
    return dict(machines=each, seeds_on_several=several)


def machine_lines(summary):
    ran_on, several = summary["machines"], summary["seeds_on_several"]  # several: none where one machine or none
    if len(ran_on) == 1:
        return [f"Every cell that records its machine ran on: {md(machine_name(ran_on[0]))}.", ""]
    head = "Machines (a result's last digits hold on its machine only: other instruction sets round differently):"
    apart = [f"seed {s}: " + ", ".join(f"{md(a)} on machine {i}" for a, i in c.items()) for s, c in several.items()]
    return bullets(head, [f"machine {i}: {md(machine_name(m))}" for i, m in enumerate(ran_on)]) + bullets(
        "**Seeds trained on different machines** (paired all the same: a machine changes rounding, not what is "
        "computed):",
        apart,
    )


def wall_time_lines(arms, seeds, wall):
    if all(t is None for t in wall.values()):
        return []
    cell = lambda arm, s: "-" if (t := wall.get(cell_name(arm, s))) is None else f"{t:.0f}"
    total = lambda arm: f"{sum(wall.get(cell_name(arm, s)) or 0 for s in seeds):.0f}"
    head = "Wall time per cell (s; training and evaluation, compile included):"
    return block(head, cell_table(arms, seeds, cell, after=[("total", total)]))


def step_time(log):
    """A cell's training ms/step: the mean of its log's intervals, the first (allocation, warm-up) left out; or None."""
    times = [r["ms_per_step"] for r in log if is_finite(r.get("ms_per_step"))]
    return float(np.mean(times[1:] or times)) if times else None


def step_time_lines(arms, seeds, logs, reference, results):
    """Each arm's training ms/step per seed and its ratio to the reference's (the mean over seeds of arm / reference):
    what a gain costs, measured in the same grid (its machine, its load). A seed whose two cells recorded different
    machines is left out of the ratio, with a note: a grid continued on another host would price the hosts' speeds."""
    times = {(a, s): step_time(logs.get((a, s), [])) for a in arms for s in seeds}
    if all(t is None for t in times.values()):
        return []
    apart, used, ratios = {}, [], {}
    for arm in arms:
        timed = [s for s in seeds if times[arm, s] and times[reference, s]]
        ran_on = {s: [machine_of(results.get((a, s)) or {}) for a in (arm, reference)] for s in timed}  # None: unknown
        if left := [s for s, (here, there) in ran_on.items() if here and there and here != there]:
            apart[arm] = left
        both = [s for s in timed if s not in left]
        used += [ran_on[s][1] for s in both]
        ratios[arm] = f"{np.mean([times[arm, s] / times[reference, s] for s in both]):.2f}" if both else "-"
    ms = lambda a, s: "-" if times[a, s] is None else f"{times[a, s]:.1f}"
    notes = [
        f"{md(arm)}: seed(s) {seed_list(left)} left out of its ratio: its cell and {md(reference)}'s "
        "trained on different machines (their result.json's config.machine); rerun one of the two beside the "
        "other to price it."
        for arm, left in apart.items()
    ]
    if len(used := distinct(used)) > 1:
        notes.append(f"The ratios come from {len(used)} machines (each seed's two cells on one).")
    return block(
        f"Training step time (ms/step, each cell's logged intervals but the first; ratio: the mean over seeds of "
        f"the arm's over {md(reference)}'s, measured in this grid):",
        cell_table(arms, seeds, ms, after=[(f"ratio to {md(reference)}", ratios.get)]),
    ) + block(None, notes)
