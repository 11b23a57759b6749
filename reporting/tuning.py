"""Learning rates: the rate each cell trained at, and the tuned protocol's tuning (train.py's tune_learning_rates,
tune.py): out/tune/choice.json, checked against the tuning cells by grid_files.read_tuning."""

from grid_files import TUNE_DIR, is_finite, is_seed, rate_name, read_tuning, tuning_results
from reporting.text import block, bullets, fmt, md, plural, rate_list, seed_list, table


def arm_learning_rates(results, arm):
    """The sorted learning rates an arm's cells trained at (its own, else the grid's): one, several or none."""
    rate = lambda p: (p.get("arm_settings") or {}).get("learning_rate", (p.get("settings") or {}).get("learning_rate"))
    rates = [rate(r.get("pairing") or {}) for (a, _), r in results.items() if a == arm]
    return sorted({r for r in rates if is_finite(r)})


def grid_cost(results):
    """Cells, steps and wall time (s) of results {(arm, seed): result.json}; a time unrecorded counts 0."""
    return dict(
        cells=len(results),
        steps=sum(r["steps"] for r in results.values() if is_seed(r.get("steps"))),
        wall_time_s=round(sum(r["wall_time_s"] for r in results.values() if is_finite(r.get("wall_time_s"))), 1),
    )


def choice_table(column, options, shown, chosen, missing):
    """A table of shown {arm: {option: text}}, a column(option) per option, chosen[arm] in bold, missing where none."""
    cell = lambda arm, option: f"**{shown[arm][option]}**" if option == chosen[arm] else shown[arm][option]
    rows = [[arm, *(cell(arm, o) if o in shown[arm] else missing for o in options)] for arm in shown]
    return table(["arm", *map(column, options)], rows)


# what paired.json's tuning holds of choice.json
SUMMARY_KEYS = "choice reason tune_seeds tune_iters max_iters min_lr_ratio tuning_text test_tokens".split()


def tuning_section(out_dir, arms, results, config):
    """report.md's tuning section and paired.json's tuning, or ([], None) for a frozen-protocol grid: notes where a
    choice is at the edge of those tried or not what an arm trained at; the problem of a bad or missing choice.json."""
    record, why = read_tuning(out_dir)
    title = ["## Learning-rate tuning", ""]
    if why:
        said = (
            f"{TUNE_DIR}/choice.json: unreadable ({md(why)}); the arms' rates cannot be traced to a tuning: the "
            f"learning rate column below is what each arm trained at."
        )
        return title + [said, ""], dict(problem=why)
    if record is None and config.get("tune_learning_rates"):
        said = (
            f"This grid was tuned (config.json: tune_learning_rates {md(config['tune_learning_rates'])}), but "
            f"{TUNE_DIR}/choice.json is missing: the arms' rates cannot be traced to the tuning. Rerun the train.py "
            f"command that made the grid (the same config and flags, its out_dir this folder): it writes the choice "
            f"again from the tuning cells in {TUNE_DIR}/, trains none that finished, and writes this report again."
        )
        why = f"missing, though config.json records tune_learning_rates {config['tune_learning_rates']}"
        return title + [said, ""], dict(problem=why)
    if record is None:
        return [], None
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
        f"Each arm's learning rate was chosen before the compared seeds trained, on text they are not judged on: "
        f"every arm ran at each rate below on tuning seeds {seed_list(seeds)} (never a compared seed) "
        f"for {record['tune_iters']} of the {record['max_iters']} steps (the whole schedule in them, min_lr "
        f"{record['min_lr_ratio']:g} x the rate), evaluated on {where}. "
        f"A rate counts only where every tuning seed finished below its step-0 loss; a larger rate beats a "
        f"smaller one only when it is better on every tuning seed and its mean is lower by more than the s.d. of "
        f"its own seeds' losses; each arm's choice is the smallest rate no larger one beats (never above the "
        f"lowest mean; an exact tie goes to the smaller). The paired result below compares each arm at its own "
        f"chosen rate.",
        "",
    ]
    mean_sd = lambda row: "not finished" if row["problem"] else f"{fmt(row['mean'], '.4f')} ({fmt(row['sd'], '.4f')})"
    notes, unfinished = [], []

    def edge_note(arm, what, chosen, tried, option):
        if len(tried) > 1 and chosen in (min(tried), max(tried)):
            side = "smallest" if chosen == min(tried) else "largest"
            notes.append(
                f"{arm}: the chosen {what} {chosen:g} is the {side} tried; the best may lie beyond it ({option})"
            )

    routing = record.get("routing_table") or {}
    own = {arm: rows["1"]["learning_rate"] for arm, rows in routing.items() if "1" in rows}  # at routing x1
    by_rate = {arm: {row["learning_rate"]: row for row in rows.values()} for arm, rows in record["table"].items()}
    for arm, rows in by_rate.items():
        unfinished += [f"{arm} at {r:g}: {row['problem']}" for r, row in rows.items() if row["problem"]]
        edge_note(arm, "rate", record["choice"][arm], list(rows), "widen tune_learning_rates")
    shown = {arm: {r: mean_sd(row) for r, row in rows.items()} for arm, rows in by_rate.items()}
    bold = {arm: own.get(arm, record["choice"][arm]) for arm in by_rate}  # a routed arm's rate at routing x1
    lines += block(
        "Mean (s.d.) final validation loss on the tuning seeds (the chosen rate in bold):",
        choice_table(lambda r: f"lr {r:g}", rates, shown, bold, "-"),
    )
    lines += bullets(
        "Choices:",
        [
            f"{md(arm)}: {rate:g}, {md(record['reason'][arm])}"
            if own.get(arm, rate) == rate
            else f"{md(arm)}: {rate:g}, its rate at routing x{record['routing_choice'][arm]:g} (below); with its "
            f"routing at x1 the rule takes {own[arm]:g}: {md(record['reason'][arm])}"
            for arm, rate in record["choice"].items()
        ],
    )
    if routing:
        scales = sorted({float(name) for rows in routing.values() for name in rows})
        at_rate = lambda row, scale: f"{mean_sd(row)} at {row['learning_rate'] / scale:g}"
        shown = {
            arm: {s: at_rate(rows[rate_name(s)], s) for s in scales if rate_name(s) in rows}
            for arm, rows in routing.items()
        }
        lines += block(
            "Routing rate (tune_routing_lr_scales): each routed arm also trained with its routing parameters at each "
            "scale below x the learning rate, at every rate, on the same tuning seeds and budget; at each scale the "
            "rate is chosen by the rule above, then the scale, each at its own rate, by the same rule over the "
            "routing rates (so the smaller scale unless a larger one beats it); the arm trains at that scale and its "
            "rate. Mean (s.d.) at each scale's chosen rate, the chosen scale in bold:",
            choice_table(lambda s: f"routing x{s:g}", scales, shown, record["routing_choice"], "no rate finished"),
        )
        chosen = []
        for arm, scale in record["routing_choice"].items():  # (each row is a chosen rate's: it finished)
            chosen.append(f"{md(arm)}: x{scale:g}, {md(record['routing_reason'][arm])}")
            edge_note(arm, "routing scale", scale, scales, "widen tune_routing_lr_scales")
        lines += bullets("Routing choices:", chosen)
    lines += bullets(
        "Rates never chosen (not finished: a seed diverged, or ended at or above its step-0 loss):", map(md, unfinished)
    )
    cost, grid = grid_cost(tuning_results(out_dir, record)), grid_cost(results)
    cells = lambda n: f"{n} {plural('cell', n)}"
    lines += [
        f"Cost: the tuning {cells(cost['cells'])}, {cost['steps']:,} steps, {cost['wall_time_s']:,.0f} s wall; "
        f"the paired grid {cells(grid['cells'])}, {grid['steps']:,} steps, {grid['wall_time_s']:,.0f} s wall"
        + (f" (the tuning {100 * cost['steps'] / grid['steps']:.0f}% of the grid's steps)." if grid["steps"] else "."),
        "",
    ]
    for arm in arms:
        trained = arm_learning_rates(results, arm)
        if arm not in record["choice"]:
            notes.append(f"{arm}: not in tune/choice.json (not tuned)")
        elif set(trained) - {record["choice"][arm]}:
            notes.append(f"{arm}: trained at {rate_list(trained)}, tune/choice.json chose {record['choice'][arm]:g}")
    per_rate = lambda key: {arm: {f"{r:g}": row[key] for r, row in rows.items()} for arm, rows in by_rate.items()}
    summary = {k: record[k] for k in SUMMARY_KEYS} | dict(notes=notes, mean=per_rate("mean"), sd=per_rate("sd"))
    summary |= {k: record[k] for k in ("routing_scales", "routing_choice", "routing_reason") if k in record}
    return title + lines + bullets(None, map(md, notes)), summary | dict(cost=dict(tuning=cost, grid=grid))
