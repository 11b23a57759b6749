"""
The configs in config/ run: each trains every one of its arms for two steps at a tiny size with every
option it sets kept (fsdp, activation checkpointing, optimizer, schedule, tuning, each arm's residual
options); only sizes, lengths and paths are overridden. A config that sets fsdp runs on 2 CPU processes
(gloo) under torchrun, as on GPUs; the others run in this process through train.main. And FSDP2 with
activation checkpointing (config/dar_1b.py's setting) equals DDP with it.

    OMP_NUM_THREADS=1 .venv/bin/python -m pytest tests/test_configs.py -q -p no:cacheprovider
"""

import glob
import json
import math
import os

import numpy as np
import pytest

import train
from helpers import logged, result, torchrun

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIGS = sorted(os.path.relpath(p, ROOT) for p in glob.glob(os.path.join(ROOT, "config", "*.py")))
STEPS = 2


def settings_of(path):
    """The keys a config file sets, as train.py reads them (the file is Python, run in a namespace)."""
    namespace = {"__file__": os.path.join(ROOT, path)}
    exec(open(os.path.join(ROOT, path)).read(), namespace)
    return {k: v for k, v in namespace.items() if not k.startswith("_") and k != "os"}


def tiny_overrides(path, shards, out_dir):
    """Sizes, lengths and paths only: a step of 8 sequences, 2 micro-batches per rank (accumulation),
    both schedule phases (1 warmup step), one block of the config's attnres_block_size."""
    layers = settings_of(path).get("attnres_block_size", 4) // 2
    base = {
        "data_dir": shards,
        "out_dir": str(out_dir),
        "seeds": "0",
        "n_layer": layers,
        "n_head": 2,
        "n_embd": 32,
        "block_size": 16,
        "vocab_size": 64,
        "batch_size": 2,
        "gradient_accumulation_steps": 4,
        "max_iters": STEPS,
        "warmup_iters": 1,
        "eval_interval": STEPS,
        "log_interval": 1,
        "eval_tokens": 65,
        "eval_batch_size": 2,
        "device": "cpu",
        "compile": False,
    }
    tuning = {"tune_iters": STEPS, "tune_seeds": "1,2"} if settings_of(path).get("tune_learning_rates") else {}
    return base | tuning


RUNS = {}


def run_config(path, shards, tmp_path_factory, monkeypatch, **extra):
    """path trained at the tiny size, once per (path, extra): its out_dir. Under torchrun (2 processes)
    where the config shards with FSDP (or extra sets fsdp), else in this process (no report: report.py's
    own tests cover it)."""
    key = (path, tuple(sorted(extra.items())))
    if key not in RUNS:
        out_dir = tmp_path_factory.mktemp(os.path.basename(path)[:-3])
        args = {**tiny_overrides(path, shards, out_dir), **extra}
        argv = [path] + [f"--{k}={v}" for k, v in args.items()]
        if "fsdp" in extra or settings_of(path).get("fsdp", False):  # FSDP, or DDP to compare it with
            proc = torchrun("train.py", argv)
            assert proc.returncode == 0, f"{path} {extra}: {proc.stderr[-3000:]}"
        else:
            import report

            monkeypatch.setattr(report, "main", lambda argv: None)
            train.main(argv)
        RUNS[key] = out_dir
    return RUNS[key]


@pytest.mark.parametrize("path", CONFIGS)
def test_config_trains_at_a_tiny_size(path, shards, tmp_path_factory, monkeypatch):
    settings = settings_of(path)
    out_dir = run_config(path, shards, tmp_path_factory, monkeypatch)
    kept = {k: v for k, v in settings.items() if k not in tiny_overrides(path, shards, out_dir) and k != "arms"}
    assert "arms" in settings, path
    if settings.get("tune_learning_rates"):  # each arm's rate is chosen on the tuning seeds: one of those tried
        kept.pop("learning_rate", None), kept.pop("min_lr", None)
    for arm, arm_settings in settings["arms"].items():
        r = result(out_dir, arm)
        assert r["status"] == "finished" and r["steps"] == STEPS and math.isfinite(r["val_loss"]), (path, arm)
        assert all(math.isfinite(x) for x in logged(out_dir, arm)) and len(logged(out_dir, arm)) == STEPS
        with open(os.path.join(out_dir, arm, "seed0", "config.json")) as f:
            recorded = json.load(f)
        # the cell ran with every option the config sets, its arm's own on top
        assert {k: recorded[k] for k in kept} == {k: arm_settings.get(k, v) for k, v in kept.items()}, (path, arm)
        if settings.get("tune_learning_rates"):
            assert recorded["learning_rate"] in settings["tune_learning_rates"], (path, arm)
        assert {k: recorded["model"][k] for k in arm_settings} == arm_settings, (path, arm)
        assert recorded["world_size"] == (2 if settings.get("fsdp") else 1) and recorded["fsdp"] == settings.get(
            "fsdp", False
        )


def test_fsdp_with_activation_checkpointing_equals_ddp(shards, tmp_path_factory, monkeypatch):
    # config/dar_1b.py shards with FSDP2 and recomputes each sublayer in backward; the same grid under DDP
    # (each sublayer still recomputed) must give the same losses within fp32 rounding (sums in another order)
    path = "config/dar_1b.py"
    settings = settings_of(path)
    assert settings["fsdp"] and settings["activation_checkpointing"]
    fsdp = run_config(path, shards, tmp_path_factory, monkeypatch)
    ddp = run_config(path, shards, tmp_path_factory, monkeypatch, fsdp=False)
    for arm in settings["arms"]:
        np.testing.assert_allclose(logged(fsdp, arm), logged(ddp, arm), rtol=1e-5, err_msg=arm)
        np.testing.assert_allclose(
            logged(fsdp, arm, key="val_loss"), logged(ddp, arm, key="val_loss"), rtol=1e-6, err_msg=arm
        )


def test_every_configs_arms_are_recorded_as_written():
    """Each config names its arms after the schemes they train (arms = {name: {"residual": name}}): the arms
    train.py records are the file's, to the byte, so a grid made from it compares equal on a rerun."""
    import records
    from configurator import configure

    for path in CONFIGS:
        given = configure(train.DEFAULTS, [os.path.join(ROOT, path)], entries=dict(arms=train.SCHEME_ARMS))
        assert json.dumps(records.typed_arms(given)) == json.dumps(settings_of(path)["arms"]), path
