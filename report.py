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

A cell is the arm and seed its result.json records: a copied, moved or linked cell folder, or two
cells of one arm with the same init and data hashes, is listed under "Skipped" and never counted.
Every file is written to a temporary name of this process and renamed (two reports on one grid
never share one); paired.json is strict JSON, null for a number that is not finite.
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

from data.prepare import DataError, write_atomic

MISSING = object()  # a pairing key one cell does not record
CELL_NAME = re.compile(r"seed(0|[1-9][0-9]*)")


def is_number(x):
    """A real number that fits a float (JSON true/false load as bools, which Python would count as 1 and 0;
    a JSON integer of 400 digits loads as an int that no float arithmetic takes)."""
    return isinstance(x, float) or isinstance(x, int) and not isinstance(x, bool) and abs(x) <= sys.float_info.max


def is_seed(x):
    return isinstance(x, int) and not isinstance(x, bool) and x >= 0


def is_folder_name(name):
    """A name that joins onto out_dir as one folder inside it (config.json's arms are not trusted)."""
    return name not in ("", ".", "..") and "/" not in name and "\0" not in name


def described(value):
    """A JSON value as a short string for an error line."""
    text = json.dumps(value)
    return text if len(text) <= 20 else text[:16] + "..."


def file_problem(path):
    """Why path cannot be read as a file (a folder, a device, a dangling link), or None."""
    if os.path.isdir(path):
        return "a folder, not a file"
    return None if os.path.isfile(path) else "not a regular file"


def read_json(path):
    """(the file's dict, None), or (None, why it cannot be used: not a file, unreadable, not JSON, not a dict)."""
    if problem := file_problem(path):
        return None, problem
    try:
        with open(path) as f:
            obj = json.load(f)
    except OSError as e:
        return None, (e.strerror or str(e)).lower()
    except (ValueError, RecursionError):  # half-written, not UTF-8, or nested past Python's stack
        return None, "not JSON"
    return (obj, None) if isinstance(obj, dict) else (None, f"{described(obj)}, not a JSON object")


def wrong_type(record, checks, prefix="", optional=True):
    """The first 'key is value, not kind' among checks = (key, test, kind) of a dict; an absent or null key is
    allowed when optional."""
    for key, ok, kind in checks:
        if (record.get(key) is not None or not optional and key in record) and not ok(record[key]):
            return f"{prefix}{key} is {described(record[key])}, not {kind}"
    return None


def is_weights(w):
    return isinstance(w, list) and len(w) > 0 and all(map(is_number, w))


def log_problem(record):
    """Why a log.jsonl record cannot be used (a field report.py reads has the wrong type), or None."""
    if not isinstance(record, dict):
        return "not a JSON object"
    problem = wrong_type(record, (("tokens", lambda t: is_number(t) and math.isfinite(t), "a finite number"),
                                  ("val_loss", is_number, "a number"), ("routing", lambda r: isinstance(r, dict), "a dict")))
    routing = record.get("routing") or {}
    problem = problem or wrong_type(routing, [(k, lambda t: isinstance(t, dict), "a dict") for k in ("weights", "qk_v_jsd")],
                                    "routing.")
    if problem:
        return problem
    weights, jsd = routing.get("weights") or {}, routing.get("qk_v_jsd") or {}
    return wrong_type(weights, [(k, is_weights, "a list of numbers") for k in weights], "routing.weights.", False) or \
        wrong_type(jsd, [(k, is_number, "a number") for k in jsd], "routing.qk_v_jsd.", False)


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
    for key in ("arm", "seed"):
        if result.get(key) is None:
            return f"no {key} recorded"
    problem = wrong_type(result, (("arm", lambda a: isinstance(a, str), "a string"), ("seed", is_seed, "a seed"),
                                  ("val_loss", is_number, "a number"),
                                  ("wall_time_s", lambda t: is_number(t) and math.isfinite(t), "a finite number"),
                                  ("pairing", lambda v: isinstance(v, dict), "a dict")))
    if problem is None and not isinstance((result.get("pairing") or {}).get("settings", {}), dict):
        return "pairing.settings is not a dict"
    return problem


def subfolders(path):
    """(sorted names of the folders in path, None), or ([], why it cannot be listed)."""
    try:
        names = os.listdir(path)
    except OSError as e:
        return [], (e.strerror or str(e)).lower()
    return sorted(n for n in names if os.path.isdir(os.path.join(path, n))), None


def training_of(result):
    """(init_hash, data_hash) of a result: two cells of one arm that share both are one training, or None."""
    pairing = result.get("pairing") or {}
    hashes = pairing.get("init_hash"), pairing.get("data_hash")
    return hashes if all(isinstance(h, str) and h for h in hashes) else None


def load_grid(out_dir):
    """(arms, seeds, {(arm, seed): usable result}, {(arm, seed): why a cell's result.json is not used},
    {(arm, seed): log records}, notes on what was skipped).

    A cell's arm and seed are what its result.json records: a folder holding another cell's record (a copy
    or a link) is never counted, nor are two cells of one arm with the same init and data hashes. An arm is
    a folder listed in config.json or holding a cell of its own; a seed is one of those cells' or listed."""
    notes, config = [], {}
    if os.path.lexists(os.path.join(out_dir, "config.json")):
        config, why = read_json(os.path.join(out_dir, "config.json"))
        if why:
            notes.append(f"config.json: unreadable ({why}); arms and seeds taken from the folders")
            config = {}
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
    real = {os.path.realpath(os.path.join(out_dir, f)): f for f in folders if not os.path.islink(os.path.join(out_dir, f))}
    for arm in arms + [f for f in folders if f not in arms]:
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
            seed, where = int(cell[4:]), f"{arm}/{cell}"
            result_path, log_path = (os.path.join(arm_dir, cell, name) for name in ("result.json", "log.jsonl"))
            if not os.path.lexists(result_path) and not os.path.lexists(log_path):
                arm_notes.append(f"folder {where}/: no result.json or log.jsonl (not started)")
                continue
            if os.path.lexists(result_path):
                result, why = read_json(result_path)
                why = why or result_problem(result)
                if why:
                    unusable[arm, seed] = "unreadable result.json"
                    arm_notes.append(f"{where}/result.json: unreadable ({why})")
                elif (result["arm"], result["seed"]) != (arm, seed):
                    copies.append((where, result["arm"], result["seed"]))
                    continue  # another cell's record: not a seed of this arm, its log not read
                else:
                    results[arm, seed] = result
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
    for arm in arms:  # a copy whose recorded seed was edited to match its folder: one training, never two seeds
        by_training = {}
        for (a, seed), result in results.items():
            if a == arm and training_of(result):
                by_training.setdefault(training_of(result), []).append(seed)
        for same in (s for s in by_training.values() if len(s) > 1):
            cells = [f"{arm}/seed{s}" for s in same]
            for seed in same:
                del results[arm, seed]
                unusable[arm, seed] = "same training as " + ", ".join(c for c in cells if c != f"{arm}/seed{seed}")
            notes.append(f"{', '.join(cells)}: one training (the same init_hash and data_hash), none counted; "
                         f"delete the copies, keeping the cell trained with that seed")
    return arms, sorted(seeds), results, unusable, logs, notes


def divergence(result):
    """Why a cell diverged (one line), or None."""
    loss = result.get("val_loss")
    if result.get("status") == "diverged":
        return result.get("reason") or "diverged"
    if not isinstance(loss, (int, float)) or not math.isfinite(loss):
        return f"val_loss is {loss}"
    return None


def cell_problem(results, unusable, arm, seed):
    """Why a cell cannot be paired, or None."""
    if (arm, seed) in unusable:
        return unusable[arm, seed]
    if (arm, seed) not in results:
        return "missing"
    result = results[arm, seed]
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


def unpaired_reason(arms, seed, results, unusable):
    """Why a seed cannot be paired across these arms, or None when it can."""
    problems = [f"{arm}/seed{seed} {p}" for arm in arms if (p := cell_problem(results, unusable, arm, seed))]
    if problems:
        return "; ".join(problems)
    for a, b in itertools.combinations(arms, 2):
        difference = pairing_difference(results[a, seed]["pairing"], results[b, seed]["pairing"])
        if difference:
            return f"{a} and {b} differ in {difference}"
    return None


def mixed_versions(results, arms, seeds):
    """What differs between the seeds of a comparison, beyond the seed itself (init and data hashes):
    each seed is paired fairly, but a mean over seeds trained under other code or settings
    (--allow_changes) mixes versions. ["key: seeds 0, 1: value; seed 2: value", ...]."""
    def values(pairing):
        v = {k: pairing.get(k) for k in ("code", "eval_tokens", "val_hash", "init_from", "changes")}
        settings = pairing.get("settings") if isinstance(pairing.get("settings"), dict) else {}
        return v | {f"settings.{k}": x for k, x in settings.items()}
    per_seed = {s: {arm: values(results[arm, s]["pairing"]) for arm in arms} for s in seeds}
    notes = []
    for key in sorted({k for s in seeds for arm in arms for k in per_seed[s][arm]}):
        groups = {}
        for s in seeds:
            groups.setdefault(json.dumps([per_seed[s][arm].get(key) for arm in arms], sort_keys=True), []).append(s)
        if len(groups) > 1:
            brief = lambda v: " / ".join(dict.fromkeys(json.dumps(x)[:18] for x in json.loads(v)))  # reference / arm
            notes.append(f"{key}: " + "; ".join(f"seed{'s' if len(g) > 1 else ''} {', '.join(map(str, g))}: {brief(v)}"
                                                 for v, g in groups.items()))
    return notes


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
    return {r["tokens"]: r["val_loss"] for r in log if r.get("val_loss") is not None and r.get("tokens") is not None}


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
        late = late[np.isfinite(late)]  # a non-finite evaluation would make the limits NaN
        axes[1].set(xlim=(half, None), title="second half of training")
        if len(late):
            pad = 0.05 * (late.max() - late.min()) or 0.01
            axes[1].set(ylim=(late.min() - pad, late.max() + pad))
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
        records = [r for r in logs.get((jsd_arm, seed), [])
                   if (r.get("routing") or {}).get("qk_v_jsd") and r.get("tokens") is not None]
        if not records:
            continue
        fig, ax = plt.subplots(figsize=(6, 4))
        for layer in records[0]["routing"]["qk_v_jsd"]:  # a layer a later record lacks is a gap, not an error
            ax.plot([r["tokens"] for r in records], [r["routing"]["qk_v_jsd"].get(layer, np.nan) for r in records],
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
    try:
        write_atomic(os.path.join(out_dir, name), lambda tmp: fig.savefig(tmp, dpi=110, format="png"))
    finally:
        plt.close(fig)
    return title, name


def write_text(path, text):
    def write(tmp):
        with open(tmp, "w") as f:
            f.write(text)
    write_atomic(path, write)


def strict(x):
    """x with every non-finite float as None: paired.json is strict JSON (an arm with one seed has no std)."""
    if isinstance(x, float):
        return x if math.isfinite(x) else None
    if isinstance(x, dict):
        return {k: strict(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [strict(v) for v in x]
    return x


def output_names(arms, cell):
    """Every file report.py may write into out_dir for these arms and this cell."""
    return ["report.md", "paired.json", "val_loss.png", "delta_curve.png", *(f"jsd_{arm}.png" for arm in arms),
            f"routing_{cell[0]}_seed{cell[1]}.png"]


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
    arms, seeds, results, unusable, logs, notes = load_grid(args.out_dir)
    if not arms:
        sys.exit(f"error: {args.out_dir} holds no arms; give the out_dir of a train.py grid")
    reference = args.reference or arms[0]
    if reference not in arms:
        sys.exit(f"error: reference arm {reference!r} not found; arms: {', '.join(arms)}")
    others = [arm for arm in arms if arm != reference]
    left_out = {arm: {s: r for s in seeds if (r := unpaired_reason([reference, arm], s, results, unusable))} for arm in others}
    paired_seeds = {arm: [s for s in seeds if s not in left_out[arm]] for arm in others}
    # the reference's own curve: the seeds it is paired in with any arm (its finished ones when it is alone)
    paired_seeds[reference] = sorted(set().union(*paired_seeds.values())) if others else \
        [s for s in seeds if not cell_problem(results, unusable, reference, s)]
    cell = parse_cell(args.cell, arms, seeds, results, logs) if args.cell else \
        (arms[-1], (paired_seeds[arms[-1]] or seeds or [0])[0])
    for name in output_names(arms, cell):  # before anything is written: a folder there would stop the report half way
        if os.path.isdir(path := os.path.join(args.out_dir, name)):
            raise DataError(f"{path} is a folder, where report.py writes its {name}; move or delete it")
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
    paired, curves, mixed = {}, {}, {}
    table = ["| arm | n | wins | mean delta | std | 95% CI | p (t-test) | p (sign) | ppl change |",
             "|---|---|---|---|---|---|---|---|---|"]
    for arm in others:
        seeds_of = paired_seeds[arm]
        st = paired_statistics([results[arm, s]["val_loss"] - results[reference, s]["val_loss"] for s in seeds_of])
        curves[arm] = delta_curve(logs, arm, reference, seeds_of)
        mixed[arm] = mixed_versions(results, [reference, arm], seeds_of)
        paired[arm] = dict(st, seeds=seeds_of, left_out=[dict(seed=s, reason=r) for s, r in left_out[arm].items()],
                           mixed_versions=mixed[arm], delta_curve={k: np.asarray(v).tolist() for k, v in curves[arm].items()})
        table.append(f"| {arm} | {st['n']} | {st['wins']}/{st['n']} | {fmt(st['mean'])} | {fmt(st['std'], '.4f')} | "
                     f"[{fmt(st['ci95'][0])}, {fmt(st['ci95'][1])}] | {fmt(st['p_ttest'], '.3g')} | "
                     f"{fmt(st['p_sign'], '.3g')} | {fmt(100 * st['ppl_change'], '+.2f')}% |")
        lines.append(f"Per-seed deltas, {arm}: "
                     + (", ".join(f"seed {s}: {fmt(d)}" for s, d in zip(seeds_of, st["deltas"])) or "none"))
    lines += ["", *table, ""]
    if any(mixed.values()):
        lines += ["**Mixed versions**: each seed below is paired fairly, but these seeds were trained under other "
                  "code or settings (--allow_changes), so an arm's mean mixes them; read the seeds apart, or rerun "
                  "the grid in a new out_dir:", "",
                  *(f"- {arm}: {note}" for arm in others for note in mixed[arm]), ""]
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
    write_text(os.path.join(args.out_dir, "report.md"), "\n".join(lines))
    write_text(os.path.join(args.out_dir, "paired.json"), json.dumps(strict(
        dict(reference=reference, arms=paired, diverged=diverged, wall_time_s=wall, skipped=notes)), indent=1,
        allow_nan=False))
    print(summary)


if __name__ == "__main__":
    try:
        main(sys.argv[1:])
    except DataError as e:  # a file that could not be written (full disk): one line
        sys.exit(f"error: {e}")
