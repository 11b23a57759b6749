"""The report's downstream section: the cells' CORE results (downstream.json, downstream.py), checked, paired seed by
seed with each reference over the seeds paired for the loss, and tabled: CORE, each task's accuracy and the bits per
byte of its right answers."""

from grid_files import described
from paired_stats import paired_statistics
from reporting.paired import pair_seeds
from reporting.text import arm_notes, block, cell_table, fmt, left_out_lines, md, per_seed, seed_groups
from reporting.text import statistics_table


def evaluation(record):
    """What a downstream result was measured on: two results pair only when this agrees key by key."""
    # not max_per_task: the items scored are (500 items of a task of 400 are every item, its prompts the same)
    return dict(
        bundle_sha256=record["bundle_sha256"],
        scoring_code=record.get("scoring_code"),  # None: written before downstream.json recorded it
        dtype=record.get("dtype"),  # None: as scoring_code
        **{f"tasks.{label}.items": task["items"] for label, task in record["tasks"].items()},
    )


def downstream_comparison(reference, arm, seeds, results, downstream, problems):
    """An arm's downstream results against the reference's: the seeds that pair (both cells' results of their final
    step and of one evaluation) and why others do not, the deltas' statistics, and the evaluations a mean mixes."""

    def problem(a, s):
        if (a, s) in problems:
            return problems[a, s]
        if (a, s) not in downstream:
            return "has no downstream.json"
        if downstream[a, s]["step"] != results[a, s].get("steps"):
            return (
                f"downstream.json is of step {downstream[a, s]['step']}, its result.json of "
                f"step {described(results[a, s].get('steps'))}"
            )

    paired, left_out = pair_seeds(reference, arm, seeds, problem, lambda a, s: evaluation(downstream[a, s]))
    # arm - reference of read(a cell's downstream.json) over seeds; bits per byte: lower is better
    delta = lambda seeds, read, higher_is_better=False: paired_statistics(
        [read(downstream[arm, s]) - read(downstream[reference, s]) for s in seeds], higher_is_better
    )
    with_bits = [s for s in paired if "bits_per_byte" in downstream[reference, s]]  # both or neither (scoring_code)
    tasks = {}
    for label in dict.fromkeys(label for s in paired for label in downstream[reference, s]["tasks"]):
        with_task = [s for s in paired if label in downstream[reference, s]["tasks"]]
        theirs = [downstream[reference, s]["tasks"][label] for s in with_task]
        kinds = " / ".join(dict.fromkeys(t["icl_task_type"] for t in theirs))
        st = delta(with_task, lambda d: d["tasks"][label]["accuracy"], True)
        tasks[label] = dict(st, seeds=with_task, icl_task_type=kinds, items=sorted({t["items"] for t in theirs}))
        if all("bits_per_byte" in t for t in theirs):
            tasks[label]["bits_per_byte"] = delta(with_task, lambda d: d["tasks"][label]["bits_per_byte"])
    evaluated = lambda d: (
        f"bundle {d['bundle_sha256'][:12]}, {sum(t['items'] for t in d['tasks'].values())} items, scoring code "
        f"{str(d.get('scoring_code'))[:12]}, {d.get('dtype')}"
    )
    mixed = seed_groups(paired, lambda s: evaluated(downstream[reference, s]))
    return dict(
        seeds=paired,
        left_out=left_out,
        mixed_evaluations=[mixed] if mixed else [],
        core=delta(paired, lambda d: d["core"], True),
        bits_per_byte=delta(with_bits, lambda d: d["bits_per_byte"]) | dict(seeds=with_bits),
        tasks=tasks,
    )


def downstream_lines(arms, seeds, downstream, problems, compared):
    """The report's downstream section; compared: {reference: {arm: downstream_comparison}}."""
    core = {cell: "unreadable" for cell in problems} | {cell: fmt(d["core"], ".4f") for cell, d in downstream.items()}
    lines = [
        "## Downstream tasks",
        "",
        "delta = arm - reference in CORE (the mean over tasks of (accuracy - random baseline) / "
        "(1 - random baseline)) and in each task's accuracy, positive = better; and in bits per byte of the right "
        "answers (each task's, and their mean), negative = better; a win is a delta on the better side of 0. Of "
        "the seeds paired above, a seed counts when both cells' downstream.json are of their final step and of "
        "one evaluation (task bundle, scoring code, precision, tasks and items).",
        "",
        *block("CORE per cell:", cell_table(arms, seeds, lambda a, s: core.get((a, s), "-"))),
    ]
    kind = ("type", lambda t: md(t["icl_task_type"])), ("items", lambda t: ", ".join(map(str, t["items"])))
    for reference, against in compared.items():
        if not against:
            continue
        lines += [f"**Against {md(reference)}**:", ""]
        lines += left_out_lines("**Downstream seeds left out** (of this section only):", against)
        lines += statistics_table("arm", "mean CORE delta", {arm: c["core"] for arm, c in against.items()})
        lines += [
            per_seed(f"Per-seed CORE deltas, {md(arm)}", c["seeds"], c["core"]["deltas"]) for arm, c in against.items()
        ]
        lines.append("")
        if bits := {arm: c["bits_per_byte"] for arm, c in against.items() if c["bits_per_byte"]["n"]}:
            lines += statistics_table("arm", "mean bits-per-byte delta", bits, lambda arm: f"{arm}, bits per byte")
        lines += arm_notes(
            "**Mixed evaluations**: each seed is paired fairly, but an arm's seeds were evaluated on different "
            "task bundles, items, scoring code or precision, so its means mix them; read the seeds apart:",
            against,
            lambda c: map(md, c["mixed_evaluations"]),
        )
        for arm, c in against.items():
            if c["tasks"]:
                lines += [f"Task accuracy, {md(arm)} - {md(reference)}:", ""]
                lines += statistics_table(
                    "task", "mean delta", c["tasks"], lambda label: f"{arm}, {label}", before=kind
                )
            if bits := {label: t["bits_per_byte"] for label, t in c["tasks"].items() if "bits_per_byte" in t}:
                lines += [f"Task bits per byte, {md(arm)} - {md(reference)} (lower is better):", ""]
                lines += statistics_table("task", "mean delta", bits, lambda label: f"{arm}, {label} bits per byte")
    return lines
