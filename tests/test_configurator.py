"""configurator.py: config files and --key=value overrides, their types, and the one-line errors."""

import pytest

import train
from configurator import ConfigError, configure

DEFAULTS = dict(
    out_dir="out",
    learning_rate=3e-4,
    max_iters=100,
    compile=True,
    init_from=None,
    seeds=[0, 1],
    arms={"a": {"residual": "attnres"}, "b": {"residual": "rd_attnres"}},
)


def test_configurator_overrides():
    cfg = configure(
        DEFAULTS,
        [
            "--out_dir=runs/lr=3e-4",
            "--learning_rate=1",
            "--max_iters=1e3",
            "--compile=false",
            "--init_from=[1, 2]",
            "--seeds=3,4",
            "--arms=b",
        ],
    )
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
    path.write_text(
        "import math\n_helper = 2\nmax_iters = 10 * _helper\narms = {'x': {}, 'y': {'residual': 'attnres'}}\n"
    )
    cfg = configure(DEFAULTS, [str(path), "--arms=y"])
    assert cfg["max_iters"] == 20 and cfg["arms"] == {"y": {"residual": "attnres"}}


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--learnig_rate=1"], "did you mean learning_rate"),
        (["--max_iters=1.5"], "max_iters must be a int"),
        (["--compile=1"], "compile must be True or False"),
        (["--seeds"], "--key=value"),
        (["--arms=c"], "arms has no entry c; known: a, b"),
        (["--arms=aa"], r"arms has no entry aa \(did you mean a\?\)"),
        (["missing.py"], "config file missing.py not found"),
    ],
)
def test_configurator_errors(argv, message):
    with pytest.raises(ConfigError, match=message):
        configure(DEFAULTS, argv)


def test_config_file_errors_are_one_line(tmp_path):
    cases = {
        "unknown.py": ("n_layers = 3\n", "unknown config key 'n_layers'"),
        "syntax.py": ("max_iters = (\n", "syntax.py line 1"),
        "raises.py": ("max_iters = 1 // 0\n", "raised ZeroDivisionError"),
    }
    for name, (text, message) in cases.items():
        (tmp_path / name).write_text(text)
        with pytest.raises(ConfigError, match=message):
            configure({"n_layer": 2, "max_iters": 1}, [str(tmp_path / name)])


def test_config_files_that_exec_neighbours_work_from_any_directory(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    cfg = configure(train.DEFAULTS, ["config/dar_120m.py"])  # not under tmp_path: found beside configurator.py
    assert cfg["n_layer"] == 12 and cfg["out_dir"] == "out/dar_120m" and "dar" in cfg["arms"]


@pytest.mark.parametrize(
    "name, text",
    [
        ("cfg.py", '{"max_iters": 10}\n'),  # a JSON object is a Python expression that sets nothing
        ("cfg.txt", "max_iters: 10\nout_dir: runs/x\n"),  # YAML's key: value lines are Python annotations
        ("cfg", "max_iters = 10\n- 3\n"),
    ],
)
def test_config_file_that_is_not_python_assignments_is_refused(tmp_path, name, text):
    (tmp_path / name).write_text(text)
    with pytest.raises(
        ConfigError,
        match=rf"config file .*{name} line \d+ is not Python that sets a key.*"
        r"name the file \.json or \.yaml",
    ):
        configure(DEFAULTS, [str(tmp_path / name)])


def test_json_and_yaml_config_files_are_read_as_what_they_are(tmp_path):
    (tmp_path / "c.json").write_text('{"max_iters": 10, "seeds": [3], "arms": "b", "init_from": null}')
    (tmp_path / "c.yaml").write_text("# a comment\nmax_iters: 20\nout_dir: runs/x\ncompile: false\n")
    (tmp_path / "empty.yml").write_text("")
    cfg = configure(DEFAULTS, [str(tmp_path / "c.json")])
    assert (cfg["max_iters"], cfg["seeds"], cfg["init_from"]) == (10, [3], None)
    assert cfg["arms"] == {"b": DEFAULTS["arms"]["b"]}
    cfg = configure(DEFAULTS, [str(tmp_path / "c.json"), str(tmp_path / "c.yaml"), str(tmp_path / "empty.yml")])
    assert (cfg["max_iters"], cfg["out_dir"], cfg["compile"], cfg["seeds"]) == (20, "runs/x", False, [3])


@pytest.mark.parametrize(
    "name, text, message",
    [
        ("torn.json", '{"max_iters": 1', "torn.json cannot be read"),
        ("nan.json", '{"learning_rate": NaN}', r"cannot be read \(NaN is not JSON\)"),
        ("list.json", "[1, 2]", "holds a list, not an object of keys"),
        ("scalar.yaml", "just words", "holds a str, not an object of keys"),
        ("keys.yaml", "1: 2", "not an object of keys"),
        ("bad.yaml", "a: [1", "bad.yaml cannot be read"),
        ("typo.yaml", "max_iter: 3", "unknown config key 'max_iter'; did you mean max_iters"),
        ("latin1.py", b"out_dir = '\xe9'\n", "cannot be read .*give a UTF-8 text file"),
    ],
)
def test_json_and_yaml_config_file_errors_are_one_line(tmp_path, name, text, message):
    path = tmp_path / name
    path.write_bytes(text) if isinstance(text, bytes) else path.write_text(text)
    with pytest.raises(ConfigError, match=message):
        configure(DEFAULTS, [str(path)])


@pytest.mark.parametrize("name", ["c.py", "c.json", "c.yaml"])
def test_config_file_with_a_utf8_bom_is_read(tmp_path, name):
    text = {"c.py": "max_iters = 7\n", "c.json": '{"max_iters": 7}', "c.yaml": "max_iters: 7\n"}[name]
    (tmp_path / name).write_bytes(b"\xef\xbb\xbf" + text.encode())  # what some editors put first
    assert configure(DEFAULTS, [str(tmp_path / name)])["max_iters"] == 7


def test_numpy_values_in_a_config_file_are_plain_numbers(tmp_path):
    (tmp_path / "c.py").write_text(
        "import numpy as np\nlearning_rate = np.float32(0.5)\nmax_iters = np.int64(9)\n"
        "tune_learning_rates = np.logspace(-3, -2, 2)\nseeds = [np.int64(4)]\n"
    )
    cfg = configure(dict(DEFAULTS, tune_learning_rates=[]), [str(tmp_path / "c.py")])
    assert (cfg["learning_rate"], cfg["max_iters"], cfg["seeds"]) == (0.5, 9, [4])
    assert cfg["tune_learning_rates"] == [1e-3, 1e-2]
    assert all(
        type(v) in (int, float)
        for v in [cfg["learning_rate"], cfg["max_iters"], *cfg["seeds"], *cfg["tune_learning_rates"]]
    ), "numpy types left in the config"
    import tune  # the rates' check takes them as the numbers they are, not as 'give positive numbers'

    tune_cfg = dict(train.DEFAULTS, tune_learning_rates=cfg["tune_learning_rates"])
    tune.check(tune_cfg)


# --- bad input of issue #66: what a JSON or YAML file means as --key=value would mean it -------------------------


def test_yaml_exponents_are_floats_as_in_every_other_reader(tmp_path):
    (tmp_path / "c.yaml").write_text(
        "learning_rate: 3e-4\nmax_iters: 1e3\ntune_learning_rates: [1e-3, 3E-3, .5e-2]\nout_dir: 1e3x\n"
    )  # YAML 1.1 (PyYAML) reads 3e-4 as a string; YAML 1.2, JSON and --learning_rate=3e-4 as a float
    cfg = configure(dict(DEFAULTS, tune_learning_rates=[]), [str(tmp_path / "c.yaml")])
    assert cfg["learning_rate"] == 3e-4 and type(cfg["learning_rate"]) is float
    assert cfg["max_iters"] == 1000 and type(cfg["max_iters"]) is int  # as --max_iters=1e3
    assert cfg["tune_learning_rates"] == [1e-3, 3e-3, 5e-3] and cfg["out_dir"] == "1e3x"
    import yaml

    assert yaml.safe_load("a: 3e-4") == {"a": "3e-4"}  # PyYAML itself is left as it is for everyone else
    (tmp_path / "q.json").write_text('{"learning_rate": "3e-4"}')  # a quoted number is a string in JSON: said so
    with pytest.raises(ConfigError, match=r"^learning_rate must be a float, got '3e-4' \(str\); write the number"):
        configure(DEFAULTS, [str(tmp_path / "q.json")])


@pytest.mark.parametrize(
    "name, text", [("c.json", '{"arms": ["standard", "mhar"]}'), ("c.yaml", "arms: [standard, mhar]")]
)
def test_a_list_of_arm_names_in_a_config_file_is_what_arms_gives(tmp_path, name, text):
    (tmp_path / name).write_text(text)
    given = configure(train.DEFAULTS, [str(tmp_path / name)], entries=dict(arms=train.SCHEME_ARMS))
    assert (
        given["arms"]
        == configure(train.DEFAULTS, ["--arms=standard,mhar"], entries=dict(arms=train.SCHEME_ARMS))["arms"]
    )
    assert given["arms"] == {"standard": {"residual": "standard"}, "mhar": {"residual": "mhar"}}
    for bad in ('{"arms": ["a", "a"]}', '{"arms": [1]}', '{"arms": [{"residual": "hc"}]}'):
        (tmp_path / "bad.json").write_text(bad)
        with pytest.raises(ConfigError, match=r"^arms=\[.*\]: give distinct names, e.g. --arms=a,b$"):
            configure(DEFAULTS, [str(tmp_path / "bad.json")])
