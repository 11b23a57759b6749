"""
downstream.py, the CORE in-context evaluator: its core.yaml reader, the prompts it assembles, each
task type's scoring against hand-computed answers (a bigram model whose every loss is known), the
left cut at block_size, 2 ranks == 1 process, bad bundles, the download and the CLI on tiny cells;
and train.py's evaluation during training (what the CLI computes, resumed, 2 FSDP ranks, its settings).

$ python -m pytest tests/test_downstream.py -q
"""

import csv
import dataclasses
import json
import math
import os
import random
import shutil
import subprocess
import sys
import zipfile
from contextlib import nullcontext

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
from torch.nn import functional as F

import cells
import downstream
import records
import train
from common import ConfigError, DataError
from helpers import killed_at_step, log_records, result, tiny, torchrun, without_timings, write_checkpoint
from data.shards import get_tokenizer, write_shard
from model import GPT, GPTConfig

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ENV = {**os.environ, "OMP_NUM_THREADS": "1"}
torch.set_num_threads(1)
BYTES = get_tokenizer("bytes")
EOT = BYTES.eot


class Bigram(nn.Module):
    """The next token's logits from the current token alone (a table), called as GPT is: every loss is known."""

    def __init__(self, table):
        super().__init__()
        self.table = nn.Parameter(table)
        self.calls = 0

    def forward(self, idx, targets=None, reduction="mean"):
        self.calls += 1
        logits = self.table[idx]
        if targets is None:
            return logits[:, [-1]], None
        loss = F.cross_entropy(
            logits.float().view(-1, logits.size(-1)), targets.reshape(-1), ignore_index=-1, reduction=reduction
        )
        return logits, loss.view(targets.shape) if reduction == "none" else loss


def bigram(*favoured):
    """A byte bigram model, uniform but for (pair, logit) entries: 'ab', 3.0 makes b likelier after a."""
    table = torch.zeros(257, 257)
    for pair, logit in favoured:
        table[ord(pair[0]), ord(pair[1])] = logit
    return Bigram(table)


def token_loss(model, prev, nxt):
    """The reference: -log p(nxt | prev) straight from the table."""
    return -F.log_softmax(model.table[ord(prev)].double(), -1)[ord(nxt)].item()


def write_bundle(root, tasks, baselines=None, yaml_text=None):
    """A CORE bundle laid out as the public one: core.yaml, eval_meta_data.csv, eval_data/<group>/<label>.jsonl.
    tasks: dicts of label, kind, items and optionally fewshot, delimiter."""
    root = str(root)
    os.makedirs(os.path.join(root, "eval_data", "group"), exist_ok=True)
    lines = ["icl_tasks:"]
    for t in tasks:
        lines += [
            "-",
            f"  label: {t['label']}",
            f"  dataset_uri: group/{t['label']}.jsonl",
            f"  num_fewshot: [{t.get('fewshot', 0)}]",
            f"  icl_task_type: {t['kind']}",
        ]
        if "delimiter" in t:
            lines.append(f"  continuation_delimiter: {json.dumps(t['delimiter'])} # between context and answer")
        with open(os.path.join(root, "eval_data", "group", f"{t['label']}.jsonl"), "w") as f:
            f.writelines(json.dumps(item) + "\n" for item in t["items"])
    with open(os.path.join(root, "core.yaml"), "w") as f:
        f.write(yaml_text or "\n".join(lines) + "\n")
    with open(os.path.join(root, "eval_meta_data.csv"), "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["Eval Task", "Task Category", "Random baseline", "Description"])
        for t in tasks:
            writer.writerow([t["label"], "cat", (baselines or {}).get(t["label"], 25), "a task, with a comma"])
    return root


def evaluate(model, bundle_dir, block_size=1024, max_per_task=None, rank=0, world=1, batch_tokens=4096):
    tasks = downstream.encode_tasks(
        downstream.load_bundle(bundle_dir, max_per_task).tasks, BYTES, block_size, rank, world
    )
    return downstream.evaluate_tasks(model, tasks, "cpu", nullcontext(), world, batch_tokens)


def encoded(bundle_dir, block_size=1024, tokenizer=BYTES):
    """The first task of a bundle, encoded."""
    return downstream.encode_tasks(downstream.load_bundle(bundle_dir).tasks, tokenizer, block_size)[0]


def accuracy_part(scores):
    """Each task's scores without its bits per byte (tested on its own)."""
    return {label: {k: v for k, v in t.items() if k != "bits_per_byte"} for label, t in scores["tasks"].items()}


# -----------------------------------------------------------------------------
# core.yaml

REAL_LAYOUT = """\
# the CORE tasks, as the public bundle lays them out
icl_tasks:
-
  label: hellaswag_zeroshot
  dataset_uri: language_understanding/hellaswag.jsonl
  num_fewshot: [0]
  icl_task_type: multiple_choice
-
  label: jeopardy
  dataset_uri: world_knowledge/jeopardy_all.jsonl # the whole file
  num_fewshot: [10]
  icl_task_type: language_modeling
  continuation_delimiter: "\\nAnswer: " # this separates questions from answers
  has_categories: true
-
  label: winograd
  dataset_uri: language_understanding/winograd_wsc.jsonl
  num_fewshot:
  - 0
  icl_task_type: schema
  continuation_delimiter: ' it''s # not a comment'
  metric_names: [InContextLearningMultipleChoiceAccuracy, "a, b"]
- label: boolq
  dataset_uri: reading_comprehension/boolq.jsonl
  num_fewshot: [10]
  icl_task_type: multiple_choice
  continuation_delimiter: "\\nAnswer: \\u00e9\\t"

icl_seq_len: 2048
"""


def core_yaml(tmp_path, text, encoding="utf-8"):
    path = tmp_path / "core.yaml"
    path.write_text(text, encoding=encoding)
    return str(path)


@pytest.mark.parametrize("encoding", ["utf-8", "utf-8-sig"])  # saved with a byte-order mark, as some editors do
def test_core_yaml_reader_reads_the_bundles_layout(tmp_path, encoding):
    tasks = downstream.read_core_yaml(core_yaml(tmp_path, REAL_LAYOUT, encoding))
    assert tasks == [
        dict(
            label="hellaswag_zeroshot",
            dataset_uri="language_understanding/hellaswag.jsonl",
            num_fewshot=[0],
            icl_task_type="multiple_choice",
        ),
        dict(
            label="jeopardy",
            dataset_uri="world_knowledge/jeopardy_all.jsonl",
            num_fewshot=[10],
            icl_task_type="language_modeling",
            continuation_delimiter="\nAnswer: ",
            has_categories=True,
        ),
        dict(
            label="winograd",
            dataset_uri="language_understanding/winograd_wsc.jsonl",
            num_fewshot=[0],
            icl_task_type="schema",
            continuation_delimiter=" it's # not a comment",
            metric_names=["InContextLearningMultipleChoiceAccuracy", "a, b"],
        ),
        dict(
            label="boolq",
            dataset_uri="reading_comprehension/boolq.jsonl",
            num_fewshot=[10],
            icl_task_type="multiple_choice",
            continuation_delimiter="\nAnswer: \u00e9\t",
        ),
    ]


@pytest.mark.parametrize(
    "text, match",
    [
        ('icl_tasks:\n-\n  label: "open\n', r"core.yaml line 4 is not YAML \(found unexpected end of stream\)$"),
        ("icl_tasks:\n-\n\tlabel: x\n", r"core.yaml line 3 is not YAML"),
        ("icl_tasks: [a]\n", r"core.yaml lists no tasks: it needs 'icl_tasks:' followed by one '-' mapping per task"),
        ("icl_tasks:\n", r"core.yaml lists no tasks"),
        ("other: 1\n", r"core.yaml lists no tasks"),
        ("- 1\n", r"core.yaml lists no tasks"),
        ("icl_tasks: " + "[" * 100_000 + "\n", r"core.yaml (line 1 is not YAML|is nested too deeply)"),
    ],
)
def test_core_yaml_errors_are_one_line(tmp_path, text, match):
    with pytest.raises(DataError, match=match) as e:
        downstream.read_core_yaml(core_yaml(tmp_path, text))
    assert "\n" not in str(e.value)


# -----------------------------------------------------------------------------
# prompts


def task_of(kind, items, fewshot=0, delimiter=" "):
    return downstream.Task("t", kind, fewshot, delimiter, 0.25, items)


def fewshot_order(index, n, k):
    """The documented draw: random.Random(1234 + index).sample of the other items' indices."""
    return random.Random(1234 + index).sample([i for i in range(n) if i != index], k)


def test_prompts_are_assembled_exactly():
    mc = [dict(query=f"Q{i}", choices=[f"a{i}", f"b{i}"], gold=i % 2) for i in range(3)]
    first, second = fewshot_order(0, 3, 2)
    shot = {j: f"Q{j}\nA: {['a', 'b'][j % 2]}{j}\n\n" for j in range(3)}
    assert downstream.prompts(task_of("multiple_choice", mc, 2, "\nA: "), 0) == [
        shot[first] + shot[second] + "Q0\nA: a0",
        shot[first] + shot[second] + "Q0\nA: b0",
    ]

    schema = [dict(context_options=[f"x{i}", f"y{i}"], continuation=f"c{i}", gold=1) for i in range(3)]
    (first,) = fewshot_order(1, 3, 1)
    assert downstream.prompts(task_of("schema", schema, 1), 1) == [
        f"y{first} c{first}\n\nx1 c1",
        f"y{first} c{first}\n\ny1 c1",
    ]

    # contexts lose their surrounding whitespace; the context alone ends without any (the delimiter's
    # trailing space then belongs to the continuation)
    lm = [dict(context=f" C{i} \n", continuation=f"T{i}") for i in range(2)]
    assert downstream.prompts(task_of("language_modeling", lm, 1, ": "), 0) == ["C1: T1\n\nC0:", "C1: T1\n\nC0: T0"]


@pytest.mark.parametrize("tokenizer", ["bytes", "gpt2"])
def test_a_language_modelling_item_scores_exactly_its_continuation(tokenizer):
    # the scored span decodes to the continuation (with the delimiter's space), and what comes before it to the
    # context alone: its first token scored (issue #41: skipping it raised LM accuracy and CORE, and no test saw it)
    tok = get_tokenizer(tokenizer)
    items = [
        dict(context=" The capital of France is\n", continuation="Paris, on the Seine"),
        dict(context="2 + 2 =", continuation=" 4 (four)"),
        dict(context="Grass is", continuation="green and lush"),
    ]
    for delimiter in (" ", "\nAnswer: "):
        task = task_of("language_modeling", items, 1, delimiter)
        (encoded,) = downstream.encode_tasks([task], tok, 1024)
        for index, item in enumerate(items):
            ((tokens, start, end),) = encoded.sequences[index]
            context_alone, whole = downstream.prompts(task, index)
            assert tok.decode(tokens[1:start]) == context_alone and end == len(tokens)
            assert tok.decode(tokens[start:end]).strip() == item["continuation"].strip()


def test_fewshot_never_includes_the_item_and_repeats_with_its_seed():
    items = [dict(query=f"Q{i}", choices=["a", "b"], gold=0) for i in range(8)]
    task = task_of("multiple_choice", items, 7)
    for index in range(8):  # 7 of 8 items: every other item exactly once, never the item itself
        shots = downstream.fewshot_examples(task, index)
        assert sorted(e["query"] for e in shots) == sorted(f"Q{i}" for i in range(8) if i != index)
        assert [e["query"] for e in shots] == [f"Q{j}" for j in fewshot_order(index, 8, 7)]
        assert downstream.prompts(task, index) == downstream.prompts(task, index)
    orders = {tuple(e["query"] for e in downstream.fewshot_examples(task, i)) for i in range(8)}
    assert len(orders) == 8  # each item draws its own examples


def test_tasks_are_shuffled_with_a_fixed_seed_and_max_per_task_cuts_before_the_draw(tmp_path):
    items = [dict(context=f"c{i}", continuation="x") for i in range(20)]
    bundle = write_bundle(tmp_path, [dict(label="lm", kind="language_modeling", items=items, fewshot=2)])
    a, b = downstream.load_bundle(bundle).tasks[0], downstream.load_bundle(bundle).tasks[0]
    expected = items[:]
    random.Random(1337).shuffle(expected)
    assert a.items == b.items == expected != items
    cut = downstream.load_bundle(bundle, 5)
    assert cut.max_per_task == 5 and cut.tasks[0].items == expected[:5]
    # the examples come from the 5 items scored (nanochat's order: cut, then draw), so the prompts differ
    full, short = (downstream.encode_tasks([t], BYTES, 64)[0] for t in (a, cut.tasks[0]))
    assert short.items == 5 and sorted(short.sequences) == list(range(5))
    assert all(e in expected[:5] for i in range(5) for e in downstream.fewshot_examples(cut.tasks[0], i))
    assert any(short.sequences[i] != full.sequences[i] for i in range(5))
    assert (
        downstream.load_bundle(bundle, 20).tasks[0].items
        == downstream.load_bundle(bundle, 99).tasks[0].items
        == expected
    )
    with pytest.raises(DataError, match=r"max_per_task=2 leaves too few items for lm's 2 few-shot examples"):
        downstream.load_bundle(bundle, 2)


def nanochat_reference(model, data, kind, num_fewshot, delimiter, max_per_task, block_size):
    """
    nanochat's CORE for one task (its scripts/base_eval.py and nanochat/core_eval.py, 2026-12, read and
    written again here, the prompts as Jinja templates as there): the file's items shuffled with
    random.Random(1337), cut to max_per_task, each item's examples drawn with random.Random(1234 + i)
    from the others of what is left; each item's texts tokenized with a leading BOS (here the
    end-of-text token), cut to the last block_size tokens, padded with BOS, one forward per item;
    the lowest mean loss or an exact greedy continuation wins. Returns ([(tokens, start, end), ...]
    per item, each item's correctness).
    """
    from jinja2 import Template

    data = list(data)
    random.Random(1337).shuffle(data)
    data = data[:max_per_task] if max_per_task > 0 else data
    shot = {
        "multiple_choice": "{{ e.query }}{{ d }}{{ e.choices[e.gold] }}",
        "schema": "{{ e.context_options[e.gold] }}{{ d }}{{ e.continuation }}",
        "language_modeling": "{{ e.context | trim }}{{ d }}{{ e.continuation }}",
    }[kind]
    tail = {
        "multiple_choice": "{{ item.query }}{{ d }}{{ option }}",
        "schema": "{{ option }}{{ d }}{{ item.continuation }}",
        "language_modeling": "{{ item.context | trim }}{{ d }}{% if option %}{{ item.continuation }}{% endif %}",
    }[kind]
    template = Template("{% for e in shots %}" + shot + "\n\n{% endfor %}" + tail)
    sequences, right = [], []
    for i, item in enumerate(data):
        others = [j for j in range(len(data)) if j != i]
        shots = [data[j] for j in random.Random(1234 + i).sample(others, num_fewshot)] if num_fewshot else []
        options = {
            "multiple_choice": item.get("choices"),
            "schema": item.get("context_options"),
            "language_modeling": [False, True],
        }[kind]
        texts = [template.render(shots=shots, d=delimiter, item=item, option=o) for o in options]
        if kind == "language_modeling":
            texts[0] = texts[0].strip()
        tokens = [[EOT] + list(text.encode("utf-8")) for text in texts]
        if kind == "multiple_choice":
            start = downstream_free_common(tokens)
            spans = [(start, len(t)) for t in tokens]
        elif kind == "schema":
            suffix = downstream_free_common([t[::-1] for t in tokens])
            spans = [(len(t) - suffix, len(t)) for t in tokens]
        else:
            assert tokens[1][: len(tokens[0])] == tokens[0]
            tokens, spans = [tokens[1]], [(len(tokens[0]), len(tokens[1]))]
        crops = [max(0, len(t) - block_size) for t in tokens]
        tokens = [t[c:] for t, c in zip(tokens, crops)]
        spans = [(s - c, e - c) for (s, e), c in zip(spans, crops)]
        sequences.append([(t, s, e) for t, (s, e) in zip(tokens, spans)])
        width = max(len(t) for t in tokens)
        ids = torch.tensor([t + [EOT] * (width - len(t)) for t in tokens])
        with torch.no_grad():
            logits = model(ids)[0] if isinstance(model, Bigram) else model(ids, ids)[0]
        losses = F.cross_entropy(logits.float().transpose(1, 2), torch.roll(ids, -1, 1), reduction="none")
        if kind == "language_modeling":
            s, e = spans[0]
            right.append(bool((logits[0, s - 1 : e - 1].argmax(-1) == ids[0, s:e]).all()))
        else:
            means = [losses[r, s - 1 : e - 1].mean().item() for r, (s, e) in enumerate(spans)]
            right.append(means.index(min(means)) == item["gold"])
    return sequences, right


def downstream_free_common(lists):
    """How many leading entries all lists share (nanochat's find_common_length, left)."""
    n = 0
    while n < min(map(len, lists)) and len({l[n] for l in lists}) == 1:
        n += 1
    return n


def reference_tasks(n=12):
    """A task of each type the bundle uses, few-shot, with items of varied lengths; some prompts exceed block 96."""
    words = ["alpha", "beta", "gamma", "delta", "epsilon", "zeta"]
    return [
        dict(
            label="mc",
            kind="multiple_choice",
            fewshot=3,
            delimiter="\nAnswer: ",
            items=[
                dict(
                    query=f"Question {i}: which {words[i % 6]}?",
                    choices=[words[(i + k) % 6] for k in range(2 + i % 3)],
                    gold=i % (2 + i % 3),
                )
                for i in range(n)
            ],
        ),
        dict(
            label="schema",
            kind="schema",
            fewshot=2,
            items=[
                dict(
                    context_options=[f"The {w} fell" for w in words[i % 3 : i % 3 + 3]],
                    continuation=f"because of {i}.",
                    gold=i % 3,
                )
                for i in range(n)
            ],
        ),
        dict(
            label="lm",
            kind="language_modeling",
            fewshot=2,
            items=[dict(context=f" Count {i} then say ", continuation=f"{words[i % 6]}") for i in range(n)],
        ),
    ]


@pytest.mark.parametrize("max_per_task", [5, 0])
def test_core_equals_an_independent_reimplementation_of_nanochats(tmp_path, max_per_task):
    # a model that gets some items right: a small GPT fitted for a few steps to the tasks' own answers
    torch.manual_seed(0)
    gpt = GPT(GPTConfig(n_layer=2, n_head=2, n_embd=32, block_size=96, vocab_size=257))
    tasks = reference_tasks()
    bundle = write_bundle(tmp_path, tasks, baselines=dict(mc=40, schema=33, lm=0))
    text = torch.tensor(
        ([EOT] + list(" ".join(f"{i['query']} {i['choices'][i['gold']]}" for i in tasks[0]["items"]).encode()))[:97]
    )
    opt = torch.optim.AdamW(gpt.parameters(), lr=1e-2)
    for _ in range(30):
        opt.zero_grad()
        gpt(text[None, :-1], text[None, 1:])[1].backward()
        opt.step()
    gpt.eval()
    ours = evaluate(gpt, bundle, block_size=96, max_per_task=max_per_task or None, batch_tokens=512)
    loaded = downstream.load_bundle(bundle, max_per_task or None)
    for task, spec in zip(downstream.encode_tasks(loaded.tasks, BYTES, 96), tasks):
        with open(os.path.join(bundle, "eval_data", "group", f"{spec['label']}.jsonl")) as f:
            data = [json.loads(line) for line in f]
        sequences, right = nanochat_reference(
            gpt, data, spec["kind"], spec["fewshot"], spec.get("delimiter", " "), max_per_task, 96
        )
        assert [task.sequences[i] for i in range(task.items)] == sequences, spec["label"]  # prompts, cuts, spans
        assert ours["tasks"][spec["label"]]["correct"] == sum(right), spec["label"]
    assert ours["truncated"] > 0  # the crop was exercised
    assert 0 < sum(t["correct"] for t in ours["tasks"].values()) < sum(t["items"] for t in ours["tasks"].values())


# -----------------------------------------------------------------------------
# scoring, by task type, against hand-computed losses


def test_multiple_choice_takes_the_lowest_mean_loss_not_the_sum(tmp_path):
    # after "Q " the choices "ab" and "xyzw": uniform bytes cost log 257 each, but x->y, y->z, z->w are cheap.
    # xyzw has the lower mean loss and the higher sum; item 1 asks for it, item 2 for ab
    model = bigram(("xy", 3.0), ("yz", 3.0), ("zw", 3.0))
    uniform, cheap = math.log(257), math.log(256 + math.exp(3)) - 3
    assert token_loss(model, " ", "a") == pytest.approx(uniform) and token_loss(model, "x", "y") == pytest.approx(cheap)
    mean_ab, mean_xyzw = uniform, (uniform + 3 * cheap) / 4
    assert mean_xyzw < mean_ab and 4 * mean_xyzw > 2 * mean_ab
    items = [dict(query="Q", choices=["ab", "xyzw"], gold=1), dict(query="Q", choices=["ab", "xyzw"], gold=0)]
    bundle = write_bundle(tmp_path, [dict(label="mc", kind="multiple_choice", items=items)], baselines=dict(mc=50))
    scores = evaluate(model, bundle)
    assert accuracy_part(scores)["mc"] == dict(
        icl_task_type="multiple_choice", items=2, correct=1, accuracy=0.5, random_baseline=0.5, centered=0.0
    )
    # the scored span is the choice (after the shared "Q "), and its mean loss is the reference's
    task = encoded(bundle)
    assert [tokens for tokens, _, _ in task.sequences[0]] == [[EOT, *b"Q ab"], [EOT, *b"Q xyzw"]]  # a new document
    losses, _, _ = downstream.forward_batch(
        model, [(0, c, *s, None) for c, s in enumerate(task.sequences[0])], "cpu", nullcontext()
    )
    assert losses == pytest.approx([mean_ab, mean_xyzw], rel=1e-6)
    # a uniform model ties every choice: the first wins, as in nanochat
    tie = write_bundle(
        tmp_path / "tie",
        [
            dict(
                label="mc",
                kind="multiple_choice",
                items=[dict(query="Q", choices=["ab", "cd", "ef"], gold=g) for g in (0, 0, 1, 2)],
            )
        ],
    )
    assert evaluate(bigram(), tie)["tasks"]["mc"]["correct"] == 2


def test_schema_takes_the_context_under_which_the_continuation_is_likeliest(tmp_path):
    # options "ab" / "cd" before the shared " zz": only the first token of the shared suffix (" ",
    # after b or d) differs, and b -> " " is favoured
    model = bigram(("b ", 4.0))
    items = [
        dict(context_options=["ab", "cd"], continuation="zz", gold=0),
        dict(context_options=["ab", "cd"], continuation="zz", gold=1),
        dict(context_options=["cd", "ab"], continuation="zz", gold=1),
    ]
    bundle = write_bundle(tmp_path, [dict(label="s", kind="schema", items=items)], baselines=dict(s=50))
    task = encoded(bundle)
    assert all(tokens[start:end] == list(b" zz") for item in task.sequences.values() for tokens, start, end in item)
    assert accuracy_part(evaluate(model, bundle))["s"] == dict(
        icl_task_type="schema", items=3, correct=2, accuracy=2 / 3, random_baseline=0.5, centered=(2 / 3 - 0.5) / 0.5
    )


def test_language_modeling_needs_every_greedy_token(tmp_path):
    # greedy after "Q:" is " abc" (each next byte favoured); " abd" misses only its last token
    model = bigram((": ", 5.0), (" a", 5.0), ("ab", 5.0), ("bc", 5.0))
    items = [
        dict(context="Q", continuation=" abc"),
        dict(context="Q", continuation=" abd"),
        dict(context="Q", continuation=" xbc"),
    ]
    bundle = write_bundle(
        tmp_path, [dict(label="lm", kind="language_modeling", items=items, delimiter=":")], baselines=dict(lm=0)
    )
    assert accuracy_part(evaluate(model, bundle))["lm"] == dict(
        icl_task_type="language_modeling", items=3, correct=1, accuracy=1 / 3, random_baseline=0.0, centered=1 / 3
    )


def test_centered_accuracy_and_core(tmp_path):
    model = bigram(("xy", 3.0), ("yz", 3.0), ("zw", 3.0))
    mc = [dict(query="Q", choices=["ab", "xyzw"], gold=1)] * 3 + [dict(query="Q", choices=["ab", "xyzw"], gold=0)]
    lm = [dict(context="Q", continuation=" q")] * 2
    bundle = write_bundle(
        tmp_path,
        [dict(label="mc", kind="multiple_choice", items=mc), dict(label="lm", kind="language_modeling", items=lm)],
        baselines=dict(mc=25, lm=0),
    )
    scores = evaluate(model, bundle)
    assert scores["tasks"]["mc"]["accuracy"] == 0.75 and scores["tasks"]["lm"]["accuracy"] == 0.0
    assert scores["tasks"]["mc"]["centered"] == pytest.approx((0.75 - 0.25) / 0.75)
    assert scores["core"] == pytest.approx(((0.75 - 0.25) / 0.75 + 0.0) / 2) and scores["truncated"] == 0


def test_bits_per_byte_is_the_right_answers_loss_over_its_bytes(tmp_path):
    # the right answer is what follows the context and the delimiter, the delimiter's space included:
    # " xyzw" (item 1) and " ab" (item 2) after "Q", though the choices are scored only where they differ
    model = bigram(("xy", 3.0), ("yz", 3.0), ("zw", 3.0), ("b ", 4.0), (": ", 5.0), (" a", 5.0), ("ab", 5.0))

    def loss(text, after):  # the summed loss of text's bytes, each after the one before
        return sum(token_loss(model, p, n) for p, n in zip(after + text[:-1], text))

    mc = [dict(query="Q", choices=["ab", "xyzw"], gold=1), dict(query="Q", choices=["ab", "xyzw"], gold=0)]
    schema = [dict(context_options=["ab", "cd"], continuation="zz", gold=g) for g in (0, 1)]
    lm = [dict(context="Q", continuation=" ab\u00e9")]  # the last character is two UTF-8 bytes
    bundle = write_bundle(
        tmp_path,
        [
            dict(label="mc", kind="multiple_choice", items=mc),
            dict(label="s", kind="schema", items=schema),
            dict(label="lm", kind="language_modeling", items=lm, delimiter=":"),
        ],
    )
    scores = evaluate(model, bundle)
    bpb = {label: t["bits_per_byte"] for label, t in scores["tasks"].items()}
    assert bpb["mc"] == pytest.approx((loss(" xyzw", "Q") + loss(" ab", "Q")) / math.log(2) / 8, rel=1e-6)
    assert bpb["s"] == pytest.approx((loss(" zz", "b") + loss(" zz", "d")) / math.log(2) / 6, rel=1e-6)
    table = F.log_softmax(model.table.double(), -1)  # é is bytes c3 a9, after b
    lm_loss = loss(" ab", ":") - table[ord("b"), 0xC3].item() - table[0xC3, 0xA9].item()
    assert bpb["lm"] == pytest.approx(lm_loss / math.log(2) / 5, rel=1e-6)
    assert scores["bits_per_byte"] == pytest.approx(sum(bpb.values()) / 3)
    # the same bytes under GPT-2's tokens: the answer's tokens are exactly its text
    gpt2 = get_tokenizer("gpt2")
    task = downstream.encode_tasks(downstream.load_bundle(bundle).tasks, gpt2, 1024)[0]
    for index, (c, start, n_bytes) in task.answers.items():
        tokens = task.sequences[index][c][0]
        assert gpt2.decode(tokens[start:]) == " " + task.golds[index] * "xyzw" + (1 - task.golds[index]) * "ab"
        assert n_bytes == len(gpt2.decode(tokens[start:]).encode())


def test_answers_cut_to_nothing_are_one_line(tmp_path):
    # block_size 1 keeps only each sequence's end-of-text token: no answer byte to divide by
    bundle = write_bundle(
        tmp_path, [dict(label="lm", kind="language_modeling", items=[dict(context="Q", continuation="ab")])]
    )
    with pytest.raises(
        DataError, match=r"^task lm: its right answers keep 0 bytes .*; score a model of a longer block_size$"
    ):
        evaluate(bigram(("ab", 3.0)), bundle, block_size=1)
    assert evaluate(bigram(("ab", 3.0)), bundle, block_size=2)["tasks"]["lm"]["bits_per_byte"] > 0


def test_long_sequences_lose_their_oldest_tokens_and_are_counted(tmp_path):
    # 2-shot prompts far beyond block_size 12: the scored choice stays, the examples go first
    items = [dict(query=f"question number {i}", choices=["ab", "xyzw"], gold=1) for i in range(3)]
    bundle = write_bundle(tmp_path, [dict(label="mc", kind="multiple_choice", items=items, fewshot=2)])
    task = encoded(bundle, 12)
    assert task.truncated == 6
    full = encoded(bundle)
    for cut_item, full_item in zip(task.sequences.values(), full.sequences.values()):
        for (tokens, start, end), (all_tokens, all_start, all_end) in zip(cut_item, full_item):
            assert len(tokens) == 12 and tokens == all_tokens[-12:]  # cut from the left
            assert tokens[start:end] == all_tokens[all_start:all_end]  # the same scored tokens
    model = bigram(("xy", 3.0), ("yz", 3.0), ("zw", 3.0))  # a bigram model reads one token back: the same answers
    assert evaluate(model, bundle, block_size=12)["truncated"] == 6
    assert evaluate(model, bundle, block_size=12)["tasks"] == evaluate(model, bundle)["tasks"]


def test_a_padded_batch_scores_each_row_as_alone():
    torch.manual_seed(0)
    gpt = GPT(GPTConfig(n_layer=2, n_head=2, n_embd=32, block_size=32, vocab_size=257)).eval()
    rows = [
        (0, 0, [EOT, 1, 2, 3, 4, 5, 6, 7, 8, 9], 3, 10, 1),
        (0, 1, [EOT, 1, 2, 9], 2, 4, None),
        (1, 0, [EOT, 5, 5], 1, 3, 2),
    ]
    with torch.no_grad():
        together = downstream.forward_batch(gpt, rows, "cpu", nullcontext())
        alone = [downstream.forward_batch(gpt, [row], "cpu", nullcontext()) for row in rows]
        assert together[0] == pytest.approx([a[0][0] for a in alone], rel=1e-5)
        assert together[1] == [a[1][0] for a in alone]
        assert together[2][1] is None and together[2][::2] == pytest.approx([a[2][0] for a in alone][::2], rel=1e-5)
        x = torch.tensor([rows[0][2]])  # the reference: the mean of the scored tokens' losses, one sequence
        token_losses = F.cross_entropy(gpt(x, x)[0][0, :9], x[0, 1:10], reduction="none")
    assert together[0][0] == pytest.approx(token_losses[2:].mean().item(), rel=1e-5)
    assert together[2][0] == pytest.approx(token_losses.sum().item(), rel=1e-5)  # the answer from token 1 on


def test_batch_size_does_not_change_the_result(tmp_path):
    torch.manual_seed(0)
    gpt = GPT(GPTConfig(n_layer=1, n_head=2, n_embd=16, block_size=64, vocab_size=257))
    bundle = write_bundle(tmp_path, mixed_tasks())
    assert evaluate(gpt, bundle, batch_tokens=1) == evaluate(gpt, bundle, batch_tokens=10**6)
    assert gpt.training  # the model's mode is restored


def mixed_tasks(n=7):
    """One small task of each type, items of varied lengths and answers."""
    return [
        dict(
            label="mc",
            kind="multiple_choice",
            fewshot=1,
            delimiter="\nA: ",
            items=[
                dict(query="q" * (1 + i), choices=["yes", "no", "maybe"][: 2 + i % 2], gold=i % 2) for i in range(n)
            ],
        ),
        dict(
            label="schema",
            kind="schema",
            fewshot=2,
            items=[dict(context_options=[f"a{i}", "bb" * i], continuation=" ends", gold=i % 2) for i in range(n)],
        ),
        dict(
            label="lm",
            kind="language_modeling",
            fewshot=1,
            items=[dict(context=f"say {i}", continuation=f" {i % 3}") for i in range(n)],
        ),
    ]


# -----------------------------------------------------------------------------
# ranks


def rank_worker(rank, bundle, rendezvous, out):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{rendezvous}", rank=rank, world_size=2)
    try:
        model = bigram(("xy", 3.0), ("a ", 2.0), ("es", 1.0))
        scores = evaluate(model, bundle, rank=rank, world=2, batch_tokens=64)
        with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
            json.dump(dict(scores=scores, forwards=model.calls), f)
    finally:
        dist.destroy_process_group()


def test_two_ranks_equal_one_process(tmp_path):
    bundle = write_bundle(tmp_path / "bundle", mixed_tasks(n=7))  # 7 items: the ranks take 4 and 3
    # forked, not spawned: the ranks need not import torch again
    mp.start_processes(
        rank_worker, args=(bundle, str(tmp_path / "rendezvous"), str(tmp_path)), nprocs=2, start_method="fork"
    )
    model = bigram(("xy", 3.0), ("a ", 2.0), ("es", 1.0))
    single = evaluate(model, bundle, batch_tokens=64)
    ranks = []
    for rank in (0, 1):
        with open(tmp_path / f"rank{rank}.json") as f:
            ranks.append(json.load(f))
    assert ranks[0]["scores"] == ranks[1]["scores"] == single
    # as many forwards on each rank (an FSDP forward is collective), though rank 1 has fewer items
    assert ranks[0]["forwards"] == ranks[1]["forwards"] and ranks[0]["forwards"] < model.calls
    assert 0 < sum(t["correct"] for t in single["tasks"].values()) < 21  # not all wrong, not all right


# -----------------------------------------------------------------------------
# bad bundles


def test_bad_bundles_are_one_line_naming_the_file(tmp_path):
    good = [dict(label="mc", kind="multiple_choice", items=[dict(query="q", choices=["a", "b"], gold=0)] * 3)]

    def bundle(tasks=good):
        return write_bundle(tmp_path / f"b{len(os.listdir(tmp_path))}", tasks)

    def refused(folder, match):
        with pytest.raises(DataError, match=match) as err:
            downstream.load_bundle(folder)
        assert "\n" not in str(err.value)

    folder = bundle()
    os.remove(os.path.join(folder, "eval_data", "group", "mc.jsonl"))
    refused(folder, r"task file .*group/mc.jsonl does not exist; restore the bundle")
    folder = bundle()
    with open(os.path.join(folder, "eval_data", "group", "mc.jsonl"), "a") as f:
        f.write('{"query": \n')
    refused(folder, r"group/mc.jsonl line 4 is not JSON")
    folder = bundle([dict(good[0], items=good[0]["items"] + [dict(query="q", choices=["a", "b"], gold=2)])])
    refused(folder, r"group/mc.jsonl line 4 is not a multiple_choice item: it needs query")
    refused(
        bundle([dict(good[0], kind="question_answering")]),
        r"core.yaml: task 1 \(mc\): unknown icl_task_type 'question_answering'",
    )
    folder = bundle()
    with open(os.path.join(folder, "eval_meta_data.csv"), "w") as f:
        f.write("Eval Task,Random baseline\nother,25\n")
    refused(folder, r"eval_meta_data.csv has no random baseline for task 'mc'")
    with open(os.path.join(folder, "eval_meta_data.csv"), "w") as f:
        f.write("Eval Task,Random baseline\nmc,100\n")
    refused(folder, r"eval_meta_data.csv line 2: the random baseline of mc must be a percent")
    refused(bundle([dict(good[0], fewshot=3)]), r"mc asks for 3 few-shot examples but holds 3 items")
    refused(
        bundle([dict(good[0], delimiter="\ud800")]),
        r"task 1 \(mc\): continuation_delimiter holds a lone surrogate escape",
    )
    for line, match in [
        ("[" * 100_000 + "\n", r"group/mc.jsonl line 4 is nested too deeply to be a task item"),
        (
            '{"query": "q\\ud800", "choices": ["a", "b"], "gold": 0}\n',
            r"group/mc.jsonl line 4 holds a lone surrogate escape",
        ),
    ]:
        folder = bundle()
        with open(os.path.join(folder, "eval_data", "group", "mc.jsonl"), "a") as f:
            f.write(line)
        refused(folder, match)
    folder = bundle()
    os.remove(os.path.join(folder, "core.yaml"))
    refused(folder, r"core.yaml does not exist; get the CORE bundle with python downstream.py --download")


def test_task_lines_split_at_line_ends_only(tmp_path):
    items = [dict(context="a\u2028b\u0085c", continuation=" d")] * 2  # line separators inside a JSON string
    bundle = write_bundle(tmp_path, [dict(label="lm", kind="language_modeling", items=items)])
    with open(os.path.join(bundle, "eval_data", "group", "lm.jsonl"), "w", encoding="utf-8") as f:
        f.writelines(json.dumps(item, ensure_ascii=False) + "\n" for item in items)
    assert downstream.load_bundle(bundle).tasks[0].items == items


def test_bundle_sha256_covers_every_file_and_its_name(tmp_path):
    a = write_bundle(tmp_path / "a", mixed_tasks())
    b = shutil.copytree(a, tmp_path / "b")
    assert downstream.bundle_sha256(a) == downstream.bundle_sha256(b) == downstream.load_bundle(a).sha256
    with open(os.path.join(b, "eval_data", "group", "lm.jsonl"), "a") as f:
        f.write("\n")  # one blank line more: the same items, another bundle
    assert downstream.bundle_sha256(b) != downstream.bundle_sha256(a)
    c = shutil.copytree(a, tmp_path / "c")
    os.rename(os.path.join(c, "eval_data", "group"), os.path.join(c, "eval_data", "other"))
    assert downstream.bundle_sha256(c) != downstream.bundle_sha256(a)


# -----------------------------------------------------------------------------
# download


def zipped(source, path):
    with zipfile.ZipFile(path, "w") as z:
        for folder, _, names in os.walk(source):
            for name in names:
                full = os.path.join(folder, name)
                z.write(full, os.path.join("eval_bundle", os.path.relpath(full, source)))
    return path


def test_download_unpacks_once_and_offline_is_one_line(tmp_path, capsys):
    source = write_bundle(tmp_path / "source", mixed_tasks())
    url = "file://" + zipped(source, str(tmp_path / "eval_bundle.zip"))
    target = str(tmp_path / "data" / "eval_bundle")
    os.makedirs(tmp_path / "data")
    assert downstream.download(target, url) == downstream.bundle_sha256(source) == downstream.bundle_sha256(target)
    assert sorted(os.listdir(tmp_path / "data")) == ["eval_bundle"]  # no temporary left
    assert downstream.download(target, "file:///nowhere.zip") == downstream.bundle_sha256(source)  # there already
    assert "is there already" in capsys.readouterr().out

    elsewhere = str(tmp_path / "data" / "other")
    with pytest.raises(
        DataError,
        match=r"cannot download http://127.0.0.1:9/eval_bundle.zip \(.*\); without a "
        r"network, fetch .* elsewhere and unzip it so that .*/other/core.yaml exists",
    ):
        downstream.download(elsewhere, "http://127.0.0.1:9/eval_bundle.zip", timeout=5)
    (tmp_path / "junk.zip").write_text("not a zip")
    with pytest.raises(DataError, match=r"junk.zip is not a readable zip"):
        downstream.download(elsewhere, "file://" + str(tmp_path / "junk.zip"))
    os.remove(os.path.join(source, "eval_meta_data.csv"))  # a zip of a broken bundle never takes the name
    with pytest.raises(DataError, match=r"eval_meta_data.csv cannot be read"):
        downstream.download(elsewhere, "file://" + zipped(source, str(tmp_path / "broken.zip")))
    assert sorted(os.listdir(tmp_path / "data")) == ["eval_bundle"]


# -----------------------------------------------------------------------------
# the command line on cells


def save_cell(cell_dir, seed, step, vocab_size=257):
    """A cell as train.py leaves it (ckpt.pt, config.json, result.json), with an untrained tiny byte model."""
    config = GPTConfig(n_layer=1, n_head=2, n_embd=16, block_size=32, vocab_size=vocab_size)
    torch.manual_seed(seed)
    gpt = GPT(config)
    record = dict(
        arm="attnres", seed=seed, data_dir="data/shakespeare_bytes", tokenizer="bytes", model=dataclasses.asdict(config)
    )
    os.makedirs(cell_dir)
    write_checkpoint(cell_dir, gpt, record, step)
    for name, obj in (("config.json", record), ("result.json", dict(val_loss=1.0))):
        with open(os.path.join(cell_dir, name), "w") as f:
            json.dump(obj, f)
    return gpt


def test_cli_writes_downstream_json_into_every_cell(tmp_path):
    bundle = write_bundle(tmp_path / "bundle", mixed_tasks())
    models = {seed: save_cell(tmp_path / "out" / "attnres" / f"seed{seed}", seed, step=3 + seed) for seed in (0, 1)}
    result_before = (tmp_path / "out" / "attnres" / "seed0" / "result.json").read_bytes()
    downstream.main([str(tmp_path / "out"), f"--bundle={bundle}", "--max_per_task=5", "--device=cpu"])
    sha = downstream.bundle_sha256(bundle)
    for seed, gpt in models.items():
        cell = tmp_path / "out" / "attnres" / f"seed{seed}"
        with open(cell / "downstream.json") as f:
            got = json.load(f, parse_constant=lambda c: pytest.fail(f"{c} in strict JSON"))
        assert list(got) == [
            "bundle_sha256",
            "max_per_task",
            "scoring_code",
            "dtype",
            "step",
            "core",
            "bits_per_byte",
            "truncated",
            "tasks",
        ]
        assert (got["bundle_sha256"], got["max_per_task"], got["step"], got["dtype"]) == (sha, 5, 3 + seed, "float32")
        assert got["scoring_code"] == downstream.scoring_code()
        assert {k: got[k] for k in ("core", "bits_per_byte", "truncated", "tasks")} == evaluate(gpt, bundle, 32, 5)
        assert got["truncated"] > 0 and all(t["items"] == 5 for t in got["tasks"].values())
        assert sorted(os.listdir(cell)) == ["ckpt.pt", "config.json", "downstream.json", "result.json"]
    assert (tmp_path / "out" / "attnres" / "seed0" / "result.json").read_bytes() == result_before
    downstream.main([str(tmp_path / "out" / "attnres" / "seed1"), f"--bundle={bundle}", "--device=cpu"])  # one cell
    with open(tmp_path / "out" / "attnres" / "seed1" / "downstream.json") as f:
        assert json.load(f)["max_per_task"] is None


def test_the_cli_says_when_the_code_changed_since_the_cell_trained(tmp_path, capsys):
    bundle = write_bundle(tmp_path / "bundle", mixed_tasks())
    cell = tmp_path / "out" / "attnres" / "seed0"
    save_cell(cell, 0, step=3)  # its record holds no code: an earlier version's, compared as a whole
    downstream.main([str(cell), f"--bundle={bundle}", "--max_per_task=5", "--device=cpu"])
    assert f"note: the code differs from the one {cell} was trained with (all of it: " in capsys.readouterr().err
    ckpt = torch.load(cell / "ckpt.pt", weights_only=True)
    ckpt["config"]["code"] = records.code_record()  # today's: nothing to say
    torch.save(ckpt, cell / "ckpt.pt")
    downstream.main([str(cell), f"--bundle={bundle}", "--max_per_task=5", "--device=cpu"])
    assert "code differs" not in capsys.readouterr().err


@pytest.mark.parametrize(
    "name, code, message",
    [
        ("model.py", ("base=10000.0", "base=10001.0"), ("must be in [0, 1)", "must lie in [0, 1)")),
        (
            "downstream.py",
            ("SHUFFLE_SEED, FEWSHOT_SEED = 1337, 1234", "SHUFFLE_SEED, FEWSHOT_SEED = 1337, 1235"),
            ("holds no items", "has no items"),
        ),
        (
            "data/shards.py",
            ("vocab_size, eot = 257, 256", "vocab_size, eot = 257, 255"),
            ("restore it from git", "restore it"),
        ),
        (
            "checkpoint.py",
            ('map_location=device, weights_only=True', 'map_location=device, weights_only=False'),
            ("use the code that trained it", "use other code"),
        ),
    ],
)
def test_the_scoring_code_covers_the_forward_weights_and_tokens_not_messages(
    tmp_path, monkeypatch, name, code, message
):
    # downstream.json's scoring_code: a change to what computes a score is another code, a reworded message is not
    for file in downstream.SCORING_FILES:
        os.makedirs(os.path.dirname(tmp_path / file), exist_ok=True)
        shutil.copyfile(os.path.join(ROOT, file), tmp_path / file)
    here = downstream.scoring_code()
    monkeypatch.setattr(downstream, "HERE", str(tmp_path))
    assert downstream.scoring_code() == here

    def edited(old, new):
        text = (tmp_path / name).read_text()
        assert text.count(old) == 1, old
        (tmp_path / name).write_text(text.replace(old, new))
        return downstream.scoring_code()

    assert edited(*message) == here
    assert edited(*code) != here


def test_cli_refusals_are_one_line(tmp_path):
    bundle = write_bundle(tmp_path / "bundle", mixed_tasks())
    save_cell(tmp_path / "out" / "attnres" / "seed0", 0, step=2)
    os.makedirs(tmp_path / "out" / "attnres" / "seed1")  # begun, no checkpoint yet
    proc = subprocess.run(
        [sys.executable, "downstream.py", str(tmp_path / "out"), f"--bundle={bundle}"],
        cwd=ROOT,
        env=ENV,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 1 and proc.stderr.count("\n") == 1, proc.stderr
    assert proc.stderr.startswith("error: 1 cell(s) have no ckpt.pt yet") and "seed1" in proc.stderr
    assert not os.path.exists(tmp_path / "out" / "attnres" / "seed0" / "downstream.json")
    with pytest.raises(DataError, match=r"nowhere/core.yaml does not exist; get the CORE bundle"):
        downstream.main([str(tmp_path / "out" / "attnres" / "seed0"), f"--bundle={tmp_path / 'nowhere'}"])
    small = tmp_path / "small" / "seed0"
    save_cell(small, 0, step=1, vocab_size=64)
    with pytest.raises(DataError, match=r"vocab_size 64 is below its tokenizer's 257; it cannot read text"):
        downstream.main([str(small), f"--bundle={bundle}"])
    with pytest.raises(SystemExit, match=r"--max_per_task=0 must be >= 1"):
        downstream.main([str(tmp_path / "out"), "--max_per_task=0"])


# -----------------------------------------------------------------------------
# during training: train.py's downstream_bundle, downstream_interval, downstream_max_per_task


@pytest.fixture(scope="module")
def byte_shards(tmp_path_factory):
    """A byte-token corpus without a manifest (a model on it reads the tasks' text): validation and train shards."""
    d = tmp_path_factory.mktemp("bytes")
    text = np.frombuffer(b"say 1 or say 2; the answer: yes, no, maybe. " * 800, dtype=np.uint8)
    write_shard(str(d / "val_000000.bin"), text[:3000], tokenizer="bytes")
    write_shard(str(d / "train_000001.bin"), text[3000:], tokenizer="bytes")
    return str(d)


def with_core(shards, out_dir, bundle, *extra):
    """train.py's arguments for a tiny byte-token grid (both arms, 8 steps) evaluated on bundle's first 5 items
    a task."""
    return tiny(
        shards,
        out_dir,
        "--vocab_size=320",
        "--arms=attnres,rd_attnres",
        f"--downstream_bundle={bundle}",
        "--downstream_max_per_task=5",
        *extra,
    )


@pytest.fixture(scope="module")
def core_grid(byte_shards, tmp_path_factory):
    """(out_dir, bundle) of a grid trained with the CORE tasks every 4 steps, report included."""
    root = tmp_path_factory.mktemp("core")
    bundle = write_bundle(root / "bundle", mixed_tasks())
    train.main(with_core(byte_shards, root / "out", bundle, "--downstream_interval=4"))
    return root / "out", bundle


def read(path):
    with open(path) as f:
        return json.load(f, parse_constant=lambda c: pytest.fail(f"{c} in strict JSON"))


@pytest.mark.parametrize("arm", ["attnres", "rd_attnres"])
def test_training_writes_the_downstream_json_the_cli_computes(core_grid, arm, tmp_path):
    out, bundle = core_grid
    cell = tmp_path / arm
    shutil.copytree(out / arm / "seed0", cell)
    got = read(cell / "downstream.json")
    assert list(got) == [
        "bundle_sha256",
        "max_per_task",
        "scoring_code",
        "dtype",
        "step",
        "core",
        "bits_per_byte",
        "truncated",
        "tasks",
    ]
    assert (got["bundle_sha256"], got["max_per_task"], got["step"]) == (downstream.bundle_sha256(bundle), 5, 8)
    assert read(cell / "result.json")["steps"] == 8 and all(t["items"] == 5 for t in got["tasks"].values())
    # logged at every downstream_interval after step 0 and at the end, the last one as written
    logged = [r for r in log_records(out, arm) if "core" in r]
    assert [r["step"] for r in logged] == [4, 8] and logged[-1]["core"] == got["core"]
    assert logged[-1]["centered"] == {label: t["centered"] for label, t in got["tasks"].items()}
    assert logged[-1]["bits_per_byte"] == got["bits_per_byte"]
    assert logged[-1]["task_bits_per_byte"] == {label: t["bits_per_byte"] for label, t in got["tasks"].items()}
    # the command line on the cell's checkpoint (the last step's weights), in other batches: the same file
    os.remove(cell / "downstream.json")
    downstream.main([str(cell), f"--bundle={bundle}", "--max_per_task=5", "--device=cpu"])
    assert read(cell / "downstream.json") == got


def test_the_downstream_evaluation_changes_no_training_and_the_report_pairs_it(
    core_grid, byte_shards, tmp_path, monkeypatch, capsys
):
    out, bundle = core_grid
    off = tiny(byte_shards, tmp_path / "off", "--vocab_size=320", "--arms=attnres,rd_attnres")
    train.main(off)
    monkeypatch.setattr(cells, "GPT", lambda *a: pytest.fail("a rerun with downstream settings trained"))
    capsys.readouterr()
    train.main(off + [f"--downstream_bundle={bundle}", "--downstream_interval=4"])  # not a change: the grid goes on
    monkeypatch.undo()
    cell = tmp_path / "off" / "attnres" / "seed0"  # finished without it: said, with the command that adds it
    said = capsys.readouterr().out
    assert f"has no downstream.json: python downstream.py {cell} --bundle={bundle} --max_per_task=500" in said
    for arm in ("attnres", "rd_attnres"):
        on = [r for r in log_records(out, arm) if "core" not in r]
        assert without_timings(on) == without_timings(log_records(tmp_path / "off", arm))
        assert result(out, arm)["pairing"] == result(tmp_path / "off", arm)["pairing"]
        assert not os.path.exists(tmp_path / "off" / arm / "seed0" / "downstream.json")
    report = (out / "report.md").read_text()
    assert "CORE per cell" in report and "unreadable downstream.json" not in report


def test_downstream_max_per_task_0_scores_every_item_and_the_report_takes_it(byte_shards, tmp_path):
    # the edge value of the setting (issue #41: 0 once reached downstream.json as 0, which the report refused)
    bundle = write_bundle(tmp_path / "bundle", mixed_tasks())  # 7 items a task
    out = tmp_path / "o"
    train.main(
        with_core(
            byte_shards,
            out,
            bundle,
            "--downstream_max_per_task=0",
            "--max_iters=2",
            "--eval_interval=2",
            "--arms=attnres",
        )
    )
    got = read(out / "attnres" / "seed0" / "downstream.json")
    assert got["max_per_task"] is None and [t["items"] for t in got["tasks"].values()] == [7, 7, 7]
    report = (out / "report.md").read_text()
    assert "CORE per cell" in report and "unreadable downstream.json" not in report


def test_a_killed_cell_writes_downstream_json_when_it_resumes_to_the_end(core_grid, byte_shards, tmp_path, monkeypatch):
    out, bundle = core_grid
    args = with_core(byte_shards, tmp_path / "o", bundle, "--downstream_interval=4", "--arms=attnres")
    cell, whole = tmp_path / "o" / "attnres" / "seed0", read(out / "attnres" / "seed0" / "downstream.json")
    killed_at_step(6, monkeypatch, args)  # after step 4's checkpoint and CORE evaluation
    assert not os.path.exists(cell / "downstream.json")
    train.main(args)
    assert read(cell / "downstream.json") == whole
    # the resumed log redoes step 4's evaluations: it equals the uninterrupted one, CORE records included
    assert without_timings(log_records(tmp_path / "o", "attnres")) == without_timings(log_records(out, "attnres"))
    # killed once its last checkpoint and downstream.json are written, before result.json: done again on resume
    os.remove(cell / "result.json")
    os.remove(cell / "downstream.json")
    train.main(args)
    assert read(cell / "downstream.json") == whole and read(cell / "result.json")["steps"] == 8


def test_two_ranks_sharded_write_what_one_process_computes(byte_shards, tmp_path):
    bundle = write_bundle(tmp_path / "bundle", mixed_tasks())  # 5 items a task: the ranks take 3 and 2
    args = with_core(byte_shards, tmp_path / "o", bundle, "--arms=rd_attnres", "--batch_size=8", "--fsdp=True")
    proc = torchrun("train.py", args)
    assert proc.returncode == 0, proc.stderr[-2000:]
    cell = tmp_path / "o" / "rd_attnres" / "seed0"
    sharded = read(cell / "downstream.json")
    assert sharded["step"] == 8 and all(t["items"] == 5 for t in sharded["tasks"].values())
    os.remove(cell / "downstream.json")
    downstream.main([str(cell), f"--bundle={bundle}", "--max_per_task=5", "--device=cpu"])
    assert read(cell / "downstream.json") == sharded


def test_bad_downstream_settings_are_one_line(byte_shards, tmp_path):
    base = dict(train.DEFAULTS, vocab_size=320, tokenizer="bytes")
    bundle = write_bundle(tmp_path / "bundle", mixed_tasks())
    for override, message in [
        (
            dict(downstream_interval=10),
            "downstream_interval=10 must be 0 (each cell's last step only) or a multiple of eval_interval=25",
        ),
        (dict(downstream_interval=-25), "downstream_interval=-25 must be 0"),
        (dict(downstream_max_per_task=-1), "downstream_max_per_task=-1 must be at least 1, or 0 for every item"),
        (
            dict(downstream_bundle=str(tmp_path / "nowhere")),
            "nowhere holds no core.yaml; get the CORE bundle with python downstream.py --download --bundle=",
        ),
        (
            dict(downstream_bundle=bundle, tokenizer="gpt2"),
            "vocab_size=320 is below the 50257 ids of the data's gpt2 tokenizer",
        ),
    ]:
        with pytest.raises(ConfigError) as e:
            records.check_config(dict(base, **override), 1)
        assert message in str(e.value) and "\n" not in str(e.value)
    records.check_config(dict(base, downstream_bundle=bundle, downstream_interval=50, downstream_max_per_task=0), 1)
    with open(os.path.join(bundle, "eval_data", "group", "lm.jsonl"), "a") as f:
        f.write("{not json\n")
    proc = subprocess.run(
        [sys.executable, "train.py", *with_core(byte_shards, tmp_path / "o", bundle)],
        cwd=ROOT,
        env=ENV,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 1 and proc.stderr.count("\n") == 1, proc.stderr[-2000:]
    assert proc.stderr.startswith("error: ") and "lm.jsonl line 8 is not JSON" in proc.stderr
    assert not os.path.exists(tmp_path / "o")  # before anything is written
    for line, match in [
        ("[" * 100_000, "line 8 is nested too deeply"),
        ('{"context": "\\udfff", "continuation": "x"}', "line 8 holds a lone surrogate escape"),
    ]:
        bad = write_bundle(tmp_path / f"bad{len(match)}", mixed_tasks())
        with open(os.path.join(bad, "eval_data", "group", "lm.jsonl"), "a") as f:
            f.write(line + "\n")
        with pytest.raises(DataError, match=match):
            train.main(with_core(byte_shards, tmp_path / "o", bad))
        assert not os.path.exists(tmp_path / "o")
    with pytest.raises(DataError, match=r"max_per_task=1 leaves too few items for mc's 1 few-shot examples"):
        train.main(with_core(byte_shards, tmp_path / "o", bundle, "--downstream_max_per_task=1"))
    assert not os.path.exists(tmp_path / "o")
