import json
import os
import subprocess
import sys

import numpy as np
import pytest
import torch

import analyze
import train
from configurator import ConfigError
from data.prepare import write_shard
from model import GPT, RESIDUALS, GPTConfig

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
torch.set_num_threads(1)  # tiny models: threads only contend with each other on a shared machine
TINY = dict(n_layer=2, n_head=2, n_embd=32, block_size=16, vocab_size=64)
VARIANTS = {name: dict(residual=name) for name in RESIDUALS} | {"attnres_full": dict(residual="attnres",
                                                                                      attnres_block_size=1)}
CPU = dict(rank=0, world=1, device="cpu", autocast=train.nullcontext())
EVAL = dict(block_size=16, eval_tokens=400, eval_batch_size=8)
# at init these equal the unmodified model in exact arithmetic, but sum in another order
ROUNDED = {("dar", ("one_stream", 0)), ("dar", ("one_stream", 1)), ("mhc", ("identity_mixing",))}


@pytest.fixture(scope="module")
def stream():
    rng = np.random.default_rng(0)  # a learnable stream: a repeating pattern with noise, tokens < 64
    return (np.arange(40_000) % 17 + rng.integers(0, 3, 40_000)).astype(np.uint16)


def make(variant, seed=0):
    torch.manual_seed(seed)
    return GPT(GPTConfig(**TINY, **VARIANTS[variant]))


@pytest.mark.parametrize("variant", VARIANTS)
def test_interventions_change_nothing_at_init(variant, stream):
    model = make(variant)
    base, rows = analyze.interventions(model, stream, EVAL, CPU)
    assert len(rows) == len(model.interventions()) and (rows == []) == (variant == "standard")
    for change, nll in rows:
        if (model.config.residual, change) in ROUNDED:
            assert abs(nll - base) < 1e-6, change
        else:
            assert nll == base, change
    assert model.residual.intervention is None  # switched off afterwards


def test_effective_sources_and_cosine_matrices(stream):
    model = make("attnres_full")  # uniform weights at init: S effective sources at every read
    rep = analyze.representations(model, stream, EVAL, CPU)
    for name, w in rep["weights"].items():
        assert abs(rep["effective_sources"][name] - len(w)) < 1e-4
    with torch.no_grad():
        for p in (model.residual.query, model.residual.key_gain):
            p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(1)))
    rep = analyze.representations(model, stream, EVAL, CPU)
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
    x, _ = train.validation_batch(stream, range((EVAL["eval_tokens"] - 1) // 16), 16, "cpu")
    sources = []
    with torch.no_grad():  # the sources of Full AttnRes: the embedding and every sublayer output
        h = model.transformer.wte(x)
        sources.append(h)
        state = model.residual.start(h)
        for k in range(model.residual.n_sublayers):
            block = model.transformer.h[k // 2]
            out = block.attention(*model.residual.read_attention(state, k)) if k % 2 == 0 else \
                block.feedforward(model.residual.read(state, k))
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
    arms = ",".join(VARIANTS)
    out = str(d / "out")
    train.main([f"--data_dir={d}", f"--out_dir={out}", "--n_layer=2", "--n_head=2", "--n_embd=32",
                "--block_size=16", "--vocab_size=64", "--batch_size=4", "--max_iters=8", "--eval_interval=8",
                "--eval_tokens=500", "--compile=False", "--seeds=0", "--warmup_iters=0", "--learning_rate=3e-2",
                "--device=cpu", "--arms={" + ", ".join(f"'{a}': {VARIANTS[a]!r}" for a in VARIANTS) + "}"])
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
    assert [tuple(r["change"]) for r in a["interventions"]] == make(variant).interventions()
    for r in a["interventions"]:  # trained routing: every change matters (DAR's streams part slowly: own_keys ~1e-6)
        assert r["delta"] != 0 and r["tokens"] == a["tokens"], r
    text = open(os.path.join(cell, "analysis.md")).read()
    assert f"{a['base_nll']:.4f}" in text and not [f for f in os.listdir(cell) if f.endswith(".tmp")]
    if variant == "standard":
        assert a["representations"] is None and "has no depth reads" in text
        return
    rep = a["representations"]
    for m in [*rep.get("source_cosine", {}).values(), *([rep["stream_cosine"]["out"]] if variant in ("hc", "mhc") else [])]:
        assert np.allclose(m, np.transpose(m), atol=1e-4) and np.allclose(np.diagonal(m), 1, atol=1e-4)
    assert ("block_cosine" in rep) == (variant == "dar") and bool(rep["qk_v_jsd"]) == (variant == "rd_attnres")
    assert os.path.exists(os.path.join(cell, "analysis_interventions.png"))


def test_capped_tokens_are_recorded(grid):
    cell = os.path.join(grid, "rd_attnres", "seed0")
    analyze.main([cell, "--device=cpu", "--max_tokens=100"])
    with open(os.path.join(cell, "analysis.json")) as f:
        a = json.load(f)
    assert a["capped"] and a["tokens"] == 96 and a["recorded_val_loss"] is None
    assert all(r["tokens"] == 96 for r in a["interventions"])
    with pytest.raises(ConfigError, match="less than one sequence"):
        analyze.main([cell, "--device=cpu", "--max_tokens=10"])


def test_bad_cells_are_one_line(grid, tmp_path):
    cell = tmp_path / "cell"
    with pytest.raises(ConfigError, match="is not a cell folder"):
        analyze.main([str(cell)])
    cell.mkdir()
    (cell / "config.json").write_text(open(os.path.join(grid, "attnres", "seed0", "config.json")).read())
    with pytest.raises(ConfigError, match="ckpt.pt is missing"):
        analyze.main([str(cell)])
    (cell / "ckpt.pt").write_bytes(open(os.path.join(grid, "attnres", "seed0", "ckpt.pt"), "rb").read()[:1000])
    with pytest.raises(ConfigError, match="unreadable, truncated or empty"):
        analyze.main([str(cell)])
    ckpt = torch.load(os.path.join(grid, "dar", "seed0", "ckpt.pt"), weights_only=False)
    torch.save(ckpt, cell / "ckpt.pt")
    with pytest.raises(ConfigError, match="does not fit the model"):
        analyze.main([str(cell)])
    run = subprocess.run([sys.executable, "analyze.py", str(tmp_path / "nothing")], cwd=ROOT, capture_output=True,
                         text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert run.returncode == 1 and run.stderr.count("\n") == 1 and run.stderr.startswith("error: ")
