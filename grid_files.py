"""
What a grid's folder holds and how it is read, in one place and without torch (report.py runs on a
copied grid where only numpy and scipy are installed). train.py writes:

    out_dir/config.json                      the grid's record (records.GridRecord)
    out_dir/<arm>/seed<k>/                   a cell (cell_dir): config.json, log.jsonl, ckpt.pt, result.json,
                                             downstream.json (downstream.py), its lock while a worker holds it
    out_dir/tune/<arm>-lr<rate>/seed<k>/     the tuned protocol's tuning cells (tuning_arm), and
    out_dir/tune/choice.json                 the choice tune.py made from them (stable_choice)
    out_dir/report.md, paired.json, *.png    report.py's

Strict readers serve a run that goes on from a file (a problem is one line naming the remedy), lenient ones the
report and the tools that list cells (a problem is a note, never a crash). records.py, tune.py and report.py read a
grid's files only through here.
"""

import hashlib
import json
import math
import os
import re
import socket
import statistics
import sys
import time

from common import ConfigError, DataError, UserError, process_exists, read_json, read_lock

TUNE_DIR = "tune"  # the tuning grid's folder inside out_dir (so no arm may be named so)
CELL_NAME = re.compile(r"seed(0|[1-9][0-9]*)")
RESULT_REMEDY = "delete it to finish the cell again from its last checkpoint, or delete the cell's folder to retrain it"


def cell_dir(out_dir, arm, seed):
    return os.path.join(out_dir, arm, f"seed{seed}")


# Definitions of the fingerprinted files (records.CODE_FILES) that decide where a run finds its data, when the grid's
# report is written and how a tool opens a trained cell, never what a cell computes (the data is fingerprinted on its
# own, data_hash): the code comparisons leave them out, so fixing or moving one locks no grid and unpairs no cell
# (pairing_record). Name here only what cannot change a number.
NOT_COMPUTING = frozenset(
    "resolve_data_dir find_data prepare_bundled_or_wait write_report REPORT_WAIT_S"
    # which cells a worker trains or waits on (cells.py's once): never what a cell computes
    " grid_cells unfinished stalled modified WAIT_GIVE_UP_S"
    # how often a worker compiles, never what: machine.py's cache policy for the routed schemes' graphs
    " cache_routed_graphs ROUTED_GRAPHS_CACHED load_cell TrainedCell open_trained"
    # a config default: its value is in every record that could use it (the grid's config.json), which the
    # rerun check and the pairing compare; its assignment computes nothing
    " tune_routing_lr_scales".split()
)


def code_fingerprints(code, scheme):
    """(shared, own): sha256 of the definitions every scheme computes with, and of those only the
    scheme's (its classes, as code_record lists them). The arms of a seed pair on the first."""
    registered = {c for used in code["schemes"].values() for c in used}
    digest = lambda names: hashlib.sha256(
        json.dumps({n: code["definitions"].get(n) for n in sorted(names)}).encode()
    ).hexdigest()
    return digest(set(code["definitions"]) - registered - NOT_COMPUTING), digest(code["schemes"].get(scheme, ()))


def per_definition(code):
    """Whether a recorded code is as code_record writes it: a fingerprint per definition and each scheme's classes
    (an earlier version's record holds one fingerprint per file)."""
    names = lambda v: isinstance(v, list) and all(isinstance(n, str) for n in v)
    return (
        isinstance(code, dict)
        and isinstance(code.get("definitions"), dict)
        and all(isinstance(d, str) for d in code["definitions"].values())
        and isinstance(code.get("schemes"), dict)
        and all(map(names, code["schemes"].values()))
    )


def pairing_record(result):
    """A cell's pairing record as the report compares it: the shared-code fingerprint recomputed from its recorded
    code under this version's NOT_COMPUTING (a definition declared since to compute nothing unpairs no stored cell);
    a record not per definition (an earlier version's: one fingerprint per file) keeps the one it recorded."""
    pairing, code = result["pairing"], result.get("code")
    if "code" not in pairing or not per_definition(code):
        return pairing
    return pairing | {"code": code_fingerprints(code, None)[0]}


# settings recorded as lists whose order changes nothing: the rates a tuning tries train the same cells and give the
# same choice in any order
UNORDERED_KEYS = ("tune_learning_rates", "tune_routing_lr_scales")
# settings added later, as records made before them compare: the behaviour they had then
ABSENT_MEANS = {"eval_layout": "first", "tune_routing_lr_scales": []}


def as_compared(key, value):
    """A recorded setting as two records compare it (the rerun check, the report's pairing)."""
    if value is None and key in ABSENT_MEANS:
        return ABSENT_MEANS[key]
    if key == "tune_routing_lr_scales" and isinstance(value, list):  # 1, the rate's own scale, is tried either way
        value = [v for v in value if v != 1]
    if key in UNORDERED_KEYS and isinstance(value, list):
        try:
            return sorted(value)
        except TypeError:  # not numbers: compared as given (the config checks refuse it anyway)
            return value
    return value


def choice_path(out_dir):
    return os.path.join(out_dir, TUNE_DIR, "choice.json")


def report_inputs(out_dir, cells):
    """The files report.py reads for these (arm, seed) cells that exist: their result.json and downstream.json, the
    grid's config.json and choice.json. A report older than any (a downstream.py run, a new tuning) is out of date."""
    paths = [
        os.path.join(cell_dir(out_dir, *cell), name) for cell in cells for name in ("result.json", "downstream.json")
    ]
    return [p for p in paths + [os.path.join(out_dir, "config.json"), choice_path(out_dir)] if os.path.exists(p)]


def report_is_current(out_dir, cells):
    """Whether out_dir/report.md is newer than every file report_inputs lists for these cells: train.py's last
    worker writes the report again only when not."""
    path = os.path.join(out_dir, "report.md")
    return os.path.exists(path) and os.path.getmtime(path) > max(map(os.path.getmtime, report_inputs(out_dir, cells)))


# -----------------------------------------------------------------------------
# the grid's cells among its workers (train.py): which have no result yet, and whose worker seems gone


def grid_cells(cfg):
    return [(arm, seed) for seed in cfg["seeds"] for arm in cfg["arms"]]


def unfinished(cfg, cells):
    return [cell for cell in cells if not os.path.exists(os.path.join(cell_dir(cfg["out_dir"], *cell), "result.json"))]


# a cell waited on (the tuned protocol) whose log and checkpoint have not changed this long is taken for one whose
# worker died on another host (where its lock cannot be checked): the wait ends, saying how to free the cell
WAIT_GIVE_UP_S = 3600


def stalled(cfg, cells, seen):
    """The line for the first held one of the others' cells whose log and checkpoint have not changed in
    WAIT_GIVE_UP_S, else None. seen, kept between calls: cell -> (its files' mtimes, when this host saw them change)."""
    now = time.monotonic()
    for arm, seed in cells:
        folder = cell_dir(cfg["out_dir"], arm, seed)
        mtimes = tuple(modified(os.path.join(folder, name)) for name in ("log.jsonl", "ckpt.pt"))
        if seen.get((arm, seed), (None,))[0] != mtimes:
            seen[(arm, seed)] = (mtimes, now)
            continue
        lock = os.path.join(folder, "lock")
        pid, host = read_lock(lock)
        if pid is not None and now - seen[(arm, seed)][1] >= WAIT_GIVE_UP_S:
            return (
                f"[{arm} seed{seed}] is held by pid {pid} on {host}, and its log and checkpoint have not changed "
                f"in {WAIT_GIVE_UP_S // 60} minutes; if that worker is gone: rm {lock}, and run the same command again"
            )
    return None


def modified(path):
    try:
        return os.path.getmtime(path)
    except OSError:  # not written yet, or being replaced
        return None


# -----------------------------------------------------------------------------
# strict readers: a run goes on from these files only as train.py wrote them, else one line


def read_record(path, remedy):
    """A JSON object written by train.py; anything else is one line with the remedy."""
    try:
        record = read_json(path)
    except (OSError, ValueError) as e:
        raise ConfigError(f"{path} is unreadable or damaged ({e}); {remedy}") from None
    if not isinstance(record, dict):
        raise ConfigError(f"{path} holds {type(record).__name__}, not a train.py record; {remedy}")
    return record


def check_owner(path, record, arm, seed):
    """A cell's record (config.json, result.json, a checkpoint's) must be that cell's: a copy is no new seed."""
    if (record.get("arm"), record.get("seed")) != (arm, seed):
        raise ConfigError(
            f"{path} is the record of arm {record.get('arm')!r} seed {record.get('seed')!r} (a copied "
            f"file or folder?); delete {os.path.dirname(path)} to train this cell"
        )


def check_result(r, path):
    """A result.json as train.py writes it, or one line."""
    ended = is_number(r.get("val_loss")) if r.get("status") == "finished" else isinstance(r.get("diverged_at"), int)
    if not (r.get("status") in ("finished", "diverged") and isinstance(r.get("seed"), int) and ended):
        raise ConfigError(
            f"{path} is not a result train.py wrote (status, seed, val_loss or diverged_at missing or "
            f"of the wrong type); {RESULT_REMEDY}"
        )
    return r


def describe_done(path, change):
    r = check_result(read_record(path, RESULT_REMEDY), path)
    return (
        f"diverged at step {r['diverged_at']}" if r["status"] == "diverged" else f"val_loss {r['val_loss']:.4f}"
    ) + (f" (recorded with other settings: {', '.join(change)}; not retrained)" if change else "")


# -----------------------------------------------------------------------------
# lenient readers (report.py): each cell's result and log checked, a problem a note, never a crash


def is_number(x):
    """A real number that fits a float (JSON true/false load as bools, which Python would count as 1 and 0;
    a JSON integer of 400 digits loads as an int that no float arithmetic takes)."""
    return isinstance(x, float) or isinstance(x, int) and not isinstance(x, bool) and abs(x) <= sys.float_info.max


is_finite = lambda x: is_number(x) and math.isfinite(x)
is_seed = lambda x: isinstance(x, int) and not isinstance(x, bool) and x >= 0
is_dict = lambda x: isinstance(x, dict)
is_seeds = lambda x: isinstance(x, list) and all(map(is_seed, x))


def field(record, key, kind):
    """record[key] where it is of kind (dict, list), else an empty one: a damaged record reads as one without it."""
    value = record.get(key)
    return value if isinstance(value, kind) else kind()


def is_folder_name(name):
    """A name that joins onto out_dir as one folder inside it (config.json's arms are not trusted)."""
    return name not in ("", ".", "..") and "/" not in name and "\0" not in name


def described(value):
    """A JSON value as a short string for an error line."""
    text = json.dumps(value)
    return text if len(text) <= 20 else text[:16] + "..."


def file_problem(path):
    """Why path cannot be read as a file (a folder, a device, a dangling link), or None."""
    return "a folder, not a file" if os.path.isdir(path) else None if os.path.isfile(path) else "not a regular file"


def json_object(path):
    """(the file's dict, None), or (None, why it cannot be used: not a file, unreadable, not JSON, not a dict)."""
    if problem := file_problem(path):
        return None, problem
    try:
        obj = read_json(path, strict=False)  # older versions wrote NaN for a diverged loss: read as diverged
    except OSError as e:
        return None, (e.strerror or str(e)).lower()
    except ValueError:  # half-written, not UTF-8, NaN, or nested past Python's stack
        return None, "not JSON"
    return (obj, None) if isinstance(obj, dict) else (None, f"{described(obj)}, not a JSON object")


def checked_object(path, problem=lambda record: None):
    """json_object where problem(the dict) finds nothing wrong, else (None, why); (None, None) where path is none."""
    if not os.path.lexists(path):
        return None, None
    record, why = json_object(path)
    why = why or problem(record)
    return (None, why) if why else (record, None)


def wrong_type(record, checks, prefix="", required=False):
    """The first 'key is value, not kind' among checks = (key, test, kind) of a dict, or None; an absent or null key
    is allowed unless required, when the first key missing is 'no key'."""
    if required and (missing := [key for key, _, _ in checks if key not in record]):
        return f"no {prefix}{missing[0]}"
    for key, ok, kind in checks:
        if (required or record.get(key) is not None) and not ok(record[key]):
            return f"{prefix}{key} is {described(record[key])}, not {kind}"
    return None


def log_problem(record):
    """Why a log.jsonl record cannot be used (a field report.py reads has the wrong type), or None."""
    if not isinstance(record, dict):
        return "not a JSON object"
    is_weights = lambda w: isinstance(w, list) and len(w) > 0 and all(map(is_number, w))
    routing = record.get("routing") or {}
    fields = (
        ("tokens", is_finite, "a finite number"),
        ("val_loss", is_number, "a number"),
        ("routing", is_dict, "a dict"),
    )
    if problem := wrong_type(record, fields) or wrong_type(
        routing, [(k, is_dict, "a dict") for k in ("weights", "qk_v_jsd")], "routing."
    ):
        return problem
    weights, jsd = routing.get("weights") or {}, routing.get("qk_v_jsd") or {}
    return wrong_type(
        weights, [(k, is_weights, "a list of numbers") for k in weights], "routing.weights.", required=True
    ) or wrong_type(jsd, [(k, is_number, "a number") for k in jsd], "routing.qk_v_jsd.", required=True)


def read_log(path):
    """(records of a log.jsonl, why it or some of its lines cannot be used (a torn last line, a field of the
    wrong type), or None)"""
    if problem := file_problem(path):
        return [], f"unreadable ({problem})"
    records, bad = [], []
    try:
        with open(path, errors="replace") as f:
            for number, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    record = json.loads(line)
                except (ValueError, RecursionError):
                    bad.append(f"line {number} (not JSON)")
                    continue
                if problem := log_problem(record):
                    bad.append(f"line {number} ({problem})")
                else:
                    records.append(record)
    except OSError as e:
        return [], f"unreadable ({(e.strerror or str(e)).lower()})"
    if not bad:
        return records, None
    return records, "skipped " + ", ".join(bad[:3]) + (f" and {len(bad) - 3} more lines" if len(bad) > 3 else "")


def result_problem(result):
    """Why a result.json's fields cannot be used (a wrong type, no arm or seed), or None."""
    if missing := [key for key in ("arm", "seed") if result.get(key) is None]:
        return f"no {missing[0]} recorded"
    pairing = result.get("pairing") or {}  # checked a dict first (or null)
    return wrong_type(
        result,
        (
            ("arm", lambda a: isinstance(a, str), "a string"),
            ("seed", is_seed, "a seed"),
            ("val_loss", is_number, "a number"),
            ("wall_time_s", is_finite, "a finite number"),
            ("pairing", is_dict, "a dict"),
            ("code", is_dict, "a dict"),
        ),
    ) or next(
        (f"pairing.{k} is not a dict" for k in ("settings", "arm_settings") if not is_dict(pairing.get(k, {}))), None
    )


def cell_result(cell_dir):
    """A cell's result.json, checked, for a reader that lists cells (the report) and must never stop at one."""
    return checked_object(os.path.join(cell_dir, "result.json"), result_problem)


def subfolders(path):
    """(sorted names of the folders in path, None), or ([], why it cannot be listed)."""
    try:
        names = os.listdir(path)
    except OSError as e:
        return [], (e.strerror or str(e)).lower()
    return sorted(n for n in names if os.path.isdir(os.path.join(path, n))), None


def is_tuning_grid(out_dir, folder):
    """Whether a folder of out_dir is the tuning grid (tune/ holding arms, not seed<k> cells): not an arm."""
    return folder == TUNE_DIR and not any(CELL_NAME.fullmatch(c) for c in subfolders(os.path.join(out_dir, folder))[0])


def load_grid(out_dir):
    """(arms, seeds, {(arm, seed): usable result}, {(arm, seed): why a cell's result.json is not used},
    {(arm, seed): log records}, notes on what was skipped). A cell's arm and seed are what its result.json records
    (another cell's copy or link never counts, nor two cells of one arm with the same init and data hashes); an arm
    is a folder listed in config.json or holding a cell of its own, a seed one of those cells' or listed."""
    config, why = checked_object(os.path.join(out_dir, "config.json"))
    notes = [f"config.json: unreadable ({why}); arms and seeds taken from the folders"] if why else []
    config = config or {}
    arms = config.get("arms", {})
    if not isinstance(arms, dict):
        notes.append(f"config.json: arms is {described(arms)}, not a dict of arm settings; arms taken from the folders")
        arms = {}
    if bad := [json.dumps(a) for a in arms if not is_folder_name(a)]:
        notes.append(f"config.json: arms {', '.join(bad)} ignored (not folder names)")
    arms = [a for a in arms if is_folder_name(a)]
    listed = config.get("seeds", [])
    listed = listed if isinstance(listed, list) else [listed]
    seeds = {s for s in listed if is_seed(s)}
    if bad := [json.dumps(s) for s in listed if not is_seed(s)]:
        notes.append(f"config.json: seeds {', '.join(bad)} ignored (not non-negative integers)")
    folders, why = subfolders(out_dir)
    if why:
        raise DataError(f"cannot list {out_dir} ({why}); check its permissions")
    results, unusable, logs, copies = {}, {}, {}, []
    real = {
        os.path.realpath(os.path.join(out_dir, f)): f for f in folders if not os.path.islink(os.path.join(out_dir, f))
    }
    for arm in arms + [f for f in folders if f not in arms and not is_tuning_grid(out_dir, f)]:
        arm_dir = os.path.join(out_dir, arm)
        if os.path.islink(arm_dir) and os.path.realpath(arm_dir) in real:  # one arm under two names
            notes.append(f"folder {arm}/: a link to {real[os.path.realpath(arm_dir)]}/, not counted; delete the link")
            continue
        cells, unlisted = subfolders(arm_dir) if os.path.isdir(arm_dir) else ([], None)
        if unlisted:
            notes.append(f"folder {arm}/: unreadable ({unlisted})")
        own, arm_notes = False, []
        for cell in cells:
            if not CELL_NAME.fullmatch(cell):
                arm_notes.append(f"folder {arm}/{cell}/: not a seed<k> cell")
                continue
            seed, where, log_path = int(cell[4:]), f"{arm}/{cell}", os.path.join(arm_dir, cell, "log.jsonl")
            result, why = cell_result(os.path.join(arm_dir, cell))  # (None, None): no result.json
            if why:
                unusable[arm, seed] = "unreadable result.json"
                arm_notes.append(f"{where}/result.json: unreadable ({why})")
            elif result and (result["arm"], result["seed"]) != (arm, seed):
                copies.append((where, result["arm"], result["seed"]))
                continue  # another cell's record: not a seed of this arm, its log not read
            elif result:
                results[arm, seed] = result
            elif not os.path.lexists(log_path):
                arm_notes.append(f"folder {where}/: no result.json or log.jsonl (not started)")
                continue
            own = True
            seeds.add(seed)
            if os.path.lexists(log_path):
                logs[arm, seed], why = read_log(log_path)
                if why:
                    arm_notes.append(f"{where}/log.jsonl: {why}")
        if own and arm not in arms:
            arms.append(arm)
        if arm in arms:
            notes += arm_notes
        elif not unlisted:
            notes.append(f"folder {arm}/: not an arm (no seed<k> cell of its own with a result.json or log.jsonl)")
    for where, arm, seed in copies:
        named = f"{arm}/seed{seed}"
        fix = f"a copy of {named}/: delete it" if (arm, seed) in results else f"rename it to {named}/ or delete it"
        notes.append(f"folder {where}/: its result.json is {named}'s, not counted; {fix}")
    trainings = {}  # a copy whose recorded seed was edited to match its folder: one training, never two seeds
    for (arm, seed), result in results.items():
        hashes = tuple((result.get("pairing") or {}).get(k) for k in ("init_hash", "data_hash"))
        if all(isinstance(h, str) and h for h in hashes):
            trainings.setdefault((arm, hashes), []).append(seed)
    for (arm, _), same in trainings.items():
        if len(same) < 2:
            continue
        cells = [f"{arm}/seed{s}" for s in same]
        for seed in same:
            del results[arm, seed]
            unusable[arm, seed] = "same training as " + ", ".join(c for c in cells if c != f"{arm}/seed{seed}")
        notes.append(
            f"{', '.join(cells)}: one training (the same init_hash and data_hash), none counted; "
            f"delete the copies, keeping the cell trained with that seed"
        )
    return arms, sorted(seeds), results, unusable, logs, notes


def close(x, y):  # two computations of one number in double precision
    return math.isclose(x, y, rel_tol=1e-9, abs_tol=1e-12)


TASK_CHECKS = (
    ("icl_task_type", lambda t: isinstance(t, str), "a string"),
    ("items", lambda i: is_seed(i) and i > 0, "a positive integer"),
    ("correct", is_seed, "a non-negative integer"),
    ("accuracy", is_finite, "a finite number"),
    ("random_baseline", lambda b: is_finite(b) and 0 <= b < 1, "a fraction in [0, 1)"),
    ("centered", is_finite, "a finite number"),
)
DOWNSTREAM_CHECKS = (
    ("bundle_sha256", lambda h: isinstance(h, str) and h != "", "a hash"),
    ("max_per_task", lambda m: m is None or is_seed(m) and m > 0, "null or a positive integer"),
    ("step", is_seed, "a step"),
    ("core", is_finite, "a finite number"),
    ("tasks", lambda t: isinstance(t, dict) and len(t) > 0, "a dict of tasks"),
)


def task_problem(task, prefix):
    """Why one task's result in a downstream.json cannot be used, as downstream_problem's, or None."""
    if not isinstance(task, dict):
        return f"{prefix[:-1]} is {described(task)}, not a dict"
    if problem := wrong_type(task, TASK_CHECKS, prefix, required=True):
        return problem
    items, correct, accuracy, baseline = (task[k] for k in ("items", "correct", "accuracy", "random_baseline"))
    if correct > items:
        return f"{prefix}correct is {correct}, more than its {items} items"
    if not close(accuracy, correct / items):
        return f"{prefix}accuracy is {accuracy!r}, not correct / items ({correct / items!r})"
    if not close(task["centered"], (accuracy - baseline) / (1 - baseline)):
        return f"{prefix}centered is {task['centered']!r}, not (accuracy - random_baseline) / (1 - random_baseline)"
    if "bits_per_byte" in task and not (is_finite(task["bits_per_byte"]) and task["bits_per_byte"] >= 0):
        return f"{prefix}bits_per_byte is {described(task['bits_per_byte'])}, not a finite number >= 0"
    return None


def downstream_problem(record):
    """Why a downstream.json cannot be used (a field missing or of the wrong type, numbers that do not follow from
    each other), or None."""
    if problem := wrong_type(record, DOWNSTREAM_CHECKS, required=True) or next(
        (p for label, task in record["tasks"].items() if (p := task_problem(task, f"tasks.{label}."))), None
    ):
        return problem
    centered = [task["centered"] for task in record["tasks"].values()]
    if not close(record["core"], math.fsum(centered) / len(centered)):
        return f"core is {record['core']!r}, not the mean of its tasks' centered accuracies"
    bits = [task.get("bits_per_byte") for task in record["tasks"].values()]  # none in a file of an earlier version
    if ("bits_per_byte" in record or any(b is not None for b in bits)) and (
        None in bits or not close(record.get("bits_per_byte"), math.fsum(bits) / len(bits))
    ):
        return f"bits_per_byte is {described(record.get('bits_per_byte'))}, not the mean of every task's bits_per_byte"
    return None


def load_downstream(out_dir, results):
    """({(arm, seed): downstream.json}, {(arm, seed): why it is not used}, notes) of the cells counted in results."""
    records, problems, notes = {}, {}, []
    for arm, seed in results:
        record, why = checked_object(os.path.join(cell_dir(out_dir, arm, seed), "downstream.json"), downstream_problem)
        if why:
            problems[arm, seed] = "unreadable downstream.json"
            notes.append(f"{arm}/seed{seed}/downstream.json: unreadable ({why})")
        elif record:
            records[arm, seed] = record
    return records, problems, notes


# -----------------------------------------------------------------------------
# the tuning grid (tune/): its cells' losses, the choice tune.py's rule gives, choice.json


def rate_name(rate):
    """A rate as in a tuning arm's name and in choice.json: 6 significant digits, no '+' (not in an arm name)."""
    return f"{rate:g}".replace("+", "")


def tuning_arm(arm, rate):
    """The tuning grid's arm for an arm at a rate: <arm>-lr<rate> (a rate name holds no 'l', so it splits back)."""
    return f"{arm}-lr{rate_name(rate)}"


def tuning_iters(tune_iters, max_iters):
    """The tuning cells' steps: tune_iters, or by default (0) a quarter of max_iters, rounded up."""
    return tune_iters or -(-max_iters // 4)


def scaled_arm(arm, scale):
    """The tuning arm's stem for an arm at a routing scale: <arm>-rs<scale> (its cells: <arm>-rs<scale>-lr<rate>)."""
    return f"{arm}-rs{rate_name(scale)}"


def routing_choice(tune_dir, arm, rows, scales, seeds, budget):
    """(routing rows {scale name: row}, scale, reason, rate) of a routed arm, from its rows at routing x1 (the table's)
    and its tuning cells at the other scales. Each scale at the rate stable_choice takes there (an arm unstable at the
    largest rate at 1x may be best there with its routing slower), its row's learning_rate the routing's (rate x
    scale); no row where no rate finished. Then the scale by stable_choice over those rows: a smaller one is the
    safer, taken unless a larger one beats it (never none: x1 is the arm's own choice)."""
    routing_rows, rates = {}, {}
    for scale in sorted({*scales, 1.0}):
        tried = [
            row if scale == 1 else tuning_row(tune_dir, scaled_arm(arm, scale), row["learning_rate"], seeds, budget)
            for row in rows.values()
        ]
        rate = stable_choice(tried)[0]
        if rate is not None:
            row = next(row for row in tried if row["learning_rate"] == rate)
            routing_rows[rate_name(scale)], rates[rate_name(scale)] = dict(row, learning_rate=rate * scale), rate
    routing_rate, why = stable_choice(list(routing_rows.values()))
    scale = next(float(s) for s, row in routing_rows.items() if row["learning_rate"] == routing_rate)
    return routing_rows, scale, f"routing rate {rate_name(routing_rate)}: {why}", rates[rate_name(scale)]


def initial_loss(cell_dir):
    """A tuning cell's validation loss at step 0, before any training: the first record of its log.jsonl (a
    resumed log is cut back to its checkpoint, never before it)."""
    path = os.path.join(cell_dir, "log.jsonl")
    try:
        with open(path) as f:
            first = json.loads(f.readline())
    except (OSError, ValueError, RecursionError) as e:
        raise ConfigError(f"{path} is unreadable or damaged ({e}); delete {cell_dir} to retrain it") from None
    loss = first.get("val_loss") if isinstance(first, dict) and first.get("step") == 0 else None
    if not is_finite(loss):
        raise ConfigError(
            f"{path} does not start with the step-0 validation loss a tuning rate is judged against; "
            f"delete {cell_dir} to retrain it"
        )
    return loss


def tuning_loss(tune_dir, name, seed, rate, budget):
    """A tuning cell's (final validation loss, its step-0 loss), or (None, None) when it diverged; one line when
    it has no result or one of other settings (a copy, a rate or budget not this tuning's)."""
    path = os.path.join(cell_dir(tune_dir, name, seed), "result.json")
    if not os.path.exists(path):
        raise ConfigError(
            f"tuning cell {name}/seed{seed} has no result ({path} missing); run the same command to train it"
        )
    result = check_result(read_record(path, RESULT_REMEDY), path)
    check_owner(path, result, name, seed)
    own = field(field(result, "pairing", dict), "arm_settings", dict)  # damaged: not this tuning's
    if own.get("learning_rate") != rate or result["status"] == "finished" and result.get("steps") != budget:
        raise ConfigError(
            f"{path} is not of this tuning (learning_rate {own.get('learning_rate')!r}, "
            f"{result.get('steps')!r} steps; this tuning: {rate:g}, {budget} steps); delete "
            f"{os.path.dirname(path)} to retrain it"
        )
    return (result["val_loss"], initial_loss(os.path.dirname(path))) if result["status"] == "finished" else (None, None)


def tuning_row(tune_dir, arm, rate, seeds, budget):
    """One arm at one rate over the tuning seeds: each seed's final and step-0 validation loss, their mean and s.d.,
    and why the rate cannot be chosen (a seed diverged, or ended at or above its step-0 loss), else None."""
    name = tuning_arm(arm, rate)
    ends = {str(s): tuning_loss(tune_dir, name, s, rate, budget) for s in seeds}
    losses, starts = {s: end for s, (end, _) in ends.items()}, {s: start for s, (_, start) in ends.items()}
    problem = next(
        (
            f"seed {s} diverged"
            if end is None
            else f"seed {s} ended at {end:.4g}, not below its step-0 loss {starts[s]:.4g}"
            for s, end in losses.items()
            if end is None or not end < starts[s]
        ),
        None,
    )  # not end < start: a NaN loss too
    mean = sd = None
    if problem is None:
        mean, sd = math.fsum(losses.values()) / len(losses), statistics.stdev(losses.values())
    return dict(learning_rate=rate, val_loss=losses, initial_loss=starts, mean=mean, sd=sd, problem=problem)


def beats(row, safer):
    """Why row's (larger) rate is better than safer's beyond the tuning seeds' noise, or None: better on every seed
    (they pair: same init, same batches) and its mean lower by more than its seeds' s.d. (a gain inside that spread
    is what another draw of seeds undoes; a rate where one seed stalls has a wide spread)."""
    if any(not row["val_loss"][s] < loss for s, loss in safer["val_loss"].items()):
        return None
    gain = safer["mean"] - row["mean"]
    return (
        f"{gain:.4f} below {rate_name(safer['learning_rate'])} on every seed, beyond its seeds' s.d. {row['sd']:.4f}"
        if gain > row["sd"]
        else None
    )


def stable_choice(rows):
    """(rate, reason) for one arm from its tuning rows: among the rates where every seed finished below its step-0
    loss, the smallest that no larger rate beats (any larger one: rates need not be ordered like their losses), or
    (None, reason). The lowest mean is never beaten, so the choice is it or a smaller, safer rate; the reason says
    which rate beats the next smaller one, or why the lowest mean does not beat the safer rate."""
    usable = sorted((row for row in rows if row["problem"] is None), key=lambda row: row["learning_rate"])
    if not usable:
        return None, "no rate finished on every tuning seed (" + "; ".join(
            f"{rate_name(row['learning_rate'])}: {row['problem']}" for row in rows
        ) + ")"
    chosen = next(row for i, row in enumerate(usable) if not any(beats(r, row) for r in usable[i + 1 :]))
    best = min(usable, key=lambda row: (row["mean"], row["learning_rate"]))
    below = [row for row in usable if row["learning_rate"] < chosen["learning_rate"]]
    if chosen is best:
        if not below:
            return best["learning_rate"], "the lowest mean"
        safer = below[-1]  # the next smaller rate, beaten by the chosen one or by a rate above it
        winner = next(r for r in usable if r["learning_rate"] > safer["learning_rate"] and beats(r, safer))
        won = beats(winner, safer)
        if winner is not best:
            won = f"and {rate_name(winner['learning_rate'])} beats {rate_name(safer['learning_rate'])} ({won})"
        return best["learning_rate"], "the lowest mean, " + won
    worse = [s for s, loss in chosen["val_loss"].items() if not best["val_loss"][s] < loss]
    how = (
        f"worse on seed {', '.join(worse)}"
        if worse
        else f"{chosen['mean'] - best['mean']:.4f} lower, within its seeds' s.d. {best['sd']:.4f}"
    )
    return chosen["learning_rate"], (
        f"the safer rate: {rate_name(best['learning_rate'])} has the lowest mean but is "
        f"not better beyond the seeds' noise ({how})"
    )


TUNING_CHECKS = (
    # 2 tuning seeds at least: fewer have no s.d.
    ("tune_seeds", lambda s: is_seeds(s) and len(set(s)) == len(s) > 1, "a list of 2 or more distinct seeds"),
    ("seeds", is_seeds, "a list of seeds"),
    ("tune_iters", lambda n: is_seed(n) and n > 0, "a positive integer"),
    ("max_iters", lambda n: is_seed(n) and n > 0, "a positive integer"),
    (
        "learning_rates",
        lambda r: isinstance(r, list) and len(r) > 0 and all(is_finite(x) and x > 0 for x in r),
        "a list of positive numbers",
    ),
    ("min_lr_ratio", lambda r: is_finite(r) and 0 <= r <= 1, "a fraction in [0, 1]"),
    (
        "tuning_text",
        lambda t: (
            isinstance(t, dict)
            and is_seed(t.get("tokens"))
            and (t.get("layout") == "spread" and t.get("sequences") == "odd" or is_seed(t.get("first_token")))
        ),
        "a dict of first_token and tokens, or of layout 'spread', sequences 'odd' and tokens",
    ),
    ("test_tokens", lambda n: is_seed(n) and n > 0, "a positive integer"),
    ("table", lambda t: isinstance(t, dict) and len(t) > 0, "a dict of arms"),
    ("choice", is_dict, "a dict of arms"),
    ("reason", is_dict, "a dict of arms"),
)


def first_difference(row, held):
    """The first key where a choice.json row differs from the one its tuning cells give, with both values."""
    key = next(k for k in [*held, *row] if row.get(k) != held.get(k))
    if isinstance(row.get(key), dict) and isinstance(held.get(key), dict):  # per seed: name the seed
        seed = next(s for s in [*held[key], *row[key]] if row[key].get(s) != held[key].get(s))
        return f"{key}.{seed}", row[key].get(seed), held[key].get(seed)
    return key, row.get(key), held.get(key)


def tuning_problem(record, out_dir):
    """Why a tune/choice.json cannot be used, or None: a field missing or of the wrong type, a choice made on the
    reported validation text or on compared seeds, a row that is not what its tuning cells in out_dir/tune hold
    (an edited loss), or a choice or reason that is not stable_choice's from those rows."""
    if "tuning_text" not in record:
        return (
            "no tuning_text: a choice.json made before the tuning split, whose rates were chosen on the reported "
            "validation text itself; tune again in a new out_dir"
        )
    if problem := wrong_type(record, TUNING_CHECKS, required=True):
        return problem
    if record["tuning_text"].get("layout") != "spread" and record["tuning_text"]["first_token"] < record["test_tokens"]:
        return (
            f"tuning_text begins at token {record['tuning_text']['first_token']}, inside the reported validation "
            f"text (its first {record['test_tokens']} tokens)"
        )
    if shared := sorted(set(record["tune_seeds"]) & set(record["seeds"])):
        return f"tune_seeds and seeds share {', '.join(map(str, shared))}: rates chosen on compared seeds"
    tune_dir = os.path.join(out_dir, TUNE_DIR)
    for arm, rows in record["table"].items():
        if not isinstance(rows, dict):
            return f"table.{arm} is {described(rows)}, not a dict of rates"
        if sorted(rows) != sorted(names := [rate_name(r) for r in record["learning_rates"]]):
            return f"table.{arm} holds rates {', '.join(sorted(rows)) or 'none'}, not learning_rates {', '.join(names)}"
        for rate, name in zip(record["learning_rates"], names):
            if not isinstance(rows[name], dict):
                return f"table.{arm}.{name} is {described(rows[name])}, not a dict"
            try:
                held = tuning_row(tune_dir, arm, float(rate), record["tune_seeds"], record["tune_iters"])
            except UserError as e:
                return f"table.{arm}.{name} cannot be checked against its tuning cells: {e}"
            if rows[name] != held:
                key, written, found = first_difference(rows[name], held)
                return (
                    f"table.{arm}.{name}.{key} is {described(written)}, but its tuning cells in {TUNE_DIR}/ give "
                    f"{described(found)} (an edited or copied choice.json)"
                )
        rate, reason = stable_choice(list(rows.values()))
        if rate is None:
            return f"table.{arm}: {reason}, so nothing was chosen"
        if record["reason"].get(arm) != reason:
            return f"reason.{arm} is {described(record['reason'].get(arm))}, not the tuning rule's: {reason}"
        if arm not in record.get("routing_table", {}) and record["choice"].get(arm) != rate:
            return f"choice.{arm} is {described(record['choice'].get(arm))}, not the tuning rule's {rate:g} ({reason})"
    if extra := sorted(set(record["choice"]) - set(record["table"])):
        return f"choice.{extra[0]} has no row in table"
    routing = [record.get(k, {}) for k in ("routing_table", "routing_choice", "routing_reason")]
    scales = record.get("routing_scales", [])
    if not all(isinstance(part, dict) for part in routing) or not isinstance(scales, list):
        return "routing_table, routing_choice and routing_reason are not dicts, or routing_scales not a list"
    if not set(routing[0]) == set(routing[1]) == set(routing[2]):
        return "routing_table, routing_choice and routing_reason name different arms"
    if extra := sorted(set(routing[0]) - set(record["table"])):  # its rows at routing x1 are the table's
        return f"routing_table.{extra[0]} has no row in table"
    seeds, budget = record["tune_seeds"], record["tune_iters"]
    for arm in sorted(routing[0]):
        try:  # reads every cell the cost line counts: each scale at every rate (x1's: the table's, checked above)
            held, scale, why, rate = routing_choice(tune_dir, arm, record["table"][arm], scales, seeds, budget)
        except (UserError, KeyError, TypeError) as e:
            return f"routing_table.{arm} cannot be checked against its tuning cells: {e}"
        if routing[0].get(arm) != held:
            return f"routing_table.{arm} is not what its tuning cells in {TUNE_DIR}/ give (an edited or copied file)"
        if [routing[1].get(arm), routing[2].get(arm)] != [scale, why]:
            return f"routing_choice.{arm} or its reason is not the tuning rule's: {scale:g} ({why})"
        if record["choice"].get(arm) != rate:
            return (
                f"choice.{arm} is {described(record['choice'].get(arm))}, not the tuning rule's {rate:g} (its rate "
                f"at routing x{scale:g})"
            )
    return None


def read_tuning(out_dir):
    """out_dir/tune/choice.json, checked against its tuning cells (tuning_problem)."""
    return checked_object(choice_path(out_dir), lambda record: tuning_problem(record, out_dir))


def tuning_results(out_dir, record):
    """{(tuning arm, seed): result.json} of the tuning cells of a checked choice.json (each readable:
    tuning_problem), those of each routing scale too (at every rate: the tuning trains them all before choosing)."""
    tune_dir, routed = os.path.join(out_dir, TUNE_DIR), record.get("routing_table", {})
    names = [
        tuning_arm(stem, row["learning_rate"])
        for arm, rows in record["table"].items()
        for stem in [arm] + [scaled_arm(arm, s) for s in record.get("routing_scales", []) if arm in routed]
        for row in rows.values()
    ]
    return {
        (name, seed): json_object(os.path.join(cell_dir(tune_dir, name, seed), "result.json"))[0]
        for name in names
        for seed in record["tune_seeds"]
    }


def recorded_choice(tune_dir):
    """The choice.json a tuning wrote before into tune_dir (strict: a damaged one is one line), or None."""
    path = os.path.join(tune_dir, "choice.json")
    return read_record(path, "delete it to write the choice again") if os.path.lexists(path) else None


# -----------------------------------------------------------------------------
# another grid's files, for --beside: its record and its report's numbers


def grid_record(out_dir):
    """A grid's config.json as a dict, {} where it is missing or unreadable (the report then names what it lacks)."""
    return json_object(os.path.join(out_dir, "config.json"))[0] or {}


def read_paired(out_dir):
    """(a grid's paired.json, None) or (None, why it cannot be read)."""
    return json_object(os.path.join(out_dir, "paired.json"))


# -----------------------------------------------------------------------------
# a cell's state for launch.py --status: lenient, a problem is the row's DataError, never a traceback

KINDS = ("finished", "diverged", "training", "resumable", "pending", "unreadable")
DONE = KINDS[:2]  # a cell with a result


def cell_state(cell_dir, max_iters):
    """(kind, what the cell is doing, the device-seconds it has used, its step). Device-seconds are
    wall time x processes, from its result, else its checkpoint (a cell in training: at its last one)."""
    result_path, ckpt_path = os.path.join(cell_dir, "result.json"), os.path.join(cell_dir, "ckpt.pt")
    if os.path.exists(result_path):
        try:
            r = read_json(result_path, strict=False)
        except (OSError, ValueError) as e:  # torn by a kill mid-write of another tool, not UTF-8
            raise DataError(f"{result_path} cannot be read ({e}); move it aside to train the cell again") from None
        try:
            used = number(r["wall_time_s"], "wall_time_s") * number(r["config"]["world_size"], "world_size")
            steps = number(r["steps"], "steps")
            if r["status"] == "diverged":
                return "diverged", f"diverged at step {steps} ({r['reason']})", used, steps
            return "finished", f"finished, val_loss {number(r['val_loss'], 'val_loss'):.4f}", used, steps
        except (KeyError, TypeError, ValueError) as e:
            why = f"no {e}" if isinstance(e, KeyError) else e
            raise DataError(
                f"{result_path} is not a result train.py writes ({why}); move it aside to train the cell again"
            ) from None
    ckpt = checkpoint_summary(ckpt_path) if os.path.exists(ckpt_path) else dict(step=0, wall_time_s=0.0, world=1)
    used = ckpt["wall_time_s"] * ckpt["world"]
    pid, host = read_lock(os.path.join(cell_dir, "lock"))
    if pid and (host != socket.gethostname() or not pid.isdigit() or process_exists(int(pid))):
        last = last_log_record(os.path.join(cell_dir, "log.jsonl"))
        eta = f", {duration(last['eta_cell_s'])} left" if last.get("eta_cell_s") is not None else ""
        text = f"training: {host} pid {pid}, step {last.get('step', 0)}/{max_iters}{eta}"
        return "training", text, used, ckpt["step"]
    if ckpt["step"]:
        return "resumable", f"resumable at step {ckpt['step']}", used, ckpt["step"]
    return "pending", "pending", used, 0


def duration(seconds):
    """seconds as 0m05s, or 1h02m from an hour on (the time left that progress.py logs and --status shows)."""
    seconds = int(seconds)
    return f"{seconds // 3600}h{seconds // 60 % 60:02d}m" if seconds >= 3600 else f"{seconds // 60}m{seconds % 60:02d}s"


def checkpoint_summary(path):
    """A checkpoint's step, wall time and world size, read without loading its tensors (mmap)."""
    import pickle

    import torch

    try:
        ckpt = torch.load(path, map_location="cpu", mmap=True, weights_only=True)
    except (OSError, EOFError, RuntimeError, ValueError, KeyError, pickle.UnpicklingError) as e:
        raise DataError(
            f"{path} cannot be read as a checkpoint ({str(e).splitlines()[0] if str(e) else type(e).__name__}); "
            f"delete it to train the cell from scratch"
        ) from None
    try:
        return dict(
            step=number(ckpt["step"], "step"),
            wall_time_s=number(ckpt["wall_time_s"], "wall_time_s"),
            world=number(ckpt["config"]["world_size"], "world_size"),
        )
    except (KeyError, TypeError, ValueError) as e:
        why = f"no {e}" if isinstance(e, KeyError) else e
        raise DataError(
            f"{path} is not a checkpoint train.py writes ({why}); delete it to train the cell from scratch"
        ) from None


def number(value, name):
    """value when it is a number (an int or a float, not a bool), else ValueError naming it."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{name} is {value!r}, not a number")
    return value


def last_log_record(path):
    """The log's last whole record ({} without one)."""
    try:
        with open(path) as f:
            lines = f.read().splitlines()
    except OSError:
        return {}
    for line in reversed(lines):
        try:
            return json.loads(line)
        except ValueError:
            continue  # a line being written
    return {}
