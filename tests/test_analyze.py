"""
analyze.py: interventions and representations of a trained cell, every number recomputed by hand from
the model, on cells train.py itself trains; bad cells and read-only folders are one line before any work.

    OMP_NUM_THREADS=1 .venv/bin/python -m pytest tests/test_analyze.py -q -p no:cacheprovider
"""

import json
import os
import re
import shutil
import subprocess
import sys
from contextlib import nullcontext
from types import SimpleNamespace

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import analyze
import common
import machine
import records
import train
from common import ConfigError, DataError
from data.shards import write_shard
from model import GPT, RESIDUALS, GPTConfig

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
torch.set_num_threads(1)  # tiny models: threads only contend with each other on a shared machine
TINY = dict(n_layer=2, n_head=2, n_embd=32, block_size=16, vocab_size=64)
VARIANTS = {name: dict(residual=name) for name in RESIDUALS} | {
    "attnres_full": dict(residual="attnres", attnres_block_size=1)
}
CPU = machine.Runtime(
    world=1, rank=0, local_rank=0, device="cpu", dtype="float32", autocast=nullcontext(), peak_flops=None, fsdp=False
)
EVAL = SimpleNamespace(block_size=16, eval_tokens=400, eval_batch_size=8)


@pytest.fixture(scope="module")
def stream():
    rng = np.random.default_rng(0)  # a learnable stream: a repeating pattern with noise, tokens < 64
    return (np.arange(40_000) % 17 + rng.integers(0, 3, 40_000)).astype(np.uint16)


@pytest.fixture(scope="module")
def val_rows(stream):
    """The fixed validation set of EVAL on the stream: its first eval_tokens as sequences (eval_layout 'first')."""
    return records.ValidationText(stream, None).rows(EVAL.eval_tokens, EVAL.block_size, "first")


def make(variant, seed=0):
    torch.manual_seed(seed)
    return GPT(GPTConfig(**TINY, **VARIANTS[variant]))


def test_effective_sources_and_cosine_matrices(val_rows):
    model = make("attnres_full")  # uniform weights at init: S effective sources at every read
    rep = analyze.representations(model, val_rows, EVAL, CPU)
    for name, w in rep["weights"].items():
        assert abs(rep["effective_sources"][name] - len(w)) < 1e-4
    with torch.no_grad():
        for p in (model.residual.query, model.residual.key_gain):
            p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(1)))
    rep = analyze.representations(model, val_rows, EVAL, CPU)
    # mean over tokens of exp(H): between 1 and S, and at least exp of the mean entropy (Jensen)
    for name, w in rep["weights"].items():
        assert 1 - 1e-6 <= rep["effective_sources"][name] <= len(w) + 1e-6
        assert rep["effective_sources"][name] >= np.exp(rep["entropy"][name]) - 1e-6
    assert min(rep["effective_sources"].values()) < max(len(w) for w in rep["weights"].values()) - 0.1
    # the token-wise cosine of the output read's sources, by definition, averaged over the set
    cos = rep["source_cosine"]["out"]
    torch.testing.assert_close(cos, cos.T)
    torch.testing.assert_close(cos.diagonal(), torch.ones(len(cos)))
    assert cos.shape == (2 * TINY["n_layer"] + 1,) * 2 and cos.min() < 0.9
    x, _ = train.validation_batch(val_rows, range(len(val_rows)), "cpu")
    sources = []
    with torch.no_grad():  # the sources of Full AttnRes: the embedding and every sublayer output
        h = model.transformer.wte(x)
        sources.append(h)
        state = model.residual.start(h)
        for k in range(model.residual.n_sublayers):
            block = model.transformer.h[k // 2]
            out = (
                block.attention(*model.residual.read_attention(state, k))
                if k % 2 == 0
                else block.feedforward(model.residual.read(state, k))
            )
            state = model.residual.write(state, k, out)
            sources.append(out)
    unit = [s / s.norm(dim=-1, keepdim=True) for s in sources]
    expected = torch.tensor([[(a * b).sum(-1).mean().item() for b in unit] for a in unit])
    torch.testing.assert_close(cos, expected, atol=1e-5, rtol=1e-5)


@pytest.fixture(scope="module")
def grid(tmp_path_factory, stream):
    """One tiny trained cell of every variant, written by train.py itself."""
    d = tmp_path_factory.mktemp("analyze")
    write_shard(str(d / "val_000000.bin"), stream[:2000])
    write_shard(str(d / "train_000001.bin"), stream[2000:])
    out = str(d / "out")
    train.main(
        [
            f"--data_dir={d}",
            f"--out_dir={out}",
            "--n_layer=2",
            "--n_head=2",
            "--n_embd=32",
            "--block_size=16",
            "--vocab_size=64",
            "--batch_size=4",
            "--max_iters=8",
            "--eval_interval=8",
            "--eval_tokens=500",
            "--compile=False",
            "--seeds=0",
            "--warmup_iters=0",
            "--learning_rate=3e-2",
            "--device=cpu",
            "--arms={" + ", ".join(f"'{a}': {VARIANTS[a]!r}" for a in VARIANTS) + "}",
        ]
    )
    return out


@pytest.mark.parametrize("variant", VARIANTS)
def test_analyze_runs_on_a_trained_cell_of_every_variant(grid, variant, capsys):
    cell = os.path.join(grid, variant, "seed0")
    analyze.main([cell, "--device=cpu"])
    with open(os.path.join(cell, "analysis.json")) as f:
        a = json.load(f)
    with open(os.path.join(cell, "result.json")) as f:
        result = json.load(f)
    assert abs(a["base_nll"] - result["val_loss"]) < 1e-6 and a["recorded_val_loss"] == result["val_loss"]
    assert a["tokens"] == result["pairing"]["eval_tokens"] and a["step"] == 8 and not a["capped"]
    assert [tuple(r["change"]) for r in a["interventions"]] == make(variant).interventions(), (
        "analysis.json must list the scheme's interventions(), in order"
    )
    for r in a["interventions"]:  # trained routing: every change matters (DAR's streams part slowly: small deltas)
        assert r["delta"] != 0 and r["tokens"] == a["tokens"], (
            f"{variant}: intervention {r['change']} changes nothing on a trained cell; make it change the routing, "
            f"or leave it out of interventions()"
        )
    text = open(os.path.join(cell, "analysis.md")).read()
    assert f"{a['base_nll']:.4f}" in text and not [f for f in os.listdir(cell) if f.endswith(".tmp")]
    rep = a["representations"]
    recorded = any(v for group, v in rep.items() if group not in ("expert_load", "router_entropy"))
    assert ("lists no interventions and records no routing diagnostics" in text) == (
        not a["interventions"] and not recorded
    )
    matrices = [
        m
        for group in ("source_cosine", "stream_cosine")
        for m in rep.get(group, {}).values()
        if isinstance(m, list) and isinstance(m[0], list)
    ]  # the S x S ones (DAR's stream_cosine is per read)
    for m in matrices:
        assert np.allclose(m, np.transpose(m), atol=1e-4) and np.allclose(np.diagonal(m), 1, atol=1e-4), (
            f"{variant}: a recorded cosine matrix must be symmetric with a unit diagonal (cosines of the sources "
            f"with each other)"
        )
    for name, heads in rep.get("heads", {}).items():  # MHAR: each head's own read, not only their mean
        for h, w in enumerate(heads):
            row = f"| {name} | {h} | {rep['head_entropy'][name][h]:.3f} | {' '.join(f'{v:.2f}' for v in w)} |"
            assert row in text, f"{variant}: analysis.md must show head {h} of read {name}: {row}"
    # RD's second route: a QK/V divergence wherever a read has a value route
    assert bool(rep["qk_v_jsd"]) == any(name.startswith("attn_v.") for name in rep["weights"])
    assert os.path.exists(os.path.join(cell, "analysis_interventions.png")) == bool(a["interventions"])


def test_capped_tokens_are_recorded(grid):
    cell = os.path.join(grid, "rd_attnres", "seed0")
    analyze.main([cell, "--device=cpu", "--max_tokens=100"])
    with open(os.path.join(cell, "analysis.json")) as f:
        a = json.load(f)
    assert a["capped"] and a["tokens"] == 96 and a["recorded_val_loss"] is None
    assert all(r["tokens"] == 96 for r in a["interventions"])
    with pytest.raises(ConfigError, match="less than one sequence"):
        analyze.main([cell, "--device=cpu", "--max_tokens=10"])


def randomize(model, seed):
    """Random routing parameters (every residual.* tensor moved off its init), so every number is non-trivial."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.residual.parameters():
            p.add_(0.5 * torch.randn(p.shape, generator=g))
    return model


def nll_by_hand(model, x, y, change=None):
    """Mean cross-entropy (fp64) of the next tokens y, the model under `change`."""
    model.intervene(change)
    try:
        with torch.no_grad():
            logits = model.lm_head(model.hidden(x))
        return F.cross_entropy(logits.double().flatten(0, 1), y.flatten()).item()
    finally:
        model.intervene()


@pytest.mark.parametrize("variant", VARIANTS)
def test_intervention_nll_is_the_cross_entropy_under_the_change(variant, val_rows):
    model = randomize(make(variant), seed=1)
    if not model.interventions():
        pytest.skip(f"{variant} lists no interventions (ResidualScheme.interventions is optional): none to evaluate")
    base, rows = analyze.interventions(model, val_rows, EVAL, CPU)
    assert [change for change, _ in rows] == model.interventions()
    assert model.residual.intervention is None, "GPT.intervene() must switch every intervention off again"
    x, y = train.validation_batch(val_rows, range(len(val_rows)), "cpu")
    assert abs(base - nll_by_hand(model, x, y)) < 1e-6
    for change, nll in rows:
        assert abs(nll - nll_by_hand(model, x, y, change)) < 1e-6, change
    assert max(abs(nll - base) for _, nll in rows) > 5e-5, (  # 50 times the tolerance: a wrong sign or change fails
        f"{variant}: no intervention changes the loss with random routing parameters; make each change the routing"
    )


def final_state(model, x):
    """The scheme's state before the output read: GPT.hidden's loop, written out."""
    r = model.residual
    state = r.start(model.transformer.wte(x))
    for k in range(r.n_sublayers):
        block = model.transformer.h[k // 2]
        out = block.attention(*r.read_attention(state, k)) if k % 2 == 0 else block.feedforward(r.read(state, k))
        state = r.write(state, k, out)
    return state


def cosines(a, b):
    """Token-wise cosine of every source in a with every source in b, averaged over tokens."""
    return torch.tensor([[F.cosine_similarity(u, v, dim=-1).mean().item() for v in b] for u in a])


def depth_softmax(query, keys, eps):
    """A read's weights over its sources by their definition: softmax_i <q, k_i> / rms(k_i)."""
    logits = torch.stack([(k * query).sum(-1) / (k.pow(2).mean(-1) + eps).sqrt() for k in keys], -1)
    return logits.softmax(-1)


def close(reported, expected, what):
    """analysis.json keeps 6 significant digits."""
    torch.testing.assert_close(
        torch.tensor(reported, dtype=torch.float64), torch.as_tensor(expected).double(), rtol=2e-5, atol=2e-6, msg=what
    )


@pytest.mark.parametrize("variant", VARIANTS)
def test_analysis_json_recomputed_by_hand(grid, stream, variant, tmp_path):
    """Every number analyze.py writes, recomputed from the cell's model: a trained cell of the grid
    with random routing parameters, so that no number is its init value."""
    src, cell = os.path.join(grid, variant, "seed0"), str(tmp_path / "cell")
    os.makedirs(cell)
    for f in ("config.json", "result.json"):
        shutil.copy(os.path.join(src, f), cell)
    cfg = json.load(open(os.path.join(cell, "config.json")))
    model = GPT(GPTConfig(**cfg["model"]))
    ckpt = torch.load(os.path.join(src, "ckpt.pt"), weights_only=True)
    model.load_state_dict(ckpt["model"])
    randomize(model, seed=2)
    ckpt["model"] = model.state_dict()
    torch.save(ckpt, os.path.join(cell, "ckpt.pt"))
    analyze.main([cell, "--device=cpu"])
    a = json.load(open(os.path.join(cell, "analysis.json")))
    model.eval()
    val = records.ValidationText(stream[:2000], None).rows(cfg["eval_tokens"], 16, cfg["eval_layout"])
    x, y = train.validation_batch(val, range(len(val)), "cpu")
    base = nll_by_hand(model, x, y)
    assert abs(a["base_nll"] - base) < 1e-6
    for r in a["interventions"]:  # delta = NLL with the change - NLL without: positive when the change hurts
        assert abs(r["delta"] - (nll_by_hand(model, x, y, tuple(r["change"])) - base)) < 2e-6, r
    if a["interventions"]:  # 50 times the tolerance: a negated delta fails
        assert max(abs(r["delta"]) for r in a["interventions"]) > 1e-4
    rep, r = a["representations"], model.residual
    r.record = {}  # the per-token record of one pass over every sequence of the set
    with torch.no_grad():
        model.hidden(x)
        state = final_state(model, x)
    record, r.record = r.record, None
    weights = {k: w for k, w in record.items() if "/" not in k}
    assert set(rep["weights"]) == set(weights), "analysis.json reports a read's weights for every depth read noted"
    for name, w in weights.items():
        h = -(w * w.clamp_min(1e-30).log()).sum(-1)
        close(rep["weights"][name], w.mean((0, 1)), name)
        close(rep["entropy"][name], h.mean(), name)
        close(rep["effective_sources"][name], h.exp().mean(), name)  # the mean of exp(H), not exp of the mean
    for key, value in record.items():  # fusion, write_gate, mixing, stream_mixing, dwa: token averages
        if "/" in key and key.split("/")[0] not in ("source_cosine", "block_cosine", "stream_cosine"):
            group, name = key.split("/")
            close(rep[group][name], value.mean((0, 1)), key)
    for layer, jsd in rep["qk_v_jsd"].items():
        p, q = weights[f"attn.{layer}"], weights[f"attn_v.{layer}"]
        m = (p + q) / 2
        close(jsd, (0.5 * (p * (p / m).log()).sum(-1) + 0.5 * (q * (q / m).log()).sum(-1)).mean(), layer)
    assert bool(rep["qk_v_jsd"]) == any(name.startswith("attn_v.") for name in weights)
    # the sources of each scheme's cosine matrices, from its state: written out for the schemes of model.py
    if variant in ("hc", "mhc"):
        close(rep["stream_cosine"]["out"], cosines(state.H.unbind(-2), state.H.unbind(-2)), "streams")
    elif variant == "denseformer":
        close(rep["source_cosine"]["out"], cosines(state.outputs, state.outputs), "layer outputs")
    elif variant == "dar":
        n = r.n_sublayers
        for s in (0, 1):
            sources, keys = state[s].blocks, state[1 - s].blocks  # reciprocal: addressed by the other stream's keys
            close(rep["source_cosine"][f"out.s{s}"], cosines(sources, sources), f"out.s{s}")
            w = depth_softmax(r.query[n, s] * r.key_gain[n], keys, r.eps)
            close(rep["weights"][f"out.s{s}"], w.mean((0, 1)), f"out.s{s}")
            h = -(w * w.log()).sum(-1)
            close(a["dar"]["effective_sources"][s], h.exp().mean(), f"effective sources, stream {s}")
            c = cosines(sources, sources)
            close(
                a["dar"]["source_cosine_off_diagonal"][s], c[~torch.eye(len(c), dtype=torch.bool)].mean(), f"stream {s}"
            )
        close(rep["fusion"]["out"], r.fusion[n].softmax(-1), "fusion")
        block = cosines(state[0].blocks[1:], state[1].blocks[1:]).diagonal()
        close(rep["block_cosine"]["out"], block, "block cosine")
        close(a["dar"]["block_cosine"], block, "block cosine")
        delta = {tuple(d["change"]): d["delta"] for d in a["interventions"]}
        assert a["dar"]["own_keys"] == delta[("own_keys",)] and abs(delta[("own_keys",)]) > 1e-4
        assert a["dar"]["one_stream"] == [delta[("one_stream", 0)], delta[("one_stream", 1)]]
        assert a["dar"]["sources"] == len(state[0].blocks)
        text = open(os.path.join(cell, "analysis.md")).read()
        assert f"| one_stream delta NLL | {delta[('one_stream', 0)]:+.3g} | {delta[('one_stream', 1)]:+.3g} |" in text
    elif variant == "scaled_residual":  # no depth sources: its scales, every sublayer's, are token averages above
        assert rep["scales"] and set(rep["scales"]) == {k.split("/")[1] for k in record if k.startswith("scales/")}
        assert "source_cosine" not in rep
    elif variant in ("attnres", "attnres_full", "rd_attnres"):
        close(rep["source_cosine"]["out"], cosines(state.blocks, state.blocks), "sources")


def write(cell, name, text):
    with open(os.path.join(cell, name), "w") as f:
        f.write(text)


def edit_json(cell, name, edit):
    with open(os.path.join(cell, name)) as f:
        record = json.load(f)
    edit(record)
    write(cell, name, json.dumps(record))


def edit_ckpt(cell, edit):
    ckpt = torch.load(os.path.join(cell, "ckpt.pt"), weights_only=True)
    edit(ckpt)
    torch.save(ckpt, os.path.join(cell, "ckpt.pt"))


BAD_CELLS = {  # what is wrong with a copy of a good cell -> the one line that says so
    "torn config.json": (
        lambda c: write(c, "config.json", '{"model": {"n_layer": 2,'),
        "config.json is unreadable or damaged",
    ),
    "list config.json": (lambda c: write(c, "config.json", "[1, 2]"), "config.json holds list, not a train.py record"),
    "no dtype": (lambda c: edit_json(c, "config.json", lambda r: r.pop("dtype")), "(no dtype)"),
    "dtype a number": (
        lambda c: edit_json(c, "config.json", lambda r: r.update(dtype=32)),
        "dtype=32 is not of type str",
    ),
    "eval_tokens a string": (
        lambda c: edit_json(c, "config.json", lambda r: r.update(eval_tokens="500")),
        "eval_tokens='500' is not of type int",
    ),
    "eval_batch_size 0": (
        lambda c: edit_json(c, "config.json", lambda r: r.update(eval_batch_size=0)),
        "eval_batch_size=0 is not positive",
    ),
    "model without block_size": (
        lambda c: edit_json(c, "config.json", lambda r: r["model"].pop("block_size")),
        "model has no block_size",
    ),
    "model n_layer a string": (
        lambda c: edit_json(c, "config.json", lambda r: r["model"].update(n_layer="2")),
        "n_layer='2' must be a positive integer",
    ),
    "no ckpt.pt": (lambda c: os.remove(os.path.join(c, "ckpt.pt")), "ckpt.pt is missing"),
    "truncated ckpt.pt": (
        lambda c: write(c, "ckpt.pt", "PK\x03\x04 not a checkpoint"),
        "cannot be read as a checkpoint",
    ),
    "ckpt.pt without weights": (
        lambda c: edit_ckpt(c, lambda k: k.update(model=[1, 2])),
        "is not a train.py checkpoint (no model weights",
    ),
    "ckpt.pt missing a weight": (
        lambda c: edit_ckpt(c, lambda k: k["model"].pop("residual.query")),
        "does not fit this model.py",
    ),
    "ckpt.pt of another model": (
        lambda c: edit_ckpt(c, lambda k: k["config"]["model"].update(norm_eps=1e-5)),
        "holds another model than",
    ),
    "ckpt.pt diverged": (
        lambda c: edit_ckpt(c, lambda k: k["model"]["residual.query"].fill_(float("nan"))),
        "non-finite weights",
    ),
    "other validation tokens": (
        lambda c: edit_json(c, "config.json", lambda r: r.update(val_hash="0" * 64)),
        "are not the ones the cell was evaluated on",
    ),
    "torn result.json": (lambda c: write(c, "result.json", '{"val_loss": 2.4'), "result.json is unreadable or damaged"),
    "list result.json": (lambda c: write(c, "result.json", "[2.4]"), "result.json holds list, not a train.py record"),
    "val_loss a string": (
        lambda c: edit_json(c, "result.json", lambda r: r.update(val_loss="2.4")),
        "is not a result of train.py (val_loss='2.4')",
    ),
}


@pytest.mark.parametrize("problem", BAD_CELLS)
def test_a_bad_cell_is_one_line_and_writes_nothing(grid, tmp_path, problem):
    cell = str(tmp_path / "cell")
    shutil.copytree(os.path.join(grid, "attnres", "seed0"), cell)
    write(cell, "analysis.json", "the last analysis")  # kept whatever fails
    spoil, message = BAD_CELLS[problem]
    spoil(cell)
    before = sorted(os.listdir(cell))
    with pytest.raises(common.UserError, match=re.escape(message)) as e:  # a bad setting or a damaged file
        analyze.main([cell, "--device=cpu"])
    assert "\n" not in str(e.value) and sorted(os.listdir(cell)) == before
    assert open(os.path.join(cell, "analysis.json")).read() == "the last analysis"


def test_a_read_only_cell_fails_before_computing(grid, tmp_path, monkeypatch):
    cell = str(tmp_path / "cell")
    shutil.copytree(os.path.join(grid, "attnres", "seed0"), cell)

    real = common.tempfile.TemporaryFile

    def refuse(*args, dir=None, **kwargs):  # what the OS says in a read-only folder (chmod does not stop root)
        if dir is not None and os.path.abspath(dir) == cell:
            raise PermissionError(13, "Permission denied", dir)
        return real(*args, dir=dir, **kwargs)

    monkeypatch.setattr(common.tempfile, "TemporaryFile", refuse)  # common.check_writable's probe
    monkeypatch.setattr(analyze, "interventions", lambda *a: pytest.fail("computed before checking the folder"))
    with pytest.raises(
        DataError, match=f"cannot write into {re.escape(cell)} \\(Permission denied\\); analyze.py writes"
    ):
        analyze.main([cell, "--device=cpu"])


def test_not_a_cell_folder_is_one_line(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        analyze.main([str(tmp_path / "nothing")])
    (tmp_path / "file").write_text("")
    with pytest.raises(ConfigError, match="is a file, not a cell folder"):
        analyze.main([str(tmp_path / "file")])
    with pytest.raises(ConfigError, match="is not a cell folder \\(no config.json\\)"):
        analyze.main([str(tmp_path)])
    run = subprocess.run(
        [sys.executable, "analyze.py", str(tmp_path / "file")],
        cwd=ROOT,
        capture_output=True,
        text=True,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert run.returncode == 1 and run.stderr.count("\n") == 1 and run.stderr.startswith("error: ")


def test_an_moe_cell_shows_each_layers_expert_load_and_router_entropy(grid, tmp_path):
    # standard under MoE has no depth reads, yet its routers are worth reading: loads sum to k per token
    data = os.path.dirname(grid)
    out = str(tmp_path / "out")
    train.main(
        [
            f"--data_dir={data}",
            f"--out_dir={out}",
            "--n_layer=2",
            "--n_head=2",
            "--n_embd=32",
            "--block_size=16",
            "--vocab_size=64",
            "--batch_size=4",
            "--max_iters=4",
            "--eval_interval=4",
            "--eval_tokens=500",
            "--compile=False",
            "--seeds=0",
            "--warmup_iters=0",
            "--device=cpu",
            "--arms=standard",
            "--n_experts=4",
            "--moe_top_k=2",
        ]
    )
    cell = os.path.join(out, "standard", "seed0")
    analyze.main([cell, "--device=cpu"])
    with open(os.path.join(cell, "analysis.json")) as f:
        rep = json.load(f)["representations"]
    assert set(rep["expert_load"]) == set(rep["router_entropy"]) == {"mlp.0", "mlp.1"}
    for name, load in rep["expert_load"].items():
        assert len(load) == 4 and abs(sum(load) - 2) < 1e-3, (name, load)  # every token reaches its 2 experts
        assert 0 < rep["router_entropy"][name] <= np.log(4) + 1e-6
    text = open(os.path.join(cell, "analysis.md")).read()
    assert "## Experts" in text and "| mlp.1 | " + " ".join(f"{v:.2f}" for v in rep["expert_load"]["mlp.1"]) in text
