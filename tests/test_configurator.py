"""configurator.py: config files and --key=value overrides, their types, and the one-line errors."""

import pytest

import train
from configurator import ConfigError, configure

DEFAULTS = dict(out_dir="out", learning_rate=3e-4, max_iters=100, compile=True, init_from=None,
                seeds=[0, 1], arms={"a": {"residual": "attnres"}, "b": {"residual": "rd_attnres"}})


def test_configurator_overrides():
    cfg = configure(DEFAULTS, ["--out_dir=runs/lr=3e-4", "--learning_rate=1", "--max_iters=1e3",
                               "--compile=false", "--init_from=[1, 2]", "--seeds=3,4", "--arms=b"])
    assert cfg["out_dir"] == "runs/lr=3e-4"  # only the first '=' splits
    assert cfg["learning_rate"] == 1.0 and isinstance(cfg["learning_rate"], float)
    assert cfg["max_iters"] == 1000 and isinstance(cfg["max_iters"], int)
    assert cfg["compile"] is False and cfg["init_from"] == [1, 2] and cfg["seeds"] == [3, 4]
    assert cfg["arms"] == {"b": {"residual": "rd_attnres"}}
    assert configure(DEFAULTS, ["--seeds=7"])["seeds"] == [7]
    assert configure(dict(names=["a"]), ["--names=hc,mhc"])["names"] == ["hc", "mhc"]
    assert configure(DEFAULTS, ["--out_dir=123"])["out_dir"] == "123"
    assert DEFAULTS["seeds"] == [0, 1]  # defaults are not mutated


def test_configurator_config_file_then_override(tmp_path):
    path = tmp_path / "c.py"
    path.write_text("import math\n_helper = 2\nmax_iters = 10 * _helper\narms = {'x': {}, 'y': {'residual': 'attnres'}}\n")
    cfg = configure(DEFAULTS, [str(path), "--arms=y"])
    assert cfg["max_iters"] == 20 and cfg["arms"] == {"y": {"residual": "attnres"}}


@pytest.mark.parametrize("argv, message", [
    (["--learnig_rate=1"], "did you mean learning_rate"),
    (["--max_iters=1.5"], "max_iters must be a int"),
    (["--compile=1"], "compile must be True or False"),
    (["--seeds"], "--key=value"),
    (["--arms=c"], "arms has no entry c; known: a, b"),
    (["--arms=aa"], r"arms has no entry aa \(did you mean a\?\)"),
    (["missing.py"], "config file missing.py not found"),
])
def test_configurator_errors(argv, message):
    with pytest.raises(ConfigError, match=message):
        configure(DEFAULTS, argv)


def test_config_file_errors_are_one_line(tmp_path):
    cases = {"unknown.py": ("n_layers = 3\n", "unknown config key 'n_layers'"),
             "syntax.py": ("max_iters = (\n", "syntax.py line 1"),
             "raises.py": ("max_iters = 1 // 0\n", "raised ZeroDivisionError")}
    for name, (text, message) in cases.items():
        (tmp_path / name).write_text(text)
        with pytest.raises(ConfigError, match=message):
            configure({"n_layer": 2, "max_iters": 1}, [str(tmp_path / name)])


def test_config_files_that_exec_neighbours_work_from_any_directory(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    cfg = configure(train.DEFAULTS, ["config/dar_120m.py"])  # not under tmp_path: found beside configurator.py
    assert cfg["n_layer"] == 12 and cfg["out_dir"] == "out/dar_120m" and "dar" in cfg["arms"]
