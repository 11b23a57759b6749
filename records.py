"""
What a result is and when a grid may go on. A cell's settings (the run's keys, its arm's over them) are checked before
anything trains; what made a cell (settings, data, code) is recorded beside it; a rerun goes on only where those
records agree with it (check_rerun), or --allow_changes=True, recorded; result.json is the pairing record report.py
compares across arms. docs/protocol.md says what each record means.
"""

import ast
import dataclasses
import hashlib
import importlib.util
import json
import math
import netrc
import os
import re
import subprocess
import urllib.parse

import numpy as np
import torch

from common import ConfigError, cannot_write, temporary_name, write_json
from configurator import coerce
from data.prepare import held_out_names_in
from data.shards import TOKENIZERS

# a cell's files are read in grid_files.py; train.py, cells.py, launch.py and analyze.py call some as records.<name>
from grid_files import NOT_COMPUTING, RESULT_REMEDY, as_compared, cell_dir, check_owner, check_result, code_fingerprints
from grid_files import field, per_definition, read_record
from grid_files import describe_done  # noqa: F401  (cells.py's records.describe_done)
from model import GPT, RESIDUALS, GPTConfig, is_routing, option_owners

HERE = os.path.dirname(os.path.abspath(__file__))
MODEL_DEFAULTS = {f.name: f.default for f in dataclasses.fields(GPTConfig)}
MODEL_KEYS = tuple(MODEL_DEFAULTS)
# what an arm may set besides model keys: its learning rates (a sweep of them is arms of one grid, paired seed by
# seed); the schedule's shape (warmup_iters, lr_schedule, cooldown_frac) stays the grid's
ARM_LEARNING_RATES = ("learning_rate", "min_lr", "muon_learning_rate")
# an arm is a folder of out_dir: a plain name, none of the files the grid and its report write there, and short (it
# names that folder and the report's files, such as routing_<arm>_seed<k>.png)
ARM_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]*")
ARM_NAME_MAX = 64
OUT_DIR_SUFFIXES = (".json", ".md", ".png", ".tmp")
FLOAT32_MAX = float(np.finfo(np.float32).max)
COUNTS = ("batch_size", "gradient_accumulation_steps", "max_iters", "eval_interval", "log_interval", "eval_batch_size")
# keys that do not change a cell's result: left out of its pairing settings and of the rerun check. data_dir: where
# the shards lie is not what they hold (train_data_sha256, val_hash and data_hash are); wandb_*: a copy of the log
# elsewhere; downstream_*: an evaluation in eval mode, which draws no random numbers
NOT_RESULT_KEYS = tuple(
    "arm seed arms seeds reference_arm out_dir data_dir log_interval eval_batch_size verify_shards allow_changes "
    "wandb_log wandb_project wandb_run_name downstream_bundle downstream_interval downstream_max_per_task".split()
)
# the code that computes a result: the model, the runtime (TF32, deterministic kernels), the step, the data order, a
# cell's init and what a resume restores (fingerprinted per definition, without comments, docstrings and messages:
# code_record). The report, the config checks here, downloads, the log (progress.py) and these records are not in it.
CODE_FILES = ("model.py", "train.py", "machine.py", "cells.py", "checkpoint.py", "data/shards.py")


# -----------------------------------------------------------------------------
# config checks


def model_config(cfg, settings):
    """The model of one arm: the run's model keys, overridden by the arm's. A scheme's own option (hc_streams,
    dar_keys, ...) set for the run reaches only the arms of that scheme."""
    settings = {k: v for k, v in settings.items() if k in MODEL_KEYS}  # not its learning rates
    residual = settings.get("residual", cfg["residual"])
    own = {k: cfg[k] for k in MODEL_KEYS if k not in settings and not foreign_option(k, residual)}
    return GPTConfig(**own | settings)


def foreign_option(key, residual):
    """Whether key is an option of other schemes only (so it cannot apply to residual)."""
    owners = option_owners(key)
    return bool(owners) and residual not in owners


def cell_config(cfg, arm, seed):
    """A cell's effective config: the run's keys, the arm's settings (model keys, learning rates) over them."""
    settings = cfg["arms"][arm]
    rates = {k: v for k, v in settings.items() if k in ARM_LEARNING_RATES}
    return dict(cfg, **dataclasses.asdict(model_config(cfg, settings)), **rates, arm=arm, seed=seed)


def pairing_settings(cell, arm_settings):
    """What must be equal across the arms of a seed: the result-changing keys the arm does not set."""
    skip = (*NOT_RESULT_KEYS, *arm_settings)
    return {k: v for k, v in cell.items() if k not in skip and not foreign_option(k, cell["residual"])}


def typed_arms(cfg):
    """{arm: settings} of cfg's arms, each setting typed as --key=value types it (dropout=0 is 0.0), an arm named after
    a scheme given its residual (as --arms=NAME is); one line for an arm name or settings that cannot be."""
    arms = {}
    for arm, settings in cfg["arms"].items():
        if not isinstance(arm, str) or not ARM_NAME.fullmatch(arm) or arm.endswith(OUT_DIR_SUFFIXES):
            raise ConfigError(
                f"arm name {arm!r}: use letters, digits, '_', '.' and '-' (not first), not ending in "
                f"{', '.join(OUT_DIR_SUFFIXES)} (the grid's own files in out_dir)"
            )
        if len(arm) > ARM_NAME_MAX:
            raise ConfigError(
                f"arm name {arm[:20]}... is {len(arm)} characters; use at most {ARM_NAME_MAX} (it names "
                f"a folder, and the report's files)"
            )
        if not isinstance(settings, dict) or set(settings) - set(MODEL_KEYS + ARM_LEARNING_RATES):
            raise ConfigError(
                f"arm {arm!r}: settings must be a dict of model keys ({', '.join(MODEL_KEYS)}) or "
                f"learning rates ({', '.join(ARM_LEARNING_RATES)})"
            )
        typed = {k: coerce(f"arm {arm!r}: {k}", v, MODEL_DEFAULTS.get(k, cfg.get(k))) for k, v in settings.items()}
        if arm in RESIDUALS:  # an arm named after a scheme trains it, as --arms=NAME does (not the run's residual)
            if typed.get("residual", arm) != arm:
                free = typed["residual"] if typed["residual"] not in cfg["arms"] else f"{typed['residual']}-{arm}"
                raise ConfigError(
                    f"arm {arm!r} sets residual={typed['residual']!r}, but an arm named after a scheme trains that "
                    f"scheme (as --arms={arm} does); rename the arm, e.g. to {free!r}"
                )
            typed = typed if "residual" in typed else {"residual": arm} | typed
        arms[arm] = typed
    return arms


def check_config(cfg, world, command_line=()):
    """One line for each setting that cannot run, before anything is trained. command_line: the keys set by
    --key=value, so that a key every arm overrides is not silently lost."""
    for key, value in cfg.items():
        check_number(key, value, "")
        if isinstance(value, str) and "\0" in value:  # os calls raise ValueError on it, mid-run
            raise ConfigError(f"{key}={value!r} holds a NUL byte; give it without one")
    if bad := [k for k in ("out_dir", "data_dir") if not cfg[k]]:
        raise ConfigError(f"{bad[0]} is empty; give a folder, e.g. --out_dir=out or --data_dir=data/shakespeare_bytes")
    for keys, ok, rule in (
        (COUNTS, lambda v: v >= 1, "must be at least 1"),
        (("weight_decay", "grad_clip", "warmup_iters"), lambda v: v >= 0, "must not be negative"),
        (("beta1", "beta2"), lambda v: 0 <= v < 1, "must be in [0, 1)"),
        (("cooldown_frac",), lambda v: 0 <= v <= 1, "must be in [0, 1]"),
    ):
        if bad := [k for k in keys if not ok(cfg[k])]:
            raise ConfigError(f"{bad[0]}={cfg[bad[0]]} {rule}")
    if cfg["eval_layout"] not in EVAL_LAYOUTS:
        raise ConfigError(
            f"eval_layout={cfg['eval_layout']!r}: choose spread (sequences across the whole validation shard) or first"
            f" (its first eval_tokens, as grids made before the setting)"
        )
    check_learning_rates(cfg, cfg, "")
    seeds = cfg["seeds"]
    if not seeds or any(type(s) is not int or s < 0 for s in seeds) or len(set(seeds)) != len(seeds):
        raise ConfigError(f"seeds={seeds!r}: give distinct non-negative integers, e.g. --seeds=0,1,2")
    if not isinstance(cfg["arms"], dict) or not cfg["arms"]:
        raise ConfigError(
            "arms is empty; give at least one arm, e.g. --arms=standard,attnres (scheme names) "
            "or arms = {'standard': {}}"
        )
    if cfg["residual"] not in RESIDUALS:
        schemes = ", ".join(RESIDUALS)
        raise ConfigError(f"residual={cfg['residual']!r} is not a residual scheme; choose one of {schemes}")
    arms = typed_arms(cfg)  # as train.build_config records them (cfg itself is not changed)
    models = {}
    for arm, settings in arms.items():
        for key, value in settings.items():
            check_number(key, value, f"arm {arm!r}: ")
        try:
            models[arm] = config = model_config(cfg, settings)
        except (ValueError, TypeError) as e:  # GPTConfig's own checks (sizes, dropout, scheme options)
            raise ConfigError(f"arm {arm!r}: {e}") from None
        check_learning_rates(cfg | settings, settings, f"arm {arm!r}: ", config)
        if not config.moe_bias_rate * cfg["max_iters"] <= FLOAT32_MAX:  # the bias moves by the rate each step
            raise ConfigError(
                f"arm {arm!r}: moe_bias_rate={config.moe_bias_rate:.3g} is too large: over max_iters="
                f"{cfg['max_iters']} steps the balancing bias can reach {config.moe_bias_rate * cfg['max_iters']:.3g}, "
                f"beyond float32 ({FLOAT32_MAX:.3g}); lower it (DeepSeek-V3 used 1e-3)"
            )
        if cfg["eval_tokens"] < config.block_size + 1:
            raise ConfigError(
                f"eval_tokens={cfg['eval_tokens']} is less than one sequence of block_size+1 = "
                f"{config.block_size + 1} tokens" + (f" (arm {arm!r})" if "block_size" in settings else "")
            )
        unused = unused_settings(cfg, config)
        for key in settings:  # what the arm sets itself; its value from the run is recorded for every arm alike
            if key in unused and settings[key] != cfg[key]:
                raise ConfigError(
                    f"arm {arm!r}: {key}={settings[key]!r} changes nothing: {unused[key]}; drop it from the arm"
                )
    for key in command_line:
        unused = [unused_settings(cfg, config).get(key) for config in models.values()]
        if all(unused):
            every = f" (nor does any arm's: {', '.join(arms)})" if key in MODEL_KEYS and len(arms) > 1 else ""
            raise ConfigError(f"--{key}={cfg[key]!r} changes nothing: {unused[0]}{every}; drop --{key}")
        overriding = [arm for arm, settings in arms.items() if key in settings and settings[key] != cfg[key]]
        if overriding and len(overriding) == len(arms):
            per_arm = f"--arms=\"{{'name': {{'{key}': {cfg[key]!r}}}}}\" to set it per arm"
            way = f"--arms={cfg[key]} (scheme names are arms)" if key == "residual" else per_arm
            raise ConfigError(
                f"--{key}={cfg[key]!r} is overridden by every arm ({', '.join(overriding)} set {key}); use {way}"
            )
        if foreign_option(key, cfg["residual"]) and all(foreign_option(key, m.residual) for m in models.values()):
            raise ConfigError(
                f"--{key}={cfg[key]!r} is an option of residual={' or '.join(option_owners(key))}, which no arm trains"
            )
    if (sequences := cfg["batch_size"] * cfg["gradient_accumulation_steps"]) % world:
        raise ConfigError(
            f"a step's batch_size x gradient_accumulation_steps = {sequences} sequences do not split evenly over "
            f"{world} processes; change either, or the number of processes"
        )
    for key, choices in (("lr_schedule", ("cosine", "wsd")), ("optimizer", ("adamw", "muon"))):
        if cfg[key] not in choices:
            raise ConfigError(f"{key}={cfg[key]!r}: choose {' or '.join(choices)}")
    if cfg["optimizer"] == "muon" and not hasattr(torch.optim, "Muon"):
        raise ConfigError(
            f"optimizer='muon' needs torch.optim.Muon (torch 2.9 or later), this is torch "
            f"{torch.__version__}; upgrade torch or use --optimizer=adamw"
        )
    if cfg["fsdp"] and world < 2:
        raise ConfigError(
            "fsdp=True shards the model over processes: run under torchrun with --nproc_per_node=2 "
            "or more, or set --fsdp=False"
        )
    if cfg["fsdp"] and cfg["optimizer"] == "muon":  # Newton-Schulz wants whole matrices, FSDP holds row shards
        raise ConfigError(
            "fsdp=True with optimizer='muon' is not supported (Muon orthogonalizes whole matrices, "
            "FSDP holds shards of them); use DDP (--fsdp=False) for Muon, or --optimizer=adamw"
        )
    if cfg["wandb_log"]:
        check_wandb()
    references = cfg["reference_arm"].split(",") if cfg["reference_arm"] else []  # report.py's --reference
    if unknown := [r for r in references if r not in cfg["arms"]]:
        raise ConfigError(
            f"reference_arm={cfg['reference_arm']!r}: {unknown[0]!r} is not an arm "
            f"({', '.join(cfg['arms'])}); name arms, comma-separated, e.g. --reference_arm=standard,scaled_residual"
        )
    if len(set(references)) < len(references):
        raise ConfigError(f"reference_arm={cfg['reference_arm']!r} names an arm twice; name each reference once")
    check_downstream(cfg, [config.vocab_size for config in models.values()])


def unused_settings(cfg, config):
    """{key: where it applies} for the settings that change nothing in a cell of cfg whose model is config.
    Set where they do nothing, they would only be recorded (and a rerun without them refused as a change),
    so they are refused where given, as a scheme's own options and the MoE options are (model.py)."""
    unused = {}
    if cfg["optimizer"] != "muon":
        unused["muon_learning_rate"] = f"it applies under optimizer='muon' (this run's is {cfg['optimizer']!r})"
    if cfg["lr_schedule"] != "wsd":
        unused["cooldown_frac"] = f"it applies under lr_schedule='wsd' (this run's is {cfg['lr_schedule']!r})"
    if not cfg["tune_learning_rates"]:
        tuned = "it applies to the tuned protocol, and tune_learning_rates is empty"
        unused |= dict.fromkeys(("tune_seeds", "tune_iters", "tune_routing_lr_scales"), tuned)
    if not RESIDUALS[config.residual].extra_params(config):
        unused["routing_lr_scale"] = f"residual={config.residual!r} has no routing parameters for it to scale"
    return unused


def notes(cfg, models):
    """What a run says before it trains, of settings that run but not as one may expect: arms that can never pair
    (another block_size: other batches; shared weights of other shapes, as an MoE arm beside a dense one: another
    init), and a warmup longer than the run (allowed: a quick run of a paper config)."""
    said, groups = [], {}
    for arm, config in models.items():
        groups.setdefault((config.block_size, shared_shapes(config)), []).append(arm)
    if len(groups) > 1:
        configs = [[models[arm] for arm in arms] for arms in groups.values()]
        why = [
            k
            for k in MODEL_KEYS
            if all(len({getattr(c, k) for c in group}) == 1 for group in configs)
            and len({getattr(group[0], k) for group in configs}) > 1
            and not option_owners(k)
            and k != "residual"
        ]
        effects = [e for i, e in enumerate(("other batches", "another init")) if len({key[i] for key in groups}) > 1]
        said.append(
            f"note: arms {' | '.join(', '.join(arms) for arms in groups.values())} differ in "
            f"{', '.join(why) or 'the shapes of their shared weights'} ({' and '.join(effects)}): the report "
            f"pairs no arm with one of another group"
        )
    if cfg["warmup_iters"] > cfg["max_iters"]:
        said.append(
            f"note: warmup_iters={cfg['warmup_iters']} is longer than max_iters={cfg['max_iters']}: the run ends in "
            f"its warmup, at {cfg['max_iters'] / cfg['warmup_iters']:.0%} of learning_rate, and never decays to min_lr"
        )
    return said


def shared_shapes(config):
    """The names and shapes of a model's shared weights, built on the meta device (no memory, no numbers drawn):
    shapes alike are drawn alike from a seed (shared_init_hash), others never are."""
    with torch.device("meta"):
        model = GPT(config)
    return tuple((name, tuple(t.shape)) for name, t in model.state_dict().items() if not is_routing(name))


def check_number(key, value, where):
    """A float setting: finite, and within float32, what the model and the optimizer compute it in (a larger one
    becomes inf there: NaN weights, or a traceback inside the optimizer)."""
    if isinstance(value, float) and not math.isfinite(value):
        raise ConfigError(f"{where}{key}={value} must be a finite number")
    if isinstance(value, float) and not abs(value) <= FLOAT32_MAX:
        raise ConfigError(
            f"{where}{key}={value:.3g} is beyond float32 ({FLOAT32_MAX:.3g}), which the model and "
            f"optimizer compute in; lower it"
        )


def check_downstream(cfg, vocab_sizes):
    """The downstream_* settings (the bundle itself is read by train.main, before anything trains)."""
    bundle, interval, most = cfg["downstream_bundle"], cfg["downstream_interval"], cfg["downstream_max_per_task"]
    if interval < 0 or interval % cfg["eval_interval"]:
        raise ConfigError(
            f"downstream_interval={interval} must be 0 (each cell's last step only) or a multiple of "
            f"eval_interval={cfg['eval_interval']}"
        )
    if most < 0:
        raise ConfigError(f"downstream_max_per_task={most} must be at least 1, or 0 for every item")
    if bundle and not os.path.isfile(os.path.join(bundle, "core.yaml")):
        raise ConfigError(
            f"downstream_bundle={bundle} holds no core.yaml; get the CORE bundle with python "
            f"downstream.py --download --bundle={bundle}, or leave downstream_bundle empty"
        )
    needed = TOKENIZERS[cfg["tokenizer"]].vocab_size if bundle and cfg.get("tokenizer") else 0
    if min(vocab_sizes) < needed:
        raise ConfigError(
            f"vocab_size={min(vocab_sizes)} is below the {needed} ids of the data's {cfg['tokenizer']} tokenizer: such "
            f"a model cannot read the CORE tasks' text; leave vocab_size unset, or downstream_bundle empty"
        )


def check_learning_rates(rates, given, where, config=None):
    """The learning rates of rates (the run's, or an arm's effective ones, config its model): positive, min_lr not
    above learning_rate, and where they meet float32 within it: each group's first step (AdamW's is lr / (1 - beta1);
    optimizer.step fails on one beyond) and the decay's factor 1 - lr x weight_decay. given: the settings of where."""
    for key in ("learning_rate", "muon_learning_rate"):
        if not rates[key] > 0:
            raise ConfigError(f"{where}{key}={rates[key]} must be positive")
    if not rates["min_lr"] >= 0:
        raise ConfigError(f"{where}min_lr={rates['min_lr']} must not be negative")
    if rates["min_lr"] > rates["learning_rate"]:
        raise ConfigError(
            f"{where}min_lr={rates['min_lr']} is above learning_rate={rates['learning_rate']}: the "
            f"schedule decays from learning_rate down to min_lr; set min_lr at most learning_rate"
            + (" in the arm" if "min_lr" not in given and where else "")
        )
    lr = rates["learning_rate"]
    peaks = dict(learning_rate=lr, muon_learning_rate=rates["muon_learning_rate"])
    if config:  # the routing parameters and the MoE routers step at their multiple of learning_rate
        peaks |= {f"learning_rate x {k}": lr * getattr(config, k) for k in ("routing_lr_scale", "moe_router_lr_scale")}
    for name, peak in peaks.items():
        if not peak / (1 - rates["beta1"]) <= FLOAT32_MAX:
            raise ConfigError(
                f"{where}{name} = {peak:.3g} is too large: its first step, lr / (1 - beta1) = "
                f"{peak / (1 - rates['beta1']):.3g}, is beyond float32 ({FLOAT32_MAX:.3g}); lower it"
            )
    if not lr * rates["weight_decay"] <= FLOAT32_MAX:  # AdamW and Muon both decay by lr x weight_decay per step
        raise ConfigError(
            f"{where}learning_rate x weight_decay = {lr * rates['weight_decay']:.3g} is beyond float32 "
            f"({FLOAT32_MAX:.3g}): each step multiplies the weights by 1 minus it; lower weight_decay"
        )


def check_wandb():
    """wandb_log=True runs only where wandb is installed and will log without asking: offline or disabled
    (WANDB_MODE), an API key in WANDB_API_KEY, or one that `wandb login` left in ~/.netrc."""
    if importlib.util.find_spec("wandb") is None:
        raise ConfigError("wandb_log=True needs the wandb package: pip install wandb (or set --wandb_log=False)")
    if os.environ.get("WANDB_MODE") in ("offline", "disabled", "dryrun") or os.environ.get("WANDB_API_KEY"):
        return
    host = urllib.parse.urlparse(os.environ.get("WANDB_BASE_URL", "https://api.wandb.ai")).hostname
    try:
        logged_in = netrc.netrc(os.environ.get("NETRC")).authenticators(host) is not None
    except (OSError, netrc.NetrcParseError):
        logged_in = False
    if not logged_in:
        raise ConfigError(
            f"wandb_log=True but wandb has no login for {host} here: run `wandb login`, set "
            f"WANDB_API_KEY, or WANDB_MODE=offline (wandb sync later); or set --wandb_log=False"
        )


# -----------------------------------------------------------------------------
# provenance: what code made a cell

# calls whose arguments are messages, never results: print, warnings.warn, sys.exit, a logger's
MESSAGE_CALLS = ("print", "warn", "exit", "debug", "info", "warning", "error", "exception", "critical")


def code_fingerprint(source):
    """sha256 of a Python file's syntax tree without what cannot change a result (strip_messages)."""
    return hashlib.sha256(ast.dump(strip_messages(ast.parse(source))).encode()).hexdigest()


def strip_messages(tree):
    """A syntax tree without comments, layout, docstrings, and messages (the arguments of a raised exception, an
    assert's message, the arguments of MESSAGE_CALLS, which must therefore compute nothing but text). Rewording an
    error never locks a grid; an operator, a constant or a condition does."""
    for node in ast.walk(tree):
        if (
            isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
            and ast.get_docstring(node, clean=False) is not None
        ):
            node.body = node.body[1:] or [ast.Pass()]
        if isinstance(node, ast.Assert):
            node.msg = None
        raised = isinstance(node, ast.Raise)
        message = node.exc if raised else node
        if isinstance(message, ast.Call) and (raised or call_name(message.func) in MESSAGE_CALLS):
            message.args, message.keywords = [], []  # the exception's class, or the function called, stays
    return tree


def call_name(func):
    return func.id if isinstance(func, ast.Name) else func.attr if isinstance(func, ast.Attribute) else None


def bound_name(node):
    """The name a top-level statement defines (an assignment's targets, joined), or None."""
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
        return node.name
    single = isinstance(node, (ast.AnnAssign, ast.AugAssign))
    targets = [node.target] if single else node.targets if isinstance(node, ast.Assign) else []
    return ", ".join(n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name)) or None


def code_record():
    """One fingerprint per top-level definition of CODE_FILES, keyed by the name it defines (a file's other statements
    under the file's name; imports left out: they bind names to definitions fingerprinted here, or to torch, whose
    version is recorded); 'schemes': the registry's classes each scheme computes with (classes), so that code_changes
    compares only what a cell computes with: moving a definition to another file, reordering definitions or adding a
    scheme no arm trains changes nothing. Also the git commit and dirty flag where git can tell."""
    statements, references = {}, {}
    for file in CODE_FILES:
        with open(os.path.join(HERE, file), "rb") as f:
            tree = strip_messages(ast.parse(f.read()))
        for node in tree.body:
            name = bound_name(node) or file
            if isinstance(node, (ast.Import, ast.ImportFrom)) or name == "RESIDUALS":  # the registry: 'schemes'
                continue
            statements.setdefault(name, []).append(ast.dump(node))
            references.setdefault(name, set()).update(n.id for n in ast.walk(node) if isinstance(n, ast.Name))
    definitions = {
        name: hashlib.sha256("\n".join(dumps).encode()).hexdigest()[:16] for name, dumps in statements.items()
    }
    registered = {cls.__name__ for cls in RESIDUALS.values()}
    shared = {c for name, refs in references.items() if name not in registered for c in refs & registered}

    def classes(cls):  # the registered classes a scheme computes with: its own, and those it derives from or names
        used, todo = set(), [c.__name__ for c in cls.__mro__ if c.__name__ in registered]
        while todo:
            name = todo.pop()
            if name not in used:
                used.add(name)
                todo += sorted(references.get(name, set()) & registered)
        return sorted(used | shared)

    schemes = {name: classes(cls) for name, cls in RESIDUALS.items()}
    fingerprint = hashlib.sha256(json.dumps([definitions, schemes], sort_keys=True).encode()).hexdigest()

    def git(*args):
        try:
            return subprocess.run(
                ["git", "-C", HERE, *args], capture_output=True, text=True, timeout=30, check=True
            ).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            return None

    commit, status = git("rev-parse", "HEAD"), git("status", "--porcelain", "--untracked-files=no")
    dirty = None if status is None else status != ""
    return dict(fingerprint=fingerprint, definitions=definitions, schemes=schemes, git_commit=commit, git_dirty=dirty)


def code_changes(old, new, schemes):
    """The definitions that differ between two code records for a run of these schemes: all but the registry's classes
    none of them computes with. A record of an earlier version (one fingerprint per file) compares as a whole."""
    if not (per_definition(old) and per_definition(new)):
        same = isinstance(old, dict) and isinstance(new, dict) and old.get("fingerprint") == new.get("fingerprint")
        return [] if same else ["all of it: recorded per file by an earlier version"]
    # a scheme the recorded code did not have trained none of its cells: new, it changed nothing they computed (so a
    # grid goes on with an arm of a scheme added since)
    schemes = {s for s in schemes if s in old["schemes"]}
    registered = {c for r in (old, new) for used in r["schemes"].values() for c in used}
    used = {c for r in (old, new) for s in schemes for c in r["schemes"].get(s, ())}
    before, now = old["definitions"], new["definitions"]
    return [
        name
        for name in sorted((set(before) | set(now)) - NOT_COMPUTING)
        if before.get(name) != now.get(name) and (name not in registered or name in used)
    ] + [f"RESIDUALS[{s!r}]" for s in sorted(schemes) if old["schemes"].get(s) != new["schemes"].get(s)]


def run_schemes(*records):
    """The schemes the runs of these records train: a cell's, or each arm's of a grid (its settings over the grid's)."""
    cells = lambda r: [r] if "arm" in r else [r | s for s in field(r, "arms", dict).values() if isinstance(s, dict)]
    return {s for r in records for cell in cells(r) if isinstance(s := cell.get("residual"), str)}


def differences(old, new):
    """{key: [recorded, now]} over the keys that change a result, 'code' for the code fingerprint (when code_changes
    finds a definition the run computes with changed)."""
    skip = NOT_RESULT_KEYS + ("model", "code", "changes", "machine")  # machine: provenance (cells.open_cell)
    keys = [k for k in sorted(set(old) | set(new)) if k not in skip]
    # a setting added since compares as its old behaviour (as_compared)
    pairs = {k: [as_compared(k, old.get(k)), as_compared(k, new.get(k))] for k in keys}
    diff = {k: [a, b] for k, (a, b) in pairs.items() if a != b}
    old_arms, new_arms = field(old, "arms", dict), field(new, "arms", dict)
    for arm in set(old_arms) & set(new_arms):
        if old_arms[arm] != new_arms[arm]:
            diff[f"arms[{arm!r}]"] = [old_arms[arm], new_arms[arm]]
    old_code, new_code = field(old, "code", dict), field(new, "code", dict)
    if code_changes(old_code, new_code, run_schemes(old, new)):
        diff["code"] = [old_code.get("fingerprint"), new_code.get("fingerprint")]
    return diff


def described_changes(old, new, schemes):
    """code_changes as a short phrase for one line."""
    changed = code_changes(old, new, schemes)
    return ", ".join(changed[:6]) + (f" and {len(changed) - 6} more" if len(changed) > 6 else "")


# -----------------------------------------------------------------------------
# the rerun check: one for every record a run goes on from


def check_rerun(path, old, new, allow):
    """old: the record read from path (the grid's config.json: GridRecord, a cell's: check_cell, a checkpoint's:
    checkpoint.resume); new: the run's. A cell's record must be this cell's (new names an arm); a difference over the
    keys that change a result is refused unless allow. Returns the difference."""
    if "arm" in new:
        check_owner(path, old, new["arm"], new["seed"])
    diff = differences(old, new)
    if diff and not allow:
        short = lambda v: repr(v) if len(repr(v)) <= 40 else "..."
        named = ", ".join(
            f"code changed ({described_changes(old.get('code'), new['code'], run_schemes(old, new))})"
            if k == "code"
            else f"{k} ({short(a)} -> {short(b)})"
            for k, (a, b) in diff.items()
        )
        recorded = field(old, "code", dict)
        commit = "code" in diff and recorded.get("git_commit")
        edits = ", plus uncommitted edits" if recorded.get("git_dirty") else ""
        at = f" (the code of git commit {commit[:12]}{edits})" if commit else ""
        hint = (
            f" (eval_layout: give --eval_layout={diff['eval_layout'][0]}, as recorded"
            + (", the layout of every grid made before that setting)" if diff["eval_layout"][0] == "first" else ")")
            if "eval_layout" in diff
            else ""
        )
        raise ConfigError(
            f"{path} was made with other settings: {named}; rerun with the recorded ones{at}{hint}, use a new "
            f"--out_dir for the new ones, or add --allow_changes=True to go on here (recorded in every "
            f"cell it touches; the report pairs a seed only where its arms' records agree, and names "
            f"seeds trained under other versions)"
        )
    return diff


def check_cell(cfg, arm, seed, code, val):
    """check_rerun for a cell with something to protect, a checkpoint or a result (which must be readable and this
    cell's); returns how its config.json differs from this run ({} when it has none)."""
    folder = cell_dir(cfg["out_dir"], arm, seed)
    result_path, config_path = os.path.join(folder, "result.json"), os.path.join(folder, "config.json")
    if not any(os.path.exists(os.path.join(folder, f)) for f in ("ckpt.pt", "result.json")):
        return {}  # nothing trained yet: the cell starts from scratch
    if os.path.exists(result_path):
        check_owner(result_path, check_result(read_record(result_path, RESULT_REMEDY), result_path), arm, seed)
    if not os.path.exists(config_path):
        return {}  # a checkpoint alone: resume refuses it, naming what to do
    cell = cell_config(cfg, arm, seed)
    new = dict(cell, code=code, val_hash=val.hash(cell["eval_tokens"], cell["block_size"], cell["eval_layout"]))
    recorded = read_record(config_path, "restore it, or delete the folder to start it again")
    return check_rerun(config_path, recorded, new, cfg["allow_changes"])


class GridRecord:
    """out_dir/config.json: the grid's settings, every arm and seed run so far, accepted changes. Checked against the
    run when made (check_rerun); written once, when the run first trains a cell, so a run that trains nothing changes
    nothing. Checked again when written, against the record as it is then: of two runs started at once, the second to
    train is checked against (and adds to) the first's record, a new grid's created exclusively."""

    def __init__(self, cfg, code):
        self.path, self.cfg, self.code = os.path.join(cfg["out_dir"], "config.json"), cfg, code
        self.recorded, self.change = self.check()
        self.written = False

    def check(self):
        if not os.path.exists(self.path):
            return None, {}
        recorded = read_record(self.path, "restore it, or delete the folder to start it again")
        return recorded, check_rerun(self.path, recorded, dict(self.cfg, code=self.code), self.cfg["allow_changes"])

    def write_once(self):
        if self.written:
            return
        # where another run made the grid since this one checked, or added to it: checked again, as it is now
        if os.path.exists(self.path) or not create_json(self.path, self.merged()):
            self.recorded, self.change = self.check()
            write_json(self.path, self.merged())
        self.written = True

    def merged(self):
        recorded, cfg = self.recorded or {}, self.cfg
        seeds = field(recorded, "seeds", list)
        return dict(
            cfg,
            arms=field(recorded, "arms", dict) | cfg["arms"],
            seeds=seeds + [s for s in cfg["seeds"] if s not in seeds],
            code=self.code,
            changes=field(recorded, "changes", list) + ([self.change] if self.change else []),
        )


def create_json(path, obj):
    """write_json, where path does not exist yet; False, writing nothing, if another process made it first (linked
    from a written temporary: a hard link is atomic and never replaces a file)."""
    tmp = temporary_name(path)  # one a kill leaves is removed by the next write of path
    write_json(tmp, obj)
    try:
        os.link(tmp, path)
        return True
    except FileExistsError:
        return False
    except OSError as e:
        raise cannot_write(path, e) from None
    finally:
        os.remove(tmp)


# -----------------------------------------------------------------------------
# results


def rounded(value):
    """Diagnostics as JSON: tensors to (nested) lists, numbers to 6 significant digits, non-finite to None."""
    if isinstance(value, dict):
        return {str(k): rounded(v) for k, v in value.items()}
    if isinstance(value, torch.Tensor):
        return rounded(value.tolist())
    if isinstance(value, list):
        return [rounded(v) for v in value]
    return float(f"{value:.6g}") if math.isfinite(value) else None


def write_result(
    path,
    cell,
    record,
    model,
    code,
    *,
    steps,
    tokens,
    val_loss,
    sequence_losses,
    diverged,
    routing,
    init_hash,
    data_hash,
    eval_tokens,
    validation,
    changes,
    wall_time_s,
):
    """result.json: how the cell ended, and the pairing record report.py compares across arms; returns it.
    pairing.arm_settings: what the arm sets itself (model keys, learning rates), which may differ across the arms of
    a seed; pairing.settings: every other result-changing key, which may not, nor pairing.code, the code every scheme
    computes with; pairing.scheme_code: the arm's own scheme's (code_fingerprints)."""
    init_from = dict(path=cell["init_from"], sha256=cell["init_from_sha256"]) if cell["init_from"] else None
    arm_settings = cell["arms"][cell["arm"]]
    shared_code, scheme_code = code_fingerprints(code, cell["residual"])
    pairing = dict(
        init_hash=init_hash,
        data_hash=data_hash,
        eval_tokens=eval_tokens,
        val_hash=record["val_hash"],
        code=shared_code,
        scheme_code=scheme_code,
        init_from=init_from,
        arm_settings=arm_settings,
        settings=pairing_settings(cell, arm_settings),
    )
    if changes:
        pairing["changes"] = changes
    finished = not diverged
    result = dict(
        arm=cell["arm"],
        seed=cell["seed"],
        status="finished" if finished else "diverged",
        val_loss=val_loss if finished else None,
        # the final evaluation per validation sequence (val_loss is their mean): the text's uncertainty
        val_sequence_losses=sequence_losses.tolist() if finished else None,
        # past exp(709) a perplexity is no float: null, as for a diverged cell
        val_ppl=math.exp(val_loss) if finished and val_loss < 709 else None,
        diverged_at=None if finished else steps,
        reason=diverged,
        tokens=tokens,
        steps=steps,
        validation=validation,  # the text evaluated, in words for the report (val_hash in pairing pins it)
        params=model.num_params(non_embedding=False),
        non_embedding_params=model.num_params(),
        active_params=model.num_params(non_embedding=False, active=True),
        wall_time_s=round(wall_time_s, 3),
        routing=routing if finished else None,
        pairing=pairing,
        code=code,
        config=record,
    )
    write_json(path, result)
    return result


# -----------------------------------------------------------------------------
# what pairs: the shared init, the validation tokens, the train data


def shared_init_hash(model):
    """sha256 of the shared (non-routing) parameters: equal across the arms of a seed, by design."""
    h = hashlib.sha256()
    for name, p in sorted(model.state_dict().items()):
        if not is_routing(name):
            h.update(name.encode())
            h.update(p.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


# where the validation sequences lie in the validation shard (eval_layout, ValidationText): 'spread' reads every
# held-out document longer than their spacing; 'first' one document of the bundled corpora, as every grid made
# before the setting did (grid_files.as_compared reads a record without it so)
EVAL_LAYOUTS = ("spread", "first")


class ValidationText:
    """The sequences of T + 1 tokens a grid evaluates, cut from the validation shard. part 'test': the reported ones;
    'tune': the tuned protocol's, which never share a token with them. 'spread': the shard cut into slots of T + 1
    tokens, 2 n of them picked at even spacing (n = (eval_tokens - 1) // T), the even picks reported and the odd
    ones tuning, so both sets cover the whole shard (where 2 n do not fit but n do, a frozen grid's: n at even
    spacing, and no tuning ones). 'first': the first eval_tokens tokens as n sequences that share their boundary
    tokens (tuning: the eval_tokens after them). val_hash pins the tokens, so cells of two layouts never pair."""

    def __init__(self, shard, tokenizer, part="test"):
        self.shard, self.tokenizer, self.part = shard, tokenizer, part
        self.made = {}  # (what, eval_tokens, T, layout) -> rows or description: each cell of a grid asks again

    def starts(self, eval_tokens, T, layout):
        n = (eval_tokens - 1) // T
        if layout == "first":
            first = eval_tokens if self.part == "tune" else 0
            if first + n * T + 1 > len(self.shard):
                what = f"the {eval_tokens:,} tokens after the {eval_tokens:,} reported" if first else "its first"
                raise ConfigError(
                    f"eval_layout='first' reads {what} {eval_tokens:,} tokens of the validation shard, which holds "
                    f"{len(self.shard):,}; lower eval_tokens, or set --eval_layout=spread"
                )
            return first + T * np.arange(n)
        slots = len(self.shard) // (T + 1)
        if 2 * n <= slots:
            picks = (np.arange(2 * n) * 2 + 1) * slots // (4 * n)  # the middle of each of 2 n equal stretches
            return picks[self.part == "tune" :: 2] * (T + 1)
        if self.part == "tune":
            raise ConfigError(
                f"eval_layout='spread' reads 2 x {n:,} sequences of {T + 1} tokens (the reported ones and the tuning "
                f"ones between them) but the validation shard holds {slots:,} ({len(self.shard):,} tokens); set "
                f"--eval_tokens={slots // 2 * T + 1} or less, or give a longer validation shard"
            )
        if n > slots:
            raise ConfigError(
                f"eval_layout='spread' reads {n:,} sequences of {T + 1} tokens but the validation shard holds "
                f"{slots:,} ({len(self.shard):,} tokens); set --eval_tokens={slots * T + 1} or less, or give a "
                f"longer validation shard"
            )
        # no room for tuning sequences between them, so no tuned grid reads this text (its tuning part is refused
        # above): a frozen grid's n sequences, one in the middle of each of n equal stretches
        return (np.arange(n) * 2 + 1) * slots // (2 * n) * (T + 1)

    def rows(self, eval_tokens, T, layout):
        """The sequences, an (n, T + 1) array (one per setting: callers only read it)."""
        key = ("rows", eval_tokens, T, layout)
        if key not in self.made:
            starts = self.starts(eval_tokens, T, layout)
            self.made[key] = np.stack([self.shard[s : s + T + 1] for s in starts]).astype(np.uint16)
        return self.made[key]

    def hash(self, eval_tokens, T, layout):
        """val_hash: sha256 of the tokens evaluated ('first': the contiguous stretch, as grids before eval_layout
        recorded it; 'spread': the starts and the sequences)."""
        starts = self.starts(eval_tokens, T, layout)
        if layout == "first":
            return hashlib.sha256(np.ascontiguousarray(self.shard[starts[0] : starts[-1] + T + 1])).hexdigest()
        rows = self.rows(eval_tokens, T, layout)
        return hashlib.sha256(b"spread" + starts.astype(np.int64).tobytes() + rows.tobytes()).hexdigest()

    def described(self, eval_tokens, T, layout):
        """What report.md names: the layout, sequences, tokens, the documents they touch out of those held out
        (documents begin with end-of-text: docs/shards.md), the bytes of text they hold, and per document touched
        its name (data/prepare.py's held_out_names, None where it cannot be told), bytes and sequences."""
        key = ("described", eval_tokens, T, layout)
        if key not in self.made:
            self.made[key] = self.description(eval_tokens, T, layout)
        return self.made[key]

    def description(self, eval_tokens, T, layout):
        starts, rows = self.starts(eval_tokens, T, layout), self.rows(eval_tokens, T, layout)
        counted = dict(layout=layout, part=self.part, sequences=len(rows), tokens=len(rows) * T)
        tokenizer = TOKENIZERS[self.tokenizer]() if self.tokenizer in TOKENIZERS else None
        if tokenizer is None:  # a shard of no known tokenizer: documents and bytes cannot be told
            return counted
        begins = np.flatnonzero(np.asarray(self.shard) == tokenizer.eot)
        path = getattr(self.shard, "filename", None)  # a prepared folder's shard (an np.memmap knows its file)
        names = held_out_names_in(os.path.dirname(path)) if path else None
        if not len(begins) or begins[0] != 0:  # a shard that starts mid-document: its first is no held-out one named
            begins, names = np.concatenate([[0], begins]), None
        if names is not None and len(names) != len(begins):
            names = None  # a manifest that does not describe this shard
        first = np.searchsorted(begins, starts, side="right") - 1
        last = np.searchsorted(begins, starts + T, side="right") - 1
        lengths = np.array([len(tokenizer.token_bytes(i)) for i in range(tokenizer.vocab_size)] + [0])
        lengths[tokenizer.eot] = 0
        row_bytes = lengths[np.minimum(rows, tokenizer.vocab_size)]
        # each (sequence, document) it touches, and the bytes of that document in that sequence
        touches = last - first + 1
        seq = np.repeat(np.arange(len(rows)), touches)
        doc = np.repeat(first - np.cumsum(touches) + touches, touches) + np.arange(touches.sum())
        ends = np.append(begins[1:], len(self.shard))
        cumulative = np.concatenate([np.zeros((len(rows), 1), np.int64), np.cumsum(row_bytes, axis=1)], axis=1)
        before = lambda at: cumulative[seq, np.clip(at - starts[seq], 0, T + 1)]  # a sequence's bytes before at
        doc_bytes = np.bincount(doc, before(ends[doc]) - before(begins[doc]), minlength=len(begins))
        sequences = np.bincount(doc, minlength=len(begins))
        touched = np.flatnonzero(sequences)
        name = lambda d: names[d] if names else None
        read = [dict(name=name(d), bytes=int(doc_bytes[d]), sequences=int(sequences[d])) for d in touched]
        counted |= dict(documents=len(touched), held_out_documents=len(begins), bytes=int(row_bytes.sum()))
        return dict(counted, documents_read=read)


def train_data_fingerprint(train_paths, manifest):
    """sha256 over the train shards, cheap enough for every start: each shard's sha256 from the (verified) manifest
    where data/prepare.py wrote one (verify_shards=True checks those), else its name, size and first and last 64 KiB.
    The content itself is in data_hash, which only training computes."""
    listed = {s["name"]: s["sha256"] for s in manifest["shards"]} if manifest else {}
    h = hashlib.sha256()
    for path in train_paths:
        name, size = os.path.basename(path), os.path.getsize(path)
        h.update(f"{name} {size} {listed.get(name, '')}".encode())
        if name not in listed:
            with open(path, "rb") as f:
                h.update(f.read(1 << 16))
                f.seek(max(0, size - (1 << 16)))
                h.update(f.read(1 << 16))
    return h.hexdigest()
