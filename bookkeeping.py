"""
The bookkeeping that keeps a grid honest, so that train.py's loop does not have to: config checks,
provenance (what code, data and settings made a cell), the rerun check that refuses to mix cells
made differently, one process per cell, checkpoints and logs that survive a kill or a full disk,
warm-start checks, result records and time left. docs/protocol.md says what each record means.
"""

import ast
import dataclasses
import hashlib
import importlib.util
import json
import math
import os
import pickle
import re
import shutil
import subprocess
from contextlib import contextmanager, nullcontext

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict, get_optimizer_state_dict,
                                                     set_model_state_dict, set_optimizer_state_dict)

from configurator import ConfigError, coerce
from data.prepare import (BUNDLED, TOKENIZERS, find_shards, open_shard, pid_lock, prepare_bundled,
                          shard_tokenizer, verify_manifest, write_atomic, write_json)
from model import GPT, RESIDUALS, GPTConfig

HERE = os.path.dirname(os.path.abspath(__file__))
MODEL_DEFAULTS = {f.name: f.default for f in dataclasses.fields(GPTConfig)}
MODEL_KEYS = tuple(MODEL_DEFAULTS)
# an arm is a folder of out_dir: a plain name, and none of the files the grid and its report write there
ARM_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]*")
OUT_DIR_SUFFIXES = (".json", ".md", ".png", ".tmp")
# keys that do not change a cell's result: left out of its pairing settings and of the rerun check.
# data_dir: where the shards lie is not what they hold (train_data_sha256, val_hash and data_hash are);
# wandb_*: a copy of the log elsewhere
NOT_RESULT_KEYS = ("arm", "seed", "arms", "seeds", "reference_arm", "out_dir", "data_dir", "log_interval",
                   "eval_batch_size", "verify_shards", "allow_changes", "wandb_log", "wandb_project", "wandb_run_name")
CODE_FILES = ("model.py", "train.py", "bookkeeping.py", "configurator.py", "data/prepare.py")
RESULT_REMEDY = "delete it to finish the cell again from its last checkpoint, or delete the cell's folder to retrain it"


# -----------------------------------------------------------------------------
# config checks

def model_config(cfg, settings):
    """The model of one arm: the run's model keys, overridden by the arm's settings. A scheme's own
    option (hc_streams, dar_keys, ...) set for the run reaches only the arms of that scheme."""
    residual = settings.get("residual", cfg["residual"])
    own = {k: cfg[k] for k in MODEL_KEYS if k not in settings and not foreign_option(k, residual)}
    return GPTConfig(**own | settings)


def foreign_option(key, residual):
    """Whether key is an option of other schemes only (so it cannot apply to residual)."""
    owners = [name for name, scheme in RESIDUALS.items() if key in scheme.options]
    return bool(owners) and residual not in owners


def cell_config(cfg, arm, seed):
    """A cell's effective config: the run's keys, the arm's model settings over them."""
    model = dataclasses.asdict(model_config(cfg, cfg["arms"][arm]))
    return dict(cfg, **model, arm=arm, seed=seed)


def pairing_settings(cell, arm_settings):
    """What must be equal across the arms of a seed: the result-changing keys the arm does not set."""
    return {k: v for k, v in cell.items()
            if k not in NOT_RESULT_KEYS and k not in arm_settings and not foreign_option(k, cell["residual"])}


def check_config(cfg, world, command_line=()):
    """One line for each setting that cannot run, before anything is trained. command_line: the
    keys set by --key=value, so that a model key every arm overrides is not silently lost."""
    for key, value in cfg.items():
        if isinstance(value, float) and not math.isfinite(value):
            raise ConfigError(f"{key}={value} must be a finite number")
    if not cfg["out_dir"] or not cfg["data_dir"]:
        raise ConfigError(f"{'out_dir' if not cfg['out_dir'] else 'data_dir'} is empty; give a folder, e.g. "
                          f"--out_dir=out or --data_dir=data/shakespeare_bytes")
    for key in ("batch_size", "gradient_accumulation_steps", "max_iters", "eval_interval", "log_interval",
                "eval_batch_size"):
        if cfg[key] < 1:
            raise ConfigError(f"{key}={cfg[key]} must be at least 1")
    for key in ("learning_rate", "muon_learning_rate"):
        if not cfg[key] > 0:
            raise ConfigError(f"{key}={cfg[key]} must be positive")
    for key in ("min_lr", "weight_decay", "grad_clip", "warmup_iters"):
        if not cfg[key] >= 0:
            raise ConfigError(f"{key}={cfg[key]} must not be negative")
    for key in ("beta1", "beta2"):
        if not 0 <= cfg[key] < 1:
            raise ConfigError(f"{key}={cfg[key]} must be in [0, 1)")
    if not 0 <= cfg["cooldown_frac"] <= 1:
        raise ConfigError(f"cooldown_frac={cfg['cooldown_frac']} must be in [0, 1]")
    seeds = cfg["seeds"]
    if not seeds or any(type(s) is not int or s < 0 for s in seeds) or len(set(seeds)) != len(seeds):
        raise ConfigError(f"seeds={seeds!r}: give distinct non-negative integers, e.g. --seeds=0,1,2")
    if not isinstance(cfg["arms"], dict) or not cfg["arms"]:
        raise ConfigError("arms is empty; give at least one arm, e.g. --arms=standard,attnres (scheme names) "
                          "or arms = {'standard': {}}")
    if cfg["residual"] not in RESIDUALS:
        raise ConfigError(f"residual={cfg['residual']!r} is not a residual scheme; choose one of {', '.join(RESIDUALS)}")
    arms = {}  # type-checked like --key=value
    for arm, settings in cfg["arms"].items():
        if not isinstance(arm, str) or not ARM_NAME.fullmatch(arm) or arm.endswith(OUT_DIR_SUFFIXES):
            raise ConfigError(f"arm name {arm!r}: use letters, digits, '_', '.' and '-' (not first), not ending in "
                              f"{', '.join(OUT_DIR_SUFFIXES)} (the grid's own files in out_dir)")
        if not isinstance(settings, dict) or set(settings) - set(MODEL_KEYS):
            raise ConfigError(f"arm {arm!r}: settings must be a dict of model keys ({', '.join(MODEL_KEYS)})")
        settings = arms[arm] = {k: coerce(f"arm {arm!r}: {k}", v, MODEL_DEFAULTS[k]) for k, v in settings.items()}
        for key, value in settings.items():
            if isinstance(value, float) and not math.isfinite(value):
                raise ConfigError(f"arm {arm!r}: {key}={value} must be a finite number")
        try:
            config = model_config(cfg, settings)
        except (ValueError, TypeError) as e:  # GPTConfig's own checks (sizes, dropout, scheme options)
            raise ConfigError(f"arm {arm!r}: {e}") from None
        if cfg["eval_tokens"] < config.block_size + 1:
            raise ConfigError(f"eval_tokens={cfg['eval_tokens']} is less than one sequence of block_size+1 = "
                              f"{config.block_size + 1} tokens" + (f" (arm {arm!r})" if "block_size" in settings else ""))
    cfg["arms"] = arms
    for key in command_line:
        if key not in MODEL_KEYS:
            continue
        overriding = [arm for arm, settings in arms.items() if key in settings and settings[key] != cfg[key]]
        if overriding and len(overriding) == len(arms):
            way = (f"--arms={cfg[key]} (scheme names are arms)" if key == "residual" else
                   f"--arms=\"{{'name': {{'{key}': {cfg[key]!r}}}}}\" to set it per arm")
            raise ConfigError(f"--{key}={cfg[key]!r} is overridden by every arm ({', '.join(overriding)} set {key}); "
                              f"use {way}")
        if foreign_option(key, cfg["residual"]) and not any(not foreign_option(key, model_config(cfg, s).residual)
                                                              for s in arms.values()):
            raise ConfigError(f"--{key}={cfg[key]!r} is an option of residual="
                              f"{' or '.join(n for n, s in RESIDUALS.items() if key in s.options)}, which no arm trains")
    if (cfg["batch_size"] * cfg["gradient_accumulation_steps"]) % world:
        raise ConfigError(f"a step's batch_size x gradient_accumulation_steps = "
                          f"{cfg['batch_size'] * cfg['gradient_accumulation_steps']} sequences do not split evenly "
                          f"over {world} processes; change either, or the number of processes")
    if cfg["lr_schedule"] not in ("cosine", "wsd"):
        raise ConfigError(f"lr_schedule={cfg['lr_schedule']!r}: choose cosine or wsd")
    if cfg["optimizer"] not in ("adamw", "muon"):
        raise ConfigError(f"optimizer={cfg['optimizer']!r}: choose adamw or muon")
    if cfg["optimizer"] == "muon" and not hasattr(torch.optim, "Muon"):
        raise ConfigError(f"optimizer='muon' needs torch.optim.Muon (torch 2.9 or later), this is torch "
                          f"{torch.__version__}; upgrade torch or use --optimizer=adamw")
    if cfg["fsdp"] and world < 2:
        raise ConfigError("fsdp=True shards the model over processes: run under torchrun with --nproc_per_node=2 "
                          "or more, or set --fsdp=False")
    if cfg["fsdp"] and cfg["optimizer"] == "muon":  # Newton-Schulz wants whole matrices, FSDP holds row shards
        raise ConfigError("fsdp=True with optimizer='muon' is not supported (Muon orthogonalizes whole matrices, "
                          "FSDP holds shards of them); use DDP (--fsdp=False) for Muon, or --optimizer=adamw")
    if cfg["wandb_log"] and importlib.util.find_spec("wandb") is None:
        raise ConfigError("wandb_log=True needs the wandb package: pip install wandb (or set --wandb_log=False)")
    if cfg["reference_arm"] and cfg["reference_arm"] not in cfg["arms"]:
        raise ConfigError(f"reference_arm={cfg['reference_arm']!r} is not an arm ({', '.join(cfg['arms'])})")


def resolve_compile(requested, device):
    """compile as used: 'auto' compiles on CUDA only (on a CPU, compiling a small model costs more
    than it saves), else True or False as asked (--compile=True arrives as the string 'True')."""
    choice = str(requested).lower()
    if choice not in ("auto", "true", "false"):
        raise ConfigError(f"compile={requested!r}: choose auto, True or False")
    return device.startswith("cuda") if choice == "auto" else choice == "true"


def resolve_device(requested, world, local_rank, cuda_count, mps_available):
    """The device this process trains on: 'auto' picks cuda, then mps, then cpu; 'cuda' is the
    process's own GPU (cuda:LOCAL_RANK under torchrun, cuda:0 alone); 'cuda:N' names one GPU, so
    only one process may use it."""
    kind, _, index = requested.partition(":")
    if requested == "auto":
        kind, index = "cuda" if cuda_count else "mps" if mps_available else "cpu", ""
    if kind not in ("cpu", "cuda", "mps") or (index and (kind != "cuda" or not index.isdigit())):
        raise ConfigError(f"device={requested!r}: choose auto, cpu, cuda, cuda:N or mps")
    if kind == "mps" and not mps_available:
        raise ConfigError(f"device={requested!r} but this torch sees no MPS device; use --device=auto or cpu")
    if kind != "cuda":
        return kind
    if not cuda_count:
        raise ConfigError(f"device={requested!r} but this torch sees no CUDA GPU; use --device=auto or cpu")
    if index and world > 1:
        raise ConfigError(f"device={requested!r} names one GPU for {world} processes; use --device=cuda "
                          f"(each process takes cuda:LOCAL_RANK)")
    gpu = int(index) if index else local_rank
    if gpu >= cuda_count:
        raise ConfigError(f"device cuda:{gpu} does not exist: this machine shows {cuda_count} GPU(s)")
    return f"cuda:{gpu}"


# dense bf16 peak FLOP/s per GPU, for MFU (matched against torch.cuda.get_device_name)
PEAK_FLOPS = {"H100": 989e12, "H200": 989e12, "H800": 989e12, "B200": 2250e12, "A100": 312e12,
              "A800": 312e12, "L40S": 362e12, "L4": 121e12, "A10G": 125e12, "RTX 4090": 165e12,
              "RTX 3090": 71e12}


def setup(cfg):
    """Device, dtype, distributed context: returns ctx."""
    world = int(os.environ.get("WORLD_SIZE", 1))
    rank, local_rank = int(os.environ.get("RANK", 0)), int(os.environ.get("LOCAL_RANK", 0))
    device = resolve_device(cfg["device"], world, local_rank, torch.cuda.device_count(),
                            torch.backends.mps.is_available())
    dtype = cfg["dtype"]
    if dtype not in ("auto", "bfloat16", "float32"):
        raise ConfigError(f"dtype={dtype!r}: choose auto, bfloat16 or float32")
    if device == "cpu":
        # compiled CPU kernels are otherwise not run-to-run repeatable on several threads (the
        # default 2-seed run moved by up to 0.1 nats); the deterministic ones cost nothing measurable
        torch.use_deterministic_algorithms(True)
    if device.startswith("cuda"):
        torch.cuda.set_device(device)
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    if world > 1:
        dist.init_process_group(backend="nccl" if device.startswith("cuda") else "gloo")
    if dtype == "auto":
        dtype = "bfloat16" if device.startswith("cuda") and torch.cuda.is_bf16_supported() else "float32"
    autocast = torch.autocast(device.split(":")[0], dtype=torch.bfloat16) if dtype == "bfloat16" else nullcontext()
    peak = None
    if device.startswith("cuda") and dtype == "bfloat16":
        name = torch.cuda.get_device_name()
        peak = next((v for k, v in PEAK_FLOPS.items() if k in name), None)
    return dict(world=world, rank=rank, local_rank=local_rank, device=device, dtype=dtype, autocast=autocast,
                peak_flops=peak, fsdp=cfg["fsdp"])


def resolve_data_dir(path):
    """data_dir as an absolute path: a relative one is taken from the working directory when it is
    there, else from the project directory (so the bundled default works from anywhere)."""
    if os.path.isabs(path) or os.path.exists(path):
        return os.path.abspath(path)
    return os.path.abspath(os.path.join(HERE, path))


def open_data(cfg, vocab_size, init_tokenizer, ctx):
    """The validation shard and the train shards, every one checked before anything trains (the
    bundled corpus prepared on first use). Records in cfg what the data is: the absolute data_dir,
    its tokenizer (byte and GPT-2 cells never pair) and train_data_sha256 (other train data is a
    change, like other weights; other validation tokens show in each cell's val_hash)."""
    master = ctx["rank"] == 0
    cfg["data_dir"] = data_dir = resolve_data_dir(cfg["data_dir"])
    if data_dir in BUNDLED and not os.path.exists(os.path.join(data_dir, "manifest.json")):
        if master:
            prepare_bundled(data_dir)
        if ctx["world"] > 1:
            dist.barrier()
    manifest = verify_manifest(data_dir, full=cfg["verify_shards"] and master)  # the sha256s once, on rank 0
    val_path, train_paths = find_shards(data_dir)
    cfg["tokenizer"] = tokenizer = manifest["tokenizer"] if manifest else shard_tokenizer(val_path)
    if init_tokenizer not in (None, tokenizer):  # the same ids would be other tokens
        raise ConfigError(f"init_from={cfg['init_from']} was trained on {init_tokenizer} tokens, data_dir {data_dir} "
                          f"holds {tokenizer} tokens; warm-start on data of the checkpoint's tokenizer")
    needed = TOKENIZERS[tokenizer].vocab_size
    if manifest and vocab_size < needed:
        raise ConfigError(f"vocab_size={vocab_size} is less than the {needed} ids of {data_dir}'s {tokenizer} tokens; "
                          f"set --vocab_size={-(-needed // 64) * 64} (padded to a multiple of 64)")
    val = open_shard(val_path, vocab_size)
    if cfg["eval_tokens"] > len(val):
        raise ConfigError(f"eval_tokens={cfg['eval_tokens']} is more than the validation shard {val_path} holds "
                          f"({len(val):,} tokens); lower eval_tokens")
    train_shards = [open_shard(path, vocab_size) for path in train_paths]
    cfg["train_data_sha256"] = train_data_fingerprint(train_paths, manifest)
    return val, train_shards


def check_writable(out_dir):
    try:
        os.makedirs(out_dir, exist_ok=True)
        probe = os.path.join(out_dir, f".write_test.{os.getpid()}.tmp")
        with open(probe, "w"):
            pass
        os.remove(probe)
    except OSError as e:
        raise ConfigError(f"out_dir {out_dir} is not writable ({e.strerror}); choose another --out_dir") from None


# -----------------------------------------------------------------------------
# provenance and the rerun check

def code_fingerprint(source):
    """sha256 of a Python file's syntax tree without docstrings: comments, docstrings, blank lines
    and layout are not code, so editing them does not change a result (or lock a grid)."""
    tree = ast.parse(source)
    for node in ast.walk(tree):
        body = getattr(node, "body", None)
        if (isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and body
                and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant)
                and isinstance(body[0].value.value, str)):
            node.body = body[1:] or [ast.Pass()]
    return hashlib.sha256(ast.dump(tree).encode()).hexdigest()


def code_record():
    """The fingerprint of the training code (per file, and of them all), and the git commit and
    dirty flag where git can tell."""
    files = {}
    for name in CODE_FILES:
        with open(os.path.join(HERE, name), "rb") as f:
            files[name] = code_fingerprint(f.read())
    fingerprint = hashlib.sha256(json.dumps(files, sort_keys=True).encode()).hexdigest()

    def git(*args):
        try:
            return subprocess.run(["git", "-C", HERE, *args], capture_output=True, text=True, timeout=30,
                                  check=True).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            return None
    commit, status = git("rev-parse", "HEAD"), git("status", "--porcelain", "--untracked-files=no")
    return dict(fingerprint=fingerprint, files=files, git_commit=commit,
                git_dirty=None if status is None else status != "")


def differences(old, new):
    """{key: [recorded, now]} over the keys that change a result, 'code' for the code fingerprint."""
    skip = NOT_RESULT_KEYS + ("model", "code", "changes")
    diff = {k: [old.get(k), new.get(k)] for k in sorted(set(old) | set(new))
            if k not in skip and old.get(k) != new.get(k)}
    old_arms, new_arms = old.get("arms"), new.get("arms")
    if isinstance(old_arms, dict) and isinstance(new_arms, dict):
        for arm in set(old_arms) & set(new_arms):
            if old_arms[arm] != new_arms[arm]:
                diff[f"arms[{arm!r}]"] = [old_arms[arm], new_arms[arm]]
    old_code, new_code = (r.get("code") if isinstance(r.get("code"), dict) else {} for r in (old, new))
    if old_code.get("fingerprint") != new_code.get("fingerprint"):
        diff["code"] = [old_code.get("fingerprint"), new_code.get("fingerprint")]
    return diff


def changed_files(old, new):
    """The code files whose fingerprint differs between two code records (all, for an older record)."""
    before, now = (r.get("files") if isinstance(r, dict) and isinstance(r.get("files"), dict) else {} for r in (old, new))
    return [name for name in now if before.get(name) != now[name]] or list(now)


def read_record(path, remedy):
    """A JSON object written by train.py; anything else is one line with the remedy."""
    try:
        with open(path) as f:
            record = json.load(f)
    except (OSError, ValueError) as e:
        raise ConfigError(f"{path} is unreadable or damaged ({e}); {remedy}") from None
    if not isinstance(record, dict):
        raise ConfigError(f"{path} holds {type(record).__name__}, not a train.py record; {remedy}")
    return record


def check_rerun(path, new, allow):
    """The record at path (or None) and how the new config differs from it; refuses a difference
    unless allow."""
    if not os.path.exists(path):
        return None, {}
    old = read_record(path, "restore it, or delete the folder to start it again")
    diff = differences(old, new)
    if diff and not allow:
        short = lambda v: repr(v) if len(repr(v)) <= 40 else "..."
        named = ", ".join(f"code changed ({', '.join(changed_files(old.get('code') or {}, new['code']))})"
                          if k == "code" else f"{k} ({short(a)} -> {short(b)})" for k, (a, b) in diff.items())
        recorded = old.get("code") if isinstance(old.get("code"), dict) else {}
        at = f" (the code of git commit {recorded['git_commit'][:12]}{', plus uncommitted edits' if recorded.get('git_dirty') else ''})" \
            if "code" in diff and recorded.get("git_commit") else ""
        raise ConfigError(f"{path} was made with other settings: {named}; rerun with the recorded ones{at}, use a new "
                          f"--out_dir for the new ones, or add --allow_changes=True to go on here (recorded in every "
                          f"cell it touches; the report pairs a seed only where its arms' records agree, and names "
                          f"seeds trained under other versions)")
    return old, diff


def check_cell(cfg, arm, seed, code, val):
    """check_rerun for a cell with something to protect: a checkpoint or a result (which must be
    readable and be this cell's: a copied folder is not a new seed)."""
    cell_dir = os.path.join(cfg["out_dir"], arm, f"seed{seed}")
    if not any(os.path.exists(os.path.join(cell_dir, f)) for f in ("ckpt.pt", "result.json")):
        return None, {}  # nothing trained yet: the cell starts from scratch
    if os.path.exists(os.path.join(cell_dir, "result.json")):
        r = check_result(read_record(os.path.join(cell_dir, "result.json"), RESULT_REMEDY),
                         os.path.join(cell_dir, "result.json"))
        if (r.get("arm"), r["seed"]) != (arm, seed):
            raise ConfigError(f"{cell_dir}/result.json is the result of arm {r.get('arm')!r} seed {r['seed']} (a copied "
                              f"file?); delete {cell_dir} to train this cell")
    cell = cell_config(cfg, arm, seed)
    new = dict(cell, code=code, val_hash=validation_hash(val, cell["eval_tokens"], cell["block_size"]))
    recorded, diff = check_rerun(os.path.join(cell_dir, "config.json"), new, cfg["allow_changes"])
    if recorded is not None and (recorded.get("arm"), recorded.get("seed")) != (arm, seed):
        raise ConfigError(f"{cell_dir} holds the record of arm {recorded.get('arm')!r} seed {recorded.get('seed')!r} "
                          f"(a copied or renamed folder?); delete {cell_dir} to train this cell")
    return recorded, diff


def check_result(r, path):
    """A result.json as train.py writes it, or one line."""
    ok = (r.get("status") in ("finished", "diverged") and isinstance(r.get("seed"), int)
          and (isinstance(r.get("val_loss"), (int, float)) and not isinstance(r.get("val_loss"), bool)
               if r["status"] == "finished" else isinstance(r.get("diverged_at"), int)))
    if not ok:
        raise ConfigError(f"{path} is not a result train.py wrote (status, seed, val_loss or diverged_at missing or "
                          f"of the wrong type); {RESULT_REMEDY}")
    return r


def train_data_fingerprint(train_paths, manifest):
    """sha256 over the train shards, cheap enough for every start: each shard's sha256 from the
    (verified) manifest where data/prepare.py wrote one (verify_shards=True checks those), else its
    name, size and first and last 64 KiB. The content itself is in data_hash, which only training computes."""
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


def validation_hash(val, eval_tokens, T):
    """sha256 of the validation tokens evaluated: the whole sequences of T + 1 in the first eval_tokens."""
    return hashlib.sha256(np.ascontiguousarray(val[:(eval_tokens - 1) // T * T + 1])).hexdigest()


def shared_init_hash(model):
    """sha256 of the shared (non-routing) parameters: equal across the arms of a seed, by design."""
    h = hashlib.sha256()
    for name, p in sorted(model.state_dict().items()):
        if not name.startswith("residual."):
            h.update(name.encode())
            h.update(p.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


class GridRecord:
    """out_dir/config.json: the grid's settings, every arm and seed run so far, accepted changes.
    Checked against the run when made (check_rerun); written once, when the run first trains a
    cell, so a run that trains nothing changes nothing."""

    def __init__(self, cfg, code):
        self.path, self.cfg, self.code = os.path.join(cfg["out_dir"], "config.json"), cfg, code
        self.recorded, self.change = check_rerun(self.path, dict(cfg, code=code), cfg["allow_changes"])
        self.written = False

    def write_once(self):
        if self.written:
            return
        recorded, cfg = self.recorded or {}, self.cfg
        seeds = recorded.get("seeds") if isinstance(recorded.get("seeds"), list) else []
        arms = recorded.get("arms") if isinstance(recorded.get("arms"), dict) else {}
        changes = recorded.get("changes") if isinstance(recorded.get("changes"), list) else []
        write_json(self.path, dict(cfg, arms=arms | cfg["arms"], seeds=seeds + [s for s in cfg["seeds"] if s not in seeds],
                                   code=self.code, changes=changes + ([self.change] if self.change else [])))
        self.written = True


# -----------------------------------------------------------------------------
# one process per cell

@contextmanager
def cell_lock(cell_dir, master):
    """One process at a time trains a cell: cell_dir/lock (data/prepare.py's pid_lock: pid and host,
    a killed run's lock taken over). Under DDP rank 0 holds it."""
    if not master:
        yield
        return
    try:
        os.makedirs(cell_dir, exist_ok=True)
    except OSError as e:  # a file where the arm's or the cell's folder should be, a read-only disk
        raise ConfigError(f"cannot create the cell folder {cell_dir} ({e.strerror}); move away the file in its "
                          f"place, or choose another --out_dir") from None
    with pid_lock(os.path.join(cell_dir, "lock"), f"cell {cell_dir} is being trained"):
        yield


# -----------------------------------------------------------------------------
# warm start

# the model keys that give the shared weights their meaning (n_head: not visible in the shapes)
ARCHITECTURE_KEYS = ("n_layer", "n_head", "n_embd", "vocab_size")


def load_init_from(cfg):
    """
    The weights every cell starts from when init_from is set, the sha256 of their file and the
    tokenizer of the data they were trained on (None for a plain state_dict, which cannot say): a
    train.py ckpt.pt of a residual='standard' arm, or a file holding a state_dict of one. Checked
    against every arm before anything runs; each cell then copies them by name over its seed's
    init, leaving its routing parameters (residual.*) at their init, which is the standard residual.
    """
    path = cfg["init_from"]
    if not path:
        return None, None, None
    h = hashlib.sha256()
    try:
        with open(path, "rb") as f:
            for chunk in iter(lambda: f.read(1 << 24), b""):
                h.update(chunk)
        ckpt = load_tensors(path, "cpu")
    except (OSError, ValueError) as e:
        why = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise ConfigError(f"init_from={path} is missing or unreadable ({why}); give a train.py ckpt.pt of a "
                          f"residual='standard' arm") from None
    weights = ckpt.get("model", ckpt) if isinstance(ckpt, dict) else None
    if (not isinstance(weights, dict) or not weights or not all(isinstance(v, torch.Tensor) for v in weights.values())
            or not all(isinstance(k, str) for k in weights)):
        raise ConfigError(f"init_from={path} holds neither a train.py ckpt.pt nor a state_dict")
    record = ckpt.get("config") if isinstance(ckpt.get("config"), dict) else {}  # a train.py checkpoint says what it is
    source = record.get("model") if isinstance(record.get("model"), dict) else {}
    routing = [k for k in weights if k.startswith("residual.")]
    if routing:
        raise ConfigError(f"init_from={path} is not a standard checkpoint (residual={source.get('residual', '?')!r}, "
                          f"routing parameters {routing[0]}, ...); warm starts begin from a residual='standard' model")
    for arm, settings in cfg["arms"].items():
        config = model_config(cfg, settings)
        for key in ARCHITECTURE_KEYS:
            if key in source and source[key] != getattr(config, key):
                raise ConfigError(f"init_from={path} has {key}={source[key]}, arm {arm!r} has {key}="
                                  f"{getattr(config, key)}; set --{key}={source[key]} or use another checkpoint")
        with torch.device("meta"):
            shapes = {k: v.shape for k, v in GPT(config).state_dict().items() if not k.startswith("residual.")}
        for name in sorted(set(shapes) | set(weights)):
            have = tuple(weights[name].shape) if name in weights else "absent"
            want = tuple(shapes[name]) if name in shapes else "absent"
            if have != want:
                raise ConfigError(f"init_from={path} does not fit arm {arm!r}: {name} is {have} there, {want} in "
                                  f"the arm (n_layer, n_embd, vocab_size must be the checkpoint's)")
    return weights, h.hexdigest(), record.get("tokenizer")


# -----------------------------------------------------------------------------
# checkpoints and logs

def save_atomically(obj, path, writer=torch.save):
    """writer(obj, tmp) through write_atomic: a failed write (a full disk) leaves the last good file
    in place and no temporary behind. torch.save reports a full disk as a RuntimeError."""
    try:
        write_atomic(path, lambda tmp: writer(obj, tmp))
    except RuntimeError as e:
        full = shutil.disk_usage(os.path.dirname(path) or ".").free < 1 << 26
        why = "no space left on device" if full else str(e).splitlines()[0]
        raise ConfigError(f"could not write {path} ({why}); the last good copy is kept: "
                          f"free disk space and rerun to resume") from None


def write_text(text, path):
    with open(path, "w") as f:
        f.write(text)


CHECKPOINT_KEYS = ("model", "optimizer", "step", "rng", "data_hash", "config", "loss_sum", "step_last", "wall_time_s")


def load_tensors(path, device):
    """torch.load of tensors and plain data only (weights_only: a planted file cannot run code); a
    file it cannot read is a ValueError whose message is the reason, in one line."""
    try:
        return torch.load(path, map_location=device, weights_only=True)
    except (OSError, EOFError, RuntimeError, ValueError, KeyError, pickle.UnpicklingError) as e:
        why = "not a checkpoint torch can read safely" if isinstance(e, pickle.UnpicklingError) else \
            str(e).splitlines()[0] if str(e) else type(e).__name__
        raise ValueError(why) from None


def load_checkpoint(path, device):
    """A ckpt.pt as train.py writes it (tensors and plain data only: weights_only), or one line."""
    remedy = "delete it to train the cell from scratch"
    try:
        ckpt = load_tensors(path, device)
    except ValueError as e:
        raise ConfigError(f"{path} is unreadable, truncated or empty ({e}); {remedy}") from None
    missing = [k for k in CHECKPOINT_KEYS if not isinstance(ckpt, dict) or k not in ckpt]
    if missing:
        raise ConfigError(f"{path} was written by an older train.py (no {', '.join(missing)}); {remedy}")
    kinds = dict(step=int, step_last=int, data_hash=str, loss_sum=(int, float), wall_time_s=(int, float), config=dict,
                 rng=list, model=dict, optimizer=dict)
    wrong = [k for k, kind in kinds.items() if not isinstance(ckpt[k], kind) or isinstance(ckpt[k], bool)]
    if "rng" not in wrong and not all(isinstance(r, dict) and isinstance(r.get("torch"), torch.Tensor) for r in ckpt["rng"]):
        wrong.append("rng")
    if wrong or ckpt["step"] < 0 or not 0 <= ckpt["step_last"] <= ckpt["step"]:
        raise ConfigError(f"{path} is not a checkpoint train.py wrote ({', '.join(wrong) or 'step'} of the wrong "
                          f"type or value); {remedy}")
    return ckpt


def log_until(log_path, step):
    """The cell's log records before a checkpoint at step (its own evaluation is redone); a
    half-written last line (a kill or a full disk mid-write) is dropped."""
    if not os.path.isfile(log_path):
        raise ConfigError(f"{log_path} is missing beside its ckpt.pt; restore it, or delete ckpt.pt to train the cell "
                          f"from scratch")
    try:
        with open(log_path, encoding="utf-8") as f:
            lines = f.read().splitlines()
    except UnicodeDecodeError:
        raise ConfigError(f"{log_path} is not text; restore it, or delete ckpt.pt to train the cell from scratch") from None
    kept = []
    for i, line in enumerate(lines):
        try:
            r = json.loads(line)
            if not isinstance(r, dict) or not isinstance(r.get("step"), int):
                raise ValueError
        except ValueError:
            if i == len(lines) - 1:
                break
            raise ConfigError(f"{log_path} line {i + 1} is not a log record; repair it, or delete ckpt.pt to train "
                              f"the cell from scratch") from None
        if r["step"] < step or (r["step"] == step and "loss" in r):
            kept.append(line + "\n")
    return "".join(kept)


def gather_rng(ctx):
    """Every rank's RNG state (dropout masks), for the checkpoint."""
    state = dict(torch=torch.get_rng_state(),
                 cuda=torch.cuda.get_rng_state() if ctx["device"].startswith("cuda") else None)
    if ctx["world"] == 1:
        return [state]
    states = [None] * ctx["world"]
    dist.all_gather_object(states, state)
    return states


def restore_rng(states, ctx):
    if len(states) != ctx["world"]:
        return  # another world size: a recorded change (world_size), whose dropout streams start afresh
    state = states[ctx["rank"]]
    torch.set_rng_state(state["torch"].cpu())
    if state["cuda"] is not None and ctx["device"].startswith("cuda"):
        torch.cuda.set_rng_state(state["cuda"].cpu())


def optimizer_parts(optimizer):
    """The torch optimizers behind configure_optimizers' one object (AdamW, or Muon and AdamW)."""
    return list(getattr(optimizer, "optimizers", [optimizer]))


def training_state(model, optimizer, ctx):
    """(model state, optimizer state) for ckpt.pt, in one format however the model is spread: the
    full model state_dict and the optimizer state keyed by parameter name. Under FSDP every rank
    must call it (it gathers the shards) and rank 0 gets them; otherwise rank 0 alone does."""
    if ctx["fsdp"]:
        full = StateDictOptions(full_state_dict=True, cpu_offload=True)
        return (get_model_state_dict(model, options=full),
                get_optimizer_state_dict(model, optimizer_parts(optimizer), options=full))
    return model.state_dict(), get_optimizer_state_dict(model, optimizer_parts(optimizer))


def load_training_state(path, ckpt, model, optimizer, ctx):
    """ckpt's model and optimizer state into model and optimizer (each rank takes its shards under FSDP)."""
    full = StateDictOptions(full_state_dict=True) if ctx["fsdp"] else None
    if ctx["fsdp"]:
        set_model_state_dict(model, ckpt["model"], options=full)
    else:
        model.load_state_dict(ckpt["model"])
    try:
        set_optimizer_state_dict(model, optimizer_parts(optimizer), ckpt["optimizer"], options=full)
    except (KeyError, ValueError, RuntimeError, TypeError) as e:
        raise ConfigError(f"{path} holds an optimizer state that does not fit this optimizer ({type(e).__name__}: "
                          f"{str(e).splitlines()[0] if str(e) else '-'}): written with another optimizer or by an "
                          f"older train.py; delete it to train the cell from scratch") from None


def resume(cell_dir, record, allow, model, optimizer, ctx):
    """Load the cell's checkpoint into model and optimizer, cut its log back to it, restore its RNG;
    returns (step, data_hash, loss_sum, step_last, wall_time_s, changes, wandb_id). The checkpoint
    is checked against the cell's new record as config.json is (check_cell): it must be this cell's,
    within max_iters, and made with the same settings and code unless allow (then recorded in changes)."""
    path = os.path.join(cell_dir, "ckpt.pt")
    if not os.path.exists(os.path.join(cell_dir, "config.json")):
        raise ConfigError(f"{cell_dir} has ckpt.pt but no config.json to check it against; restore config.json, "
                          f"or delete ckpt.pt to train the cell from scratch")
    ckpt = load_checkpoint(path, ctx["device"])
    saved = ckpt["config"]
    if (saved.get("arm"), saved.get("seed")) != (record["arm"], record["seed"]):
        raise ConfigError(f"{path} is the checkpoint of arm {saved.get('arm')!r} seed {saved.get('seed')!r} (a copied "
                          f"file?); delete it to train this cell from scratch")
    if ckpt["step"] > record["max_iters"]:
        raise ConfigError(f"{path} is at step {ckpt['step']}, past max_iters={record['max_iters']}; set "
                          f"--max_iters={saved.get('max_iters', ckpt['step'])} to finish it, or delete it to retrain")
    change = differences(saved, record)
    if change and not allow:
        raise ConfigError(f"{path} was saved with other settings: {', '.join(change)}; rerun with those, delete it to "
                          f"train the cell from scratch, or add --allow_changes=True (recorded)")
    if saved.get("optimizer", "adamw") != record["optimizer"]:
        raise ConfigError(f"{path} was trained with optimizer={saved.get('optimizer', 'adamw')!r}, whose state "
                          f"{record['optimizer']!r} cannot take over; delete it to train the cell from scratch")
    kept_log = log_until(os.path.join(cell_dir, "log.jsonl"), ckpt["step"])
    try:
        load_training_state(path, ckpt, model, optimizer, ctx)
    except RuntimeError as e:  # a state_dict of another model
        raise ConfigError(f"{path} does not fit this cell's model ({str(e).splitlines()[0]}); delete it to train the "
                          f"cell from scratch") from None
    restore_rng(ckpt["rng"], ctx)
    if ctx["rank"] == 0:
        save_atomically(kept_log, os.path.join(cell_dir, "log.jsonl"), write_text)
    before = saved.get("changes") if isinstance(saved.get("changes"), list) else []
    changes = before + ([dict(step=ckpt["step"], changed=change)] if change else [])
    return (ckpt["step"], ckpt["data_hash"], ckpt["loss_sum"] if ctx["rank"] == 0 else 0.0, ckpt["step_last"],
            ckpt["wall_time_s"], changes, ckpt.get("wandb_id"))


# -----------------------------------------------------------------------------
# the cell's log, and its wandb run

class CellLog:
    """log.jsonl of a cell (rank 0 writes it), each record also logged to the cell's wandb run when
    wandb_log: one run per cell with its record as config, continued when the cell resumes, and
    its result (pairing record included) as the run's summary."""

    def __init__(self, path, append, cell, config, wandb_id):
        self.file, self.run = open(path, "a" if append else "w"), None
        if cell["wandb_log"]:
            import wandb
            group = cell["wandb_run_name"] or os.path.basename(os.path.abspath(cell["out_dir"]))
            self.run = wandb.init(project=cell["wandb_project"], group=group,
                                  name=f"{group}/{cell['arm']}/seed{cell['seed']}", config=config,
                                  **(dict(id=wandb_id, resume="allow") if wandb_id else {}))
        self.wandb_id = self.run.id if self.run else None

    def write(self, entry, **file_only):
        self.file.write(json.dumps(dict(entry, **file_only)) + "\n")
        self.file.flush()
        if self.run:
            self.run.log(entry, step=entry["step"])

    def close(self, result):
        self.file.close()
        if self.run:
            self.run.summary.update({k: v for k, v in result.items() if k != "config"})
            self.run.finish()


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


def write_result(path, cell, record, model, code, *, steps, tokens, val_loss, diverged, routing, init_hash,
                 data_hash, eval_tokens, changes, wall_time_s):
    """result.json: how the cell ended, and the pairing record report.py compares across arms; returns it."""
    init_from = dict(path=cell["init_from"], sha256=cell["init_from_sha256"]) if cell["init_from"] else None
    pairing = dict(init_hash=init_hash, data_hash=data_hash, eval_tokens=eval_tokens, val_hash=record["val_hash"],
                   code=code["fingerprint"], init_from=init_from,
                   settings=pairing_settings(cell, cell["arms"][cell["arm"]]))
    if changes:
        pairing["changes"] = changes
    finished = not diverged
    result = dict(arm=cell["arm"], seed=cell["seed"], status="finished" if finished else "diverged",
                  val_loss=val_loss if finished else None,
                  # past exp(709) a perplexity is no float: null, as for a diverged cell
                  val_ppl=math.exp(val_loss) if finished and val_loss < 709 else None,
                  diverged_at=None if finished else steps, reason=diverged, tokens=tokens, steps=steps,
                  params=model.num_params(non_embedding=False), non_embedding_params=model.num_params(),
                  wall_time_s=round(wall_time_s, 3), routing=routing if finished else None,
                  pairing=pairing, code=code, config=record)
    write_json(path, result)
    return result


def describe_done(path, change):
    r = check_result(read_record(path, RESULT_REMEDY), path)
    return ((f"diverged at step {r['diverged_at']}" if r["status"] == "diverged" else f"val_loss {r['val_loss']:.4f}")
            + (f" (recorded with other settings: {', '.join(change)}; not retrained)" if change else ""))


# -----------------------------------------------------------------------------
# time left

class TimeLeft:
    """Time left in the cell and the grid, from the step time measured after this process's first
    logged interval (which compiles) and from the fastest evaluation (the first compiles too).
    Evaluation time is not training time. Cells not started yet are estimated at this cell's rates,
    or at their arm's when this process has run one of its cells."""

    def __init__(self, cfg, todo, rates):
        self.cfg, self.todo, self.rates = cfg, todo, rates  # rates: arm -> (s/step, s/evaluation), shared by cells
        self.intervals, self.train_s, self.train_steps, self.eval_s = 0, 0.0, 0, []

    def evaluated(self, seconds):
        self.eval_s.append(seconds)

    def logged(self, arm, seed, step, steps, seconds):
        """After a log interval of `steps` steps that took `seconds`: (cell, grid) seconds left."""
        self.intervals += 1
        if self.intervals > 1:
            self.train_s, self.train_steps = self.train_s + seconds, self.train_steps + steps
        step_s = self.train_s / self.train_steps if self.train_steps else seconds / steps
        self.rates[arm] = (step_s, min(self.eval_s))
        n = self.cfg["max_iters"]
        cell = (n - step) * step_s + evals_after(step, self.cfg) * min(self.eval_s)
        later = self.todo[self.todo.index((arm, seed)) + 1:] if (arm, seed) in self.todo else []
        grid = cell + sum(self.rates.get(a, self.rates[arm])[0] * n + self.rates.get(a, self.rates[arm])[1]
                          * evals_after(-1, self.cfg) for a, _ in later)
        return cell, grid


def evals_after(step, cfg):
    """Evaluations still to come after step."""
    n, k = cfg["max_iters"], cfg["eval_interval"]
    return n // k - step // k + (n % k != 0 and step < n)


def duration(seconds):
    seconds = int(seconds)
    return f"{seconds // 3600}h{seconds // 60 % 60:02d}m" if seconds >= 3600 else f"{seconds // 60}m{seconds % 60:02d}s"
