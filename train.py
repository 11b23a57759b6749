"""
Pretrain the paired-seed grid: every (seed, arm) cell in turn, paired within a seed (same
shared-parameter init, same data order, same dropout RNG) and evaluated on one fixed validation set.

$ python train.py                                       # default: a small paired run on the bundled corpus
$ python train.py config/rd_120m.py --seeds=0 --arms=rd_attnres   # one cell, one GPU
$ python train.py --init_from=out/standard/seed0/ckpt.pt       # every arm from a trained standard model
$ torchrun --standalone --nproc_per_node=8 train.py config/rd_343m.py
$ torchrun --nnodes=2 --node_rank=0 --master_addr=10.0.0.1 --master_port=29500 \
      --nproc_per_node=8 train.py config/rd_343m.py     # multi-node: out_dir on a shared filesystem

Each cell writes out_dir/<arm>/seed<k>/: config.json (its effective config and the code that ran),
log.jsonl, ckpt.pt and, when done, result.json. Run the same command again: finished cells are
skipped, a killed cell resumes from its last checkpoint, a cell that another process is training
(out_dir/<arm>/seed<k>/lock) stops the run with one line, and a cell recorded with other settings,
data or code is refused unless allow_changes=True (docs/protocol.md). The grid ends with the paired
report (report.py).
"""

import dataclasses
import hashlib
import json
import math
import os
import pickle
import re
import socket
import subprocess
import sys
import time
from contextlib import contextmanager, nullcontext

import numpy as np
import torch
import torch.distributed as dist
from torch.nn import functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

from configurator import ConfigError, coerce, configure
from data.prepare import (BUNDLED_OUT, DataError, find_shards, open_shard, prepare_bundled, verify_manifest,
                          write_json)
from model import GPT, RESIDUALS, GPTConfig

HERE = os.path.dirname(os.path.abspath(__file__))

_before_config = set(globals())
# -----------------------------------------------------------------------------
# default config: a small paired run on the bundled Shakespeare corpus, minutes on a 2-core CPU
# I/O
out_dir = "out"  # relative to the working directory
data_dir = "data/shakespeare_gpt2"  # relative: from the working directory if there, else from this file's
# directory (recorded absolute); the bundled corpus is prepared on demand
verify_shards = False  # at start, also check each shard's sha256 against manifest.json (file names and sizes always)
init_from = ""  # warm start: every cell from this standard checkpoint's weights (docs/protocol.md); "" = the seed's init
eval_interval = 100
log_interval = 10
eval_tokens = 32768  # the fixed validation set: the first N tokens of the validation shard
eval_batch_size = 8  # sequences per evaluation forward; does not change the result
allow_changes = False  # go on with cells recorded under other settings or code; the change is recorded in them
# the paired grid: each arm is a named set of model settings; every arm runs with every seed
arms = {"attnres": {"residual": "attnres"}, "rd_attnres": {"residual": "rd_attnres"}}
seeds = [0, 1]
reference_arm = ""  # the paired report's reference; empty = the first arm
# model: every GPTConfig field is a key, with model.py's default unless set here (the default run's size)
n_layer = 4
n_head = 4
n_embd = 128
block_size = 128
# optimizer: AdamW; routing parameters and norms are never decayed
learning_rate = 3e-3
max_iters = 200
weight_decay = 0.1
beta1 = 0.9
beta2 = 0.95
grad_clip = 1.0
lr_schedule = "cosine"  # 'cosine' (warmup + cosine to min_lr) or 'wsd' (warmup, stable, linear cooldown)
warmup_iters = 20
min_lr = 3e-4
cooldown_frac = 0.2  # wsd: the last fraction of max_iters decays linearly to min_lr
# batch: a step is gradient_accumulation_steps x batch_size sequences in all, split over ranks
batch_size = 8  # sequences per forward at most (per rank)
gradient_accumulation_steps = 1
# system
device = "auto"  # 'auto' (cuda, then mps, then cpu), or e.g. 'cpu', 'cuda', 'cuda:1', 'mps'; recorded as the type used
dtype = "auto"  # 'auto' (bfloat16 autocast where supported, else float32), 'bfloat16', 'float32'; recorded as used
compile = True
# -----------------------------------------------------------------------------
DEFAULTS = {k: v for k, v in globals().items() if k not in _before_config and k != "_before_config"}
MODEL_DEFAULTS = {f.name: f.default for f in dataclasses.fields(GPTConfig)}
MODEL_KEYS = tuple(MODEL_DEFAULTS)
DEFAULTS = MODEL_DEFAULTS | DEFAULTS  # every GPTConfig field is a key; the globals above override its defaults
# an arm is a folder of out_dir: a plain name, and none of the files the grid and its report write there
ARM_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]*")
OUT_DIR_FILES = ("config.json", "report.md", "paired.json")
# keys that do not change a cell's result: left out of its pairing settings and of the rerun check
NOT_RESULT_KEYS = ("arm", "seed", "arms", "seeds", "reference_arm", "out_dir", "log_interval", "eval_batch_size",
                   "verify_shards", "allow_changes")
CODE_FILES = ("model.py", "train.py", "configurator.py", "data/prepare.py")
# dense bf16 peak FLOP/s per GPU, for MFU (matched against torch.cuda.get_device_name)
PEAK_FLOPS = {"H100": 989e12, "H200": 989e12, "H800": 989e12, "B200": 2250e12, "A100": 312e12,
              "A800": 312e12, "L40S": 362e12, "L4": 121e12, "A10G": 125e12, "RTX 4090": 165e12,
              "RTX 3090": 71e12}


def model_config(cfg, settings):
    """The model of one arm: the run's model keys, overridden by the arm's settings."""
    return GPTConfig(**{k: cfg[k] for k in MODEL_KEYS} | settings)


def cell_config(cfg, arm, seed):
    """A cell's effective config: the run's keys, the arm's model settings over them."""
    return dict(cfg, **cfg["arms"][arm], arm=arm, seed=seed)


def pairing_settings(cell, arm_settings):
    """What must be equal across the arms of a seed: the result-changing keys the arm does not set."""
    return {k: v for k, v in cell.items() if k not in NOT_RESULT_KEYS and k not in arm_settings}


def code_record():
    """sha256 of the training code, and the git commit and dirty flag where git can tell."""
    h = hashlib.sha256()
    for name in CODE_FILES:
        h.update(name.encode())
        with open(os.path.join(HERE, name), "rb") as f:
            h.update(hashlib.sha256(f.read()).digest())

    def git(*args):
        try:
            return subprocess.run(["git", "-C", HERE, *args], capture_output=True, text=True, timeout=30,
                                  check=True).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            return None
    commit, status = git("rev-parse", "HEAD"), git("status", "--porcelain", "--untracked-files=no")
    return dict(fingerprint=h.hexdigest(), git_commit=commit, git_dirty=None if status is None else status != "")


def differences(old, new):
    """{key: [recorded, now]} over the keys that change a result, 'code' for the code fingerprint."""
    skip = NOT_RESULT_KEYS + ("model", "code", "changes")
    diff = {k: [old.get(k), new.get(k)] for k in sorted(set(old) | set(new))
            if k not in skip and old.get(k) != new.get(k)}
    for arm in set(old.get("arms", {})) & set(new.get("arms", {})):
        if old["arms"][arm] != new["arms"][arm]:
            diff[f"arms[{arm!r}]"] = [old["arms"][arm], new["arms"][arm]]
    old_code, new_code = (r.get("code", {}).get("fingerprint") for r in (old, new))
    if old_code != new_code:
        diff["code"] = [old_code, new_code]
    return diff


def read_record(path, remedy):
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError) as e:
        raise ConfigError(f"{path} is unreadable or damaged ({e}); {remedy}") from None


RESULT_REMEDY = "delete it to finish the cell again from its last checkpoint, or delete the cell's folder to retrain it"


def check_rerun(path, new, allow):
    """The record at path (or None) and how the new config differs from it; refuses a difference
    unless allow."""
    if not os.path.exists(path):
        return None, {}
    old = read_record(path, "restore it, or delete the folder to start it again")
    diff = differences(old, new)
    if diff and not allow:
        short = lambda v: repr(v) if len(repr(v)) <= 40 else "..."
        named = ", ".join("code changed" if k == "code" else f"{k} ({short(a)} -> {short(b)})" for k, (a, b) in diff.items())
        raise ConfigError(f"{path} was made with other settings: {named}; rerun with the recorded ones, use another "
                          f"out_dir, or add --allow_changes=True to go on with the new ones (recorded in each cell "
                          f"it changes, whose seed is then not paired)")
    return old, diff


def check_cell(cfg, arm, seed, code, val):
    """check_rerun for a cell with something to protect: a checkpoint or a result (which must be readable)."""
    cell_dir = os.path.join(cfg["out_dir"], arm, f"seed{seed}")
    if not any(os.path.exists(os.path.join(cell_dir, f)) for f in ("ckpt.pt", "result.json")):
        return None, {}  # nothing trained yet: the cell starts from scratch
    if os.path.exists(os.path.join(cell_dir, "result.json")):
        read_record(os.path.join(cell_dir, "result.json"), RESULT_REMEDY)
    cell = cell_config(cfg, arm, seed)
    new = dict(cell, code=code, val_hash=validation_hash(val, cell["eval_tokens"], cell["block_size"]))
    return check_rerun(os.path.join(cell_dir, "config.json"), new, cfg["allow_changes"])


def resolve_data_dir(path):
    """data_dir as an absolute path: a relative one is taken from the working directory when it is
    there, else from the project directory (so the bundled default works from anywhere)."""
    if os.path.isabs(path) or os.path.exists(path):
        return os.path.abspath(path)
    return os.path.abspath(os.path.join(HERE, path))


def train_data_fingerprint(data_dir, train_paths):
    """sha256 over the train shards, cheap enough for every start: each shard's sha256 from
    manifest.json where data/prepare.py wrote one (verify_shards=True checks those), else its name,
    size and first and last 64 KiB. The content itself is in data_hash, which only training computes."""
    listed = {}
    if os.path.exists(os.path.join(data_dir, "manifest.json")):
        with open(os.path.join(data_dir, "manifest.json")) as f:
            listed = {s["name"]: s["sha256"] for s in json.load(f)["shards"]}
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


@contextmanager
def cell_lock(cell_dir, master):
    """
    One process at a time trains a cell: cell_dir/lock holds its pid and host while it runs. A lock
    whose process is gone from this host (a killed run) is taken over; one from another host (a
    shared filesystem) cannot be checked and stays until removed. Under DDP rank 0 holds it.
    """
    if not master:
        yield
        return
    os.makedirs(cell_dir, exist_ok=True)
    path, host = os.path.join(cell_dir, "lock"), socket.gethostname()
    while True:
        try:
            fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
            break
        except FileExistsError:
            try:
                with open(path) as f:
                    pid, _, owner = f.read().partition(" ")
            except FileNotFoundError:
                continue  # released meanwhile
            if owner != host or not pid.isdigit() or process_exists(int(pid)):
                raise ConfigError(f"cell {cell_dir} is being trained by pid {pid or '?'} on {owner or '?'}; wait for "
                                  f"it or remove {path} if that process is gone") from None
            os.remove(path)  # stale: its process ended without releasing it
    with os.fdopen(fd, "w") as f:
        f.write(f"{os.getpid()} {host}")
    try:
        yield
    finally:
        os.remove(path)


def process_exists(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # another user's process
    return True


# the model keys that give the shared weights their meaning (n_head: not visible in the shapes)
ARCHITECTURE_KEYS = ("n_layer", "n_head", "n_embd", "vocab_size")


def load_init_from(cfg):
    """
    The weights every cell starts from when init_from is set, and the sha256 of their file: a
    train.py ckpt.pt of a residual='standard' arm, or a file holding a state_dict of one. Checked
    against every arm before anything runs; each cell then copies them by name over its seed's
    init, leaving its routing parameters (residual.*) at their init, which is the standard residual.
    """
    path = cfg["init_from"]
    if not path:
        return None, None
    h = hashlib.sha256()
    try:
        with open(path, "rb") as f:
            for chunk in iter(lambda: f.read(1 << 24), b""):
                h.update(chunk)
        ckpt = torch.load(path, map_location="cpu", weights_only=True)  # tensors and plain data only
    except (OSError, EOFError, RuntimeError, pickle.UnpicklingError) as e:
        why = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise ConfigError(f"init_from={path} is missing or unreadable ({why}); give a train.py ckpt.pt of a "
                          f"residual='standard' arm") from None
    weights = ckpt.get("model", ckpt) if isinstance(ckpt, dict) else None
    if not isinstance(weights, dict) or not weights or not all(isinstance(v, torch.Tensor) for v in weights.values()):
        raise ConfigError(f"init_from={path} holds neither a train.py ckpt.pt nor a state_dict")
    source = ckpt.get("config", {}).get("model", {})  # a train.py checkpoint says what model it is
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
    return weights, h.hexdigest()


def seed_for(seed, purpose, rank=0):
    """Independent integer seeds per run seed: init (0), data order (1), dropout (2, per rank)."""
    return int(np.random.SeedSequence([seed, purpose, rank]).generate_state(1)[0])


class TrainData:
    """
    Sequences of block_size + 1 tokens cut from the train shards. Each epoch visits them in a
    permutation drawn from the data seed, so a step's batch depends only on (data seed, step):
    every arm sees the same batches, and resuming needs nothing but the step.
    """

    def __init__(self, shards, block_size, seed):
        self.shards = shards
        counts = [(len(s) - 1) // block_size for s in self.shards]
        self.starts = np.cumsum([0] + counts)
        if self.starts[-1] == 0:
            raise DataError(f"the train shards hold fewer than block_size+1 = {block_size + 1} tokens")
        self.block_size, self.seed, self.epoch, self.perm = block_size, seed, None, None

    def sequence_ids(self, first, count):
        ids = np.empty(count, dtype=np.int64)
        n = self.starts[-1]
        for i, pos in enumerate(range(first, first + count)):
            if pos // n != self.epoch:
                self.epoch = pos // n
                self.perm = np.random.default_rng([self.seed, self.epoch]).permutation(n)
            ids[i] = self.perm[pos % n]
        return ids

    def sequences(self, ids):
        """The tokens of sequences ids, as the shards hold them: (len(ids), block_size + 1) uint16."""
        shard = np.searchsorted(self.starts, ids, side="right") - 1
        offsets = (ids - self.starts[shard]) * self.block_size
        return np.stack([self.shards[s][o:o + self.block_size + 1] for s, o in zip(shard, offsets)])


def to_device(tokens, device):
    batch = torch.from_numpy(tokens.astype(np.int64))
    x, y = batch[:, :-1], batch[:, 1:]
    if device.startswith("cuda"):
        return x.pin_memory().to(device, non_blocking=True), y.pin_memory().to(device, non_blocking=True)
    return x.to(device), y.to(device)


def micro_batches(n, batch_size):
    """Sizes of the fewest micro-batches of at most batch_size that hold n sequences, as even as can be."""
    count = -(-n // batch_size)
    return [n // count + (i < n % count) for i in range(count)]


def backward_step(train_model, batches, step_sequences, ctx):
    """
    Accumulate into .grad the gradient of the step's mean token loss: each micro-batch's mean
    weighted by its share of the step's sequences, times the world size (which DDP's gradient
    average divides out). Returns this rank's part of the step's mean loss (detached).
    """
    part = 0.0
    for i, (x, y) in enumerate(batches):
        if ctx["world"] > 1:  # sync gradients on the last micro-step only
            train_model.require_backward_grad_sync = i == len(batches) - 1
        with ctx["autocast"]:
            _, loss = train_model(x, y)
        share = x.size(0) / step_sequences
        (loss * (share * ctx["world"])).backward()
        part = part + loss.detach() * share
    return part


def learning_rate_at(step, cfg):
    if step < cfg["warmup_iters"]:
        return cfg["learning_rate"] * (step + 1) / cfg["warmup_iters"]
    lr, lo, n = cfg["learning_rate"], cfg["min_lr"], cfg["max_iters"]
    if cfg["lr_schedule"] == "wsd":
        cooldown_start = n * (1 - cfg["cooldown_frac"])
        return lr if step < cooldown_start else lo + (lr - lo) * (n - step) / (n - cooldown_start)
    progress = (step - cfg["warmup_iters"]) / max(1, n - cfg["warmup_iters"])
    return lo + 0.5 * (1.0 + math.cos(math.pi * min(progress, 1.0))) * (lr - lo)


def validation_batch(val, seq_ids, T, device):
    """Validation sequences seq_ids (whole sequences of T + 1 tokens) as (inputs, targets)."""
    return to_device(np.stack([val[j * T: j * T + T + 1] for j in seq_ids]), device)


@torch.no_grad()
def evaluate(model, val, cfg, ctx):
    """Mean NLL (nats/token) on the fixed validation set: the first eval_tokens tokens of the
    validation shard as whole sequences, split over ranks, batch sums added in fp64, so the result
    does not depend on eval_batch_size or the world size beyond fp32 rounding. model may be the
    compiled module: every batch has one shape (a short last one is padded with ignored targets),
    so evaluation compiles once."""
    T = cfg["block_size"]
    n_seq = (cfg["eval_tokens"] - 1) // T
    mine = np.arange(ctx["rank"], n_seq, ctx["world"])
    B = min(cfg["eval_batch_size"], -(-n_seq // ctx["world"]))
    total = torch.zeros(2, dtype=torch.float64, device=ctx["device"])
    model.eval()
    for i in range(0, len(mine), B):
        x, y = validation_batch(val, mine[i:i + B], T, ctx["device"])
        x, y = F.pad(x, (0, 0, 0, B - len(x))), F.pad(y, (0, 0, 0, B - len(y)), value=-1)
        with ctx["autocast"]:
            _, loss = model(x, y, reduction="sum")
        total += torch.stack([loss.double(), (y != -1).sum().double()])
    if ctx["world"] > 1:
        dist.all_reduce(total)
    model.train()
    return (total[0] / total[1]).item()


def rounded(value):
    """Diagnostics as JSON: tensors to (nested) lists, numbers to 6 significant digits."""
    if isinstance(value, dict):
        return {str(k): rounded(v) for k, v in value.items()}
    if isinstance(value, torch.Tensor):
        return rounded(value.tolist())
    if isinstance(value, list):
        return [rounded(v) for v in value]
    return float(f"{value:.6g}")


@torch.no_grad()
def routing_summary(model, val, cfg, ctx):
    """Routing diagnostics (GPT.routing_diagnostics) on the first few validation sequences."""
    n = min(4, (len(val) - 1) // cfg["block_size"])
    x, _ = validation_batch(val, range(n), cfg["block_size"], ctx["device"])
    model.eval()
    with ctx["autocast"]:
        diag = model.routing_diagnostics(x)
    model.train()
    return rounded(diag)


def shared_init_hash(model):
    """sha256 of the shared (non-routing) parameters: equal across the arms of a seed, by design."""
    h = hashlib.sha256()
    for name, p in sorted(model.state_dict().items()):
        if not name.startswith("residual."):
            h.update(name.encode())
            h.update(p.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def save_atomically(obj, path, writer=torch.save):
    """Write to a temporary name, then rename: a failed write (a full disk) leaves the last good
    file in place and no temporary behind."""
    try:
        writer(obj, path + ".tmp")
        os.replace(path + ".tmp", path)
    except (OSError, RuntimeError) as e:
        if os.path.exists(path + ".tmp"):
            os.remove(path + ".tmp")
        raise ConfigError(f"could not write {path} ({str(e).splitlines()[0]}); the last good copy is kept: "
                          f"free disk space and rerun to resume") from None


def write_text(text, path):
    with open(path, "w") as f:
        f.write(text)


CHECKPOINT_KEYS = ("model", "optimizer", "step", "rng", "data_hash", "config", "loss_sum", "step_last", "wall_time_s")


def load_checkpoint(path, device):
    try:
        ckpt = torch.load(path, map_location=device, weights_only=False)
    except (OSError, EOFError, RuntimeError, pickle.UnpicklingError) as e:
        raise ConfigError(f"{path} is unreadable, truncated or empty ({str(e).splitlines()[0] if str(e) else type(e).__name__}); "
                          f"delete it to train the cell from scratch") from None
    missing = [k for k in CHECKPOINT_KEYS if k not in ckpt]
    if missing:
        raise ConfigError(f"{path} was written by an older train.py (no {', '.join(missing)}); delete it to train "
                          f"the cell from scratch")
    return ckpt


def log_until(log_path, step):
    """The cell's log records before a checkpoint at step (its own evaluation is redone); a
    half-written last line (a kill or a full disk mid-write) is dropped."""
    if not os.path.exists(log_path):
        raise ConfigError(f"{log_path} is missing beside its ckpt.pt; restore it, or delete ckpt.pt to train the cell "
                          f"from scratch")
    with open(log_path) as f:
        lines = f.read().splitlines()
    kept = []
    for i, line in enumerate(lines):
        try:
            r = json.loads(line)
        except ValueError:
            if i == len(lines) - 1:
                break
            raise ConfigError(f"{log_path} line {i + 1} is not JSON; repair it, or delete ckpt.pt to train the cell "
                              f"from scratch") from None
        if r["step"] < step or (r["step"] == step and "loss" in r):
            kept.append(line + "\n")
    return "".join(kept)


def gather_rng(ctx):
    state = dict(torch=torch.get_rng_state(),
                 cuda=torch.cuda.get_rng_state() if ctx["device"].startswith("cuda") else None)
    if ctx["world"] == 1:
        return [state]
    states = [None] * ctx["world"]
    dist.all_gather_object(states, state)
    return states


def evals_after(step, cfg):
    """Evaluations still to come after step."""
    n, k = cfg["max_iters"], cfg["eval_interval"]
    return n // k - step // k + (n % k != 0 and step < n)


def duration(seconds):
    seconds = int(seconds)
    return f"{seconds // 3600}h{seconds // 60 % 60:02d}m" if seconds >= 3600 else f"{seconds // 60}m{seconds % 60:02d}s"


def train_cell(arm, seed, cfg, code, grid, train_shards, val, ctx):
    """Train (or resume, or skip) one cell of the grid; a finished or diverged cell has result.json."""
    master = ctx["rank"] == 0
    cell_dir = os.path.join(cfg["out_dir"], arm, f"seed{seed}")
    result_path, ckpt_path, log_path = (os.path.join(cell_dir, f) for f in ("result.json", "ckpt.pt", "log.jsonl"))
    prefix = f"[{arm} seed{seed}]"
    recorded, change = grid["records"][arm, seed]
    if os.path.exists(result_path):
        if master:
            r = read_record(result_path, RESULT_REMEDY)
            print(f"{prefix} done already: " + (f"diverged at step {r['diverged_at']}" if r.get("status") == "diverged"
                                                else f"val_loss {r['val_loss']:.4f}")
                  + (f" (recorded with other settings: {', '.join(change)}; not retrained)" if change else ""))
        return
    cell = cell_config(cfg, arm, seed)
    config = GPTConfig(**{k: cell[k] for k in MODEL_KEYS})
    T = cell["block_size"]
    record = dict(cell, model=dataclasses.asdict(config), code=code,
                  val_hash=validation_hash(val, cell["eval_tokens"], T))
    torch.manual_seed(seed_for(seed, 0))
    model = GPT(config)
    if grid["init"] is not None:  # warm start: every shared weight replaced, routing left at its init
        model.load_state_dict(grid["init"], strict=False)
    init_hash = shared_init_hash(model)
    model.to(ctx["device"])
    optimizer = model.configure_optimizers(cell["weight_decay"], cell["learning_rate"], (cell["beta1"], cell["beta2"]),
                                           ctx["device"].split(":")[0])
    data = TrainData(train_shards, T, seed_for(seed, 1))
    # the interval's loss so far (rank 0 holds it all after each checkpoint) and where it began
    step, data_hash, loss_sum, step_last, wall_before, changes = 0, "", 0.0, 0, 0.0, []
    torch.manual_seed(seed_for(seed, 2, ctx["rank"]))  # dropout masks: paired across arms, distinct per rank
    if os.path.exists(ckpt_path):
        if recorded is None:
            raise ConfigError(f"{cell_dir} has ckpt.pt but no config.json to check it against; restore config.json, "
                              f"or delete ckpt.pt to train the cell from scratch")
        ckpt = load_checkpoint(ckpt_path, ctx["device"])
        kept_log = log_until(log_path, ckpt["step"])
        model.load_state_dict(ckpt["model"])
        optimizer.load_state_dict(ckpt["optimizer"])
        step, data_hash, step_last, wall_before = ckpt["step"], ckpt["data_hash"], ckpt["step_last"], ckpt["wall_time_s"]
        loss_sum = ckpt["loss_sum"] if master else 0.0
        changes = recorded.get("changes", []) + ([dict(step=step, changed=change)] if change else [])
        if len(ckpt["rng"]) == ctx["world"]:
            rng = ckpt["rng"][ctx["rank"]]
            torch.set_rng_state(rng["torch"].cpu())
            if rng["cuda"] is not None and ctx["device"].startswith("cuda"):
                torch.cuda.set_rng_state(rng["cuda"].cpu())
        elif master:
            print(f"{prefix} checkpoint from {len(ckpt['rng'])} ranks, now {ctx['world']}: "
                  f"dropout RNG streams are not restored exactly")
        if master:
            save_atomically(kept_log, log_path, write_text)
            print(f"{prefix} resuming from step {step}" + (f" with changes: {', '.join(change)}" if change else ""))
        del ckpt
    if changes:
        record["changes"] = changes
    if master:
        os.makedirs(cell_dir, exist_ok=True)
        write_json(os.path.join(cell_dir, "config.json"), record)
    torch._dynamo.reset()  # a new cell is a new model: compile afresh, not as the 9th recompile of forward
    # one graph per batch shape (training micro-batches, evaluation batches), never a dynamic one
    compiled = torch.compile(model, dynamic=False) if cell["compile"] else model
    train_model = DDP(compiled, device_ids=[ctx["local_rank"]] if ctx["device"].startswith("cuda") else None) \
        if ctx["world"] > 1 else compiled

    step_sequences = cell["gradient_accumulation_steps"] * cell["batch_size"]  # all ranks together
    mine = step_sequences // ctx["world"]
    sizes = micro_batches(mine, cell["batch_size"])
    tokens_per_step = step_sequences * T
    flops_per_step = model.flops_per_token(T) * tokens_per_step
    eval_tokens = (cell["eval_tokens"] - 1) // T * T
    log = open(log_path, "a" if step > 0 else "w") if master else None
    if master and step == 0:
        print(f"{prefix} {model.num_params() / 1e6:.2f}M non-embedding parameters, "
              f"{tokens_per_step:,} tokens/step, {cell['max_iters']} steps")
    loss_sum = torch.tensor(loss_sum, device=ctx["device"])
    # time left: ms/step from the logged intervals after this process's first (which compiles),
    # evaluation time from the fastest evaluation (the first compiles too)
    t_start, t_last, logged, train_s, train_steps, eval_s = time.time(), time.time(), 0, 0.0, 0, []
    diverged = None
    while True:
        if step % cell["eval_interval"] == 0 or step == cell["max_iters"]:
            t_eval = time.time()
            val_loss = evaluate(compiled, val, cell, ctx)
            if not math.isfinite(val_loss):
                diverged = f"validation loss {val_loss} at step {step}"
                break
            routing = routing_summary(model, val, cell, ctx) if master else None
            if master:
                print(f"{prefix} step {step}: val_loss {val_loss:.4f}")
                log.write(json.dumps(dict(step=step, tokens=step * tokens_per_step, val_loss=val_loss,
                                          eval_s=round(time.time() - t_eval, 3), routing=routing)) + "\n")
                log.flush()
            rng = gather_rng(ctx)
            if ctx["world"] > 1:  # the interval's loss so far, on rank 0 alone: a resume restores it exactly
                dist.all_reduce(loss_sum)
                if not master:
                    loss_sum.zero_()
            if master and step > 0:
                save_atomically(dict(model=model.state_dict(), optimizer=optimizer.state_dict(), step=step,
                                     rng=rng, data_hash=data_hash, config=record, loss_sum=loss_sum.item(),
                                     step_last=step_last, wall_time_s=wall_before + time.time() - t_start), ckpt_path)
            eval_s.append(time.time() - t_eval)
            t_last += eval_s[-1]  # evaluation time is not training time
        if step == cell["max_iters"]:
            break
        lr = learning_rate_at(step, cell)
        for group in optimizer.param_groups:
            group["lr"] = lr
        tokens = data.sequences(data.sequence_ids(step * step_sequences, step_sequences))  # all ranks' sequences
        data_hash = hashlib.sha256(data_hash.encode() + tokens.tobytes()).hexdigest()  # chains what was trained on
        tokens = tokens[ctx["rank"] * mine:(ctx["rank"] + 1) * mine]  # this rank's sequences, in micro-batches
        batches = [to_device(tokens[a:a + n], ctx["device"]) for a, n in zip(np.cumsum([0] + sizes), sizes)]
        loss_sum += backward_step(train_model, batches, step_sequences, ctx)
        if cell["grad_clip"] > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), cell["grad_clip"])
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        step += 1
        if step % cell["log_interval"] == 0 or step == cell["max_iters"]:
            if ctx["world"] > 1:
                dist.all_reduce(loss_sum)
            loss_avg = loss_sum.item() / (step - step_last)
            if not math.isfinite(loss_avg):
                diverged = f"train loss {loss_avg} over steps {step_last + 1}-{step}"
                break
            dt = (time.time() - t_last) / (step - step_last)
            logged += 1
            if logged > 1:
                train_s, train_steps = train_s + dt * (step - step_last), train_steps + step - step_last
            step_s = train_s / train_steps if train_steps else dt
            grid["rates"][arm] = (step_s, min(eval_s))
            eta_cell = (cell["max_iters"] - step) * step_s + evals_after(step, cell) * min(eval_s)
            eta_grid = eta_cell + sum(grid["rates"].get(a, grid["rates"][arm])[0] * cell["max_iters"]
                                      + grid["rates"].get(a, grid["rates"][arm])[1] * evals_after(-1, cell)
                                      for a, _ in grid["todo"][grid["todo"].index((arm, seed)) + 1:])
            mfu = flops_per_step / dt / ctx["peak_flops"] if ctx["peak_flops"] else None
            if master:
                print(f"{prefix} step {step}/{cell['max_iters']} | loss {loss_avg:.4f} | lr {lr:.2e} | "
                      f"{dt * 1000:.1f} ms/step | {tokens_per_step / dt:,.0f} tok/s"
                      + (f" | mfu {100 * mfu:.1f}%" if mfu else "")
                      + f" | left: cell {duration(eta_cell)}, grid {duration(eta_grid)}")
                log.write(json.dumps(dict(step=step, tokens=step * tokens_per_step, loss=loss_avg, lr=lr,
                                          ms_per_step=dt * 1000, tokens_per_s=tokens_per_step / dt, mfu=mfu,
                                          eta_cell_s=round(eta_cell, 1), eta_grid_s=round(eta_grid, 1))) + "\n")
                log.flush()
            loss_sum.zero_()
            t_last, step_last = time.time(), step
    if master:
        log.close()
        if diverged:
            print(f"{prefix} diverged: {diverged}; the cell stops here, the grid goes on")
        init_from = dict(path=cell["init_from"], sha256=cell["init_from_sha256"]) if cell["init_from"] else None
        pairing = dict(init_hash=init_hash, data_hash=data_hash, eval_tokens=eval_tokens, val_hash=record["val_hash"],
                       code=code["fingerprint"], init_from=init_from, settings=pairing_settings(cell, cfg["arms"][arm]))
        if changes:
            pairing["changes"] = changes
        write_json(result_path, dict(arm=arm, seed=seed, status="diverged" if diverged else "finished",
                                     val_loss=None if diverged else val_loss,
                                     val_ppl=None if diverged else math.exp(val_loss),
                                     diverged_at=step if diverged else None, reason=diverged,
                                     tokens=step * tokens_per_step, steps=step,
                                     params=model.num_params(non_embedding=False),
                                     non_embedding_params=model.num_params(),
                                     wall_time_s=round(wall_before + time.time() - t_start, 3),
                                     routing=None if diverged else routing, pairing=pairing, code=code,
                                     config=record))


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
                peak_flops=peak)


def check_config(cfg, world):
    """One line for each setting that cannot run, before anything is trained."""
    for key in ("batch_size", "gradient_accumulation_steps", "max_iters", "eval_interval", "log_interval",
                "eval_batch_size"):
        if cfg[key] < 1:
            raise ConfigError(f"{key}={cfg[key]} must be at least 1")
    if not cfg["learning_rate"] > 0:
        raise ConfigError(f"learning_rate={cfg['learning_rate']} must be positive")
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
    if not cfg["arms"]:
        raise ConfigError("arms is empty; give at least one arm, e.g. arms = {'standard': {}}")
    if cfg["residual"] not in RESIDUALS:
        raise ConfigError(f"residual={cfg['residual']!r} is not a residual scheme; choose one of {', '.join(RESIDUALS)}")
    arms = {}  # type-checked like --key=value
    for arm, settings in cfg["arms"].items():
        if not isinstance(arm, str) or not ARM_NAME.fullmatch(arm) or arm in OUT_DIR_FILES or arm.endswith(".png"):
            raise ConfigError(f"arm name {arm!r}: use letters, digits, '_', '.' and '-' (not first), and none of the "
                              f"names the grid's out_dir holds ({', '.join(OUT_DIR_FILES)}, *.png)")
        if not isinstance(settings, dict) or set(settings) - set(MODEL_KEYS):
            raise ConfigError(f"arm {arm!r}: settings must be a dict of model keys ({', '.join(MODEL_KEYS)})")
        settings = arms[arm] = {k: coerce(f"arm {arm!r}: {k}", v, MODEL_DEFAULTS[k]) for k, v in settings.items()}
        try:
            config = model_config(cfg, settings)
        except (ValueError, TypeError) as e:  # GPTConfig's own checks (sizes, dropout, scheme options)
            raise ConfigError(f"arm {arm!r}: {e}") from None
        if cfg["eval_tokens"] < config.block_size + 1:
            raise ConfigError(f"eval_tokens={cfg['eval_tokens']} is less than one sequence of block_size+1 = "
                              f"{config.block_size + 1} tokens" + (f" (arm {arm!r})" if "block_size" in settings else ""))
    cfg["arms"] = arms
    if (cfg["batch_size"] * cfg["gradient_accumulation_steps"]) % world:
        raise ConfigError(f"a step's batch_size x gradient_accumulation_steps = "
                          f"{cfg['batch_size'] * cfg['gradient_accumulation_steps']} sequences do not split evenly "
                          f"over {world} processes; change either, or the number of processes")
    if cfg["lr_schedule"] not in ("cosine", "wsd"):
        raise ConfigError(f"lr_schedule={cfg['lr_schedule']!r}: choose cosine or wsd")
    if cfg["reference_arm"] and cfg["reference_arm"] not in cfg["arms"]:
        raise ConfigError(f"reference_arm={cfg['reference_arm']!r} is not an arm ({', '.join(cfg['arms'])})")


def check_writable(out_dir):
    try:
        os.makedirs(out_dir, exist_ok=True)
        probe = os.path.join(out_dir, f".write_test.{os.getpid()}.tmp")
        with open(probe, "w"):
            pass
        os.remove(probe)
    except OSError as e:
        raise ConfigError(f"out_dir {out_dir} is not writable ({e.strerror}); choose another --out_dir") from None


def main(argv):
    cfg = configure(DEFAULTS, argv)
    ctx = setup(cfg)
    check_config(cfg, ctx["world"])
    master = ctx["rank"] == 0
    code = code_record()
    # recorded as used, so a rerun compares what ran (--device=cpu and --device=auto on a CPU are the same)
    # (torch.__version__ is a str subclass, which weights_only checkpoint loads refuse)
    cfg.update(device=ctx["device"].split(":")[0], dtype=ctx["dtype"], torch_version=str(torch.__version__))
    # the checkpoint's hash joins the config: recorded in every cell, and a rerun from other weights is a change
    init_weights, cfg["init_from_sha256"] = load_init_from(cfg)
    cfg["data_dir"] = data_dir = resolve_data_dir(cfg["data_dir"])
    if data_dir == BUNDLED_OUT and not os.path.exists(os.path.join(data_dir, "manifest.json")):
        if master:
            prepare_bundled(data_dir)
        if ctx["world"] > 1:
            dist.barrier()
    if master:
        verify_manifest(data_dir, full=cfg["verify_shards"])
    val_path, train_paths = find_shards(data_dir)
    vocab_size = min(model_config(cfg, settings).vocab_size for settings in cfg["arms"].values())
    val = open_shard(val_path, vocab_size)
    if cfg["eval_tokens"] > len(val):
        raise ConfigError(f"eval_tokens={cfg['eval_tokens']} is more than the validation shard {val_path} holds "
                          f"({len(val):,} tokens); lower eval_tokens")
    train_shards = [open_shard(path, vocab_size) for path in train_paths]  # every shard checked before training
    # other train data is a change, like other weights; other validation tokens show in each cell's val_hash
    cfg["train_data_sha256"] = train_data_fingerprint(data_dir, train_paths)
    # a rerun goes on only with the recorded settings, data and code (or allow_changes=True)
    grid_path = os.path.join(cfg["out_dir"], "config.json")
    recorded, change = check_rerun(grid_path, dict(cfg, code=code), cfg["allow_changes"])
    cells = [(arm, seed) for seed in cfg["seeds"] for arm in cfg["arms"]]
    records = {(arm, seed): check_cell(cfg, arm, seed, code, val) for arm, seed in cells}
    if master:
        check_writable(cfg["out_dir"])
        recorded = recorded or {}
        grid = dict(cfg, arms=recorded.get("arms", {}) | cfg["arms"],
                    seeds=recorded.get("seeds", []) + [s for s in cfg["seeds"] if s not in recorded.get("seeds", [])],
                    code=code, changes=recorded.get("changes", []) + ([change] if change else []))
        write_json(grid_path, grid)
    todo = [c for c in cells if not os.path.exists(os.path.join(cfg["out_dir"], c[0], f"seed{c[1]}", "result.json"))]
    grid = dict(records=records, todo=todo, rates={}, init=init_weights)
    for arm, seed in cells:
        with cell_lock(os.path.join(cfg["out_dir"], arm, f"seed{seed}"), master):
            train_cell(arm, seed, cfg, code, grid, train_shards, val, ctx)
    if ctx["world"] > 1:
        dist.barrier()
        dist.destroy_process_group()
    if master:
        import report
        report.main([cfg["out_dir"]] + ([f"--reference={cfg['reference_arm']}"] if cfg["reference_arm"] else []))


if __name__ == "__main__":
    try:
        main(sys.argv[1:])
    except (ConfigError, DataError) as e:
        sys.exit(f"error: {e}")
