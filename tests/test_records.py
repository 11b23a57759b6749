"""
records.py: the config checks (one line for each setting that cannot run), the code fingerprint
(messages and comments are not code, math is), the one rerun check for every record a run goes on
from, result records and the warm-start checks; with per-arm learning rates trained end to end.

$ OMP_NUM_THREADS=1 python -m pytest tests/test_records.py -q
"""

import ast
import dataclasses
import json
import os
import re
import shutil
import sys

import numpy as np
import pytest
import torch

import cells
import checkpoint
import records
import train
from common import ConfigError
from configurator import configure
from helpers import README_SCHEME, ROOT, log_records, result, tiny
from model import GPT, RESIDUALS, GPTConfig

DEFAULTS = dict(train.DEFAULTS, vocab_size=320)  # as train.main resolves it from the bundled corpus' bytes


# --- keys, checks ---------------------------------------------------------------------------------


def test_every_model_field_is_a_key_and_can_be_set_per_arm():
    for field in dataclasses.fields(GPTConfig):
        value = DEFAULTS[field.name]
        cfg = configure(DEFAULTS, [f"--{field.name}={value!r}", f"--arms={{'a': {{'{field.name}': {value!r}}}}}"])
        records.check_config(cfg, 1)
        assert getattr(records.model_config(cfg, cfg["arms"]["a"]), field.name) == value
    cfg = dict(DEFAULTS, arms={"a.1": {"dropout": 0}})  # an int for a float, as --dropout=0
    records.check_config(cfg, 1)
    assert cfg["arms"]["a.1"]["dropout"] == 0 and type(records.typed_arms(cfg)["a.1"]["dropout"]) is float
    # the ablations the README names, as arms
    cfg = configure(
        DEFAULTS,
        ["--arms={'self': {'residual': 'dar', 'dar_keys': 'self'}, 'hc2': {'residual': 'hc', 'hc_streams': 2}}"],
    )
    records.check_config(cfg, 1)
    assert (
        records.cell_config(cfg, "self", 0)["dar_keys"] == "self"
        and records.cell_config(cfg, "hc2", 0)["hc_streams"] == 2
    )
    assert records.model_config(cfg, cfg["arms"]["hc2"]).hc_streams == 2


@pytest.mark.parametrize(
    "override, message",
    [
        ({"batch_size": 0}, "batch_size=0 must be at least 1"),
        ({"learning_rate": -1e-3}, "learning_rate=-0.001 must be positive"),
        ({"seeds": [""]}, "seeds=['']: give distinct non-negative integers"),
        ({"seeds": ["a", "b"]}, "seeds=['a', 'b']"),
        ({"seeds": [-1]}, "seeds=[-1]"),
        ({"seeds": []}, "seeds=[]"),
        ({"seeds": [1, 1]}, "seeds=[1, 1]"),
        ({"eval_interval": 0}, "eval_interval=0 must be at least 1"),
        ({"log_interval": 0}, "log_interval=0 must be at least 1"),
        ({"eval_batch_size": 0}, "eval_batch_size=0 must be at least 1"),
        ({"dropout": 1.5}, "dropout=1.5 must be in [0, 1)"),
        ({"residual": "resnet"}, "residual='resnet' is not a residual scheme"),  # though every arm sets its own
        ({"eval_tokens": 128}, "eval_tokens=128 is less than one sequence of block_size+1 = 129"),
        ({"arms": {"x": {"residual": "attnres", "rd_control": "dup"}}}, "arm 'x': rd_control='dup' needs residual"),
        ({"arms": {"x": {"n_layers": 3}}}, "settings must be a dict of model keys"),
        ({"arms": {"x": {"warmup_iters": 3}}}, "settings must be a dict of model keys"),  # the schedule is the grid's
        ({"gradient_accumulation_steps": 0}, "gradient_accumulation_steps=0 must be at least 1"),
        ({"block_size": 0}, "arm 'attnres': block_size=0 must be a positive integer"),  # before anything divides by it
        ({"n_head": 0}, "arm 'attnres': n_head=0 must be a positive integer"),
        ({"arms": {"a": {"n_layer": "x"}}}, "arm 'a': n_layer must be a int, got 'x'"),
        ({"arms": {"a": {"dropout": "0.1"}}}, "arm 'a': dropout must be a float"),
        ({"arms": {"a": {"learning_rate": "fast"}}}, "arm 'a': learning_rate must be a float"),
        ({"arms": {"a": {"learning_rate": 0.0}}}, "arm 'a': learning_rate=0.0 must be positive"),
        ({"arms": {"": {}}}, "arm name ''"),
        ({"arms": {"../a": {}}}, "arm name '../a'"),
        ({"arms": {"-a": {}}}, "arm name '-a'"),
        ({"arms": {1: {}}}, "arm name 1"),
        ({"arms": {"config.json": {}}}, "arm name 'config.json': use letters"),
        ({"arms": {"paired.json": {}}}, "arm name 'paired.json'"),
        ({"arms": {"val_loss.png": {}}}, "arm name 'val_loss.png'"),
        ({"batch_size": 3, "world": 2}, "3 sequences do not split evenly over 2 processes"),
        (
            {"reference_arm": "attnres,standard"},
            "reference_arm='attnres,standard': 'standard' is not an arm (attnres, ",
        ),
        ({"reference_arm": "attnres,attnres"}, "reference_arm='attnres,attnres' names an arm twice"),
    ],
)
def test_bad_settings_are_one_line(override, message):
    world = override.pop("world", 1)
    with pytest.raises(ConfigError) as e:
        records.check_config(dict(DEFAULTS, **override), world)
    assert message in str(e.value) and "\n" not in str(e.value)


def checked(argv, world=1):
    cfg = configure(DEFAULTS, argv, entries=dict(arms=train.SCHEME_ARMS))
    records.check_config(cfg, world, [a[2:].partition("=")[0] for a in argv if a.startswith("--")])
    return cfg


def test_scheme_names_are_arms_and_overridden_keys_are_refused():
    cfg = checked(["--arms=standard,denseformer"])
    assert cfg["arms"] == {"standard": {"residual": "standard"}, "denseformer": {"residual": "denseformer"}}
    assert checked(["--arms=attnres,hc"])["arms"]["attnres"] == {"residual": "attnres"}  # the default arm's entry
    with pytest.raises(
        ConfigError,
        match=r"--residual='dar' is overridden by every arm \(attnres, rd_attnres set "
        r"residual\); use --arms=dar",
    ):
        checked(["--residual=dar"])
    with pytest.raises(ConfigError, match=r"--n_layer=3 is overridden by every arm \(a set n_layer\)"):
        checked(["--n_layer=3", "--arms={'a': {'n_layer': 2}}"])
    with pytest.raises(ConfigError, match=r"--learning_rate=0.001 is overridden by every arm \(a set learning_rate\)"):
        checked(["--learning_rate=1e-3", "--min_lr=1e-5", "--arms={'a': {'learning_rate': 2e-3}}"])
    assert checked(["--residual=dar", "--arms={'a': {'residual': 'attnres'}, 'b': {}}"])["arms"]["b"] == {}
    # a scheme's option reaches that scheme's arms only, and is refused when no arm trains it
    cfg = checked(["--arms=standard,hc", "--hc_streams=2"])
    assert records.model_config(cfg, cfg["arms"]["hc"]).hc_streams == 2
    assert records.model_config(cfg, cfg["arms"]["standard"]).hc_streams == GPTConfig.hc_streams
    standard, hc = (records.cell_config(cfg, arm, 0) for arm in ("standard", "hc"))
    assert "hc_streams" not in records.pairing_settings(standard, cfg["arms"]["standard"])
    assert records.pairing_settings(hc, cfg["arms"]["hc"])["hc_streams"] == 2
    with pytest.raises(
        ConfigError, match=r"--hc_streams=2 is an option of residual=hc or mhc( or [a-z_]+)*, which no arm trains"
    ):
        checked(["--hc_streams=2"])


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--out_dir=None"], "out_dir cannot be None; give a str"),
        (["--max_iters=None"], "max_iters cannot be None; give a int"),
        (["--compile=None"], "compile cannot be None"),
        (["--learning_rate=None"], "learning_rate cannot be None"),
        (["--learning_rate=float('inf')"], "learning_rate must be a float, got"),  # not a literal: a string
        (["--arms={'a': {'norm_eps': None}}"], "arm 'a': norm_eps cannot be None"),
    ],
)
def test_none_and_non_literals_are_one_line(argv, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        checked(argv)


@pytest.mark.parametrize("key", ["learning_rate", "norm_eps", "min_lr", "grad_clip", "dropout", "routing_lr_scale"])
def test_non_finite_settings_are_refused(key):
    for value in (float("inf"), float("nan")):
        with pytest.raises(ConfigError, match=f"{key}={value} must be a finite number"):
            records.check_config(dict(DEFAULTS, **{key: value}), 1)
    for key in ("norm_eps", "learning_rate", "routing_lr_scale"):
        with pytest.raises(ConfigError, match=f"arm 'a': {key}=inf must be a finite number"):
            records.check_config(dict(DEFAULTS, arms={"a": {key: float("inf")}}), 1)


@pytest.mark.parametrize(
    "arm", ["config.json.tmp", "report.md.tmp", "paired.json.tmp", "val_loss.png.tmp", "report.md", "x.json"]
)
def test_arm_names_are_never_the_grid_files(arm):
    with pytest.raises(ConfigError, match="arm name"):
        records.check_config(dict(DEFAULTS, arms={arm: {}}), 1)


@pytest.mark.parametrize(
    "override, world, message",
    [
        ({"optimizer": "sgd"}, 1, "optimizer='sgd': choose adamw or muon"),
        ({"optimizer": "muon", "muon_learning_rate": 0.0}, 1, "muon_learning_rate=0.0 must be positive"),
        ({"fsdp": True}, 1, "fsdp=True shards the model over processes: run under torchrun"),
        ({"fsdp": True, "optimizer": "muon"}, 2, "fsdp=True with optimizer='muon' is not supported"),
        ({"wandb_log": True}, 1, "wandb_log=True needs the wandb package: pip install wandb"),
    ],
)
def test_optimizer_fsdp_and_wandb_settings_are_one_line(override, world, message, monkeypatch):
    monkeypatch.delitem(sys.modules, "wandb", raising=False)
    monkeypatch.setattr(records.importlib.util, "find_spec", lambda name: None)  # as where wandb is not installed
    with pytest.raises(ConfigError) as e:
        records.check_config(dict(DEFAULTS, **override), world)
    assert message in str(e.value) and "\n" not in str(e.value)
    records.check_config(dict(DEFAULTS, fsdp=True, batch_size=8), 2)  # what does run
    records.check_config(dict(DEFAULTS, optimizer="muon"), 2)


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--arms=standard,standard"], "arms='standard,standard': give distinct names"),
        (["--arms="], "arms='': give distinct names"),
        (["--arms=standard,,attnres"], "give distinct names"),
        (["--out_dir="], "out_dir is empty; give a folder"),
    ],
)
def test_arm_lists_and_empty_folders_are_one_line(argv, message):
    with pytest.raises(ConfigError, match=message):
        checked(argv)


# --- bad input that used to get past the checks (issue #33) ---------------------------------------


def one_line(cfg, message, world=1):
    with pytest.raises(ConfigError) as e:
        records.check_config(cfg, world)
    assert message in str(e.value) and "\n" not in str(e.value), str(e.value)


def first_step(cfg, arm):
    """One AdamW step of the arm's tiny model at its peak learning rate, as train.py takes it."""
    cell = records.cell_config(cfg, arm, 0)
    model = GPT(GPTConfig(**{k: cell[k] for k in records.MODEL_KEYS}))
    optimizer = model.configure_optimizers(
        0.0, cell["learning_rate"], (cell["beta1"], cell["beta2"]), "cpu", "adamw", cell["muon_learning_rate"]
    )
    x = torch.zeros(1, 8, dtype=torch.long)
    model(x, x)[1].backward()
    optimizer.step()


def test_learning_rates_beyond_float32_are_one_line():
    small = dict(DEFAULTS, n_layer=2, n_head=2, n_embd=16, block_size=8, vocab_size=32, eval_tokens=100)
    # what optimizer.step fails on, mid-run, is refused before anything runs
    for cfg, arm in (
        (dict(small, learning_rate=1e38, min_lr=0.0, arms={"s": {"residual": "standard"}}), "s"),
        (
            dict(
                small,
                arms={
                    "r": {
                        "residual": "attnres",
                        "attnres_block_size": 2,
                        "learning_rate": 1e9,
                        "routing_lr_scale": 1e30,
                    }
                },
            ),
            "r",
        ),
    ):
        with pytest.raises(RuntimeError, match="overflow"):
            first_step(cfg, arm)
        one_line(cfg, "is too large: its first step")
    one_line(dict(small, beta1=0.99, learning_rate=1e37, min_lr=0.0), "learning_rate = 1e+37 is too large")
    # the MoE routers' group (its own scale) and the decay factor 1 - lr x weight_decay, as the routing group's
    routers = dict(small, arms={"m": {"n_experts": 4, "learning_rate": 1e9, "moe_router_lr_scale": 1e30}})
    with pytest.raises(RuntimeError, match="overflow"):
        first_step(routers, "m")
    one_line(routers, "arm 'm': learning_rate x moe_router_lr_scale = 1e+39 is too large: its first step")
    one_line(
        dict(small, learning_rate=1e9, weight_decay=1e30),
        "learning_rate x weight_decay = 1e+39 is beyond float32 (3.4e+38): each step multiplies the weights by 1 "
        "minus it; lower weight_decay",
    )
    # a large but representable rate runs (test_train's forced divergence uses 1e9)
    cfg = dict(small, learning_rate=1e9, arms={"s": {"residual": "standard"}})
    records.check_config(cfg, 1)
    first_step(cfg, "s")


def test_every_float_setting_is_bounded_at_float32_the_same_way():
    floats = [k for k, v in DEFAULTS.items() if isinstance(v, float)]
    assert {"learning_rate", "weight_decay", "grad_clip", "norm_eps", "moe_bias_rate", "moe_router_lr_scale"} <= set(
        floats
    )
    moe = dict(DEFAULTS, n_experts=4)  # the MoE settings need an MoE model
    for key in floats:
        one_line(
            dict(moe, **{key: 1e300}),
            f"{key}=1e+300 is beyond float32 (3.4e+38), which the model and optimizer compute in; lower it",
        )
        if key in records.MODEL_KEYS + records.ARM_LEARNING_RATES:
            one_line(dict(moe, arms={"a": {key: 1e300}}), f"arm 'a': {key}=1e+300 is beyond float32")
    # the balancing bias moves by moe_bias_rate each step: max_iters of them must stay a float32
    one_line(
        dict(moe, moe_bias_rate=1e37, max_iters=100),
        "arm 'attnres': moe_bias_rate=1e+37 is too large: over max_iters=100 steps the balancing bias can reach "
        "1e+39, beyond float32",
    )
    records.check_config(dict(moe, moe_bias_rate=1e36, max_iters=100), 1)


@pytest.mark.parametrize(
    "argv, message",
    [
        (
            ["--muon_learning_rate=0.05"],
            "--muon_learning_rate=0.05 changes nothing: it applies under optimizer='muon' "
            "(this run's is 'adamw'); drop --muon_learning_rate",
        ),
        (
            ["--cooldown_frac=0.5"],
            "--cooldown_frac=0.5 changes nothing: it applies under lr_schedule='wsd' (this run's is "
            "'cosine'); drop --cooldown_frac",
        ),
        (
            ["--tune_seeds=5"],
            "--tune_seeds=[5] changes nothing: it applies to the tuned protocol, and tune_learning_rates "
            "is empty; drop --tune_seeds",
        ),
        (["--tune_iters=4"], "--tune_iters=4 changes nothing: it applies to the tuned protocol"),
        (
            ["--arms=standard", "--routing_lr_scale=2"],
            "--routing_lr_scale=2.0 changes nothing: residual='standard' has no "
            "routing parameters for it to scale; drop --routing_lr_scale",
        ),
        (
            [
                "--arms={'s': {'residual': 'standard'}, 'd': {'residual': 'standard', 'dropout': 0.1}}",
                "--routing_lr_scale=2",
            ],
            "has no routing parameters for it to scale (nor does any arm's: s, d); drop --routing_lr_scale",
        ),
        (
            ["--arms={'a': {'muon_learning_rate': 0.05}, 'b': {}}"],
            "arm 'a': muon_learning_rate=0.05 changes nothing: it "
            "applies under optimizer='muon' (this run's is 'adamw'); "
            "drop it from the arm",
        ),
        (
            ["--tune_routing_lr_scales=0.1,1"],
            "--tune_routing_lr_scales=[0.1, 1] changes nothing: it applies to the tuned protocol",
        ),
        (
            ["--arms={'a': {'residual': 'standard', 'routing_lr_scale': 3.0}, 'b': {'residual': 'attnres'}}"],
            "arm 'a': routing_lr_scale=3.0 changes nothing: residual='standard' has no routing parameters for it to scale",  # noqa: E501
        ),
    ],
)
def test_a_setting_that_changes_nothing_is_refused_where_it_is_given(argv, message):
    # recorded, it would only make two arms of one model look compared, and a rerun without it a change
    with pytest.raises(ConfigError) as e:
        checked(argv)
    assert message in str(e.value) and "\n" not in str(e.value), str(e.value)


def test_a_setting_is_accepted_where_it_changes_something():
    checked(["--optimizer=muon", "--muon_learning_rate=0.05", "--arms={'a': {'muon_learning_rate': 0.01}, 'b': {}}"])
    checked(["--lr_schedule=wsd", "--cooldown_frac=0.5"])
    checked(["--tune_learning_rates=1e-3,3e-3", "--tune_seeds=5", "--tune_iters=4"])
    checked(["--tune_learning_rates=1e-3,3e-3", "--tune_routing_lr_scales=0.1,1"])
    checked(["--arms=standard,attnres", "--routing_lr_scale=2"])  # the attnres arm's routing steps at 2x
    # an arm's unused setting at the run's value changes nothing in its record either: accepted, as GPTConfig does
    checked(["--arms={'a': {'residual': 'standard', 'routing_lr_scale': 1.0, 'muon_learning_rate': 0.02}}"])


def test_arms_that_can_never_pair_are_said_before_training_and_do_not_pair(shards, tmp_path, monkeypatch, capsys):
    # a dense and an MoE arm of one scheme: their shared weights differ in shape, so their inits differ (measured)
    import report

    monkeypatch.setattr(report, "main", lambda argv: None)
    arms = "{'dense': {'residual': 'standard'}, 'moe': {'residual': 'standard', 'n_experts': 4}, 'a': {'residual': 'attnres'}}"  # noqa: E501
    train.main(tiny(shards, tmp_path / "o", f"--arms={arms}", "--max_iters=1", "--warmup_iters=0"))
    out = capsys.readouterr().out
    assert (
        "note: arms dense, a | moe differ in n_experts (another init): the report pairs no arm with one of another "
        "group\n"
    ) in out
    inits = {arm: result(tmp_path / "o", arm)["pairing"]["init_hash"] for arm in ("dense", "moe", "a")}
    assert inits["dense"] == inits["a"] != inits["moe"]  # what the note said, as trained
    cfg = dict(DEFAULTS, max_iters=10)
    assert records.notes(cfg, {"s": GPTConfig(), "b": GPTConfig(block_size=64), "w": GPTConfig(n_embd=384)}) == [
        "note: arms s | b | w differ in block_size, n_embd (other batches and another init): the report pairs no arm "
        "with one of another group",
        "note: warmup_iters=20 is longer than max_iters=10: the run ends in its warmup, at 50% of learning_rate, and "
        "never decays to min_lr",
    ]
    assert records.notes(DEFAULTS, {"s": GPTConfig(), "d": GPTConfig(residual="dar", dropout=0.1)}) == []


def test_min_lr_above_learning_rate_is_one_line_and_a_long_warmup_is_accepted():
    one_line(
        dict(DEFAULTS, learning_rate=1e-4, min_lr=3e-4),
        "min_lr=0.0003 is above learning_rate=0.0001: the schedule decays from learning_rate down to min_lr",
    )
    one_line(
        dict(DEFAULTS, arms={"a": {"learning_rate": 1e-4}}),
        "arm 'a': min_lr=0.0003 is above learning_rate=0.0001: the schedule decays from learning_rate down to "
        "min_lr; set min_lr at most learning_rate in the arm",
    )
    records.check_config(dict(DEFAULTS, arms={"a": {"learning_rate": 1e-4, "min_lr": 1e-5}}), 1)
    records.check_config(dict(DEFAULTS, min_lr=DEFAULTS["learning_rate"]), 1)  # a constant rate
    # warmup longer than the run is accepted (a quick run of a paper config; docs/protocol.md)
    records.check_config(dict(DEFAULTS, warmup_iters=250, max_iters=10), 1)


def test_the_checks_change_nothing():
    cfg = configure(
        DEFAULTS,
        [
            "--arms={'a': {'dropout': 0, 'learning_rate': 1}, 'b': {'residual': 'dar'}}",
            "--learning_rate=1e-3",
            "--min_lr=1e-4",
        ],
    )
    before = repr(cfg)
    records.check_config(cfg, 1, ["arms", "learning_rate", "min_lr"])
    assert repr(cfg) == before and type(cfg["arms"]["a"]["dropout"]) is int  # train.build_config types it
    typed = records.typed_arms(cfg)
    assert typed == {"a": {"dropout": 0.0, "learning_rate": 1.0}, "b": {"residual": "dar"}}
    assert type(typed["a"]["dropout"]) is float and type(typed["a"]["learning_rate"]) is float


def test_reference_arm_names_one_arm_or_several():
    arms = {"standard": {"residual": "standard"}, "scaled_residual": {"residual": "scaled_residual"}, "a": {}}
    for references in ("", "a", "scaled_residual,standard"):  # report.py's --reference, passed on
        records.check_config(dict(DEFAULTS, arms=arms, reference_arm=references), 1)
    one_line(dict(DEFAULTS, arms=arms, reference_arm="standard,b"), "reference_arm='standard,b': 'b' is not an arm")


def test_wandb_without_a_login_is_one_line(tmp_path, monkeypatch):
    monkeypatch.setattr(records.importlib.util, "find_spec", lambda name: object())  # as where wandb is installed
    for key in ("WANDB_MODE", "WANDB_API_KEY", "WANDB_BASE_URL"):
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv("NETRC", str(tmp_path / "netrc"))
    monkeypatch.setenv("HOME", str(tmp_path))
    cfg = dict(DEFAULTS, wandb_log=True)
    one_line(
        cfg,
        "wandb_log=True but wandb has no login for api.wandb.ai here: run `wandb login`, set WANDB_API_KEY, "
        "or WANDB_MODE=offline",
    )
    (tmp_path / "netrc").write_text("machine example.com login user password secret\n")
    one_line(cfg, "has no login for api.wandb.ai")
    (tmp_path / "netrc").write_text("machine api.wandb.ai\n  login user\n  password 0123456789abcdef\n")
    os.chmod(tmp_path / "netrc", 0o600)
    records.check_config(cfg, 1)  # `wandb login` wrote it
    os.remove(tmp_path / "netrc")
    monkeypatch.setenv("WANDB_MODE", "offline")
    records.check_config(cfg, 1)
    monkeypatch.delenv("WANDB_MODE")
    monkeypatch.setenv("WANDB_API_KEY", "0123456789abcdef")
    records.check_config(cfg, 1)


def test_nul_bytes_and_long_arm_names_are_one_line():
    one_line(dict(DEFAULTS, out_dir="out\0x"), "out_dir='out\\x00x' holds a NUL byte")
    one_line(dict(DEFAULTS, init_from="a\0.pt"), "init_from='a\\x00.pt' holds a NUL byte")
    name = "a" * (records.ARM_NAME_MAX + 1)
    one_line(
        dict(DEFAULTS, arms={name: {}}),
        f"arm name aaaaaaaaaaaaaaaaaaaa... is {len(name)} characters; use at most {records.ARM_NAME_MAX}",
    )
    records.check_config(dict(DEFAULTS, arms={"a" * records.ARM_NAME_MAX: {}}), 1)


# --- the code fingerprint ---------------------------------------------------------------------------


def test_comments_docstrings_and_layout_are_not_code():
    source = 'def f(x):\n    return x + 1\n\n\nclass A:\n    y = 2\n'
    same = (
        '"""A module."""\n# a comment\ndef f(x):  # why\n    """Doc."""\n\n    return (x +\n            1)\n\n'
        'class A:\n    """Doc."""\n    y = 2  # two\n'
    )
    assert records.code_fingerprint(source) == records.code_fingerprint(same)
    for changed in (
        'def f(x):\n    return x + 2\n\n\nclass A:\n    y = 2\n',  # a value
        'def f(x):\n    return x + 1\n\n\nclass A:\n    z = 2\n',  # a name
        'def f(x):\n    "a string that is code"\n    return x + 1\nclass A:\n    y = 2\n    "doc"\n',
    ):
        if "string that is code" in changed:  # a docstring is not code; a string after the first statement is
            assert records.code_fingerprint(changed) != records.code_fingerprint(changed.replace('\n    "doc"', ''))
        else:
            assert records.code_fingerprint(changed) != records.code_fingerprint(source)


def test_messages_are_not_code_but_what_they_guard_is():
    def same(a, b):
        return records.code_fingerprint(a) == records.code_fingerprint(b)

    base = (
        'import sys, warnings\n'
        'def f(x, log):\n'
        '    if x < 0:\n'
        '        raise ValueError(f"x={x} must not be negative")\n'
        '    assert x < 9, "x too large"\n'
        '    print(f"x is {x:.3f}", flush=True)\n'
        '    warnings.warn("slow")\n'
        '    log.info("x %s", x)\n'
        '    if x == 5:\n'
        '        sys.exit("error: " + str(x))\n'
        '    return torch.compile(x * 2.0, mode="default")\n'
    )
    reworded = (
        base.replace("must not be negative", "is negative; give 0 or more")
        .replace("x too large", "big")
        .replace('f"x is {x:.3f}"', '"x:", x')
        .replace('"slow"', 'f"slow {x}"')
        .replace("x %s", "got %s")
        .replace('"error: " + str(x)', 'f"stopped at {x}"')
    )
    assert reworded != base and same(base, reworded)
    for change in (
        ("x < 0", "x <= 0"),
        ("ValueError", "TypeError"),
        ("x < 9", "x < 8"),
        ("x * 2.0", "x / 2.0"),
        ("x * 2.0", "x * 3.0"),
        ('mode="default"', 'mode="max-autotune"'),
        ("x == 5", "x == 6"),
    ):
        assert not same(base, base.replace(*change)), change


def math_nodes(source, kind, keep):
    """The nodes of kind for which keep(node) holds, outside messages (raises and print calls), in source order."""
    tree = ast.parse(source)
    messages = {
        id(n)
        for m in ast.walk(tree)
        if isinstance(m, ast.Raise) or isinstance(m, ast.Call) and records.call_name(m.func) in records.MESSAGE_CALLS
        for n in ast.walk(m)
    }
    nodes = [n for n in ast.walk(tree) if isinstance(n, kind) and id(n) not in messages and keep(n)]
    return sorted(nodes, key=lambda n: (n.lineno, n.col_offset))


def offset(source, line, col):
    return sum(map(len, source.splitlines(keepends=True)[: line - 1])) + col


def test_editing_messages_never_locks_a_grid_and_editing_math_does(tmp_path, monkeypatch):
    """On copies of the real CODE_FILES: reworded errors and prints keep the fingerprint; an operator or
    a constant of model.py changes it. Files outside CODE_FILES (records.py, the checks, the downloader,
    the report) are not in it at all."""
    assert set(records.CODE_FILES) == {
        "model.py",
        "train.py",
        "machine.py",
        "cells.py",
        "checkpoint.py",
        "data/shards.py",
    }
    for name in records.CODE_FILES:
        os.makedirs(tmp_path / os.path.dirname(name), exist_ok=True)
        shutil.copy(os.path.join(records.HERE, name), tmp_path / name)
    monkeypatch.setattr(records, "HERE", str(tmp_path))
    originals = {name: (tmp_path / name).read_text() for name in records.CODE_FILES}
    recorded = records.code_record()
    before = recorded["fingerprint"]
    for name, text in originals.items():  # each file's first raised message, and train.py's first print
        reworded = re.sub(r'(raise \w+\(f?")', r"\1reworded: ", text, count=1)
        reworded = re.sub(r'(print\(f?")', r"\1note: ", reworded, count=1)
        assert reworded != text
        (tmp_path / name).write_text(reworded)
    assert records.code_record()["fingerprint"] == before
    model = originals["model.py"]
    # an operator: the first product or sum of model.py, flipped
    flips = {ast.Mult: ("*", "/"), ast.Add: ("+", "-")}
    node = math_nodes(model, ast.BinOp, lambda n: type(n.op) in flips)[0]
    start, end = (
        offset(model, node.left.end_lineno, node.left.end_col_offset),
        offset(model, node.right.lineno, node.right.col_offset),
    )
    (tmp_path / "model.py").write_text(model[:start] + model[start:end].replace(*flips[type(node.op)]) + model[end:])
    changed = records.code_record()
    assert changed["fingerprint"] != before and records.code_changes(recorded, changed, set(RESIDUALS)) == [
        name for name in recorded["definitions"] if node.lineno in lines(model, name)
    ]
    # a constant: the first non-zero float of model.py, doubled
    node = math_nodes(model, ast.Constant, lambda n: type(n.value) is float and n.value != 0)[0]
    start, end = offset(model, node.lineno, node.col_offset), offset(model, node.end_lineno, node.end_col_offset)
    (tmp_path / "model.py").write_text(model[:start] + repr(node.value * 2) + model[end:])
    assert records.code_record()["fingerprint"] != before
    (tmp_path / "model.py").write_text(model)
    assert records.code_record()["fingerprint"] == before


def lines(source, name):
    """The line numbers of source's top-level definitions of name."""
    return {
        i for n in ast.parse(source).body if records.bound_name(n) == name for i in range(n.lineno, n.end_lineno + 1)
    }


@pytest.fixture
def code_copy(tmp_path, monkeypatch):
    """Copies of the CODE_FILES, which code_record reads instead of the real ones; (folder, edit)."""
    for name in records.CODE_FILES:
        os.makedirs(tmp_path / os.path.dirname(name), exist_ok=True)
        shutil.copy(os.path.join(records.HERE, name), tmp_path / name)
    monkeypatch.setattr(records, "HERE", str(tmp_path))

    def edit(name, old, new):
        text = (tmp_path / name).read_text()
        assert text.count(old) == 1, old
        (tmp_path / name).write_text(text.replace(old, new))

    return tmp_path, edit


def cut(folder, name, definition):
    """Remove the top-level definition of `definition` from a copied file; returns its text."""
    source = (folder / name).read_text()
    node = next(n for n in ast.parse(source).body if records.bound_name(n) == definition)
    text = ast.get_source_segment(source, node, padded=True)
    (folder / name).write_text(source.replace(text, "", 1))
    return text


def test_moving_or_reordering_definitions_and_adding_a_scheme_no_arm_trains_lock_nothing(code_copy, monkeypatch):
    folder, edit = code_copy
    recorded = records.code_record()
    trained = set(recorded["schemes"]) - {"gated"}  # the README's example scheme, registered by conftest
    seed_for = cut(folder, "cells.py", "seed_for")  # a function moved to another fingerprinted file
    with open(folder / "data/shards.py", "a") as f:
        f.write("\n\n" + seed_for + "\n")
    sinkhorn = cut(folder, "model.py", "sinkhorn")  # a definition moved below the others
    edit("model.py", "\nRESIDUALS = dict(", "\n" + sinkhorn + "\n\n\nRESIDUALS = dict(")
    # a new scheme: its class and its registry entry (and the registry's class, as importing the new model.py gives)
    edit("model.py", "scaled_residual=ScaledResidual,\n)", "scaled_residual=ScaledResidual, gated2=GatedResidual)")
    (folder / "model.py").write_text((folder / "model.py").read_text() + "\n\n" + README_SCHEME)
    monkeypatch.setitem(RESIDUALS, "gated2", RESIDUALS["gated"])
    now = records.code_record()
    assert now["definitions"]["seed_for"] == recorded["definitions"]["seed_for"]
    assert records.code_changes(recorded, now, trained) == []  # the grid of every scheme model.py had
    assert records.code_changes(recorded, now, trained | {"gated2"}) == []  # and an arm of the new one added to it
    for scheme in trained:
        assert records.code_changes(recorded, now, {scheme}) == [], scheme
    assert records.code_changes(recorded, now, {"gated"}) == ["GatedResidual"]  # conftest's: not in the files before
    assert records.code_fingerprints(recorded, "attnres") == records.code_fingerprints(now, "attnres")


def test_a_change_locks_the_schemes_that_compute_with_it(code_copy):
    folder, edit = code_copy
    recorded = records.code_record()
    trained = set(recorded["schemes"]) - {"gated"}
    assert recorded["schemes"]["rd_attnres"] == ["AttnRes", "RDAttnRes"]  # its base class
    assert recorded["schemes"]["dar"] == ["AttnRes", "DualAttnRes"]  # a class it calls
    # a registered base class: its own scheme and the schemes built on it, no other
    edit(
        "model.py",
        "return [(\"uniform\", self.name_of(k)) for k in range(1, self.output_read + 1)]",
        "return [(\"uniform\", self.name_of(k)) for k in range(2, self.output_read + 1)]",
    )
    now = records.code_record()
    built_on = {s for s in trained if issubclass(RESIDUALS[s], RESIDUALS["attnres"])}  # attnres, rd_attnres, mhar
    assert {"attnres", "rd_attnres"} <= built_on
    assert {s for s in trained if records.code_changes(recorded, now, {s})} == built_on | {"dar"}  # dar calls it
    assert records.code_changes(recorded, now, {"rd_attnres"}) == ["AttnRes"]
    shared, own = records.code_fingerprints(now, "rd_attnres")
    assert shared == records.code_fingerprints(recorded, "rd_attnres")[0] != own
    assert own != records.code_fingerprints(recorded, "rd_attnres")[1]
    # the base class of every scheme, which the registry does not list: every scheme
    edit("model.py", "class ResidualScheme(nn.Module):", "class ResidualScheme(nn.Module):\n    extra = 1\n")
    now = records.code_record()
    assert all("ResidualScheme" in records.code_changes(recorded, now, {s}) for s in trained)
    assert records.code_fingerprints(now, "standard")[0] != records.code_fingerprints(recorded, "standard")[0]
    # the registry pointing a scheme at another class
    edit("model.py", "dar=DualAttnRes,", "dar=AttnRes,")
    before = dict(RESIDUALS)
    try:
        RESIDUALS["dar"] = RESIDUALS["attnres"]
        assert "RESIDUALS['dar']" in records.code_changes(recorded, records.code_record(), {"dar"})
    finally:
        RESIDUALS.update(before)


def test_a_record_of_an_earlier_version_is_a_change_said_once(tmp_path):
    old = dict(DEFAULTS, arm="a", seed=0, code=dict(fingerprint="e" * 64, files={"model.py": "e" * 64}))
    new = dict(old, code=records.code_record())
    with pytest.raises(
        ConfigError,
        match=r"code changed \(all of it: recorded per file by an earlier version\); "
        r".*--allow_changes=True",
    ):
        records.check_rerun("config.json", old, new, False)
    assert records.check_rerun("config.json", old, new, True) == {"code": ["e" * 64, new["code"]["fingerprint"]]}


# --- the rerun check: one for the grid's record, a cell's, a checkpoint's --------------------------

CODE = dict(fingerprint="f" * 64, definitions={"GPT": "f" * 16}, schemes={}, git_commit=None, git_dirty=None)


def grid_cfg(out_dir, **override):
    cfg = dict(DEFAULTS, out_dir=str(out_dir), init_from_sha256=None, **override)
    records.check_config(cfg, 1)
    return cfg


def test_records_that_train_py_did_not_write_are_one_line(tmp_path):
    path = tmp_path / "config.json"
    for text in ("[]", "5", "null"):
        path.write_text(text)
        with pytest.raises(ConfigError, match="not a train.py record; restore it"):
            records.GridRecord(grid_cfg(tmp_path), CODE)
    path.write_text('{"learning_rate": NaN}')  # not JSON
    with pytest.raises(ConfigError, match="config.json is unreadable or damaged"):
        records.GridRecord(grid_cfg(tmp_path), CODE)
    good = dict(status="finished", seed=0, val_loss=1.5, diverged_at=None)
    for bad in (
        dict(good, val_loss="1.5"),
        dict(good, val_loss=True),
        dict(good, status="diverged"),
        dict(good, seed="0"),
        {k: v for k, v in good.items() if k != "status"},
    ):
        with pytest.raises(ConfigError, match="is not a result train.py wrote"):
            records.check_result(bad, "result.json")
    assert records.check_result(dict(good, status="diverged", val_loss=None, diverged_at=3), "r") is not None


def test_check_rerun_refuses_another_cell_and_changed_settings_unless_allowed():
    old = dict(DEFAULTS, arm="a", seed=0, code=CODE)
    assert records.check_rerun("ckpt.pt", old, dict(old), False) == {}
    with pytest.raises(
        ConfigError,
        match=r"o/a/seed1/ckpt.pt is the record of arm 'a' seed 0 \(a copied file or "
        r"folder\?\); delete o/a/seed1 to train this cell",
    ):
        records.check_rerun("o/a/seed1/ckpt.pt", old, dict(old, seed=1), True)  # allowed changes or not
    new = dict(old, learning_rate=1e-3, code=dict(CODE, fingerprint="0" * 64, definitions={"GPT": "0" * 16}))
    with pytest.raises(
        ConfigError,
        match=r"ckpt.pt was made with other settings: learning_rate \(0.003 -> 0.001\), "
        r"code changed \(GPT\); rerun with the recorded ones",
    ) as e:
        records.check_rerun("ckpt.pt", old, new, False)
    assert "\n" not in str(e.value)
    assert records.check_rerun("ckpt.pt", old, new, True) == {
        "learning_rate": [3e-3, 1e-3],
        "code": ["f" * 64, "0" * 64],
    }
    # the grid's record names no cell: arms and seeds are added, an arm's changed settings are a change
    grid = dict(DEFAULTS, code=CODE)
    assert records.check_rerun("config.json", grid, dict(grid, seeds=[5], arms={"x": {}}), False) == {}
    with pytest.raises(ConfigError, match=r"made with other settings: arms\['attnres'\] \("):
        records.check_rerun(
            "config.json", grid, dict(grid, arms={"attnres": {"residual": "attnres", "learning_rate": 1e-3}}), False
        )


def test_a_copied_result_or_record_is_not_a_new_seed(tmp_path):
    cfg = grid_cfg(tmp_path, arms={"a": {"residual": "standard"}}, seeds=[0, 7])
    val = records.ValidationText(np.arange(20000, dtype=np.uint16), None)
    seed0, seed7 = tmp_path / "a" / "seed0", tmp_path / "a" / "seed7"
    seed0.mkdir(parents=True)
    cell = records.cell_config(cfg, "a", 0)
    record = dict(cell, code=CODE, val_hash=val.hash(cell["eval_tokens"], cell["block_size"], cell["eval_layout"]))
    (seed0 / "config.json").write_text(json.dumps(record))
    (seed0 / "result.json").write_text(json.dumps(dict(arm="a", seed=0, status="finished", val_loss=1.0)))
    assert records.check_cell(cfg, "a", 0, CODE, val) == {}
    shutil.copytree(seed0, seed7)
    with pytest.raises(ConfigError, match=r"seed7/result.json is the record of arm 'a' seed 0 \(a copied"):
        records.check_cell(cfg, "a", 7, CODE, val)
    os.remove(seed7 / "result.json")
    (seed7 / "ckpt.pt").write_bytes(b"")
    with pytest.raises(ConfigError, match=r"seed7/config.json is the record of arm 'a' seed 0 \(a copied"):
        records.check_cell(cfg, "a", 7, CODE, val)
    with pytest.raises(ConfigError, match=r"seed0/config.json was made with other settings: learning_rate"):
        records.check_cell(dict(cfg, learning_rate=1e-3, min_lr=1e-4), "a", 0, CODE, val)


def test_two_runs_started_at_once_on_a_new_grid(tmp_path):
    # both check before either has trained a cell (no config.json yet); the first to train records the grid
    first = records.GridRecord(grid_cfg(tmp_path, seeds=[0]), CODE)
    other = records.GridRecord(grid_cfg(tmp_path, seeds=[1], learning_rate=1e-2), CODE)
    same = records.GridRecord(grid_cfg(tmp_path, seeds=[2]), CODE)
    first.write_once()
    recorded = (tmp_path / "config.json").read_text()
    with pytest.raises(ConfigError, match=r"config.json was made with other settings: learning_rate \(0.003 -> 0.01\)"):
        other.write_once()
    assert (tmp_path / "config.json").read_text() == recorded and os.listdir(tmp_path) == ["config.json"]
    same.write_once()  # the same settings: it joins the grid
    assert json.loads((tmp_path / "config.json").read_text())["seeds"] == [0, 2]
    # on a grid that exists, two runs that each add a seed keep both
    three, four = (records.GridRecord(grid_cfg(tmp_path, seeds=[s]), CODE) for s in (3, 4))
    three.write_once()
    four.write_once()
    assert json.loads((tmp_path / "config.json").read_text())["seeds"] == [0, 2, 3, 4]


# --- results -------------------------------------------------------------------------------------------


def test_a_huge_finite_loss_is_recorded_without_a_perplexity(tmp_path):
    model = torch.nn.Linear(2, 2)
    model.num_params = lambda non_embedding=True, active=False: 6
    cell = dict(DEFAULTS, arm="a", seed=0, arms={"a": {}}, init_from_sha256=None)
    path = tmp_path / "result.json"
    records.write_result(
        str(path),
        cell,
        dict(val_hash="h"),
        model,
        CODE,
        steps=3,
        tokens=9,
        val_loss=812.5,
        sequence_losses=np.array([812.5]),
        diverged=None,
        routing={},
        init_hash="i",
        data_hash="d",
        eval_tokens=8,
        validation=dict(layout="spread", sequences=1, tokens=8),
        changes=[],
        wall_time_s=1.0,
    )
    r = json.loads(path.read_text(), parse_constant=lambda c: pytest.fail(f"{c} in result.json"))
    assert r["val_loss"] == 812.5 and r["val_ppl"] is None and r["status"] == "finished"


def test_rounded_diagnostics_are_strict_json():
    assert records.rounded({"a": torch.tensor([1.0, float("nan")]), 2: float("inf"), "b": 0.1234567}) == {
        "a": [1.0, None],
        "2": None,
        "b": 0.123457,
    }


def test_an_arm_with_its_own_learning_rate_trains_at_it_pairs_and_is_rerun_checked(shards, tmp_path, monkeypatch):
    import report

    monkeypatch.setattr(report, "main", lambda argv: None)
    arms = {"base": {"residual": "standard"}, "slow": {"residual": "standard", "learning_rate": 2e-3, "min_lr": 2e-4}}
    args = tiny(shards, tmp_path / "o", "--max_iters=3", "--eval_interval=3", "--warmup_iters=1", f"--arms={arms!r}")
    train.main(args)
    base, slow = result(tmp_path / "o", "base"), result(tmp_path / "o", "slow")
    config = json.loads((tmp_path / "o" / "slow" / "seed0" / "config.json").read_text())
    assert (config["learning_rate"], config["min_lr"]) == (2e-3, 2e-4) and base["config"]["learning_rate"] == 1e-2
    assert [r["lr"] for r in log_records(tmp_path / "o", "slow") if "lr" in r][0] == pytest.approx(2e-3)
    assert slow["pairing"]["arm_settings"] == arms["slow"] and base["pairing"]["arm_settings"] == arms["base"]
    # everything but the arm's own settings pairs: the same init, batches, code and shared settings
    assert "learning_rate" not in slow["pairing"]["settings"] and base["pairing"]["settings"]["learning_rate"] == 1e-2
    shared = [{k: v for k, v in r["pairing"].items() if k not in ("arm_settings", "settings")} for r in (base, slow)]
    assert shared[0] == shared[1] and slow["val_loss"] != base["val_loss"]
    assert {k: v for k, v in slow["pairing"]["settings"].items() if k not in ("learning_rate", "min_lr")} == {
        k: v for k, v in base["pairing"]["settings"].items() if k not in ("learning_rate", "min_lr")
    }
    # a rerun with the arm's learning rate changed is refused, naming the arm; with it unchanged, nothing trains
    arms["slow"]["learning_rate"] = 3e-3
    with pytest.raises(ConfigError, match=r"config.json was made with other settings: arms\['slow'\] \("):
        train.main(args[:-1] + [f"--arms={arms!r}"])
    monkeypatch.setattr(cells, "GPT", lambda *a: pytest.fail("a finished cell trained again"))
    train.main(args)


# --- warm start -----------------------------------------------------------------------------------------


def test_damaged_or_foreign_init_from_files_are_one_line(tmp_path):
    (tmp_path / "text.pt").write_bytes(b"hello world" * 10)
    torch.save({"config": [1], "model": {1: torch.zeros(1)}}, tmp_path / "intkeys.pt")
    for name, message in (("text.pt", "is missing or unreadable"), ("intkeys.pt", "holds neither a train.py ckpt.pt")):
        with pytest.raises(ConfigError, match=message):
            checkpoint.load_init_from(str(tmp_path / name))
    cfg = grid_cfg(
        tmp_path,
        n_layer=2,
        n_head=2,
        n_embd=16,
        block_size=8,
        vocab_size=32,
        eval_tokens=100,
        arms={"s": {"residual": "standard"}, "d": {"residual": "denseformer"}},
    )
    weights = GPT(records.model_config(cfg, {})).state_dict()
    torch.save(weights, tmp_path / "good.pt")
    init = checkpoint.load_init_from(str(tmp_path / "good.pt"))
    assert set(init.weights) == set(weights) and len(init.sha256) == 64 and init.tokenizer is None
    checkpoint.check_init_fits(init, cfg)
    with pytest.raises(
        ConfigError,
        match=r"init_from=.*good.pt does not fit arm 'w': lm_head.weight is "
        r"\(32, 16\) there, \(32, 32\) in the arm",
    ):
        checkpoint.check_init_fits(init, dict(cfg, arms=dict(cfg["arms"], w={"n_embd": 32})))
    assert checkpoint.load_init_from("") == checkpoint.WarmStart()  # none: every cell from its seed's init
    # a diverged run's weights: every cell would diverge at step 0
    for value in (float("nan"), float("inf")):
        broken = dict(
            weights, **{"transformer.h.1.mlp.c_fc.weight": weights["transformer.h.1.mlp.c_fc.weight"].clone()}
        )
        broken["transformer.h.1.mlp.c_fc.weight"][0, 0] = value
        torch.save(broken, tmp_path / "broken.pt")
        with pytest.raises(
            ConfigError,
            match=r"broken.pt holds non-finite values \(NaN or inf\) in "
            r"transformer.h.1.mlp.c_fc.weight; warm-start from a checkpoint",
        ):
            checkpoint.load_init_from(str(tmp_path / "broken.pt"))
    # an untied head: loading it into this model's one tensor would silently drop the embedding
    untied = dict(weights, **{"lm_head.weight": weights["lm_head.weight"] + 1})
    torch.save(untied, tmp_path / "untied.pt")
    with pytest.raises(
        ConfigError,
        match=r"untied.pt has an embedding \(transformer.wte.weight\) and a head "
        r"\(lm_head.weight\) that differ; this model ties them",
    ):
        checkpoint.load_init_from(str(tmp_path / "untied.pt"))


def test_a_grid_made_between_the_look_and_the_write_is_checked_not_overwritten(tmp_path, monkeypatch):
    first = records.GridRecord(grid_cfg(tmp_path, seeds=[0]), CODE)
    other = records.GridRecord(grid_cfg(tmp_path, seeds=[1], learning_rate=1e-2), CODE)
    first.write_once()
    recorded = (tmp_path / "config.json").read_text()
    looks, exists = [], os.path.exists
    # other's write looks once and sees no config.json: first made it just after that look (the race
    # that the exclusive creation exists for)
    monkeypatch.setattr(
        records.os.path,
        "exists",
        lambda p: exists(p) if p != other.path or looks.append(p) or len(looks) > 1 else False,
    )
    with pytest.raises(ConfigError, match=r"config.json was made with other settings: learning_rate \(0.003 -> 0.01\)"):
        other.write_once()
    assert (tmp_path / "config.json").read_text() == recorded


def test_definitions_that_compute_nothing_lock_no_grid_and_the_rest_do():
    # where the data is found, when the report is written and how a tool opens a cell change no number: fixing one
    # (write_report gained a wait, issue #52) must not refuse a rerun; the step's learning rate must
    now = records.code_record()
    assert "write_report" in now["definitions"] and "learning_rate_at" in now["definitions"], "names moved: update"
    for name, locks in (("write_report", False), ("find_data", False), ("learning_rate_at", True)):
        edited = dict(now, definitions=dict(now["definitions"], **{name: "0" * 16}))
        assert bool(records.code_changes(now, edited, {"standard"})) == locks, f"editing {name} locks: {not locks}"
        assert (records.code_fingerprints(now, "standard") != records.code_fingerprints(edited, "standard")) == locks


# --- bad input of issue #66: arms named after schemes, the eval_layout hint, a frozen grid's validation text -------


def test_an_arm_named_after_a_scheme_trains_that_scheme_in_a_config_file_too(tmp_path):
    (tmp_path / "c.json").write_text('{"arms": {"standard": {}, "mhar": {}, "wide": {"n_embd": 64}}}')
    given = configure(DEFAULTS, [str(tmp_path / "c.json")], entries=dict(arms=train.SCHEME_ARMS))
    records.check_config(given, 1)
    arms = records.typed_arms(given)  # what train.build_config records
    assert arms == {"standard": {"residual": "standard"}, "mhar": {"residual": "mhar"}, "wide": {"n_embd": 64}}
    assert arms["mhar"] == checked(["--arms=standard,mhar"])["arms"]["mhar"]  # as --arms=mhar
    cells = {arm: records.cell_config(dict(given, arms=arms), arm, 0) for arm in arms}
    assert (cells["standard"]["residual"], cells["mhar"]["residual"], cells["wide"]["residual"]) == (
        "standard",
        "mhar",
        "standard",
    )
    # the run's residual reaches only the arms not named after a scheme: the baseline stays the baseline
    given = configure(DEFAULTS, [str(tmp_path / "c.json"), "--residual=attnres"], entries=dict(arms=train.SCHEME_ARMS))
    arms = records.typed_arms(given)
    assert [records.model_config(given, arms[a]).residual for a in arms] == ["standard", "mhar", "attnres"]
    # an arm named after one scheme that sets another: one line, from a config file or --arms
    (tmp_path / "c.yaml").write_text("arms:\n  standard: {residual: attnres}\n  attnres: {}\n")
    for argv, free in (
        ([str(tmp_path / "c.yaml")], "attnres-standard"),
        (["--arms={'standard': {'residual': 'attnres'}}"], "attnres"),
    ):
        with pytest.raises(ConfigError) as e:
            checked(argv)
        assert str(e.value) == (
            f"arm 'standard' sets residual='attnres', but an arm named after a scheme trains that scheme (as "
            f"--arms=standard does); rename the arm, e.g. to '{free}'"
        )


@pytest.mark.skipif(
    not os.path.isfile(os.path.join(ROOT, "results", "leaderboard_pydoc", "grids.tar.xz")), reason="no stored grids"
)
def test_the_stored_grids_arms_are_typed_to_the_bytes_they_recorded():
    import tarfile

    seen = 0
    for name in ("leaderboard_pydoc", "leaderboard_shakespeare"):
        with tarfile.open(os.path.join(ROOT, "results", name, "grids.tar.xz")) as archive:
            for member in archive:
                if member.name.endswith("config.json") and member.name.count("/") <= 2:  # a grid's, a tuning's
                    recorded = json.load(archive.extractfile(member))
                    assert json.dumps(records.typed_arms(recorded)) == json.dumps(recorded["arms"]), member.name
                    seen += 1
    assert seen >= 4


def test_the_eval_layout_hint_names_the_recorded_layout(tmp_path):
    cfg = dict(DEFAULTS, out_dir=str(tmp_path), arms={"standard": {}}, seeds=[0])
    before = {k: v for k, v in cfg.items() if k != "eval_layout"}  # a grid made before the setting
    for recorded, now, hint in (
        (dict(cfg, eval_layout="spread"), "first", "(eval_layout: give --eval_layout=spread, as recorded)"),
        (before, "spread", "(eval_layout: give --eval_layout=first, as recorded, the layout of every grid made"),
    ):
        with pytest.raises(ConfigError) as e:
            records.check_rerun("config.json", recorded, dict(cfg, eval_layout=now), False)
        assert hint in str(e.value) and "\n" not in str(e.value), str(e.value)


def test_a_frozen_grid_needs_no_room_for_tuning_sequences(shards, tmp_path, monkeypatch):
    val, T = (np.arange(3000) % 251).astype(np.uint16), 16  # 176 slots of 17 tokens
    test, tune = records.ValidationText(val, "bytes"), records.ValidationText(val, "bytes", part="tune")
    starts = test.starts(1600, T, "spread")  # 99 sequences: 2 x 99 do not fit, 99 do
    assert len(set(starts)) == 99 and np.all(starts % (T + 1) == 0) and starts[-1] + T + 1 <= len(val)
    assert np.all(np.abs(starts // (T + 1) - (np.arange(99) + 0.5) * 176 / 99) < 1)  # one in each of 99 stretches
    with pytest.raises(ConfigError, match=r"reads 2 x 99 sequences of 17 tokens \(the reported ones and the tuning"):
        tune.starts(1600, T, "spread")  # a tuned grid's tuning text has no room
    with pytest.raises(ConfigError) as e:
        test.starts(2833, T, "spread")
    assert str(e.value) == (
        "eval_layout='spread' reads 177 sequences of 17 tokens but the validation shard holds 176 (3,000 tokens); "
        "set --eval_tokens=2817 or less, or give a longer validation shard"
    )
    test.starts(2817, T, "spread")
    # where both halves fit, the reported sequences are where every grid so far read them: the even ones of 2 n
    np.testing.assert_array_equal(test.starts(1409, T, "spread"), (np.arange(0, 176, 2) * 2 + 1) * 176 // 352 * 17)
    import report

    monkeypatch.setattr(report, "main", lambda argv: None)
    train.main(tiny(shards, tmp_path / "o", "--arms=standard", "--seeds=0", "--max_iters=1", "--eval_tokens=1600"))
    assert result(tmp_path / "o", "standard")["status"] == "finished"
