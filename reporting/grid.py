"""What the report compared, first: each arm's settings that differ from its reference, its size and FLOPs, the model
every cell shares, the data and the code, one verdict per pair and each cell's final loss; and --beside, the same
comparisons of another grid (the same grid on another corpus) set beside these."""

import json
import math

from common import DataError
from grid_files import described, grid_record, is_seed, read_paired
from paired_stats import BOOTSTRAP_CALIBRATED_SEEDS, POWER
from reporting.paired import difference, divergence, verdict_lines
from reporting.text import block, bullets, cell_table, distinct, fmt, interval, md, plural, rate_list, table
from reporting.tuning import arm_learning_rates

BASELINES = ("standard", "scaled_residual")  # by default every arm named after a baseline scheme is a reference
SIZE_KEYS = ("n_layer", "n_head", "n_embd", "block_size", "vocab_size")
GRID_ONLY_KEYS = ("out_dir", "code", "changes", "arms", "seeds", "reference_arm", "wandb_run_name")  # not its setup
DATA_KEYS = ("data_dir", "train_data_sha256", "tokenizer")  # what --beside sets apart: the same grid on two corpora
RATE_KEYS = ("learning_rate", "min_lr", "muon_learning_rate")
NAMED_DOCUMENTS = 20  # validation documents named in the report's words; more are counted
# the keys, in order of appearance, whose values two settings differ in, but skip's
differing = lambda a, b, skip=GRID_ONLY_KEYS: [k for k in {**a, **b} if k not in skip and a.get(k) != b.get(k)]
# an arm's first counted result, the one its opening describes (mixed_versions names where its seeds differ), or None
recorded_cell = lambda results, arm: next((r for (a, _), r in sorted(results.items()) if a == arm), None)


def arm_config(config, arm):
    """An arm's own settings in a grid's config.json (its arms table), or None where it records none."""
    own = config["arms"].get(arm) if isinstance(config.get("arms"), dict) else None
    return own if isinstance(own, dict) else None


def shared_model(results):
    """The model settings (size; MLP, dense or MoE) every counted cell records alike, and the keys that differ."""
    settings = [s for r in results.values() if (s := (r.get("pairing") or {}).get("settings"))]  # an old cell: none
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
        mlp = (
            f"MoE MLP: {alike['n_experts']} experts, top-{alike.get('moe_top_k')}, "
            f"{alike.get('moe_shared_experts', 0)} shared, expert width {alike.get('moe_expert_hidden') or 'auto'}, "
            f"balancing bias rate {alike.get('moe_bias_rate')}"
        )
    parts = [p for p in (size, mlp) if p] + ([f"differing between cells: {', '.join(differ)}"] if differ else [])
    return "Model shared by every cell: " + "; ".join(parts) + "."


def cell_settings(result, config):
    """A cell's model and rates as recorded: its record's model (every GPTConfig key) and learning rates, else what
    its pairing record holds over its arm's settings and the grid's (config.json); {} when none is."""
    record = result.get("config") if isinstance(result.get("config"), dict) else {}
    if isinstance(record.get("model"), dict):
        return record["model"] | {k: record[k] for k in RATE_KEYS if k in record}
    pairing = result.get("pairing") or {}
    grid = {k: v for k, v in config.items() if k != "arms"} | (arm_config(config, result["arm"]) or {})
    return grid | (pairing.get("settings") or {}) | (pairing.get("arm_settings") or {})  # the cell's own last


def differing_settings(results, config, arm, reference):
    """'key value (reference's)' for each recorded setting where an arm's cell differs from its reference's."""
    mine, theirs = (recorded_cell(results, a) for a in (arm, reference))
    if mine is None or theirs is None:
        return "not recorded (no counted cell)"
    a, b = cell_settings(mine, config), cell_settings(theirs, config)
    if not a or not b:
        return "not recorded"
    return ", ".join(f"{k} {described(a.get(k))} ({described(b.get(k))})" for k in differing(a, b)) or "none"


def size_cells(result, config):
    """[parameters, non-embedding parameters, active FLOPs per token] of a cell as recorded, the FLOPs as
    model.flops_per_token counts them: 6 x active parameters + 12 x n_layer x n_embd x block_size (attention)."""
    if result is None:
        return ["-"] * 3
    settings = cell_settings(result, config)
    counts = [result.get(k) for k in ("params", "non_embedding_params", "active_params")]
    dense = settings.get("n_experts", 1) == 1
    active = counts[2] if is_seed(counts[2]) else counts[0] if dense and is_seed(counts[0]) else None
    shape = [settings.get(k) for k in ("n_layer", "n_embd", "block_size")]
    sizes = [f"{c:,}" if is_seed(c) else "not recorded" for c in counts[:2]]
    if active is None:
        return sizes + ["not recorded (no active_params)"]
    if not all(map(is_seed, shape)):
        return sizes + ["not recorded (no n_layer, n_embd, block_size)"]
    return sizes + [f"{6 * active + 12 * math.prod(shape):,}"]


def validation_words(described):
    """A cell's record of its validation text (records.ValidationText.described) in words, each document read named
    where the cell recorded them (cells made before that record are counted, never named from a data_dir as it is
    now: the report is a function of the grid's files)."""
    if not isinstance(described, dict):
        return "validation text not described (a cell made before that record)"
    where = "spread evenly over the validation shard"
    if described.get("layout") != "spread":
        where = "the first of the validation shard (eval_layout 'first')"
    words = f"{described.get('sequences')} sequences {where}"
    if is_seed(described.get("documents")) and is_seed(described.get("held_out_documents")):
        words += f", in {described['documents']} of its {described['held_out_documents']} documents"
    if is_seed(described.get("bytes")):
        words += f", {described['bytes']:,} bytes of text"
    read = described.get("documents_read")
    fmt_count = lambda n, unit: f"{n:,} {plural(unit, n)}" if is_seed(n) else f"{unit}s not recorded"
    if isinstance(read, list) and all(isinstance(d, dict) for d in read) and any(d.get("name") for d in read):
        named = [
            f"{md(d.get('name') or 'unnamed')} ({fmt_count(d.get('bytes'), 'byte')}, "
            f"{fmt_count(d.get('sequences'), 'sequence')})"
            for d in read
        ]
        more = len(named) - NAMED_DOCUMENTS
        words += ": " + ", ".join(named[:NAMED_DOCUMENTS]) + (f" and {more} more" if more > 0 else "")
    return words


def newest(described):
    """The validation texts described, less a record made before the per-document one where another cell's record
    of the same text has it: an old and a new cell of one grid read one text."""
    per_document = [d for d in described if isinstance(d, dict) and "documents_read" in d]
    full = [{k: v for k, v in d.items() if k != "documents_read"} for d in per_document]
    return [d for d in described if not (isinstance(d, dict) and "documents_read" not in d and d in full)]


def data_lines(results, config):
    """The data the cells were trained and evaluated on, and the code, as their records say."""
    record = lambda r: r.get("config") if isinstance(r.get("config"), dict) else config
    recorded = lambda read: distinct(map(read, results.values()))  # each value the cells record (None: not)
    field = lambda key: recorded(lambda r: record(r).get(key))
    said = lambda key: "; ".join(
        "not recorded" if v is None else md(v if isinstance(v, str) else json.dumps(v, sort_keys=True))
        for v in field(key)
    )
    shards = ", ".join(md(str(v)[:12]) for v in field("train_data_sha256") if v is not None)
    shards = f" (train shards sha256 {shards}...)" if shards else ""
    trained = recorded(lambda r: r.get("tokens") if is_seed(r.get("tokens")) else None)
    tokens = ", ".join("not recorded" if v is None else f"{v:,}" for v in trained)
    pairing = lambda r: r.get("pairing") or {}
    sequences = lambda r: len(r["val_sequence_losses"]) if isinstance(r.get("val_sequence_losses"), list) else None
    evaluated = recorded(lambda r: [pairing(r).get("eval_tokens"), sequences(r), pairing(r).get("val_hash")])
    validation = "; ".join(
        f"{'not recorded' if n is None else f'{n:,} tokens'} of the validation shard evaluated"
        + (f", {m} sequences" if m else "")
        + (f", val_hash {str(h)[:12]}" if h else "")
        for n, m, h in evaluated
    )
    described = recorded(lambda r: r.get("validation"))
    if any(isinstance(d, dict) for d in described):  # what the text was, where the cells record it
        validation += "; " + "; ".join(validation_words(d) for d in newest(described))
    code_of = lambda r: r.get("code") or record(r).get("code") or {}
    commits = recorded(lambda r: [code_of(r).get("git_commit"), code_of(r).get("git_dirty")])
    code = "; ".join(
        "not recorded" if not c else f"git commit {c[:12]}" + (", plus uncommitted edits" if dirty else "")
        for c, dirty in commits
    )
    if len(commits) > 1:
        code += " (cells of several commits; Mixed versions names any whose computing code differs)"
    return [
        f"Data: corpus {said('data_dir')}{shards}, tokenizer {said('tokenizer')}; tokens trained per cell: {tokens}; "
        f"validation text: {validation}.",
        "",
        f"Code: {code}.",
        "",
    ]


def opening_lines(out_dir, arms, references, results, comparisons, config):
    """report.md's opening (this module's docstring): the title, the references and what a delta is, first."""
    lines = [
        f"# Paired report: {md(out_dir)}",
        "",
        f"{plural('Reference arm', len(references))}: {', '.join(map(md, references))}. "
        f"delta = NLL(arm) - NLL(reference) on the fixed validation set (nats/token; negative = better). Each arm "
        f"is paired with each reference seed by seed: a seed counts for an arm when both cells finished and their "
        f"pairing records agree.",
        "",
    ]
    if not any(arm in BASELINES for arm in arms):
        lines += [
            f"**No baseline arm**: none of the arms is a baseline scheme ({', '.join(BASELINES)}); every delta "
            f"below is against {', '.join(map(md, references))}, not against a baseline.",
            "",
        ]
    head = ["arm", "settings that differ from its reference (the reference's)", "parameters", "non-embedding"]
    ref = references[0]
    differ = lambda arm: "(the reference)" if arm == ref else md(differing_settings(results, config, arm, ref))
    rows = [[arm, differ(arm), *size_cells(recorded_cell(results, arm), config)] for arm in arms]
    lines += [*table([*head, "active FLOPs per token (training)"], rows), ""]
    lines += data_lines(results, config) if results else []
    return lines + bullets(
        f"Verdicts (ahead: the 95% interval of the mean delta below 0; behind: above; else not detectable "
        f"at this size). One interval is quoted: the t interval over seeds and text (the seeds' t interval "
        f"where the cells record no per-sequence losses); the two-way bootstrap only from "
        f"{BOOTSTRAP_CALIBRATED_SEEDS} seeds, where it is calibrated (below, it draws from too few seeds "
        f"and its interval is too narrow). That interval alone decides the verdict, not the seeds' t-test p in "
        f"the tables below, which leaves the text's variance out (the two can disagree); 'detects' is the "
        f"smallest mean delta the quoted interval tells from 0 with power {POWER:g}:",
        verdict_lines(comparisons, references),
    )


def final_loss_lines(arms, seeds, results):
    """Each cell's final validation loss and each arm's learning rate."""
    loss = lambda r: "-" if not r else "diverged" if divergence(r) else fmt(r["val_loss"], ".4f")
    rates = lambda arm: rate_list(arm_learning_rates(results, arm)) or "-"
    cells = cell_table(arms, seeds, lambda a, s: loss(results.get((a, s))), after=[("learning rate", rates)])
    return block("Final validation loss:", cells)


def beside(out_dir, other, comparisons):
    """Each comparison of this grid beside the same one in another grid (its report's paired.json), with the settings
    the two grids' config.json differ in: the same grid on two corpora differs in DATA_KEYS alone."""
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
    rows = []
    for reference, comparison in comparisons.items():
        there = (by_reference.get(reference) or {}).get("arms") or {}
        for arm, here in comparison["paired"].items():
            st = there.get(arm) if isinstance(there.get(arm), dict) else None
            rows.append(dict(arm=arm, reference=reference, here=here, there=st))
    arms = dict.fromkeys(a for row in rows for a in (row["reference"], row["arm"]))
    return dict(
        out_dir=other,
        differ=[] if unrecorded else sorted(differing(*configs)),
        rows=rows,
        unrecorded=unrecorded,
        arm_differ={} if unrecorded else arm_differences(configs, arms),
    )


def arm_differences(configs, arms):
    """{arm: ["key (here vs there)", ...]} for the arms whose settings (its own over its grid's, but the data) differ
    between two grids' config.json: one arm name for two methods (Block AttnRes here, Full there) compares nothing."""
    differ = {}
    for arm in arms:
        own = [arm_config(c, arm) for c in configs]
        if None in own:
            differ[arm] = ["not recorded in both grids' config.json"]
            continue
        values = [
            {k: v for k, v in c.items() if k not in (*GRID_ONLY_KEYS, *DATA_KEYS)} | o for o, c in zip(own, configs)
        ]
        if keys := sorted(differing(*values, skip=())):
            differ[arm] = [difference(k, values[0].get(k), values[1].get(k)) for k in keys]
    return differ


def beside_lines(side):
    """The section of beside(): a row per comparison, here and there."""

    def cells(st):
        if st is None:
            return ["-"] * 4
        text = st.get("text") or {}
        ci = "unavailable" if "ci95_t" not in text else interval(text["ci95_t"])
        return [fmt(st.get("mean")), f"{st.get('wins')}/{st.get('n')}", fmt(st.get("p_ttest"), ".3g"), ci]

    said = lambda arm: f"{arm}: {', '.join(side['arm_differ'][arm])}"
    arms = "; ".join(map(said, side["arm_differ"]))  # none where the settings are unrecorded
    grid = f"differ in: {md(', '.join(side['differ']))}" if side["differ"] else "are alike"
    if side["unrecorded"]:
        settings = f"cannot be compared: {md(' and '.join(side['unrecorded']))} holds no readable config.json"
    elif arms:
        other = "**arms of one name with other settings** (their rows compare different methods or rates)"
        settings = f"{grid}; {other}: {md(arms)}"
    else:
        settings = f"{grid}; every compared arm's own settings are alike"
    alike = lambda row: "; ".join(said(a) for a in (row["arm"], row["reference"]) if a in side["arm_differ"])
    there = lambda row: (
        "cannot be compared" if side["unrecorded"] else f"**other: {md(alike(row))}**" if alike(row) else "alike"
    )
    head = lambda where: [f"{where}: mean delta", "wins", "p", "CI, seeds and text"]  # cells(st)'s
    rows = [[r["arm"], md(r["reference"]), *cells(r["here"]), *cells(r["there"]), there(r)] for r in side["rows"]]
    lines = [
        f"## Beside {md(side['out_dir'])}",
        "",
        f"Each comparison here and the same one there (from its paired.json): mean delta, wins, p (t-test) and the "
        f"95% interval over seeds and text (t). The grids' settings {settings}.",
        "",
        *table(["arm", "reference", *head("here"), *head("there"), "settings there"], rows),
    ]
    if missing := [f"{row['arm']} against {row['reference']}" for row in side["rows"] if row["there"] is None]:
        lines += ["", f"Not in {md(side['out_dir'])}: {md(', '.join(missing))}."]
    return lines + [""]
