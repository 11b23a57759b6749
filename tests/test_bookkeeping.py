import dataclasses
import json
import os
import sys

import pytest
import torch

import bookkeeping
import train
from configurator import ConfigError, configure
from model import GPTConfig


# --- keys, checks, device --------------------------------------------------------------------

def test_every_model_field_is_a_key_and_can_be_set_per_arm():
    for field in dataclasses.fields(GPTConfig):
        value = train.DEFAULTS[field.name]
        cfg = configure(train.DEFAULTS, [f"--{field.name}={value!r}", f"--arms={{'a': {{'{field.name}': {value!r}}}}}"])
        bookkeeping.check_config(cfg, 1)
        assert getattr(bookkeeping.model_config(cfg, cfg["arms"]["a"]), field.name) == value
    cfg = dict(train.DEFAULTS, arms={"a.1": {"dropout": 0}})  # an int for a float, as --dropout=0
    bookkeeping.check_config(cfg, 1)
    assert type(cfg["arms"]["a.1"]["dropout"]) is float
    # the ablations the README names, as arms
    cfg = configure(train.DEFAULTS, ["--arms={'self': {'residual': 'dar', 'dar_keys': 'self'}, "
                                     "'hc2': {'residual': 'hc', 'hc_streams': 2}}"])
    bookkeeping.check_config(cfg, 1)
    assert bookkeeping.cell_config(cfg, "self", 0)["dar_keys"] == "self" and bookkeeping.cell_config(cfg, "hc2", 0)["hc_streams"] == 2
    assert bookkeeping.model_config(cfg, cfg["arms"]["hc2"]).hc_streams == 2


@pytest.mark.parametrize("override, message", [
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
    ({"gradient_accumulation_steps": 0}, "gradient_accumulation_steps=0 must be at least 1"),
    ({"block_size": 0}, "arm 'attnres': block_size=0 must be a positive integer"),  # before anything divides by it
    ({"n_head": 0}, "arm 'attnres': n_head=0 must be a positive integer"),
    ({"arms": {"a": {"n_layer": "x"}}}, "arm 'a': n_layer must be a int, got 'x'"),
    ({"arms": {"a": {"dropout": "0.1"}}}, "arm 'a': dropout must be a float"),
    ({"arms": {"": {}}}, "arm name ''"),
    ({"arms": {"../a": {}}}, "arm name '../a'"),
    ({"arms": {"-a": {}}}, "arm name '-a'"),
    ({"arms": {1: {}}}, "arm name 1"),
    ({"arms": {"config.json": {}}}, "arm name 'config.json': use letters"),
    ({"arms": {"paired.json": {}}}, "arm name 'paired.json'"),
    ({"arms": {"val_loss.png": {}}}, "arm name 'val_loss.png'"),
    ({"batch_size": 3, "world": 2}, "3 sequences do not split evenly over 2 processes"),
])
def test_bad_settings_are_one_line(override, message):
    world = override.pop("world", 1)
    with pytest.raises(ConfigError) as e:
        bookkeeping.check_config(dict(train.DEFAULTS, **override), world)
    assert message in str(e.value) and "\n" not in str(e.value)


@pytest.mark.parametrize("requested, world, local_rank, cuda, mps, expected", [
    ("auto", 1, 0, 0, False, "cpu"),
    ("auto", 1, 0, 0, True, "mps"),
    ("auto", 1, 0, 1, True, "cuda:0"),  # one process: an indexed device, as torch.cuda.set_device needs
    ("auto", 4, 3, 8, False, "cuda:3"),  # torchrun: the process's own GPU
    ("cuda", 1, 0, 2, False, "cuda:0"),
    ("cuda", 1, 1, 2, False, "cuda:1"),  # torchrun --nproc_per_node=1 on a later local rank
    ("cuda", 2, 1, 2, False, "cuda:1"),
    ("cuda:1", 1, 0, 2, False, "cuda:1"),
    ("cpu", 1, 0, 8, True, "cpu"),
    ("cpu", 2, 1, 0, False, "cpu"),
    ("mps", 1, 0, 0, True, "mps"),
    ("cuda", 1, 0, 0, False, "sees no CUDA GPU"),
    ("cuda:0", 1, 0, 0, True, "sees no CUDA GPU"),
    ("cuda:1", 2, 0, 2, False, "names one GPU for 2 processes"),
    ("cuda:2", 1, 0, 2, False, "cuda:2 does not exist"),
    ("cuda", 4, 3, 2, False, "cuda:3 does not exist"),
    ("mps", 1, 0, 1, False, "sees no MPS device"),
    ("gpu", 1, 0, 1, False, "choose auto, cpu, cuda, cuda:N or mps"),
    ("cpu:0", 1, 0, 1, False, "choose auto, cpu, cuda, cuda:N or mps"),
    ("cuda:x", 1, 0, 1, False, "choose auto, cpu, cuda, cuda:N or mps"),
])
def test_resolve_device(requested, world, local_rank, cuda, mps, expected):
    if expected in ("cpu", "mps") or expected.startswith("cuda:") and " " not in expected:
        assert bookkeeping.resolve_device(requested, world, local_rank, cuda, mps) == expected
    else:
        with pytest.raises(ConfigError, match=expected):
            bookkeeping.resolve_device(requested, world, local_rank, cuda, mps)


def test_evals_after_counts_the_evaluations_to_come():
    for n in range(1, 25):
        for k in range(1, 12):
            for step in range(-1, n + 1):  # -1: a cell not started, whose step 0 is evaluated too
                expected = sum(1 for s in range(step + 1, n + 1) if s % k == 0 or s == n)
                assert bookkeeping.evals_after(step, dict(max_iters=n, eval_interval=k)) == expected


def test_failed_checkpoint_write_keeps_the_last_good_one(tmp_path):
    path = str(tmp_path / "ckpt.pt")
    bookkeeping.save_atomically({"step": 1}, path)

    def full_disk(obj, p):
        with open(p, "wb") as f:
            f.write(b"half")
        raise RuntimeError("[enforce fail at inline_container.cc:603] . unexpected pos 64 vs 0\nbasic_ios::clear")
    with pytest.raises(ConfigError, match="could not write .*ckpt.pt .*unexpected pos.*last good copy is kept") as e:
        bookkeeping.save_atomically({"step": 2}, path, full_disk)
    assert "\n" not in str(e.value)
    assert os.listdir(tmp_path) == ["ckpt.pt"] and torch.load(path)["step"] == 1


# --- the command line never loses a model key ---------------------------------------------------

def checked(argv, world=1):
    cfg = configure(train.DEFAULTS, argv, entries=dict(arms=train.SCHEME_ARMS))
    bookkeeping.check_config(cfg, world, [a[2:].partition("=")[0] for a in argv if a.startswith("--")])
    return cfg


def test_scheme_names_are_arms_and_overridden_keys_are_refused():
    cfg = checked(["--arms=standard,denseformer"])
    assert cfg["arms"] == {"standard": {"residual": "standard"}, "denseformer": {"residual": "denseformer"}}
    assert checked(["--arms=attnres,hc"])["arms"]["attnres"] == {"residual": "attnres"}  # the default arm's entry
    with pytest.raises(ConfigError, match=r"--residual='dar' is overridden by every arm \(attnres, rd_attnres set "
                                          r"residual\); use --arms=dar"):
        checked(["--residual=dar"])
    with pytest.raises(ConfigError, match=r"--n_layer=3 is overridden by every arm \(a set n_layer\)"):
        checked(["--n_layer=3", "--arms={'a': {'n_layer': 2}}"])
    assert checked(["--residual=dar", "--arms={'a': {'residual': 'attnres'}, 'b': {}}"])["arms"]["b"] == {}
    # a scheme's option reaches that scheme's arms only, and is refused when no arm trains it
    cfg = checked(["--arms=standard,hc", "--hc_streams=2"])
    assert bookkeeping.model_config(cfg, cfg["arms"]["hc"]).hc_streams == 2
    assert bookkeeping.model_config(cfg, cfg["arms"]["standard"]).hc_streams == GPTConfig.hc_streams
    standard, hc = (bookkeeping.cell_config(cfg, arm, 0) for arm in ("standard", "hc"))
    assert "hc_streams" not in bookkeeping.pairing_settings(standard, cfg["arms"]["standard"])
    assert bookkeeping.pairing_settings(hc, cfg["arms"]["hc"])["hc_streams"] == 2
    with pytest.raises(ConfigError, match=r"--hc_streams=2 is an option of residual=hc or mhc, which no arm trains"):
        checked(["--hc_streams=2"])


@pytest.mark.parametrize("argv, message", [
    (["--out_dir=None"], "out_dir cannot be None; give a str"),
    (["--max_iters=None"], "max_iters cannot be None; give a int"),
    (["--compile=None"], "compile cannot be None"),
    (["--learning_rate=None"], "learning_rate cannot be None"),
    (["--learning_rate=float('inf')"], "learning_rate must be a float, got"),  # not a literal: a string
    (["--arms={'a': {'norm_eps': None}}"], "arm 'a': norm_eps cannot be None"),
])
def test_none_and_non_literals_are_one_line(argv, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        checked(argv)


@pytest.mark.parametrize("key", ["learning_rate", "norm_eps", "min_lr", "grad_clip", "dropout"])
def test_non_finite_settings_are_refused(key):
    for value in (float("inf"), float("nan")):
        with pytest.raises(ConfigError, match=f"{key}={value} must be a finite number"):
            bookkeeping.check_config(dict(train.DEFAULTS, **{key: value}), 1)
    with pytest.raises(ConfigError, match="arm 'a': norm_eps=inf must be a finite number"):
        bookkeeping.check_config(dict(train.DEFAULTS, arms={"a": {"norm_eps": float("inf")}}), 1)


@pytest.mark.parametrize("arm", ["config.json.tmp", "report.md.tmp", "paired.json.tmp", "val_loss.png.tmp",
                                 "report.md", "x.json"])
def test_arm_names_are_never_the_grid_files(arm):
    with pytest.raises(ConfigError, match="arm name"):
        bookkeeping.check_config(dict(train.DEFAULTS, arms={arm: {}}), 1)


# --- the code fingerprint -------------------------------------------------------------------------

def test_comments_docstrings_and_layout_are_not_code():
    source = 'def f(x):\n    return x + 1\n\n\nclass A:\n    y = 2\n'
    same = ('"""A module."""\n# a comment\ndef f(x):  # why\n    """Doc."""\n\n    return (x +\n            1)\n\n'
            'class A:\n    """Doc."""\n    y = 2  # two\n')
    assert bookkeeping.code_fingerprint(source) == bookkeeping.code_fingerprint(same)
    for changed in ('def f(x):\n    return x + 2\n\n\nclass A:\n    y = 2\n',  # a value
                    'def f(x):\n    return x + 1\n\n\nclass A:\n    z = 2\n',  # a name
                    'def f(x):\n    "a string that is code"\n    return x + 1\nclass A:\n    y = 2\n    "doc"\n'):
        if "string that is code" in changed:  # a docstring is not code; a string after the first statement is
            assert bookkeeping.code_fingerprint(changed) != bookkeeping.code_fingerprint(changed.replace('\n    "doc"', ''))
        else:
            assert bookkeeping.code_fingerprint(changed) != bookkeeping.code_fingerprint(source)
    code = bookkeeping.code_record()
    assert set(code["files"]) == set(bookkeeping.CODE_FILES)
    old = dict(code, files=dict(code["files"], **{"model.py": "0" * 64}))
    assert bookkeeping.changed_files(old, code) == ["model.py"]


# --- records written by hand, copied folders, locks -----------------------------------------------

def test_a_lock_appears_with_its_content_and_an_empty_one_is_taken_over(tmp_path):
    cell = tmp_path / "arm" / "seed0"
    cell.mkdir(parents=True)
    (cell / "lock").write_text("")  # an older version killed between creating the lock and writing it
    with bookkeeping.cell_lock(str(cell), True):
        assert (cell / "lock").read_text().split()[0] == str(os.getpid())
        assert sorted(os.listdir(cell)) == ["lock"]  # the written file it was linked from is gone
    assert os.listdir(cell) == []
    (tmp_path / "file").write_text("")
    with pytest.raises(ConfigError, match="cannot create the cell folder .*file/seed0 .*move away the file"):
        with bookkeeping.cell_lock(str(tmp_path / "file" / "seed0"), True):
            pass


def test_records_that_train_py_did_not_write_are_one_line(tmp_path):
    path = tmp_path / "config.json"
    for text in ("[]", "5", "null"):
        path.write_text(text)
        with pytest.raises(ConfigError, match="not a train.py record; restore it"):
            bookkeeping.check_rerun(str(path), {}, False)
    good = dict(status="finished", seed=0, val_loss=1.5, diverged_at=None)
    for bad in (dict(good, val_loss="1.5"), dict(good, val_loss=True), dict(good, status="diverged"),
                dict(good, seed="0"), {k: v for k, v in good.items() if k != "status"}):
        with pytest.raises(ConfigError, match="is not a result train.py wrote"):
            bookkeeping.check_result(bad, "result.json")
    assert bookkeeping.check_result(dict(good, status="diverged", val_loss=None, diverged_at=3), "r") is not None


def test_a_huge_finite_loss_is_recorded_without_a_perplexity(tmp_path):
    model = torch.nn.Linear(2, 2)
    model.num_params = lambda non_embedding=True: 6
    cell = dict(train.DEFAULTS, arm="a", seed=0, arms={"a": {}}, init_from_sha256=None)
    path = tmp_path / "result.json"
    bookkeeping.write_result(str(path), cell, dict(val_hash="h"), model, dict(fingerprint="f"), steps=3, tokens=9,
                             val_loss=812.5, diverged=None, routing={}, init_hash="i", data_hash="d", eval_tokens=8,
                             changes=[], wall_time_s=1.0)
    r = json.loads(path.read_text(), parse_constant=lambda c: pytest.fail(f"{c} in result.json"))
    assert r["val_loss"] == 812.5 and r["val_ppl"] is None and r["status"] == "finished"


def test_rounded_diagnostics_are_strict_json():
    assert bookkeeping.rounded({"a": torch.tensor([1.0, float("nan")]), 2: float("inf"), "b": 0.1234567}) == \
        {"a": [1.0, None], "2": None, "b": 0.123457}


def test_a_full_disk_says_so(tmp_path, monkeypatch):
    monkeypatch.setattr(bookkeeping.shutil, "disk_usage", lambda p: shutil_usage(free=4096))

    def torch_full(obj, p):
        with open(p, "wb") as f:
            f.write(b"half")
        raise RuntimeError("[enforce fail at inline_container.cc:603] . unexpected pos 64 vs 0")
    with pytest.raises(ConfigError, match=r"could not write .*ckpt.pt \(no space left on device\); the last good"):
        bookkeeping.save_atomically({}, str(tmp_path / "ckpt.pt"), torch_full)
    assert os.listdir(tmp_path) == []


def shutil_usage(free):
    import collections
    return collections.namedtuple("usage", "total used free")(1 << 30, (1 << 30) - free, free)


# --- time left, on a fake clock ---------------------------------------------------------------------

def test_time_left_counts_training_and_evaluation_apart():
    cfg = dict(max_iters=100, eval_interval=25)
    todo = [("a", 0), ("b", 0), ("a", 1)]
    rates = {}
    clock = bookkeeping.TimeLeft(cfg, todo, rates)
    clock.evaluated(30.0)  # step 0's evaluation: compiles
    cell, grid = clock.logged("a", 0, 10, 10, 50.0)  # the first interval compiles too: 5 s/step, not kept
    assert cell == pytest.approx(90 * 5.0 + 4 * 30.0)
    assert clock.logged("a", 0, 20, 10, 10.0)[0] == pytest.approx(80 * 1.0 + 4 * 30.0)  # 1 s/step from here
    clock.evaluated(2.0)  # the fastest evaluation is the one that counts
    cell, grid = clock.logged("a", 0, 30, 10, 30.0)  # (10 + 30) s / 20 steps = 2 s/step
    assert cell == pytest.approx(70 * 2.0 + 3 * 2.0)
    # the two cells after this one, at this arm's rates (no other arm measured yet): 100 steps, 5 evaluations
    assert grid == pytest.approx(cell + 2 * (100 * 2.0 + 5 * 2.0))
    rates["b"] = (0.5, 1.0)  # once arm b has run in this process, its own rates
    assert clock.logged("a", 0, 40, 10, 20.0)[1] == pytest.approx(60 * 2.0 + 3 * 2.0 + (100 * 0.5 + 5) + (200 + 10))


@pytest.mark.parametrize("override, world, message", [
    ({"optimizer": "sgd"}, 1, "optimizer='sgd': choose adamw or muon"),
    ({"optimizer": "muon", "muon_learning_rate": 0.0}, 1, "muon_learning_rate=0.0 must be positive"),
    ({"fsdp": True}, 1, "fsdp=True shards the model over processes: run under torchrun"),
    ({"fsdp": True, "optimizer": "muon"}, 2, "fsdp=True with optimizer='muon' is not supported"),
    ({"wandb_log": True}, 1, "wandb_log=True needs the wandb package: pip install wandb"),
])
def test_optimizer_fsdp_and_wandb_settings_are_one_line(override, world, message, monkeypatch):
    monkeypatch.delitem(sys.modules, "wandb", raising=False)
    monkeypatch.setattr(bookkeeping.importlib.util, "find_spec", lambda name: None)  # as where wandb is not installed
    with pytest.raises(ConfigError) as e:
        bookkeeping.check_config(dict(train.DEFAULTS, **override), world)
    assert message in str(e.value) and "\n" not in str(e.value)
    bookkeeping.check_config(dict(train.DEFAULTS, fsdp=True, batch_size=8), 2)  # what does run
    bookkeeping.check_config(dict(train.DEFAULTS, optimizer="muon"), 2)


@pytest.mark.parametrize("argv, message", [
    (["--arms=standard,standard"], "arms='standard,standard': give distinct names"),
    (["--arms="], "arms='': give distinct names"),
    (["--arms=standard,,attnres"], "give distinct names"),
    (["--out_dir="], "out_dir is empty; give a folder"),
])
def test_arm_lists_and_empty_folders_are_one_line(argv, message):
    with pytest.raises(ConfigError, match=message):
        checked(argv)


def test_foreign_and_damaged_checkpoints_are_one_line(tmp_path):
    (tmp_path / "text.pt").write_bytes(b"hello world" * 10)
    torch.save({"config": [1], "model": {1: torch.zeros(1)}}, tmp_path / "intkeys.pt")
    for name, message in (("text.pt", "is missing or unreadable"), ("intkeys.pt", "holds neither a train.py ckpt.pt")):
        with pytest.raises(ConfigError, match=message):
            bookkeeping.load_init_from(dict(train.DEFAULTS, init_from=str(tmp_path / name)))
    good = dict(model={}, optimizer={}, step=4, rng=[dict(torch=torch.get_rng_state(), cuda=None)], data_hash="h",
                config={}, loss_sum=0.0, step_last=4, wall_time_s=1.0)
    for change in (dict(step="4"), dict(step=-1), dict(rng=None), dict(rng=[None]), dict(step_last=5)):
        torch.save(dict(good, **change), tmp_path / "ckpt.pt")
        with pytest.raises(ConfigError, match="is not a checkpoint train.py wrote"):
            bookkeeping.load_checkpoint(str(tmp_path / "ckpt.pt"), "cpu")
    (tmp_path / "log.jsonl").write_bytes(b'{"step": 1}\n\xff\xfe\n')
    with pytest.raises(ConfigError, match="log.jsonl is not text"):
        bookkeeping.log_until(str(tmp_path / "log.jsonl"), 4)
