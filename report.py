"""
The paired report of a grid written by train.py: report.md, paired.json and plots (needs no torch).

$ python report.py out                         # every arm against each baseline arm (else the first arm)
$ python report.py out --reference=attnres --cell=rd_attnres/seed0 --effect=0.02
$ python report.py out --reference=standard,scaled_residual
$ python report.py out/calibrate_pydoc --beside=out/calibrate_shakespeare

Reads out/<arm>/seed<k>/{result.json,log.jsonl} (grid_files.load_grid), pairs every arm with each reference
(--reference's arms, else every baseline arm, else the first; each pair once) seed by seed and writes out/report.md,
out/paired.json (strict JSON) and, with matplotlib, PNG plots, each to a temporary name of this process, renamed. The
report's parts are reporting/'s modules: grid (what was compared), paired, tuning, downstream, cost, plots and text.
"""

import json
import math
import os
import re
import sys

from common import DataError, Parser, remove_stale_temporaries, run, write_text
from grid_files import grid_record, is_seed, load_downstream, load_grid, tuning_iters
from reporting.cost import machine_lines, machines, step_time_lines, wall_time_lines
from reporting.downstream import downstream_comparison, downstream_lines
from reporting.grid import BASELINES, beside, beside_lines, final_loss_lines, model_line, opening_lines, shared_model
from reporting.paired import compare, comparison_lines, diverged_cells, diverged_lines, spike_lines, spikes
from reporting.plots import cell_note, jsd_name, plots, routing_name
from reporting.text import bullets, cell_name, md, strict
from reporting.tuning import arm_learning_rates, tuning_section


def parse_args(argv):
    parser = Parser("report.py", __doc__)
    parser.add_argument("out_dir")
    parser.add_argument("--reference", help="reference arms, comma-separated (default: the baseline arms, see above)")
    parser.add_argument("--cell", help="arm/seedK whose depth weights to plot (default: last arm, first paired seed)")
    parser.add_argument("--effect", type=float, default=0.03, help="delta (nats) to count seeds for (RD-AttnRes: 0.03)")
    parser.add_argument("--beside", help="another grid's out_dir, reported already, to set beside this one")
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


def parse_cell(text, arms, seeds, results, logs):
    """--cell=arm/seedK as (arm, seed), or one error line."""
    match = re.fullmatch(r"(.+)/seed([0-9]+)", text)
    if not match:
        sys.exit(f"error: --cell={text}: give arm/seedK, e.g. --cell={arms[-1]}/seed{seeds[0] if seeds else 0}")
    cell = match[1], int(match[2])
    if cell not in results and cell not in logs:
        cells = [cell_name(a, s) for a in arms for s in seeds if (a, s) in results or (a, s) in logs]
        sys.exit(f"error: --cell={text}: no such cell; cells: {', '.join(cells)}")
    return cell


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
    last = arms[-1], (first["paired_seeds"][arms[-1]] or seeds or [0])[0]
    cell = parse_cell(args.cell, arms, seeds, results, logs) if args.cell else last
    written = ["report.md", "paired.json", "val_loss.png", "delta_curve.png", *map(jsd_name, arms), routing_name(cell)]
    for name in written:  # before anything is written: a folder there would stop the report half way
        if os.path.isdir(path := os.path.join(args.out_dir, name)):
            raise DataError(f"{path} is a folder, where report.py writes its {name}; move or delete it")
    diverged, config = diverged_cells(arms, seeds, results), grid_record(args.out_dir)
    lines = opening_lines(args.out_dir, arms, references, results, comparisons, config)
    model, differ = shared_model(results)
    lines += [md(model_line(model, differ)), ""] if results else []
    section, tuning = tuning_section(args.out_dir, arms, results, config)
    ran_on = machines(arms, seeds, results)
    lines += section + final_loss_lines(arms, seeds, results) + machine_lines(ran_on)
    for i, ref in enumerate(references):
        lines += comparison_lines(ref, comparisons[ref], references[:i], args.effect)
    side = args.beside and beside(args.out_dir, args.beside, comparisons)
    lines += (beside_lines(side) if side else []) + diverged_lines(diverged)
    # an untuned grid (no rates) has no tuning budget; a damaged one's is not read
    steps, warmup = config.get("max_iters"), config.get("warmup_iters") or 0
    budget = tuning_iters(config.get("tune_iters"), steps) if is_seed(steps) else None
    tuned_steps = budget if config.get("tune_learning_rates") and is_seed(budget) else None
    spiked = spikes(arms, seeds, logs, warmup, tuned_steps)
    lines += spike_lines(spiked, warmup, tuned_steps)
    downstream, problems, downstream_notes = load_downstream(args.out_dir, results)
    notes += downstream_notes
    compared = None
    if downstream or problems:
        pair = lambda ref, arm, paired: downstream_comparison(ref, arm, paired, results, downstream, problems)
        compared = {ref: {a: pair(ref, a, c["paired_seeds"][a]) for a in c["others"]} for ref, c in comparisons.items()}
        lines += downstream_lines(arms, seeds, downstream, problems, compared)
    wall = {cell_name(a, s): results[a, s].get("wall_time_s") for a in arms for s in seeds if results.get((a, s))}
    lines += wall_time_lines(arms, seeds, wall) + step_time_lines(arms, seeds, logs, references[0], results)
    lines += bullets("Skipped:", map(md, notes))
    lines += cell_note(cell, arms, seeds, logs) if args.cell else []
    summary = "\n".join(lines)
    for title, name in plots(args.out_dir, arms, comparisons, logs, cell):
        lines += [f"### {md(title)}", "", f"![{md(title)}]({name})", ""]
    write_text(os.path.join(args.out_dir, "report.md"), "\n".join(lines))
    core = downstream and {cell_name(a, s): r["core"] for (a, s), r in downstream.items()}
    # reference and arms (and downstream's arms): the first reference's, as a report of one reference writes them
    paired = dict(
        reference=references[0],
        references=references,
        model=dict(model, differing=differ),
        arms=first["paired"],
        by_reference={
            ref: dict(arms=c["paired"], downstream=compared and compared[ref]) for ref, c in comparisons.items()
        },
        diverged=diverged,
        spikes=spiked,
        downstream=compared and dict(core=core, arms=compared[references[0]]),
        tuning=tuning,
        learning_rates={arm: arm_learning_rates(results, arm) for arm in arms},
        wall_time_s=wall,
        machines=ran_on,
        beside=side,
        skipped=notes,
    )
    write_text(os.path.join(args.out_dir, "paired.json"), json.dumps(strict(paired), indent=1, allow_nan=False))
    print(summary)


if __name__ == "__main__":
    run(main)
