"""
Downstream evaluation of trained cells: the CORE in-context tasks (DCLM's CORE metric, arXiv
2406.11794, as nanochat computes it), written beside each cell's result as downstream.json.

$ python downstream.py --download                                  # the public CORE bundle, once (data/eval_bundle)
$ python downstream.py out/rd_attnres/seed0                        # one cell
$ python downstream.py out --max_per_task=500                      # every cell of a grid, 500 items per task
$ torchrun --standalone --nproc_per_node=8 downstream.py out       # the items split over 8 GPUs
$ python train.py --downstream_bundle=data/eval_bundle             # during training (cells.evaluate_downstream)

A task scores each item by the cell's own losses: multiple_choice picks the choice whose
continuation has the lowest mean token loss, schema the context option under which the shared
continuation has the lowest mean loss, language_modeling asks the greedy continuation to equal the
target token for token. CORE is the mean over tasks of (accuracy - b) / (1 - b), b the task's
random baseline. downstream.json records the bundle's sha256 and this file's code fingerprint:
results from different bundles or scoring code never pair. docs/downstream.md describes the bundle format, the prompts and the cost.
"""

import argparse
import csv
import hashlib
import json
import math
import os
import random
import re
import shutil
import sys
import time
import urllib.error
import urllib.request
import zipfile
from typing import NamedTuple

import torch
import torch.distributed as dist

import machine
from checkpoint import load_cell
from records import code_fingerprint
from common import DataError, UserError, check_writable, write_json
from data.shards import get_tokenizer, tokenizer_of

HERE = os.path.dirname(os.path.abspath(__file__))
BUNDLE_DIR = os.path.join(HERE, "data", "eval_bundle")
BUNDLE_URL = "https://karpathy-public.s3.us-west-2.amazonaws.com/eval_bundle.zip"
TASK_TYPES = ("multiple_choice", "schema", "language_modeling")
TASK_KEYS = ("label", "dataset_uri", "num_fewshot", "icl_task_type", "continuation_delimiter")  # others are ignored
SHUFFLE_SEED, FEWSHOT_SEED = 1337, 1234  # nanochat's: the same items, in the same order, with the same examples
EXAMPLE_SEPARATOR = "\n\n"  # between few-shot examples, and before the item
BATCH_TOKENS = 8192  # padded tokens per forward: with GPT-2 tokens, 1.6 GB of fp32 logits


# -----------------------------------------------------------------------------
# the bundle: core.yaml, eval_meta_data.csv, eval_data/<dataset_uri>

class Task(NamedTuple):
    label: str
    kind: str  # one of TASK_TYPES
    num_fewshot: int
    delimiter: str  # between a context and its continuation
    baseline: float  # the random baseline, a fraction in [0, 1)
    items: list  # the task file's items, shuffled with SHUFFLE_SEED


class Bundle(NamedTuple):
    tasks: list
    sha256: str


def opens_quote(text, i):
    """Whether text[i] opens a quoted scalar: a quote where a scalar starts (a quote inside a plain word does not)."""
    return text[i] in "\"'" and (i == 0 or text[i - 1] in " \t[,")


def strip_comment(line):
    """line without its '# ...' comment (a '#' at the start or after a space, outside quotes)."""
    quote, i = None, 0
    while i < len(line):
        c = line[i]
        if (quote == '"' and c == "\\") or (quote == "'" and line[i:i + 2] == "''"):
            i += 1  # an escaped character; in single quotes '' is a quote
        elif quote and c == quote:
            quote = None
        elif not quote and opens_quote(line, i):
            quote = c
        elif not quote and c == "#" and (i == 0 or line[i - 1] in " \t"):
            return line[:i].rstrip()
        i += 1
    return line.rstrip()


def parse_scalar(text, where):
    """A YAML scalar of the supported subset: a quoted or plain string, an integer, true/false, a flow list."""
    text = text.strip()
    if text[:1] and text[0] in "&*!|>{?%@`":  # anchors, aliases, tags, block scalars, flow mappings, reserved
        raise DataError(f"{where}: {text[0]!r} is beyond the YAML subset this reader supports")
    if text.startswith("[") and text.endswith("]"):
        inner = text[1:-1].strip()
        return [parse_scalar(part, where) for part in split_flow(inner, where)] if inner else []
    if text.startswith('"'):
        if len(text) < 2 or not text.endswith('"'):
            raise DataError(f"{where}: unterminated double-quoted string {text}")
        try:  # YAML's double-quoted escapes, as far as they are JSON's (\n, \t, \", \\, \uXXXX)
            return json.loads(text, strict=False)
        except json.JSONDecodeError as e:
            raise DataError(f"{where}: {text} is not a supported double-quoted string ({e.msg})") from None
    if text.startswith("'"):
        if len(text) < 2 or not text.endswith("'") or re.search(r"(?<!')'(?!')", text[1:-1]):
            raise DataError(f"{where}: unterminated single-quoted string {text}")
        return text[1:-1].replace("''", "'")
    if re.fullmatch(r"[-+]?[0-9]+", text):
        return int(text)
    return {"true": True, "false": False, "null": None, "~": None, "": None}.get(text, text)


def split_flow(inner, where):
    """The items of a flow list's inside, split at commas outside quotes."""
    parts, start, quote = [], 0, None
    for i, c in enumerate(inner):
        if quote and c == quote and (quote == "'" or inner[i - 1] != "\\"):
            quote = None
        elif not quote and opens_quote(inner, i):
            quote = c
        elif not quote and c in "[]{}":
            raise DataError(f"{where}: nested flow collections are not supported")
        elif not quote and c == ",":
            parts.append(inner[start:i])
            start = i + 1
    return parts + [inner[start:]]


def key_value(content, where):
    key, colon, value = content.partition(":")
    if not colon or not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_ -]*", key.strip()) or (value and value[0] not in " \t"):
        raise DataError(f"{where}: expected 'key: value', got {content.strip()!r}")
    return key.strip(), value.strip()


def parse_core_yaml(text, path):
    """
    core.yaml's icl_tasks, as a list of dicts. The subset of YAML its layout uses: a top-level
    'icl_tasks:' block list of mappings (an item opens with '-' alone or with its first key), each
    key a scalar or a list (flow '[0]' or block '- 0' lines), '#' comments. Other top-level keys are
    skipped; anything else (anchors, multi-line strings, nested mappings) is one line naming it.
    """
    tasks, in_tasks, task_indent, key_indent, list_key = [], False, None, None, None
    for n, raw in enumerate(text.splitlines(), 1):
        where = f"{path} line {n}"
        if "\t" in raw[:len(raw) - len(raw.lstrip())]:
            raise DataError(f"{where}: a tab in the indentation (YAML indents with spaces)")
        line = strip_comment(raw)
        content, indent = line.strip(), len(line) - len(line.lstrip())
        if not content or content == "---":
            continue
        is_item = content == "-" or content.startswith("- ")
        if indent == 0 and not is_item:  # a top-level key
            key, value = key_value(content, where)
            in_tasks, task_indent, list_key = key == "icl_tasks", None, None
            if in_tasks and value:
                raise DataError(f"{where}: icl_tasks must be a block list ('-' lines below it)")
            continue
        if not in_tasks:
            continue
        if is_item and (task_indent is None or indent == task_indent):  # a new task
            task_indent, key_indent, list_key = indent, None, None
            tasks.append({})
            content = content[1:].strip()
            if not content:
                continue
            indent = len(line) - len(line.lstrip()[1:].lstrip())
        elif is_item:  # an entry of a block list
            if list_key is None or indent <= task_indent:
                raise DataError(f"{where}: a list entry outside a task key's list")
            tasks[-1][list_key].append(parse_scalar(content[1:], where))
            continue
        if task_indent is None or indent <= task_indent:
            raise DataError(f"{where}: expected a task ('-') of icl_tasks, or a top-level key")
        if key_indent is None:
            key_indent = indent
        if indent != key_indent:
            raise DataError(f"{where}: nested mappings are beyond the YAML subset this reader supports")
        key, value = key_value(content, where)
        if key in tasks[-1]:
            raise DataError(f"{where}: {key} given twice in one task")
        tasks[-1][key] = parse_scalar(value, where) if value else []
        list_key = None if value else key
    if not tasks:
        raise DataError(f"{path} lists no tasks (no 'icl_tasks:' block list)")
    return tasks


def check_task(spec, index, path, data_dir):
    """(label, kind, num_fewshot, delimiter, task file) of core.yaml's index-th task, or one line."""
    where = f"{path}: task {index + 1} ({spec.get('label', 'no label')})"
    label, kind, fewshot = spec.get("label"), spec.get("icl_task_type"), spec.get("num_fewshot")
    uri, delimiter = spec.get("dataset_uri"), spec.get("continuation_delimiter", " ")
    if not isinstance(label, str) or not label:
        raise DataError(f"{where}: label must be a non-empty string")
    if kind not in TASK_TYPES:
        raise DataError(f"{where}: unknown icl_task_type {kind!r}; this evaluator runs {', '.join(TASK_TYPES)}")
    if isinstance(fewshot, list) and len(fewshot) == 1:
        fewshot = fewshot[0]
    if not isinstance(fewshot, int) or isinstance(fewshot, bool) or fewshot < 0:
        raise DataError(f"{where}: num_fewshot must be one non-negative integer (or a list of one), "
                        f"not {spec.get('num_fewshot')!r}")
    if not isinstance(uri, str) or not uri or os.path.isabs(uri) or ".." in uri.replace("\\", "/").split("/"):
        raise DataError(f"{where}: dataset_uri must be a path inside eval_data, not {uri!r}")
    if not isinstance(delimiter, str):
        raise DataError(f"{where}: continuation_delimiter must be a string, not {delimiter!r}")
    return label, kind, fewshot, delimiter, os.path.join(data_dir, uri)


def reason(e):
    """Why a text file could not be read, in a few words."""
    return e.strerror or str(e) if isinstance(e, OSError) else e.reason


def read_baselines(path):
    """Eval Task -> Random baseline (a percent) from eval_meta_data.csv."""
    try:
        with open(path, encoding="utf-8", newline="") as f:
            reader = csv.DictReader(f)
            rows = [(row, reader.line_num) for row in reader]  # line_num: where the row ends
            header = reader.fieldnames
    except (OSError, UnicodeDecodeError, csv.Error) as e:
        raise DataError(f"{path} cannot be read as a UTF-8 CSV ({e.strerror if isinstance(e, OSError) else e}); "
                        f"restore the bundle (python downstream.py --download)") from None
    if not header or "Eval Task" not in header or "Random baseline" not in header:
        raise DataError(f"{path} has no 'Eval Task' and 'Random baseline' columns")
    return {row["Eval Task"]: (row["Random baseline"], line) for row, line in rows}


# the fields an item of each type needs: name -> check
ITEM_FIELDS = dict(
    multiple_choice=dict(query=lambda v: isinstance(v, str),
                         choices=lambda v: isinstance(v, list) and len(v) >= 2 and all(isinstance(c, str) for c in v)),
    schema=dict(context_options=lambda v: isinstance(v, list) and len(v) >= 2 and all(isinstance(c, str) for c in v),
                continuation=lambda v: isinstance(v, str) and v != ""),
    language_modeling=dict(context=lambda v: isinstance(v, str), continuation=lambda v: isinstance(v, str) and v != ""),
)
ITEM_NEEDS = dict(multiple_choice="query (a string), choices (2 or more strings), gold (an index of choices)",
                  schema="context_options (2 or more strings), continuation (a non-empty string), gold (an index)",
                  language_modeling="context (a string), continuation (a non-empty string)")


def read_items(path, kind):
    """The items of a task file (JSON lines), each checked for its type's fields, or one line."""
    try:
        with open(path, encoding="utf-8") as f:
            lines = list(f)  # split at line ends only (str.splitlines would also split at U+2028 inside strings)
    except FileNotFoundError:
        raise DataError(f"task file {path} does not exist; restore the bundle (python downstream.py --download)") from None
    except (OSError, UnicodeDecodeError) as e:
        raise DataError(f"{path} cannot be read as UTF-8 text ({reason(e)})") from None
    items = []
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            item = json.loads(line)
        except json.JSONDecodeError as e:
            raise DataError(f"{path} line {n} is not JSON ({e.msg} at column {e.colno})") from None
        ok = isinstance(item, dict) and all(check(item.get(k)) for k, check in ITEM_FIELDS[kind].items())
        if ok and kind != "language_modeling":
            gold, options = item.get("gold"), item["choices" if kind == "multiple_choice" else "context_options"]
            ok = isinstance(gold, int) and not isinstance(gold, bool) and 0 <= gold < len(options)
        if not ok:
            raise DataError(f"{path} line {n} is not a {kind} item: it needs {ITEM_NEEDS[kind]}")
        items.append(item)
    if not items:
        raise DataError(f"{path} holds no items")
    return items


def bundle_sha256(bundle_dir):
    """sha256 over every file of the bundle: each relative path (sorted), its size and its bytes."""
    files = sorted(os.path.relpath(os.path.join(d, f), bundle_dir).replace(os.sep, "/")
                   for d, _, names in os.walk(bundle_dir) for f in names)
    digest = hashlib.sha256()
    for rel in files:
        digest.update(rel.encode() + b"\0" + os.path.getsize(os.path.join(bundle_dir, rel)).to_bytes(8, "little"))
        with open(os.path.join(bundle_dir, rel), "rb") as f:
            for chunk in iter(lambda: f.read(1 << 20), b""):
                digest.update(chunk)
    return digest.hexdigest()


def load_bundle(bundle_dir):
    """Every task of a CORE bundle with its items and random baseline, and the bundle's sha256."""
    config_path = os.path.join(bundle_dir, "core.yaml")
    if not os.path.isfile(config_path):
        raise DataError(f"{config_path} does not exist; get the CORE bundle with python downstream.py --download "
                        f"--bundle={bundle_dir}")
    try:
        with open(config_path, encoding="utf-8") as f:
            specs = parse_core_yaml(f.read(), config_path)
    except (OSError, UnicodeDecodeError) as e:
        raise DataError(f"{config_path} cannot be read as UTF-8 text ({reason(e)})") from None
    meta_path, data_dir = os.path.join(bundle_dir, "eval_meta_data.csv"), os.path.join(bundle_dir, "eval_data")
    baselines = read_baselines(meta_path)
    tasks = []
    for i, spec in enumerate(specs):
        label, kind, fewshot, delimiter, task_path = check_task(spec, i, config_path, data_dir)
        if any(t.label == label for t in tasks):
            raise DataError(f"{config_path}: task label {label!r} appears twice")
        if label not in baselines:
            raise DataError(f"{meta_path} has no random baseline for task {label!r} (no row with Eval Task {label})")
        percent, row = baselines[label]
        try:
            baseline = float(percent) / 100
        except (TypeError, ValueError):  # TypeError: a short row
            baseline = math.nan
        if not 0 <= baseline < 1:
            raise DataError(f"{meta_path} line {row}: the random baseline of {label} must be a percent in [0, 100), "
                            f"not {percent!r}")
        items = read_items(task_path, kind)
        if fewshot >= len(items):
            raise DataError(f"{task_path}: {label} asks for {fewshot} few-shot examples but holds {len(items)} items")
        random.Random(SHUFFLE_SEED).shuffle(items)  # files are often ordered; --max_per_task takes a random subset
        tasks.append(Task(label, kind, fewshot, delimiter, baseline, items))
    return Bundle(tasks, bundle_sha256(bundle_dir))


# -----------------------------------------------------------------------------
# prompts: text -> token sequences with the span of tokens that is scored

def fewshot_examples(task, index):
    """The task's few-shot examples for its index-th item: drawn with a fixed seed, never the item itself."""
    # positions among the other items (those past index shift by one): nanochat's draw, without a list per item
    picks = random.Random(FEWSHOT_SEED + index).sample(range(len(task.items) - 1), task.num_fewshot)
    return [task.items[j + (j >= index)] for j in picks]


def prompts(task, index):
    """The texts the model reads for the index-th item: one per choice (multiple_choice), one per
    context option (schema), or the context alone and with its continuation (language_modeling)."""
    item, d, examples = task.items[index], task.delimiter, fewshot_examples(task, index)
    if task.kind == "multiple_choice":
        shots = "".join(e["query"] + d + e["choices"][e["gold"]] + EXAMPLE_SEPARATOR for e in examples)
        return [shots + item["query"] + d + choice for choice in item["choices"]]
    if task.kind == "schema":
        shots = "".join(e["context_options"][e["gold"]] + d + e["continuation"] + EXAMPLE_SEPARATOR for e in examples)
        return [shots + option + d + item["continuation"] for option in item["context_options"]]
    shots = "".join(e["context"].strip() + d + e["continuation"] + EXAMPLE_SEPARATOR for e in examples)
    # the context alone ends without whitespace, which the continuation's first token carries instead
    return [(shots + item["context"].strip() + d).strip(), shots + item["context"].strip() + d + item["continuation"]]


def common_length(sequences, reverse=False):
    """How many leading (reverse: trailing) tokens all sequences share."""
    n = min(len(s) for s in sequences)
    for i in range(n):
        at = -1 - i if reverse else i
        if any(s[at] != sequences[0][at] for s in sequences):
            return i
    return n


def spans(task, token_lists):
    """(start, end) of the scored tokens of each sequence: what differs between the choices
    (multiple_choice), the shared continuation (schema), the continuation (language_modeling).
    Each span keeps at least its last token and never starts at the document token."""
    if task.kind == "multiple_choice":
        start = common_length(token_lists)
        return [(min(start, len(t) - 1), len(t)) for t in token_lists]
    if task.kind == "schema":
        shared = min(common_length(token_lists, reverse=True), min(len(t) for t in token_lists) - 1)
        return [(len(t) - max(shared, 1), len(t)) for t in token_lists]
    with_continuation = token_lists[1]
    return [(min(common_length(token_lists), len(with_continuation) - 1), len(with_continuation))]


class Encoded(NamedTuple):
    """One task's items of one rank, ready to score."""
    label: str
    kind: str
    baseline: float
    items: int  # on all ranks together
    golds: dict  # item index -> the right choice (None for language_modeling)
    sequences: dict  # item index -> [(tokens, start, end), ...], tokens[start:end] scored
    truncated: int  # this rank's sequences cut to block_size


def encode_tasks(tasks, tokenizer, block_size, max_per_task=None, rank=0, world=1):
    """Each task's first max_per_task items (all: None), every world-th from rank on (each rank
    encodes its own share), as token sequences of at most block_size, each starting with the
    end-of-text token (a new document, as in training); a longer one loses its oldest tokens (few-shot
    examples first) and is counted."""
    encoded = []
    for task in tasks:
        n = min(len(task.items), max_per_task or len(task.items))
        golds, sequences, truncated = {}, {}, 0
        for index in range(rank, n, world):
            token_lists = [[tokenizer.eot] + tokenizer.encode(text).tolist() for text in prompts(task, index)]
            scored = token_lists[1:] if task.kind == "language_modeling" else token_lists  # LM: the full text only
            sequences[index] = []
            for tokens, (start, end) in zip(scored, spans(task, token_lists)):
                cut = max(0, len(tokens) - block_size)
                truncated += cut > 0
                sequences[index].append((tokens[cut:], max(start - cut, 1), end - cut))
            golds[index] = task.items[index].get("gold")
        encoded.append(Encoded(task.label, task.kind, task.baseline, n, golds, sequences, truncated))
    return encoded


# -----------------------------------------------------------------------------
# scoring: many (item, choice) sequences per forward

def batches(rows, batch_tokens):
    """rows sorted longest first, cut into batches of at most batch_tokens padded tokens (one row at least)."""
    rows = sorted(rows, key=lambda r: -len(r[2]))
    out = []
    for row in rows:
        if out and (len(out[-1]) + 1) * len(out[-1][0][2]) <= batch_tokens:  # the first row is the longest
            out[-1].append(row)
        else:
            out.append([row])
    return out


def forward_batch(model, batch, device, autocast):
    """Each row's mean loss over its scored tokens, and whether greedy decoding reproduces them all."""
    T = max(len(row[2]) for row in batch)
    x = torch.zeros(len(batch), T, dtype=torch.long)
    y = torch.full((len(batch), T), -1, dtype=torch.long)
    for r, (_, _, tokens, start, end) in enumerate(batch):
        x[r, :len(tokens)] = torch.tensor(tokens)
        y[r, start - 1:end - 1] = x[r, start:end]  # position t predicts token t + 1
    x, y = x.to(device), y.to(device)
    with autocast:
        logits, loss = model(x, y, reduction="none")
    scored = y != -1
    mean_loss = loss.float().sum(1) / scored.sum(1)
    greedy = ((logits.argmax(-1) == y) | ~scored).all(1)
    return mean_loss.tolist(), greedy.tolist()


@torch.no_grad()
def evaluate_tasks(model, tasks, device, autocast, world=1, batch_tokens=BATCH_TOKENS):
    """
    Accuracy per task and CORE of model (in eval mode for the call) on this rank's encode_tasks
    output. Under torch.distributed (world > 1) the ranks' correct and truncated counts are summed
    exactly, so any world size gives one process's result (up to ties in floating point); every
    rank runs as many forwards (an FSDP forward is collective). Returns downstream.json's core,
    truncated and tasks.
    """
    was_training = model.training
    model.eval()
    correct = []
    for task in tasks:
        rows = [(i, c, *seq) for i, item in task.sequences.items() for c, seq in enumerate(item)]
        todo = batches(rows, batch_tokens)
        n_batches = torch.tensor(len(todo), device=device)
        if world > 1:
            dist.all_reduce(n_batches, op=dist.ReduceOp.MAX)
        losses, greedy = {}, {}
        for batch in todo:
            for (i, c, *_), loss, hit in zip(batch, *forward_batch(model, batch, device, autocast)):
                losses.setdefault(i, {})[c], greedy[i] = loss, hit
        for _ in range(n_batches.item() - len(todo)):  # this rank has fewer: the forwards the others make
            forward_batch(model, [(0, 0, [0, 0], 1, 2)], device, autocast)
        if task.kind == "language_modeling":
            correct.append(sum(greedy.values()))
        else:  # the lowest mean loss wins; a tie goes to the first
            correct.append(sum(min(range(len(by_choice)), key=by_choice.get) == task.golds[i]
                               for i, by_choice in losses.items()))
    model.train(was_training)
    counts = torch.tensor(correct + [sum(t.truncated for t in tasks)], dtype=torch.long, device=device)
    if world > 1:
        dist.all_reduce(counts)
    *correct, truncated = counts.tolist()
    results = {}
    for task, right in zip(tasks, correct):
        accuracy = right / task.items
        results[task.label] = dict(icl_task_type=task.kind, items=task.items, correct=right, accuracy=accuracy,
                                   random_baseline=task.baseline,
                                   centered=(accuracy - task.baseline) / (1 - task.baseline))
    core = sum(r["centered"] for r in results.values()) / len(results)
    return dict(core=core, truncated=truncated, tasks=results)


def write_scores(cell_dir, bundle, max_per_task, step, scores):
    """cell_dir/downstream.json (atomically): evaluate_tasks' scores of the checkpoint of step, with
    what they were measured on (the bundle's sha256, max_per_task: None for every item, and the
    fingerprint of this file, which scores: the report pairs none scored by other code)."""
    with open(os.path.abspath(__file__), "rb") as f:
        scoring_code = code_fingerprint(f.read())
    write_json(os.path.join(cell_dir, "downstream.json"), dict(bundle_sha256=bundle.sha256, max_per_task=max_per_task,
                                                             scoring_code=scoring_code, step=step, **scores))


# -----------------------------------------------------------------------------
# cells and the bundle download

def find_cells(path):
    """The cell folders at path: path itself when it holds ckpt.pt, else out_dir/<arm>/seed<k>; a
    cell begun but without a checkpoint yet is refused, not skipped."""
    if os.path.isfile(os.path.join(path, "ckpt.pt")):
        return [path]
    if not os.path.isdir(path):
        raise DataError(f"{path} does not exist; give a cell folder (out/<arm>/seed<k>) or a grid's out_dir")
    cells = sorted(os.path.join(path, arm, seed) for arm in os.listdir(path) if os.path.isdir(os.path.join(path, arm))
                   for seed in os.listdir(os.path.join(path, arm)) if re.fullmatch(r"seed[0-9]+", seed)
                   and os.path.isdir(os.path.join(path, arm, seed)))
    if not cells:
        raise DataError(f"{path} holds no cells (<arm>/seed<k> folders) and no ckpt.pt; "
                        f"give a cell folder or an out_dir")
    missing = [c for c in cells if not os.path.isfile(os.path.join(c, "ckpt.pt"))]
    if missing:
        raise DataError(f"{len(missing)} cell(s) have no ckpt.pt yet ({', '.join(missing[:3])}); "
                        f"give the cell folders that have one")
    return cells


def bundle_root(folder):
    """The folder holding core.yaml in an unpacked zip: the zip's top level or its one top folder."""
    entries = os.listdir(folder)
    if "core.yaml" not in entries and len(entries) == 1 and os.path.isdir(os.path.join(folder, entries[0])):
        return os.path.join(folder, entries[0])
    return folder


def download(bundle_dir, url=BUNDLE_URL, timeout=60):
    """The CORE bundle from url (a zip), unpacked into bundle_dir once: fetched and unzipped under
    temporary names, checked, then renamed into place. Returns the bundle's sha256."""
    if os.path.exists(os.path.join(bundle_dir, "core.yaml")):
        print(f"{bundle_dir} is there already")
        return bundle_sha256(bundle_dir)
    if os.path.exists(bundle_dir):
        raise DataError(f"{bundle_dir} exists but holds no core.yaml; remove it and run --download again")
    parent = os.path.dirname(os.path.abspath(bundle_dir))
    check_writable(parent, "choose another --bundle")
    zip_path, unpacked = f"{bundle_dir}.{os.getpid()}.zip.tmp", f"{bundle_dir}.{os.getpid()}.tmp"
    by_hand = f"without a network, fetch {url} elsewhere and unzip it so that {bundle_dir}/core.yaml exists"
    try:
        try:
            with urllib.request.urlopen(url, timeout=timeout) as response, open(zip_path, "wb") as f:
                shutil.copyfileobj(response, f, 1 << 20)
        except (urllib.error.URLError, OSError, ValueError) as e:  # no network, a timeout, a bad URL, a full disk
            why = getattr(e, "reason", None) or getattr(e, "strerror", None) or e
            raise DataError(f"cannot download {url} ({why}); {by_hand}") from None
        try:
            with zipfile.ZipFile(zip_path) as z:
                z.extractall(unpacked)  # member paths are kept inside unpacked
        except (zipfile.BadZipFile, OSError) as e:
            raise DataError(f"{url} is not a readable zip ({getattr(e, 'strerror', None) or e}); {by_hand}") from None
        root = bundle_root(unpacked)
        load_bundle(root)  # a bundle this evaluator can run, before it takes the name
        os.replace(root, bundle_dir)
    finally:
        if os.path.exists(zip_path):
            os.remove(zip_path)
        shutil.rmtree(unpacked, ignore_errors=True)
    sha = bundle_sha256(bundle_dir)
    print(f"the CORE bundle is in {bundle_dir} (sha256 {sha})")
    return sha


# -----------------------------------------------------------------------------

class Parser(argparse.ArgumentParser):
    def error(self, message):  # one line, like every other error of the project
        sys.exit(f"error: {message}; see python downstream.py --help")


def main(argv):
    parser = Parser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("path", nargs="?", help="a cell folder (out_dir/<arm>/seed<k>) or a grid's out_dir")
    parser.add_argument("--bundle", default=BUNDLE_DIR, help="the CORE bundle folder (default: data/eval_bundle)")
    parser.add_argument("--max_per_task", type=int, default=None, help="the first N items of each task (default: all)")
    parser.add_argument("--download", action="store_true", help="fetch the bundle into --bundle first (once)")
    parser.add_argument("--url", default=BUNDLE_URL, help="where --download fetches the zip from (a mirror, file://)")
    parser.add_argument("--device", default="auto", help="auto (cuda, then mps, then cpu), cpu, cuda, cuda:N, mps")
    parser.add_argument("--dtype", default="auto", help="auto (bfloat16 autocast where supported), bfloat16, float32")
    parser.add_argument("--batch_tokens", type=int, default=BATCH_TOKENS, help="padded tokens per forward (memory)")
    args = parser.parse_args(argv)
    if args.max_per_task is not None and args.max_per_task < 1:
        parser.error(f"--max_per_task={args.max_per_task} must be >= 1")
    if args.batch_tokens < 1:
        parser.error(f"--batch_tokens={args.batch_tokens} must be >= 1")
    if args.download:
        download(args.bundle, args.url)
    if args.path is None:
        if not args.download:
            parser.error("give a cell folder or an out_dir to evaluate (or --download)")
        return
    cells = find_cells(args.path)
    bundle = load_bundle(args.bundle)
    runtime = machine.setup(dict(device=args.device, dtype=args.dtype, fsdp=False))
    device, autocast, rank, world = runtime.device, runtime.autocast, runtime.rank, runtime.world
    for cell_dir in cells:
        t0 = time.time()
        model, record, step = load_cell(cell_dir, device)
        # the cell records its data's tokenizer; older cells are asked of their data_dir
        tokenizer = get_tokenizer(record.get("tokenizer") or tokenizer_of(record["data_dir"]))
        if tokenizer.vocab_size > model.config.vocab_size:  # a cell trained on token ids of its own
            raise DataError(f"{cell_dir}: vocab_size {model.config.vocab_size} is below its tokenizer's "
                            f"{tokenizer.vocab_size}; it cannot read text, so it has no CORE score")
        tasks = encode_tasks(bundle.tasks, tokenizer, model.config.block_size, args.max_per_task, rank, world)
        scores = evaluate_tasks(model, tasks, device, autocast, world, args.batch_tokens)
        if rank == 0:
            write_scores(cell_dir, bundle, args.max_per_task, step, scores)
            cut = f", {scores['truncated']} sequences cut to block_size {model.config.block_size} from the left" \
                if scores["truncated"] else ""
            print(f"{cell_dir} step {step}: CORE {scores['core']:.4f} over {len(tasks)} tasks{cut} "
                  f"({time.time() - t0:.0f} s)")
    if world > 1:
        dist.destroy_process_group()


if __name__ == "__main__":
    try:
        main(sys.argv[1:])
    except UserError as e:
        sys.exit(f"error: {e}")
