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
random baseline. Each task's bits per byte is the right answers' summed loss in bits over their
UTF-8 bytes. With max_per_task, a task is cut to its first N shuffled items before the few-shot
examples are drawn from them, as nanochat does. downstream.json records the bundle's sha256, the
fingerprint of the code that scored and the precision: results that differ in any never pair.
docs/downstream.md describes the bundle format, the prompts, when to read which score and the cost.
"""

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
import yaml

import machine
from checkpoint import open_trained
from records import code_fingerprint
from common import DataError, Parser, check_writable, run, write_json

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
    items: list  # the items scored: the task file's, shuffled with SHUFFLE_SEED, the first max_per_task


class Bundle(NamedTuple):
    tasks: list
    sha256: str
    max_per_task: int | None  # each task cut to its first N shuffled items (None: every item)


def read_core_yaml(path):
    """core.yaml's icl_tasks, a list of mappings (PyYAML's safe_load; a UTF-8 byte-order mark is allowed)."""
    try:
        with open(path, encoding="utf-8-sig") as f:
            config = yaml.safe_load(f)
    except (OSError, UnicodeDecodeError) as e:
        raise DataError(f"{path} cannot be read as UTF-8 text ({reason(e)})") from None
    except yaml.YAMLError as e:  # its own message spans lines: the line and the problem only
        mark = getattr(e, "problem_mark", None)
        raise DataError(
            f"{path}{f' line {mark.line + 1}' if mark else ''} is not YAML "
            f"({getattr(e, 'problem', None) or type(e).__name__})"
        ) from None
    except RecursionError:
        raise DataError(f"{path} is nested too deeply to be a CORE task list") from None
    tasks = config.get("icl_tasks") if isinstance(config, dict) else None
    if not isinstance(tasks, list) or not tasks or not all(isinstance(t, dict) for t in tasks):
        raise DataError(f"{path} lists no tasks: it needs 'icl_tasks:' followed by one '-' mapping per task")
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
        raise DataError(
            f"{where}: num_fewshot must be one non-negative integer (or a list of one), not {spec.get('num_fewshot')!r}"
        )
    if not isinstance(uri, str) or not uri or os.path.isabs(uri) or ".." in uri.replace("\\", "/").split("/"):
        raise DataError(f"{where}: dataset_uri must be a path inside eval_data, not {uri!r}")
    if not isinstance(delimiter, str):
        raise DataError(f"{where}: continuation_delimiter must be a string, not {delimiter!r}")
    for key, text in (("label", label), ("dataset_uri", uri), ("continuation_delimiter", delimiter)):
        try:
            text.encode("utf-8")
        except UnicodeEncodeError:  # a lone surrogate escape ("\\ud800"): no tokenizer encodes it
            raise DataError(
                f"{where}: {key} holds a lone surrogate escape (\\ud800-\\udfff alone), which is not text"
            ) from None
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
        raise DataError(
            f"{path} cannot be read as a UTF-8 CSV ({e.strerror if isinstance(e, OSError) else e}); "
            f"restore the bundle (python downstream.py --download)"
        ) from None
    if not header or "Eval Task" not in header or "Random baseline" not in header:
        raise DataError(f"{path} has no 'Eval Task' and 'Random baseline' columns")
    return {row["Eval Task"]: (row["Random baseline"], line) for row, line in rows}


# the fields an item of each type needs: name -> check
ITEM_FIELDS = dict(
    multiple_choice=dict(
        query=lambda v: isinstance(v, str),
        choices=lambda v: isinstance(v, list) and len(v) >= 2 and all(isinstance(c, str) for c in v),
    ),
    schema=dict(
        context_options=lambda v: isinstance(v, list) and len(v) >= 2 and all(isinstance(c, str) for c in v),
        continuation=lambda v: isinstance(v, str) and v != "",
    ),
    language_modeling=dict(context=lambda v: isinstance(v, str), continuation=lambda v: isinstance(v, str) and v != ""),
)
ITEM_NEEDS = dict(
    multiple_choice="query (a string), choices (2 or more strings), gold (an index of choices)",
    schema="context_options (2 or more strings), continuation (a non-empty string), gold (an index)",
    language_modeling="context (a string), continuation (a non-empty string)",
)


def read_items(path, kind):
    """The items of a task file (JSON lines), each checked for its type's fields, or one line."""
    try:
        with open(path, encoding="utf-8") as f:
            lines = list(f)  # split at line ends only (str.splitlines would also split at U+2028 inside strings)
    except FileNotFoundError:
        raise DataError(
            f"task file {path} does not exist; restore the bundle (python downstream.py --download)"
        ) from None
    except (OSError, UnicodeDecodeError) as e:
        raise DataError(f"{path} cannot be read as UTF-8 text ({reason(e)})") from None
    items = []
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            item = json.loads(line)
            json.dumps(item, ensure_ascii=False).encode("utf-8")  # a lone surrogate escape ("\\ud800") is no text
        except json.JSONDecodeError as e:
            raise DataError(f"{path} line {n} is not JSON ({e.msg} at column {e.colno})") from None
        except RecursionError:
            raise DataError(f"{path} line {n} is nested too deeply to be a task item") from None
        except UnicodeEncodeError:
            raise DataError(
                f"{path} line {n} holds a lone surrogate escape (\\ud800-\\udfff alone), which is "
                f"not text; fix or remove the item"
            ) from None
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
    files = sorted(
        os.path.relpath(os.path.join(d, f), bundle_dir).replace(os.sep, "/")
        for d, _, names in os.walk(bundle_dir)
        for f in names
    )
    digest = hashlib.sha256()
    for rel in files:
        digest.update(rel.encode() + b"\0" + os.path.getsize(os.path.join(bundle_dir, rel)).to_bytes(8, "little"))
        with open(os.path.join(bundle_dir, rel), "rb") as f:
            for chunk in iter(lambda: f.read(1 << 20), b""):
                digest.update(chunk)
    return digest.hexdigest()


def load_bundle(bundle_dir, max_per_task=None):
    """Every task of a CORE bundle with its random baseline and the items scored: the file's items
    shuffled with SHUFFLE_SEED, then the first max_per_task of them (None: all), as nanochat cuts a
    task before it draws the few-shot examples from what is left. Also the bundle's sha256."""
    config_path = os.path.join(bundle_dir, "core.yaml")
    if not os.path.isfile(config_path):
        raise DataError(
            f"{config_path} does not exist; get the CORE bundle with python downstream.py --download "
            f"--bundle={bundle_dir}"
        )
    specs = read_core_yaml(config_path)
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
            raise DataError(
                f"{meta_path} line {row}: the random baseline of {label} must be a percent in [0, 100), not {percent!r}"
            )
        items = read_items(task_path, kind)
        if fewshot >= len(items):
            raise DataError(f"{task_path}: {label} asks for {fewshot} few-shot examples but holds {len(items)} items")
        if max_per_task is not None and fewshot >= max_per_task:
            raise DataError(
                f"max_per_task={max_per_task} leaves too few items for {label}'s {fewshot} few-shot "
                f"examples (drawn from the items scored); give more than {fewshot}"
            )
        random.Random(SHUFFLE_SEED).shuffle(items)  # files are often ordered; max_per_task takes a random subset
        tasks.append(Task(label, kind, fewshot, delimiter, baseline, items[:max_per_task]))
    return Bundle(tasks, bundle_sha256(bundle_dir), max_per_task)


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


def answer(task, index, texts):
    """(which scored sequence holds the right answer, the text before that answer): for bits per
    byte, the right answer is what follows its context and delimiter (the gold choice, the
    continuation), with the delimiter's trailing whitespace, as language_modeling's continuation
    carries it. texts: prompts(task, index)."""
    if task.kind == "language_modeling":
        return 0, texts[0]  # its one scored sequence (the full text), after the context alone
    gold = task.items[index]["gold"]
    answer_text = (
        task.items[index]["choices"][gold] if task.kind == "multiple_choice" else task.items[index]["continuation"]
    )
    return gold, texts[gold][: len(texts[gold]) - len(answer_text)].rstrip()


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
    # item index -> (c, start, bytes): sequences[c]'s tokens[start:] are the right answer, of bytes UTF-8 bytes
    answers: dict
    truncated: int  # this rank's sequences cut to block_size


def encode_tasks(tasks, tokenizer, block_size, rank=0, world=1):
    """Each task's items, every world-th from rank on (each rank encodes its own share), as token
    sequences of at most block_size, each starting with the end-of-text token (a new document, as in
    training); a longer one loses its oldest tokens (few-shot examples first) and is counted."""
    encoded = []
    for task in tasks:
        golds, sequences, answers, truncated = {}, {}, {}, 0
        for index in range(rank, len(task.items), world):
            texts = prompts(task, index)
            token_lists = [[tokenizer.eot] + tokenizer.encode(text).tolist() for text in texts]
            scored = token_lists[1:] if task.kind == "language_modeling" else token_lists  # LM: the full text only
            sequences[index] = []
            for tokens, (start, end) in zip(scored, spans(task, token_lists)):
                cut = max(0, len(tokens) - block_size)
                truncated += cut > 0
                sequences[index].append((tokens[cut:], max(start - cut, 1), end - cut))
            c, context = answer(task, index, texts)
            with_answer = scored[c]
            start = min(
                common_length([[tokenizer.eot] + tokenizer.encode(context).tolist(), with_answer]), len(with_answer) - 1
            )
            kept = sequences[index][c][0]
            start = max(start - (len(with_answer) - len(kept)), 1)
            answers[index] = (c, start, sum(len(tokenizer.token_bytes(t)) for t in kept[start:]))
            golds[index] = task.items[index].get("gold")
        encoded.append(
            Encoded(task.label, task.kind, task.baseline, len(task.items), golds, sequences, answers, truncated)
        )
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
    """Each row's mean loss over its scored tokens, whether greedy decoding reproduces them all, and
    (rows whose answer start is given, else None) the summed loss of its tokens from that start on.
    A row: (item, choice, tokens, start, end, answer start or None)."""
    T = max(len(row[2]) for row in batch)
    x = torch.zeros(len(batch), T, dtype=torch.long)
    y = torch.full((len(batch), T), -1, dtype=torch.long)
    scored = torch.zeros(len(batch), T, dtype=torch.bool)
    for r, (_, _, tokens, start, end, answer_start) in enumerate(batch):
        x[r, : len(tokens)] = torch.tensor(tokens)
        first = start if answer_start is None else min(start, answer_start)
        y[r, first - 1 : end - 1] = x[r, first:end]  # position t predicts token t + 1
        scored[r, start - 1 : end - 1] = True
    x, y, scored = x.to(device), y.to(device), scored.to(device)
    with autocast:
        logits, loss = model(x, y, reduction="none")
    mean_loss = torch.where(scored, loss.float(), 0).sum(1) / scored.sum(1)
    greedy = ((logits.argmax(-1) == y) | ~scored).all(1)
    losses = loss.float().cpu()  # each answer's losses summed exactly (fsum): the same in any batch or rank
    answer_loss = [
        None if a is None else math.fsum(losses[r, a - 1 : end - 1].tolist())
        for r, (_, _, _, _, end, a) in enumerate(batch)
    ]
    return mean_loss.tolist(), greedy.tolist(), answer_loss


@torch.no_grad()
def evaluate_tasks(model, tasks, device, autocast, world=1, batch_tokens=BATCH_TOKENS):
    """
    Accuracy, CORE and bits per byte of model (in eval mode for the call) on this rank's
    encode_tasks output. Under torch.distributed (world > 1) the ranks' integer counts are summed,
    and each item's answer loss gathered and summed in the order of the items, so any world size
    gives one process's result (up to ties in floating point); every rank runs as many forwards
    (an FSDP forward is collective). Returns downstream.json's core, bits_per_byte, truncated and tasks.
    """
    was_training = model.training
    model.eval()
    correct, answer_bytes, answer_losses = [], [], []  # answer_losses: per item of every task, 0 where another rank's
    for task in tasks:
        rows = [
            (i, c, *seq, task.answers[i][1] if c == task.answers[i][0] else None)
            for i, item in task.sequences.items()
            for c, seq in enumerate(item)
        ]
        todo = batches(rows, batch_tokens)
        n_batches = torch.tensor(len(todo), device=device)
        if world > 1:
            dist.all_reduce(n_batches, op=dist.ReduceOp.MAX)
        losses, greedy, answer_loss = {}, {}, [0.0] * task.items
        for batch in todo:
            for (i, c, *_), loss, hit, nll in zip(batch, *forward_batch(model, batch, device, autocast)):
                losses.setdefault(i, {})[c], greedy[i] = loss, hit
                if nll is not None:
                    answer_loss[i] = nll
        for _ in range(n_batches.item() - len(todo)):  # this rank has fewer: the forwards the others make
            forward_batch(model, [(0, 0, [0, 0], 1, 2, None)], device, autocast)
        if task.kind == "language_modeling":
            correct.append(sum(greedy.values()))
        else:  # the lowest mean loss wins; a tie goes to the first
            correct.append(
                sum(min(range(len(by_choice)), key=by_choice.get) == task.golds[i] for i, by_choice in losses.items())
            )
        answer_bytes.append(sum(n for _, _, n in task.answers.values()))
        answer_losses.append(answer_loss)
    model.train(was_training)
    counts = torch.tensor(correct + answer_bytes + [sum(t.truncated for t in tasks)], dtype=torch.long, device=device)
    item_losses = torch.tensor(
        [x for losses in answer_losses for x in losses], dtype=torch.float64, device=device if world > 1 else "cpu"
    )  # no float64 on mps, which runs one process
    if world > 1:
        dist.all_reduce(counts)
        dist.all_reduce(item_losses)  # each item's loss plus zeros: exact
    counts, item_losses = counts.tolist(), item_losses.tolist()
    results = {}
    for t, task in enumerate(tasks):
        if counts[len(tasks) + t] == 0:  # every answer cut away: a block_size of 1 keeps only the end-of-text token
            raise DataError(
                f"task {task.label}: its right answers keep 0 bytes in sequences cut to the model's "
                f"block_size, so it has no bits per byte; score a model of a longer block_size"
            )
        accuracy = counts[t] / task.items
        first = sum(other.items for other in tasks[:t])  # this task's items in item_losses
        bits = math.fsum(item_losses[first : first + task.items]) / math.log(2)  # fsum: the same in any order
        results[task.label] = dict(
            icl_task_type=task.kind,
            items=task.items,
            correct=counts[t],
            accuracy=accuracy,
            random_baseline=task.baseline,
            centered=(accuracy - task.baseline) / (1 - task.baseline),
            bits_per_byte=bits / counts[len(tasks) + t],
        )
    core = sum(r["centered"] for r in results.values()) / len(results)
    bits_per_byte = sum(r["bits_per_byte"] for r in results.values()) / len(results)
    return dict(core=core, bits_per_byte=bits_per_byte, truncated=counts[-1], tasks=results)


SCORING_FILES = (
    "downstream.py",
    "model.py",
    "checkpoint.py",
    "data/shards.py",
)  # the scores, the forward, its weights, the tokens


def scoring_code():
    """The fingerprint of the code that computes the scores (SCORING_FILES, as records.code_fingerprint reads each).
    Whole files, not records.code_record's definitions restricted to a scheme's: the report pairs two arms'
    downstream.json only where their scoring_code is equal, and arms of two schemes compute with different
    definitions, so a fingerprint per scheme would pair no arms; a split one (shared for the pair, the scheme's
    own across its seeds, as records.code_fingerprints does for results) would be a second check in report.py.
    The cost: any edit to these files (a new scheme in model.py) asks for the cells to be scored again."""
    files = {}
    for name in SCORING_FILES:
        with open(os.path.join(HERE, name), "rb") as f:
            files[name] = code_fingerprint(f.read())
    return hashlib.sha256(json.dumps(files, sort_keys=True).encode()).hexdigest()


def write_scores(cell_dir, bundle, step, scores, dtype):
    """cell_dir/downstream.json (atomically): evaluate_tasks' scores of the checkpoint of step, with
    what they were measured on: the bundle's sha256 and max_per_task (None: every item), the
    fingerprint of the code that scored (scoring_code) and the precision of the forward (dtype, as
    machine.setup resolved it); the report pairs only results equal in all of them."""
    write_json(
        os.path.join(cell_dir, "downstream.json"),
        dict(
            bundle_sha256=bundle.sha256,
            max_per_task=bundle.max_per_task,
            scoring_code=scoring_code(),
            dtype=dtype,
            step=step,
            **scores,
        ),
    )


# -----------------------------------------------------------------------------
# cells and the bundle download


def find_cells(path):
    """The cell folders at path: path itself when it holds ckpt.pt, else out_dir/<arm>/seed<k>; a
    cell begun but without a checkpoint yet is refused, not skipped."""
    if os.path.isfile(os.path.join(path, "ckpt.pt")):
        return [path]
    if not os.path.isdir(path):
        raise DataError(f"{path} does not exist; give a cell folder (out/<arm>/seed<k>) or a grid's out_dir")
    cells = sorted(
        os.path.join(path, arm, seed)
        for arm in os.listdir(path)
        if os.path.isdir(os.path.join(path, arm))
        for seed in os.listdir(os.path.join(path, arm))
        if re.fullmatch(r"seed[0-9]+", seed) and os.path.isdir(os.path.join(path, arm, seed))
    )
    if not cells:
        raise DataError(
            f"{path} holds no cells (<arm>/seed<k> folders) and no ckpt.pt; give a cell folder or an out_dir"
        )
    missing = [c for c in cells if not os.path.isfile(os.path.join(c, "ckpt.pt"))]
    if missing:
        raise DataError(
            f"{len(missing)} cell(s) have no ckpt.pt yet ({', '.join(missing[:3])}); "
            f"give the cell folders that have one"
        )
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


def main(argv):
    parser = Parser("downstream.py", __doc__)
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
    bundle = load_bundle(args.bundle, args.max_per_task)
    runtime = machine.setup(dict(device=args.device, dtype=args.dtype, fsdp=False))
    device, autocast, rank, world = runtime.device, runtime.autocast, runtime.rank, runtime.world
    for cell_dir in cells:
        t0 = time.time()
        cell = open_trained(cell_dir, device)
        model, step, tokenizer = cell.model, cell.step, cell.tokenizer
        if cell.code_changes:  # its scores are of today's code (downstream.json records the scoring code's)
            print(
                f"note: the code differs from the one {cell_dir} was trained with ({cell.changed()})", file=sys.stderr
            )
        if tokenizer.vocab_size > model.config.vocab_size:  # a cell trained on token ids of its own
            raise DataError(
                f"{cell_dir}: vocab_size {model.config.vocab_size} is below its tokenizer's "
                f"{tokenizer.vocab_size}; it cannot read text, so it has no CORE score"
            )
        tasks = encode_tasks(bundle.tasks, tokenizer, model.config.block_size, rank, world)
        scores = evaluate_tasks(model, tasks, device, autocast, world, args.batch_tokens)
        if rank == 0:
            write_scores(cell_dir, bundle, step, scores, runtime.dtype)
            cut = (
                f", {scores['truncated']} sequences cut to block_size {model.config.block_size} from the left"
                if scores["truncated"]
                else ""
            )
            print(
                f"{cell_dir} step {step}: CORE {scores['core']:.4f}, {scores['bits_per_byte']:.4f} bits per byte "
                f"over {len(tasks)} tasks{cut} "
                f"({time.time() - t0:.0f} s)"
            )
    if world > 1:
        dist.destroy_process_group()


if __name__ == "__main__":
    run(main)
