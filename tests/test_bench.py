"""
bench.py: every variant's step time and memory as strict JSON, the settings checked before anything is
measured (tiny, eager, on the CPU: fractions of a second).

    OMP_NUM_THREADS=1 .venv/bin/python -m pytest tests/test_bench.py -q -p no:cacheprovider
"""

import json
from contextlib import nullcontext

import pytest
import torch

import bench
from common import ConfigError, UserError
from configurator import configure
from model import GPT, GPTConfig

# eager, tiny and on the CPU: a benchmark of two variants takes a fraction of a second
TINY = [
    "--n_layer=2",
    "--n_embd=32",
    "--n_head=2",
    "--block_size=16",
    "--batch_size=2",
    "--dtype=float32",
    "--compile=False",
    "--peak_mem=False",
    "--device=cpu",
    "--rounds=1",
    "--steps=1",
]


def raise_on_constant(name):
    raise ValueError(f"{name} is not JSON")


def test_tokens_are_drawn_from_the_models_vocabulary():
    cfg = configure(bench.BENCH_DEFAULTS, TINY + ["--vocab_size=64"])
    model, step, (x, y) = bench.setup_variant("rd_attnres", cfg, "cpu", nullcontext())
    assert model.config.vocab_size == 64 and x.shape == (2, 16)
    assert 0 <= int(x.min()) and int(x.max()) < 64 and int(y.max()) < 64 and int(x.max()) > 32  # the whole range
    step()  # an id past the embedding was an IndexError here


def test_a_benchmark_writes_one_row_per_variant_as_strict_json(tmp_path):
    out = tmp_path / "bench.json"
    bench.main(TINY + ["--vocab_size=64", "--variants=rd_attnres,standard,rd_attnres", "--rounds=2", f"--out={out}"])
    records = json.loads(out.read_text(), parse_constant=raise_on_constant)
    assert [r["variant"] for r in records] == ["standard", "rd_attnres"]  # standard first, a repeat is one row
    assert records[0]["time_ratio"] == 1.0 and records[0]["mem_ratio"] == 1.0
    assert all(r["ms_per_step"] > 0 and r["saved_bytes"] > 0 and r["peak_mem_bytes"] is None for r in records)
    assert records[1]["mem_ratio"] == records[1]["saved_bytes"] / records[0]["saved_bytes"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bench.json"]  # no temporary left


def test_standard_alone_is_timed_on_its_own(tmp_path):
    out = tmp_path / "bench.json"
    bench.main(TINY + ["--variants=standard", "--rounds=3", f"--out={out}"])
    (record,) = json.loads(out.read_text())
    assert record["variant"] == "standard" and record["ms_per_step"] > 0 and record["time_ratio"] == 1.0
    assert record["tokens_per_s"] == pytest.approx(2 * 16 / record["ms_per_step"] * 1000)


@pytest.mark.parametrize(
    "args, message",
    [
        (["--rounds=0"], "rounds=0 must be at least 1"),
        (["--steps=-1"], "steps=-1 must be at least 1"),
        (["--batch_size=0"], "batch_size=0 must be at least 1"),
        (["--copies=0", "--mode=prepare"], "copies=0 must be at least 1"),
        (["--mode=train"], "mode='train': choose model or prepare"),
        (["--variants=standard,lstm"], "unknown variants 'lstm'; choose from standard, attnres_full, attnres_block, "),
        (["--variants="], "unknown variants ''; choose from "),
        (["--variants=()"], "variants is empty; give one or more of standard, "),
        (
            ["--n_layer=1", "--variants=dar"],
            "dar: attnres_block_size=4 must be 1 (Full) or an even divisor of 2*n_layer=2",
        ),
        (["--vocab_size=0"], "standard: vocab_size=0 must be a positive integer"),
        (
            ["--out=/dev/null/bench.json"],
            "cannot write into /dev/null (File exists); give --out=/dev/null/bench.json a path in a writable folder",
        ),
        (
            ["--mode=prepare", "--input=/nonexistent/*.parquet"],
            "input=/nonexistent/*.parquet matches no file; give a glob of parquet files with a text column",
        ),
    ],
)
def test_a_bad_setting_is_one_line_before_anything_is_measured(tmp_path, monkeypatch, args, message):
    def measure(*_):
        raise AssertionError("measured before the settings were checked")

    for name in ("setup_variant", "bench_prepare"):
        monkeypatch.setattr(bench, name, measure)
    monkeypatch.chdir(tmp_path)  # the default --out=bench.json lands here, if anywhere
    with pytest.raises(UserError) as e:  # ConfigError, or DataError for a place that cannot be written
        bench.main(TINY + args)
    assert str(e.value).startswith(message) and "\n" not in str(e.value)
    assert list(tmp_path.iterdir()) == []


def test_an_out_that_is_a_folder_is_refused_before_the_benchmark(tmp_path, monkeypatch):
    monkeypatch.setattr(bench, "setup_variant", lambda *_: pytest.fail("measured before --out was checked"))
    with pytest.raises(ConfigError, match=f"^out={tmp_path} is a folder; give a file name, e.g. --out="):
        bench.main(TINY + [f"--out={tmp_path}"])


def test_an_input_that_is_not_parquet_is_one_line(tmp_path):
    pytest.importorskip("pyarrow")
    (tmp_path / "part0.parquet").write_text("not parquet")
    with pytest.raises(bench.DataError, match=r"part0.parquet: not a parquet file with a text column \(.*\); give"):
        bench.main(["--mode=prepare", f"--input={tmp_path}/*.parquet", f"--out={tmp_path / 'bench.json'}"])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["part0.parquet"]


def test_forward_memory_is_cuda_only():
    model = GPT(GPTConfig(n_layer=1, n_head=2, n_embd=32, block_size=8, vocab_size=64))
    batch = (torch.zeros(1, 8, dtype=torch.long), torch.zeros(1, 8, dtype=torch.long))
    assert bench.forward_memory(model, batch, nullcontext(), "cpu", True) is None
    assert model.activation_checkpointing is False


def test_every_variant_stays_compiled_or_the_benchmark_stops(tmp_path, monkeypatch):
    # dynamo keeps 8 graphs of GPT.forward by default, one per scheme: a 9th variant ran eager, silently (1.7 s
    # "compile", eager ms/step). Compiling 10 variants is minutes on a CPU, so this checks what bench asks of dynamo
    # while it sets each variant up, and that it asks nothing of the rest of the process
    import torch._dynamo

    seen, setup = [], bench.setup_variant
    monkeypatch.setattr(
        bench,
        "setup_variant",
        lambda *a: (
            seen.append((torch._dynamo.config.recompile_limit, torch._dynamo.config.fail_on_recompile_limit_hit))
            or setup(*a)
        ),
    )
    variants = ["scaled_residual", "attnres_block", "frac", "denseformer", "muddformer", "hc", "mhc", "laurel", "dar"]
    before = torch._dynamo.config.recompile_limit, torch._dynamo.config.fail_on_recompile_limit_hit
    bench.main(TINY + [f"--variants={','.join(variants)}", "--rounds=1", f"--out={tmp_path / 'b.json'}"])
    assert seen and all(limit >= 2 * (len(variants) + 1) and fail for limit, fail in seen), seen  # standard too
    assert (torch._dynamo.config.recompile_limit, torch._dynamo.config.fail_on_recompile_limit_hit) == before
