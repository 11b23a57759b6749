"""
nanoGPT's configurator as a function. Defaults are a script's globals; each argument is either a
Python config file (its top-level names override the defaults) or --key=value.

$ python train.py config/rd_120m.py --batch_size=16 --seeds=0,1 --arms=rd_attnres

Rules, fixing nanoGPT's sharp edges:
- an unknown key is an error (with the closest known key suggested);
- only the first '=' splits, so values may contain '=' (--out_dir=runs/lr=3e-4);
- values are Python literals; anything that is not one is a string (--device=cuda);
- the value must have the default's type: an int is accepted for a float, a whole float for an
  int (1e4), a tuple, a comma list of words or a single value for a list, true/false for a bool;
  a key whose default is None takes any value;
- a comma list of its keys for a dict-valued key keeps those entries (--arms=parent,rd_attnres), and so
  does a list of them in a config file ("arms": ["standard", "mhar"]); `entries` may name more that such
  a list can pick (train.py: every scheme name is an arm);
- None is a value only for a key whose default is None (--out_dir=None is an error, not a crash later);
- a config file is found from the working directory or else this file's directory, and runs with
  __file__ set, so it can exec a neighbour from any working directory; one that fails to run is
  one error line;
- a config file is what its name says: .json a JSON object, .yaml or .yml a YAML mapping, anything
  else Python, refused when a top-level statement sets nothing (a JSON object, YAML's `key: value`
  lines are valid Python that would set no key and train the default grid); a UTF-8 BOM is skipped;
- YAML is read with YAML 1.2's floats: 3e-4 is a float, not the string PyYAML's YAML 1.1 rules make it;
- numpy values (np.float64(1e-3), np.logspace(...)) are taken as the Python numbers and lists they hold.
"""

import ast
import difflib
import json
import os
import re

import yaml

from common import ConfigError

HERE = os.path.dirname(os.path.abspath(__file__))


class YAMLLoader(yaml.SafeLoader):
    """PyYAML's safe loader, reading an exponent without a dot (learning_rate: 3e-4) as YAML 1.2 does: a float.
    YAML 1.1, which PyYAML follows, wants 3.0e-4, so a config that reads as a float everywhere else was a string."""


YAMLLoader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?(?:[0-9][0-9_]*(?:\.[0-9_]*)?|\.[0-9_]+)[eE][-+]?[0-9]+$"),
    list("-+0123456789."),
)


def coerce(key, value, default, entries=None):
    if default is None:
        return value
    if value is None:
        raise ConfigError(f"{key} cannot be None; give a {type(default).__name__} (default {default!r})")
    if isinstance(default, bool):
        if isinstance(value, str) and value.lower() in ("true", "false"):
            return value.lower() == "true"
        if not isinstance(value, bool):
            raise ConfigError(f"{key} must be True or False, got {value!r}")
        return value
    if isinstance(default, float) and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if isinstance(default, int) and isinstance(value, float) and value.is_integer():
        return int(value)  # --max_iters=1e4
    if isinstance(default, list) and isinstance(value, (tuple, int, float, str)):
        return list(value) if isinstance(value, tuple) else value.split(",") if isinstance(value, str) else [value]
    if isinstance(default, dict) and isinstance(value, (str, tuple, list)):  # a list: a config file's, as JSON has
        names = value.split(",") if isinstance(value, str) else list(value)
        if not all(isinstance(n, str) for n in names) or "" in names or len(set(names)) != len(names):
            raise ConfigError(f"{key}={value!r}: give distinct names, e.g. --{key}={','.join(list(default)[:2])}")
        known = (entries or {}) | default
        unknown = [n for n in names if n not in known]
        if unknown:
            close = difflib.get_close_matches(str(unknown[0]), list(known), n=1)
            raise ConfigError(
                f"{key} has no entry {', '.join(map(str, unknown))}"
                + (f" (did you mean {close[0]}?)" if close else "")
                + f"; known: {', '.join(known)}"
            )
        return {n: known[n] for n in names}
    if isinstance(default, str) and not isinstance(value, str):
        return str(value)  # --out_dir=123 means the string
    if type(value) is not type(default):
        quoted = isinstance(value, str) and type(parse_literal(value)) is type(default)  # "3e-4" in a JSON file
        raise ConfigError(
            f"{key} must be a {type(default).__name__}, got {value!r} ({type(value).__name__})"
            + ("; write the number without quotes" if quoted else "")
        )
    return value


def parse_literal(text):
    try:
        return ast.literal_eval(text)
    except (ValueError, SyntaxError):
        return text


def plain(value):
    """numpy scalars and arrays as Python numbers and lists (a config file may compute rates with numpy),
    inside lists, tuples and dicts too."""
    if type(value).__module__ == "numpy" and hasattr(value, "tolist"):
        return value.tolist()
    if isinstance(value, (list, tuple)):
        return type(value)(plain(v) for v in value)
    if isinstance(value, dict):
        return {k: plain(v) for k, v in value.items()}
    return value


def not_json(name):
    raise ValueError(f"{name} is not JSON")


def read_mapping(arg, path, text):
    """The keys a .json or .yaml config file sets: its top level must be an object of names."""
    try:
        if path.lower().endswith(".json"):
            value = json.loads(text, parse_constant=not_json)
        else:
            value = yaml.load(text, YAMLLoader)
    except (ValueError, RecursionError, yaml.YAMLError) as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ConfigError(f"config file {arg} cannot be read ({first}); fix the file") from None
    value = {} if value is None else value  # an empty YAML file sets nothing, like an empty Python one
    if not isinstance(value, dict) or not all(isinstance(k, str) for k in value):
        raise ConfigError(
            f"config file {arg} holds a {type(value).__name__}, not an object of keys; "
            f"write it as {{\"max_iters\": 100, ...}} (JSON) or max_iters: 100 lines (YAML)"
        )
    return value


def run_python(arg, path, text):
    """The names a Python config file sets at its top level (helpers, imports and callables left out)."""
    try:
        tree = ast.parse(text, path)
    except SyntaxError as e:
        raise ConfigError(f"config file {arg} line {e.lineno}: {e.msg}; fix its Python") from None
    for node in tree.body:  # a statement that sets nothing: a JSON object, YAML's `key: value` (an annotation)
        docstring = (
            isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str)
        )
        if (isinstance(node, ast.Expr) and not docstring and not isinstance(node.value, ast.Call)) or (
            isinstance(node, ast.AnnAssign) and node.value is None
        ):
            raise ConfigError(
                f"config file {arg} line {node.lineno} is not Python that sets a key (JSON or YAML?); "
                f"name the file .json or .yaml, or write key = value lines"
            )
    scope = {"__file__": os.path.abspath(path)}  # a config file can read its neighbours from there
    try:
        exec(compile(tree, path, "exec"), scope)
    except SyntaxError as e:  # raised by a file it execs
        where = e.filename if e.filename and not e.filename.startswith("<") else arg  # exec'd text has none
        raise ConfigError(f"config file {where} line {e.lineno}: {e.msg}; fix its Python") from None
    except Exception as e:
        raise ConfigError(f"config file {arg} raised {type(e).__name__}: {e}; fix the file") from None
    return {
        key: value
        for key, value in scope.items()
        if not (key.startswith("_") or callable(value) or type(value).__name__ == "module")
    }


def read_config_file(arg):
    """The keys config file arg sets, read as its name says (JSON, YAML or Python), numpy values made plain."""
    path = arg if os.path.isfile(arg) else os.path.join(HERE, arg)  # config/x.py from any directory
    if not os.path.isfile(path):
        raise ConfigError(f"config file {arg} not found (arguments are config files or --key=value)")
    try:
        with open(path, encoding="utf-8-sig") as f:  # -sig: a BOM an editor put first is not text
            text = f.read()
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(
            f"config file {arg} cannot be read ({getattr(e, 'strerror', None) or e}); give a UTF-8 text file"
        ) from None
    reader = read_mapping if path.lower().endswith((".json", ".yaml", ".yml")) else run_python
    return {key: plain(value) for key, value in reader(arg, path, text).items()}


def check_key(key, config):
    if key not in config:
        close = difflib.get_close_matches(key, list(config), n=1)
        hint = f"; did you mean {close[0]}?" if close else "; see the defaults at the top of train.py"
        raise ConfigError(f"unknown config key {key!r}{hint}")


def current(key, config, defaults):
    """What a new value is checked against: the value so far (a dict selection picks from it)."""
    return None if defaults[key] is None else config[key]


def configure(defaults, argv, entries=None):
    """Returns a new dict: defaults updated by config files and --key=value arguments, in order.
    entries: {key: {name: value}}, what a comma list may select for a dict-valued key beyond its
    current entries."""
    entries = entries or {}
    config = dict(defaults)
    for arg in argv:
        if arg.startswith("--"):
            key, eq, text = arg[2:].partition("=")
            if not eq:
                raise ConfigError(f"{arg}: write overrides as --key=value")
            check_key(key, config)
            config[key] = coerce(key, parse_literal(text), current(key, config, defaults), entries.get(key))
        else:
            for key, value in read_config_file(arg).items():
                check_key(key, config)
                config[key] = coerce(key, value, current(key, config, defaults), entries.get(key))
    return config
