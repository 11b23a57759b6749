"""
export.py, a cell as a Hugging Face model folder: transformers loads it for every scheme (dense and
MoE) with logits equal to model.py's in fp32, its tokenizers give the project's token ids, bad
input is one line; and lm-evaluation-harness, run offline on a local task, computes the
log-likelihoods the project's own scorer does. Needs requirements-extras.txt (make test installs it).

$ python -m pytest tests/test_export.py -q
"""

import dataclasses
import json
import os
import signal
import socket
import subprocess
import sys

import pytest
import torch

pytest.importorskip("transformers", reason="the export's extras: pip install -r requirements-extras.txt")
from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: E402

import downstream  # noqa: E402
import export  # noqa: E402
from common import DataError, UserError  # noqa: E402
from helpers import ROOT, TINY, randomize_routing, write_checkpoint  # noqa: E402
from data.shards import get_tokenizer  # noqa: E402
import model  # noqa: E402
import records  # noqa: E402
from model import GPT, RESIDUALS, GPTConfig  # noqa: E402

torch.set_num_threads(1)
# every scheme model.py defines, at its defaults, and the sparse MoE MLP (under a routed scheme, its balancing
# biases moved); a scheme registered from elsewhere (the README's example, in conftest) is refused
IN_MODEL_PY = [name for name, scheme in RESIDUALS.items() if scheme in vars(model).values()]
EXPORTED = {name: dict(residual=name) for name in IN_MODEL_PY} | {"moe": dict(residual="attnres", n_experts=4)}
CODE = records.code_record()  # the code the cells of these tests were trained with: today's


def write_cell(folder, seed=0, tokenizer="bytes", code=CODE, **overrides):
    """A cell as train.py leaves it (ckpt.pt), its routing and MoE biases away from their init: the GPT."""
    config = GPTConfig(**{**TINY, "vocab_size": 320, **overrides})
    torch.manual_seed(seed)
    gpt = GPT(config)
    randomize_routing(gpt)
    for moe in gpt.moes().values():
        moe.expert_bias.copy_(torch.randn(moe.expert_bias.shape))
    record = dict(
        arm=config.residual,
        seed=seed,
        data_dir="data/x",
        tokenizer=tokenizer,
        model=dataclasses.asdict(config),
        code=code,
    )
    write_checkpoint(folder, gpt, record, step=7)
    return gpt.eval()


@pytest.mark.parametrize("variant", EXPORTED)
def test_transformers_loads_every_scheme_with_model_py_logits(tmp_path, variant):
    gpt = write_cell(tmp_path / "cell", **EXPORTED[variant])
    export.main([str(tmp_path / "cell"), f"--out={tmp_path / 'hf'}"])
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "hf", trust_remote_code=True).eval()
    assert type(loaded).__name__ == "NanodepthForCausalLM"
    assert dataclasses.asdict(loaded.gpt.config) == dataclasses.asdict(gpt.config)  # its own copy of model.py
    x = torch.randint(0, 320, (2, TINY["block_size"]), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert torch.equal(loaded(x).logits, gpt(x, x)[0]), f"{variant}: the export's logits differ from model.py's"
        # right padding is what a causal model's scored positions never see; left padding is refused
        mask = torch.ones_like(x)
        mask[1, -3:] = 0
        assert torch.equal(loaded(x, attention_mask=mask).logits, gpt(x, x)[0])
        with pytest.raises(ValueError, match="right padding only"):
            loaded(x, attention_mask=mask.flip(1))
        # greedy generation is model.py's greedy loop
        prompt, greedy = x[:1, :4], x[:1, :4]
        for _ in range(6):
            greedy = torch.cat([greedy, gpt(greedy)[0][:, -1].argmax(-1, keepdim=True)], 1)
        assert torch.equal(loaded.generate(prompt, max_new_tokens=6, do_sample=False), greedy)
        # and past block_size, sample.py's greedy tokens (GPT.generate at top_k=1): the context cropped the same way
        longer = TINY["block_size"] + 8
        torch.manual_seed(0)
        assert torch.equal(
            loaded.generate(prompt, max_new_tokens=longer, do_sample=False), gpt.generate(prompt, longer, top_k=1)
        )
        with pytest.raises(ValueError, match=f"^{longer} tokens are more than this model's block_size=16; give at"):
            loaded(torch.zeros(1, longer, dtype=torch.long))


@pytest.mark.parametrize("tokenizer", ["bytes", "gpt2"])
def test_the_folder_and_its_tokenizer(tmp_path, tokenizer, capsys):
    write_cell(tmp_path / "cell", tokenizer=tokenizer, **({"vocab_size": 50304} if tokenizer == "gpt2" else {}))
    out = tmp_path / "hf"
    export.main([str(tmp_path / "cell"), f"--out={out}"])
    assert f"step 7 -> {out} (standard, {tokenizer} tokens)" in capsys.readouterr().out
    assert sorted(os.listdir(out)) == [
        "config.json",
        "model.py",
        "model.safetensors",
        "modeling_nanodepth.py",
        "tokenizer.json",
        "tokenizer_config.json",
    ]
    assert sorted(os.listdir(tmp_path)) == ["cell", "hf"]  # no temporary left
    with open(out / "config.json") as f:
        config = json.load(f)
    assert config["nanodepth"] == dict(arm="standard", seed=0, step=7, tokenizer=tokenizer, code_changes=[])
    ours = get_tokenizer(tokenizer)
    assert config["bos_token_id"] == config["eos_token_id"] == ours.eot
    theirs = AutoTokenizer.from_pretrained(out, trust_remote_code=True)
    for text in [
        "ROMEO:\nBut soft!  What light",
        " caf\u00e9 \u4e2d\u6587 \U0001f600 ",
        "it's 12,345.6 -- ok",
        "\n\n\t x",
    ]:
        ids = theirs(text).input_ids
        assert ids == [ours.eot] + ours.encode(text).tolist(), (tokenizer, text)  # a new document, as in training
        assert theirs.decode(ids[1:]) == text
    assert theirs.model_max_length == TINY["block_size"]


def test_bad_exports_are_one_line(tmp_path):
    write_cell(tmp_path / "cell")
    (tmp_path / "taken").mkdir()
    with pytest.raises(UserError, match=r"taken exists; remove it or choose another --out"):
        export.main([str(tmp_path / "cell"), f"--out={tmp_path / 'taken'}"])
    write_cell(tmp_path / "small", vocab_size=96)
    with pytest.raises(DataError, match=r"vocab_size 96 is below its bytes tokenizer's 257 ids"):
        export.main([str(tmp_path / "small"), f"--out={tmp_path / 'o'}"])
    for name in set(RESIDUALS) - set(IN_MODEL_PY):
        write_cell(tmp_path / name, residual=name)
        with pytest.raises(UserError, match=rf"its scheme '{name}' is not defined in model.py .*; add it to model.py"):
            export.main([str(tmp_path / name), f"--out={tmp_path / 'o'}"])
    with pytest.raises(DataError, match=r"nowhere does not exist; give a cell folder"):
        export.main([str(tmp_path / "nowhere"), f"--out={tmp_path / 'o'}"])
    with pytest.raises(SystemExit, match=r"^error: the following arguments are required: --out; see python export.py"):
        export.main([str(tmp_path / "cell")])
    assert not os.path.exists(tmp_path / "o")


@pytest.mark.parametrize("out", ["", " "])
def test_an_empty_out_is_refused_and_nothing_is_written(tmp_path, monkeypatch, out):
    write_cell(tmp_path / "cell")
    (tmp_path / "cwd").mkdir()
    monkeypatch.chdir(tmp_path / "cwd")  # --out=$UNSET: the working directory replaced, or a folder in its parent
    with pytest.raises(UserError, match=r"^--out='\s*' is empty \(an unset variable\?\); give the folder to write"):
        export.main([str(tmp_path / "cell"), f"--out={out}"])
    assert sorted(os.listdir(tmp_path)) == ["cell", "cwd"] and os.listdir(tmp_path / "cwd") == []


def test_the_exported_models_loss_with_labels_is_the_projects_and_its_length_the_cells(tmp_path):
    """transformers' convention: labels are the input ids and the model shifts them (-100 ignored); tools such
    as lm-evaluation-harness read the longest sequence from max_position_embeddings."""
    gpt = write_cell(tmp_path / "cell", residual="rd_attnres", block_size=24)
    export.main([str(tmp_path / "cell"), f"--out={tmp_path / 'hf'}"])
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "hf", trust_remote_code=True).eval()
    assert loaded.config.max_position_embeddings == 24, "lm-eval would cut or pad to another length than the cell's"
    x = torch.randint(0, 320, (2, 24), generator=torch.Generator().manual_seed(2))
    labels = x.clone()
    labels[1, -5:] = -100  # right padding, ignored
    targets = labels[:, 1:].masked_fill(labels[:, 1:] == -100, -1)  # the project's ignored target is -1
    with torch.no_grad():
        ours = gpt(x[:, :-1], targets)[1]
        theirs = loaded(x, labels=labels).loss
    assert torch.allclose(theirs, ours, rtol=1e-6, atol=1e-6), f"loss with labels= {theirs} is not the cell's {ours}"


def test_code_changed_since_training_is_refused_or_recorded(tmp_path):
    """The folder carries today's model.py: a cell whose scheme's code changed since it trained exports
    other logits than it computed, so export refuses it, or records the changes under --allow_changes=True."""
    old = dict(
        CODE, definitions=dict(CODE["definitions"], GPT="0" * 16, DualAttnRes="0" * 16), git_commit="abcdef1234567890"
    )
    write_cell(tmp_path / "cell", residual="attnres", code=old)
    with pytest.raises(
        UserError,
        match=r"cell: the code differs from the one the cell was trained with \(GPT\), so .*"
        r"trained with \(git commit abcdef123456\), or add --allow_changes=True",
    ):
        export.main([str(tmp_path / "cell"), f"--out={tmp_path / 'hf'}"])
    assert sorted(os.listdir(tmp_path)) == ["cell"]
    export.main([str(tmp_path / "cell"), f"--out={tmp_path / 'hf'}", "--allow_changes=True"])
    with open(tmp_path / "hf" / "config.json") as f:
        assert json.load(f)["nanodepth"]["code_changes"] == ["GPT"]  # not DualAttnRes: dar's, not attnres's
    write_cell(
        tmp_path / "dar", residual="dar", code=dict(old, definitions=dict(CODE["definitions"], DualAttnRes="0" * 16))
    )
    with pytest.raises(UserError, match=r"trained with \(DualAttnRes\)"):
        export.main([str(tmp_path / "dar"), f"--out={tmp_path / 'hf2'}"])


def test_a_killed_export_leaves_no_temporary(tmp_path):
    """SIGTERM mid-write removes the temporary folder before the process dies of it; one a SIGKILL left
    (its writer gone) the next export removes."""
    write_cell(tmp_path / "cell")
    out = tmp_path / "hf"
    killed = subprocess.run(
        [
            sys.executable,
            "-c",
            f"""import os, signal, sys
sys.path.insert(0, {ROOT!r})
import export
export.hf_tokenizer = lambda *args: os.kill(os.getpid(), signal.SIGTERM)  # after the weights are written
export.export({str(tmp_path / "cell")!r}, {str(out)!r})""",
        ],
        capture_output=True,
        text=True,
        timeout=300,
        env=dict(os.environ, OMP_NUM_THREADS="1"),
    )
    assert killed.returncode == -signal.SIGTERM, killed.stderr
    assert sorted(os.listdir(tmp_path)) == ["cell"]
    stale = tmp_path / f"hf.999999999.{socket.gethostname()}.tmp"  # no process has that pid
    stale.mkdir()
    (stale / "model.safetensors").write_bytes(b"half")
    export.main([str(tmp_path / "cell"), f"--out={out}"])
    assert sorted(os.listdir(tmp_path)) == ["cell", "hf"]


LOCAL_TASKS = {
    "nanodepth_mc": """output_type: multiple_choice
doc_to_text: "{{query}}"
doc_to_choice: "{{choices}}"
doc_to_target: "{{gold}}"
target_delimiter: " "
""",
    "nanodepth_lm": """output_type: loglikelihood
doc_to_text: "{{context}}"
doc_to_target: "{{continuation}}"
target_delimiter: ""
""",
}


def test_lm_eval_on_a_local_task_computes_the_projects_log_likelihoods(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    lm_eval = pytest.importorskip("lm_eval", reason="pip install -r requirements-extras.txt")
    from lm_eval.tasks import TaskManager

    gpt = write_cell(tmp_path / "cell", residual="rd_attnres", block_size=64)
    export.main([str(tmp_path / "cell"), f"--out={tmp_path / 'hf'}"])
    items = dict(
        nanodepth_mc=[
            dict(query=f"Question {i}: is {i} odd?", choices=["yes", "no", "it is caf\u00e9"], gold=i % 2)
            for i in range(4)
        ],
        nanodepth_lm=[dict(context=f"Count: {i}, {i + 1},", continuation=f" {i + 2}") for i in range(4)],
    )
    for name, spec in LOCAL_TASKS.items():  # a task of lm-evaluation-harness: a yaml naming a local jsonl
        with open(tmp_path / f"{name}.jsonl", "w") as f:
            f.writelines(json.dumps(item) + "\n" for item in items[name])
        (tmp_path / f"{name}.yaml").write_text(
            f"task: {name}\ndataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {tmp_path / name}.jsonl\n"
            f"  cache_dir: {tmp_path / 'cache'}\ntest_split: test\n{spec}"
        )
    out = lm_eval.simple_evaluate(
        model="hf",
        model_args=f"pretrained={tmp_path / 'hf'},trust_remote_code=True,dtype=float32",
        tasks=list(LOCAL_TASKS),
        task_manager=TaskManager(include_path=str(tmp_path), include_defaults=False),
        log_samples=True,
        device="cpu",
        batch_size=3,
    )
    bytes_ = get_tokenizer("bytes")
    compared = 0
    for name in LOCAL_TASKS:
        for sample in out["samples"][name]:
            for (context, continuation), [(log_likelihood, is_greedy)] in zip(sample["arguments"], sample["resps"]):
                # the project's own: downstream.py's forward over the end-of-text token, context and
                # continuation, the continuation's summed loss (what bits per byte divides)
                tokens = [bytes_.eot] + bytes_.encode(context + continuation).tolist()
                start = 1 + len(context.encode())
                _, greedy, (loss,) = downstream.forward_batch(
                    gpt, [(0, 0, tokens, start, len(tokens), start)], "cpu", torch.no_grad()
                )
                assert log_likelihood == pytest.approx(-loss, rel=1e-5, abs=1e-5), (name, context, continuation)
                assert is_greedy == greedy[0]
                compared += 1
    assert compared == 4 * 3 + 4
