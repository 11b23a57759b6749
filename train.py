"""
Pretrain the paired-seed grid: every (seed, arm) cell in turn, paired within a seed (same
shared-parameter init, same data order, same dropout RNG) and evaluated on one fixed validation set.

$ python train.py                                          # the default paired run on the bundled corpus
$ python train.py --arms=standard,denseformer --seeds=0    # scheme names are arms: one seed, two cells
$ python train.py config/rd_120m.py --seeds=0 --arms=rd_attnres   # one cell of a grid, one GPU
$ python train.py --init_from=out/standard/seed0/ckpt.pt   # every arm from a trained standard model
$ torchrun --standalone --nproc_per_node=8 train.py config/rd_343m.py
$ torchrun --nnodes=2 --node_rank=0 --master_addr=10.0.0.1 --master_port=29500 \
      --nproc_per_node=8 train.py config/rd_343m.py        # multi-node: out_dir on a shared filesystem

Each cell writes out_dir/<arm>/seed<k>/: config.json, log.jsonl, ckpt.pt and, when done,
result.json. Run the same command again: finished cells are skipped, a killed cell resumes from
its last checkpoint (checkpoint.py), and a cell recorded with other settings, data or code is
refused unless allow_changes=True (records.py; docs/protocol.md says what is recorded). This file
is the runtime, the data order, the step and the loop. The grid ends with the paired report (report.py).
"""

import dataclasses
import hashlib
import math
import os
import sys
import time
from contextlib import contextmanager, nullcontext
from types import SimpleNamespace

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.fsdp import fully_shard, register_fsdp_forward_method
from torch.nn import functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

import checkpoint
import downstream
import records
import tune
from progress import CellLog
from checkpoint import CellState
from common import ConfigError, DataError, UserError, check_writable, pid_lock, write_json
from configurator import configure
from data.prepare import prepare_bundled
from data.shards import BUNDLED, TOKENIZERS, find_shards, get_tokenizer, open_shard, shard_tokenizer, verify_manifest
from model import GPT, RESIDUALS, GPTConfig

_before_config = set(globals())
# -----------------------------------------------------------------------------
# default config: a small paired run on the bundled Shakespeare corpus in bytes, minutes on a 2-core CPU
# (docs/training.md says more of each key)
# I/O
out_dir = "out"  # relative to the working directory
data_dir = "data/shakespeare_bytes"  # the bundled corpora are prepared on first use
verify_shards = False  # also check each shard's sha256 against manifest.json at start
init_from = ""  # warm start every cell from this standard checkpoint; "" = the seed's init
eval_interval = 25  # evaluate and checkpoint every N steps
log_interval = 10
eval_tokens = 8192  # the fixed validation set: whole sequences in the validation shard's first N tokens
eval_batch_size = 8  # sequences per evaluation forward; does not change the result
allow_changes = False  # go on with cells recorded under other settings or code (recorded in them)
# downstream: the CORE in-context tasks (downstream.py) on each cell's model, logged, and written as downstream.json
downstream_bundle = ""  # the CORE bundle folder (python downstream.py --download: data/eval_bundle); "" = off
downstream_interval = 0  # 0: at each cell's last step only; else also every N steps (a multiple of eval_interval)
downstream_max_per_task = 500  # the first N items of each task (nanochat's in-training setting); 0 = every item
# the paired grid: every arm (a named set of model settings) runs with every seed
arms = {"attnres": {"residual": "attnres"}, "rd_attnres": {"residual": "rd_attnres"}}
seeds = [0, 1]
reference_arm = ""  # the paired report's reference; "" = the first arm
# the tuned protocol (tune.py): each arm's learning rate chosen on tune_seeds first; [] = one rate for every arm
tune_learning_rates = []  # e.g. [1e-3, 3e-3, 1e-2]: every arm runs at each on the tuning seeds, then at its best
tune_seeds = [1000, 1001]  # never a compared seed
tune_iters = 0  # the tuning cells' steps (their whole schedule); 0 = a quarter of max_iters
# model: every GPTConfig field is a key, with model.py's default unless set here
n_layer = 4
n_head = 4
n_embd = 128
block_size = 128
vocab_size = None  # None: the data's tokenizer, padded to a multiple of 64 (bytes 320, gpt2 50304)
# optimizer
optimizer = "adamw"  # or 'muon' for the attention and MLP matrices
learning_rate = 3e-3
muon_learning_rate = 0.02  # muon: the hidden matrices' peak learning rate
max_iters = 250
weight_decay = 0.1  # never on routing parameters and norms
beta1 = 0.9
beta2 = 0.95
grad_clip = 1.0  # 0 = off
lr_schedule = "cosine"  # 'cosine' or 'wsd' (warmup, stable, linear cooldown)
warmup_iters = 20
min_lr = 3e-4
cooldown_frac = 0.2  # wsd: the last fraction of max_iters decays to min_lr
# batch: a step is gradient_accumulation_steps x batch_size sequences, split over ranks
batch_size = 8  # sequences per forward at most, per rank
gradient_accumulation_steps = 1
# system
device = "auto"  # 'auto' (cuda, mps, cpu), 'cpu', 'cuda', 'cuda:1', 'mps'
dtype = "auto"  # 'auto' (bfloat16 where supported), 'bfloat16', 'float32'
compile = "auto"  # 'auto' = on CUDA only; True or False
fsdp = False  # under torchrun: FSDP2 instead of DDP
activation_checkpointing = False  # recompute each sublayer in backward: less memory
# wandb: one run per cell
wandb_log = False
wandb_project = "nanodepth"
wandb_run_name = ""  # the runs' group; "" = out_dir's name
# -----------------------------------------------------------------------------
DEFAULTS = {k: v for k, v in globals().items() if k not in _before_config and k != "_before_config"}
DEFAULTS = records.MODEL_DEFAULTS | DEFAULTS  # every GPTConfig field is a key; the globals above override its defaults
# --arms=NAME,... may name a scheme of model.py: the arm of that name trains it at the run's settings
SCHEME_ARMS = {name: {"residual": name} for name in RESIDUALS}


# -----------------------------------------------------------------------------
# the runtime: processes, device, precision

@dataclasses.dataclass
class Runtime:
    """Where this process trains: its place among the processes, its device and precision."""
    world: int
    rank: int
    local_rank: int
    device: str  # 'cpu', 'mps' or 'cuda:N'
    dtype: str  # as used: 'bfloat16' or 'float32'
    autocast: object  # torch.autocast for bfloat16, else a null context
    peak_flops: float | None  # the GPU's dense bf16 peak FLOP/s, for MFU
    fsdp: bool

    @property
    def master(self):
        return self.rank == 0


# dense bf16 peak FLOP/s per GPU, for MFU (matched against torch.cuda.get_device_name)
PEAK_FLOPS = {"H100": 989e12, "H200": 989e12, "H800": 989e12, "B200": 2250e12, "A100": 312e12,
              "A800": 312e12, "L40S": 362e12, "L4": 121e12, "A10G": 125e12, "RTX 4090": 165e12,
              "RTX 3090": 71e12}


def setup(cfg):
    """The Runtime of this process from cfg's device, dtype and fsdp (and torchrun's environment)."""
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
    return Runtime(world=world, rank=rank, local_rank=local_rank, device=device, dtype=dtype, autocast=autocast,
                   peak_flops=peak, fsdp=cfg["fsdp"])


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


def resolve_compile(requested, device):
    """compile as used: 'auto' compiles on CUDA only (on a CPU, compiling a small model costs more
    than it saves), else True or False as asked (--compile=True arrives as the string 'True')."""
    choice = str(requested).lower()
    if choice not in ("auto", "true", "false"):
        raise ConfigError(f"compile={requested!r}: choose auto, True or False")
    return device.startswith("cuda") if choice == "auto" else choice == "true"


def cpu_threads(runtime):
    """The CPU threads this process computes with, said on rank 0; and a warning when the machine
    is busier than its cores (threads then wait on each other: 2 threads on 2 busy cores ran 13x slower)."""
    threads = torch.get_num_threads()
    if runtime.master:
        print(f"cpu: {threads} thread(s) per process (set with OMP_NUM_THREADS)")
        load, cores = os.getloadavg()[0], os.cpu_count()
        if load > cores:
            print(f"warning: this machine's load ({load:.1f}) exceeds its {cores} cores: training will be slow; "
                  f"with OMP_NUM_THREADS=1 it waits least")
    return threads


# -----------------------------------------------------------------------------
# data: the same batches for every arm of a seed, the same validation tokens for every cell

def seed_for(seed, purpose, rank=0):
    """Independent integer seeds per run seed: init (0), data order (1), dropout (2, per rank)."""
    return int(np.random.SeedSequence([seed, purpose, rank]).generate_state(1)[0])


def resolve_data_dir(path):
    """data_dir as an absolute path: a relative one is taken from the working directory when it is
    there, else from the project directory (so the bundled default works from anywhere)."""
    if os.path.isabs(path) or os.path.exists(path):
        return os.path.abspath(path)
    return os.path.abspath(os.path.join(os.path.dirname(os.path.abspath(__file__)), path))


def find_data(cfg, runtime):
    """The data's manifest (or None), validation shard and train shards, with names and sizes
    checked against the manifest (the bundled corpus prepared on first use). Records in cfg the
    absolute data_dir and its tokenizer (byte and GPT-2 cells never pair)."""
    cfg["data_dir"] = data_dir = resolve_data_dir(cfg["data_dir"])
    if data_dir in BUNDLED and not os.path.exists(os.path.join(data_dir, "manifest.json")):
        if runtime.master:
            prepare_bundled(data_dir)
        if runtime.world > 1:
            dist.barrier()
    manifest = verify_manifest(data_dir, full=cfg["verify_shards"] and runtime.master)  # the sha256s once, on rank 0
    val_path, train_paths = find_shards(data_dir)
    cfg["tokenizer"] = manifest["tokenizer"] if manifest else shard_tokenizer(val_path)
    return manifest, val_path, train_paths


def data_vocab_size(tokenizer):
    """The vocabulary of a tokenizer's data: its ids padded to a multiple of 64 (bytes 320, gpt2 50304)."""
    return -(-TOKENIZERS[tokenizer].vocab_size // 64) * 64


def open_data(cfg, data, vocab_size, init_tokenizer):
    """The validation shard and the train shards of find_data's data, every one checked before
    anything trains. Records in cfg train_data_sha256 (other train data is a change, like other
    weights; other validation tokens show in each cell's val_hash)."""
    manifest, val_path, train_paths = data
    tokenizer, data_dir = cfg["tokenizer"], cfg["data_dir"]
    if init_tokenizer not in (None, tokenizer):  # the same ids would be other tokens
        raise ConfigError(f"init_from={cfg['init_from']} was trained on {init_tokenizer} tokens, data_dir {data_dir} "
                          f"holds {tokenizer} tokens; warm-start on data of the checkpoint's tokenizer")
    needed = TOKENIZERS[tokenizer].vocab_size
    if manifest and vocab_size < needed:
        raise ConfigError(f"vocab_size={vocab_size} is less than the {needed} ids of {data_dir}'s {tokenizer} tokens; "
                          f"set --vocab_size={data_vocab_size(tokenizer)} (padded to a multiple of 64), or leave it unset")
    val = open_shard(val_path, vocab_size)
    if cfg["eval_tokens"] > len(val):
        raise ConfigError(f"eval_tokens={cfg['eval_tokens']} is more than the validation shard {val_path} holds "
                          f"({len(val):,} tokens); lower eval_tokens")
    train_shards = [open_shard(path, vocab_size) for path in train_paths]
    cfg["train_data_sha256"] = records.train_data_fingerprint(train_paths, manifest)
    return val, train_shards


class TrainData:
    """
    Sequences of block_size + 1 tokens cut from the train shards. Each epoch visits them in a
    permutation drawn from the data seed, so a step's batch depends only on (data seed, step):
    every arm sees the same batches, and resuming needs nothing but the step. `hash` chains the
    sha256 of every batch drawn with batch(), from data_hash (a resumed cell's).
    """

    def __init__(self, shards, block_size, seed, data_hash=""):
        self.shards = shards
        counts = [(len(s) - 1) // block_size for s in self.shards]
        self.starts = np.cumsum([0] + counts)
        if self.starts[-1] == 0:
            raise DataError(f"the train shards hold fewer than block_size+1 = {block_size + 1} tokens")
        self.block_size, self.seed, self.epoch, self.perm, self.hash = block_size, seed, None, None, data_hash

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

    def batch(self, step, count):
        """The count sequences of step (all ranks'), chained into hash: what the cell trained on."""
        tokens = self.sequences(self.sequence_ids(step * count, count))
        self.hash = hashlib.sha256(self.hash.encode() + tokens.tobytes()).hexdigest()
        return tokens


def to_device(tokens, device):
    batch = torch.from_numpy(tokens.astype(np.int64))
    x, y = batch[:, :-1], batch[:, 1:]
    if device.startswith("cuda"):
        return x.pin_memory().to(device, non_blocking=True), y.pin_memory().to(device, non_blocking=True)
    return x.to(device), y.to(device)


def validation_batch(val, seq_ids, T, device):
    """Validation sequences seq_ids (whole sequences of T + 1 tokens) as (inputs, targets)."""
    rows = [val[j * T: j * T + T + 1] for j in seq_ids]
    return to_device(np.stack(rows) if rows else np.zeros((0, T + 1), dtype=np.uint16), device)


def micro_batches(n, batch_size):
    """Sizes of the fewest micro-batches of at most batch_size that hold n sequences, as even as can be."""
    count = -(-n // batch_size)
    return [n // count + (i < n % count) for i in range(count)]


# -----------------------------------------------------------------------------
# one step, the schedule, evaluation

def backward_step(train_model, batches, step_sequences, runtime):
    """
    Accumulate into .grad the gradient of the step's mean token loss: each micro-batch's mean
    weighted by its share of the step's sequences, times the world size (which DDP's gradient
    average divides out). Returns this rank's part of the step's mean loss (detached).
    """
    part = 0.0
    for i, (x, y) in enumerate(batches):
        if isinstance(train_model, DDP):  # sync gradients on the last micro-step only (FSDP reduces each one:
            train_model.require_backward_grad_sync = i == len(batches) - 1  # its gradients stay sharded)
        with runtime.autocast:
            _, loss = train_model(x, y)
        share = x.size(0) / step_sequences
        (loss * (share * runtime.world)).backward()
        part = part + loss.detach() * share
    return part


def learning_rate_at(step, cell):
    if step < cell.warmup_iters:
        return cell.learning_rate * (step + 1) / cell.warmup_iters
    lr, lo, n = cell.learning_rate, cell.min_lr, cell.max_iters
    if cell.lr_schedule == "wsd":
        cooldown_start = n * (1 - cell.cooldown_frac)
        return lr if step < cooldown_start else lo + (lr - lo) * (n - step) / (n - cooldown_start)
    progress = (step - cell.warmup_iters) / max(1, n - cell.warmup_iters)
    return lo + 0.5 * (1.0 + math.cos(math.pi * min(progress, 1.0))) * (lr - lo)


@torch.no_grad()
def evaluate(model, val, cell, runtime):
    """Mean NLL (nats/token) on the fixed validation set: the first cell.eval_tokens tokens of the
    validation shard as whole sequences of cell.block_size + 1, split over ranks, batch sums added
    in fp64, so the result does not depend on eval_batch_size or the world size beyond fp32
    rounding. model may be the compiled module: every batch has one shape (a short last one is
    padded with ignored targets), so evaluation compiles once. Every rank runs as many batches (an
    FSDP forward is collective)."""
    T = cell.block_size
    n_seq = (cell.eval_tokens - 1) // T
    ours = np.arange(runtime.rank, n_seq, runtime.world)
    per_rank = -(-n_seq // runtime.world)
    B = min(cell.eval_batch_size, per_rank)
    total = torch.zeros(2, dtype=torch.float64, device=runtime.device)
    model.eval()
    for i in range(0, per_rank, B):
        x, y = validation_batch(val, ours[i:i + B], T, runtime.device)
        x, y = F.pad(x, (0, 0, 0, B - len(x))), F.pad(y, (0, 0, 0, B - len(y)), value=-1)
        with runtime.autocast:
            _, loss = model(x, y, reduction="sum")
        total += torch.stack([loss.double(), (y != -1).sum().double()])
    if runtime.world > 1:
        dist.all_reduce(total)
    model.train()
    return (total[0] / total[1]).item()


@torch.no_grad()
def routing_summary(model, val, cell, runtime):
    """Routing diagnostics (GPT.routing_diagnostics) on the first few validation sequences."""
    n = min(4, (len(val) - 1) // cell.block_size)
    x, _ = validation_batch(val, range(n), cell.block_size, runtime.device)
    model.eval()
    with runtime.autocast:
        diag = model.routing_diagnostics(x)
    model.train()
    return records.rounded(diag)


def apply_fsdp(model):
    """FSDP2 over the processes: each sublayer's weights a unit (the scheme calls attention and MLP
    apart, so they are gathered apart), then the root with the rest (embedding, norms, routing)."""
    for block in model.transformer.h:
        fully_shard(block.attn)
        fully_shard(block.mlp)
    fully_shard(model)
    register_fsdp_forward_method(model, "routing_diagnostics")  # gathers the root's weights, as forward does


# -----------------------------------------------------------------------------
# the life of one cell

@dataclasses.dataclass
class Grid:
    """What the cells of one run share."""
    code: dict  # records.code_record()
    record: records.GridRecord  # out_dir/config.json: written once, when the first cell trains
    differences: dict  # (arm, seed) -> how the cell's config.json differs from this run (records.check_cell)
    todo: list  # the cells without a result, in order: for time left
    init: dict | None  # the warm start's weights (init_from), or None
    bundle: downstream.Bundle | None  # the CORE tasks (downstream_bundle), or None
    rates: dict = dataclasses.field(default_factory=dict)  # arm -> (s/step, s/evaluation), for time left


@dataclasses.dataclass
class Cell:
    """A cell ready to train (open_cell)."""
    settings: SimpleNamespace  # the cell's config (records.cell_config) as attributes
    record: dict  # its config.json
    model: GPT
    compiled: torch.nn.Module  # the model as it runs: compiled, or the model itself
    train_model: torch.nn.Module  # the compiled model under DDP, or the compiled model
    optimizer: object
    state: CellState
    log: CellLog
    init_hash: str
    tasks: list | None  # this rank's share of the CORE tasks, encoded for the cell (downstream.encode_tasks)

    @property
    def dir(self):
        return os.path.join(self.settings.out_dir, self.settings.arm, f"seed{self.settings.seed}")


def open_cell(arm, seed, cfg, grid, val, runtime):
    """A cell ready to train, or None when it is done already (said on rank 0): its model at the
    seed's shared init (or the warm start's weights), resumed from its checkpoint when it has one,
    its config.json written and its log opened."""
    cell = SimpleNamespace(**records.cell_config(cfg, arm, seed))
    cell_dir, prefix = os.path.join(cell.out_dir, arm, f"seed{seed}"), f"[{arm} seed{seed}]"
    change = grid.differences[arm, seed]
    if os.path.exists(os.path.join(cell_dir, "result.json")):
        if runtime.master:
            print(f"{prefix} done already: {records.describe_done(os.path.join(cell_dir, 'result.json'), change)}")
            if grid.bundle and not os.path.exists(os.path.join(cell_dir, "downstream.json")):  # trained without it
                most = f" --max_per_task={cell.downstream_max_per_task}" if cell.downstream_max_per_task else ""
                print(f"{prefix} has no downstream.json: python downstream.py {cell_dir} "
                      f"--bundle={cell.downstream_bundle}{most}")
        return None
    config = GPTConfig(**{k: getattr(cell, k) for k in records.MODEL_KEYS})
    record = dict(vars(cell), model=dataclasses.asdict(config), code=grid.code,
                  val_hash=records.validation_hash(val, cell.eval_tokens, cell.block_size))
    torch.manual_seed(seed_for(seed, 0))  # the seed's shared init, bit-identical across arms
    model = GPT(config)
    if grid.init is not None:  # every shared weight replaced, routing left at its init
        model.load_state_dict(grid.init, strict=False)
    init_hash = records.shared_init_hash(model)
    model.to(runtime.device)
    model.activation_checkpointing = cell.activation_checkpointing
    if runtime.fsdp:
        apply_fsdp(model)
    optimizer = model.configure_optimizers(cell.weight_decay, cell.learning_rate, (cell.beta1, cell.beta2),
                                           runtime.device.split(":")[0], cell.optimizer, cell.muon_learning_rate)
    torch.manual_seed(seed_for(seed, 2, runtime.rank))  # dropout masks: paired across arms, distinct per rank
    state = CellState()
    if os.path.exists(os.path.join(cell_dir, "ckpt.pt")):
        state = checkpoint.resume(cell_dir, record, cell.allow_changes, model, optimizer, runtime)
        if runtime.master:
            print(f"{prefix} resuming from step {state.step}" + (f" with changes: {', '.join(change)}" if change else ""))
    if state.changes:
        record["changes"] = state.changes
    if runtime.master:
        write_json(os.path.join(cell_dir, "config.json"), record)
    torch._dynamo.reset()  # a new cell is a new model: compile afresh, not as the 9th recompile of forward
    # one graph per batch shape (training micro-batches, evaluation batches), never a dynamic one
    compiled = torch.compile(model, dynamic=False) if cell.compile else model
    train_model = DDP(compiled, device_ids=[runtime.local_rank] if runtime.device.startswith("cuda") else None) \
        if runtime.world > 1 and not runtime.fsdp else compiled
    log = CellLog(cell, state, dict(record, init_hash=init_hash), model, grid, runtime)
    tasks = None if grid.bundle is None else downstream.encode_tasks(
        grid.bundle.tasks, get_tokenizer(cell.tokenizer), cell.block_size, cell.downstream_max_per_task or None,
        runtime.rank, runtime.world)
    return Cell(cell, record, model, compiled, train_model, optimizer, state, log, init_hash, tasks)


def save_cell(cell, data, loss_sum, grid, runtime):
    """The cell's checkpoint at its state's step. The log interval's loss so far is summed onto rank
    0 (the others' zeroed), which holds it in the checkpoint, so a resume restores it exactly."""
    if runtime.world > 1:
        dist.all_reduce(loss_sum)
        if not runtime.master:
            loss_sum.zero_()
    state = cell.state
    state.data_hash, state.loss_sum, state.wall_time_s = data.hash, loss_sum.item(), cell.log.wall_time_s()
    if runtime.master:
        grid.record.write_once()
    checkpoint.save_checkpoint(os.path.join(cell.dir, "ckpt.pt"), cell.model, cell.optimizer, state, cell.record, runtime)


def evaluate_downstream(cell, grid, runtime):
    """The CORE tasks on the cell's model when due (downstream_interval, and the cell's last step),
    on every rank, logged; at the last step rank 0 writes downstream.json (before result.json, so a
    finished cell has both). The uncompiled model: its batches vary in shape. Eval mode draws no
    random numbers, so training goes on as without it."""
    s, step = cell.settings, cell.state.step
    due = step == s.max_iters or (s.downstream_interval and step > 0 and step % s.downstream_interval == 0)
    if cell.tasks is None or not due:
        return
    t0 = time.time()
    # eval_batch_size sequences of block_size per forward: the memory of a validation batch
    scores = downstream.evaluate_tasks(cell.model, cell.tasks, runtime.device, runtime.autocast, runtime.world,
                                       s.eval_batch_size * s.block_size)
    cell.log.downstream(step, scores, time.time() - t0)
    if step == s.max_iters and runtime.master:
        downstream.write_scores(cell.dir, grid.bundle, s.downstream_max_per_task or None, step, scores)


def finish_cell(cell, data, val_loss, diverged, routing, grid, runtime):
    """result.json: how the cell ended (rank 0)."""
    if not runtime.master:
        return
    s, state = cell.settings, cell.state
    if diverged:
        print(f"[{s.arm} seed{s.seed}] diverged: {diverged}; the cell stops here, the grid goes on")
    grid.record.write_once()
    cell.log.close(records.write_result(
        os.path.join(cell.dir, "result.json"), vars(s), cell.record, cell.model, grid.code, steps=state.step,
        tokens=state.step * cell.log.tokens_per_step, val_loss=val_loss, diverged=diverged, routing=routing,
        init_hash=cell.init_hash, data_hash=data.hash, eval_tokens=(s.eval_tokens - 1) // s.block_size * s.block_size,
        changes=state.changes, wall_time_s=cell.log.wall_time_s()))


def train_cell(arm, seed, cfg, grid, train_shards, val, runtime):
    """Train (or resume, or skip) one cell of the grid; a finished or diverged cell has result.json."""
    cell = open_cell(arm, seed, cfg, grid, val, runtime)
    if cell is None:
        return
    s, model, optimizer, state, log = cell.settings, cell.model, cell.optimizer, cell.state, cell.log
    data = TrainData(train_shards, s.block_size, seed_for(seed, 1), state.data_hash)
    step_sequences = s.gradient_accumulation_steps * s.batch_size  # all ranks together
    per_rank = step_sequences // runtime.world
    sizes = micro_batches(per_rank, s.batch_size)
    loss_sum = torch.tensor(state.loss_sum, device=runtime.device)  # the log interval's, on this rank
    diverged = val_loss = routing = None
    while True:
        if state.step % s.eval_interval == 0 or state.step == s.max_iters:
            t_eval = time.time()
            val_loss = evaluate(cell.compiled, val, s, runtime)
            if not math.isfinite(val_loss):
                diverged = f"validation loss {val_loss} at step {state.step}"
                break
            routing = routing_summary(model, val, s, runtime)  # on every rank: an FSDP forward is collective
            log.evaluated(state.step, val_loss, routing, time.time() - t_eval)
            evaluate_downstream(cell, grid, runtime)
            if state.step > 0:
                save_cell(cell, data, loss_sum, grid, runtime)
            log.paused(time.time() - t_eval)  # evaluation time is not training time
        if state.step == s.max_iters:
            break
        lr = learning_rate_at(state.step, s)
        for group in optimizer.param_groups:
            group["lr"] = lr * group["lr_scale"]
        tokens = data.batch(state.step, step_sequences)[runtime.rank * per_rank:(runtime.rank + 1) * per_rank]
        batches = [to_device(tokens[a:a + n], runtime.device) for a, n in zip(np.cumsum([0] + sizes), sizes)]
        loss_sum += backward_step(cell.train_model, batches, step_sequences, runtime)
        if s.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), s.grad_clip)
        optimizer.step()
        model.update_expert_bias()  # MoE: the balancing biases follow this step's loads (an all-reduce: every rank)
        optimizer.zero_grad(set_to_none=True)
        state.step += 1
        if state.step % s.log_interval == 0 or state.step == s.max_iters:
            if runtime.world > 1:
                dist.all_reduce(loss_sum)
            loss_avg = loss_sum.item() / (state.step - state.step_last)
            if not math.isfinite(loss_avg):
                diverged = f"train loss {loss_avg} over steps {state.step_last + 1}-{state.step}"
                break
            log.trained(state.step, state.step - state.step_last, loss_avg, lr)
            loss_sum.zero_()
            state.step_last = state.step
    finish_cell(cell, data, val_loss, diverged, routing, grid, runtime)


# -----------------------------------------------------------------------------
# the grid

@contextmanager
def cell_lock(cell_dir, master):
    """One process at a time trains a cell: cell_dir/lock (common.pid_lock: pid and host, a killed
    run's lock taken over). Under DDP rank 0 holds it."""
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


def main(argv):
    cfg = configure(DEFAULTS, argv, entries=dict(arms=SCHEME_ARMS))
    runtime = setup(cfg)
    data = find_data(cfg, runtime) if cfg["data_dir"] else None  # an empty one is check_config's line
    if cfg["vocab_size"] is None and data:  # the data sets the vocabulary
        cfg["vocab_size"] = data_vocab_size(cfg["tokenizer"])
    records.check_config(cfg, runtime.world, [a[2:].partition("=")[0] for a in argv if a.startswith("--")])
    models = {arm: records.model_config(cfg, settings) for arm, settings in cfg["arms"].items()}
    if runtime.master and len({m.block_size for m in models.values()}) > 1:  # allowed (a sweep over context), never paired
        print(f"note: the arms' block_size differ ({', '.join(f'{a} {m.block_size}' for a, m in models.items())}): "
              f"their batches differ, so the report pairs none of them with another")
    code = records.code_record()
    # recorded as used, so a rerun compares what ran (--device=cpu and --device=auto on a CPU are the
    # same); the world size changes a step's rounding, so it is a setting too
    # (torch.__version__ is a str subclass, which weights_only checkpoint loads refuse); on a CPU, compiled
    # kernels round differently on another thread count (measured), so the count is a setting too
    cfg.update(device=runtime.device.split(":")[0], dtype=runtime.dtype, torch_version=str(torch.__version__),
               world_size=runtime.world, compile=resolve_compile(cfg["compile"], runtime.device),
               cpu_threads=cpu_threads(runtime) if runtime.device == "cpu" else None)
    # the checkpoint's hash joins the config: recorded in every cell, and a rerun from other weights is a change
    init_weights, cfg["init_from_sha256"], init_tokenizer = records.load_init_from(cfg)
    bundle = downstream.load_bundle(cfg["downstream_bundle"]) if cfg["downstream_bundle"] else None  # every rank
    val, train_shards = open_data(cfg, data, min(m.vocab_size for m in models.values()), init_tokenizer)
    for config in models.values():  # enough tokens for a sequence of every arm, before anything is written
        TrainData(train_shards, config.block_size, 0)
    if cfg["tune_learning_rates"]:  # the tuned protocol: each arm's rate chosen on the tuning seeds, then the grid
        records.GridRecord(dict(cfg, arms={}), code)  # a rerun under other settings or code: refused before tuning
        tuning = tune.tuning_config(cfg)
        records.check_config(tuning, runtime.world)  # its arms' rates, as any arm's
        train_grid(tuning, code, val, train_shards, init_weights, None, runtime)  # no downstream tasks: tune.py
        cfg["arms"] = tune.tuned_arms(cfg, tune.choose(cfg, tuning["out_dir"]))
    train_grid(cfg, code, val, train_shards, init_weights, bundle, runtime)
    if runtime.world > 1:
        dist.destroy_process_group()
    if runtime.master:
        import report
        report.main([cfg["out_dir"]] + ([f"--reference={cfg['reference_arm']}"] if cfg["reference_arm"] else []))


def train_grid(cfg, code, val, train_shards, init_weights, bundle, runtime):
    """Train every cell of cfg's grid (arms x seeds) in turn: finished cells skipped, killed ones resumed."""
    # a rerun goes on only with the recorded settings, data and code (or allow_changes=True)
    grid_record = records.GridRecord(cfg, code)
    cells = [(arm, seed) for seed in cfg["seeds"] for arm in cfg["arms"]]
    differences = {(arm, seed): records.check_cell(cfg, arm, seed, code, val)[1] for arm, seed in cells}
    if runtime.master:
        check_writable(cfg["out_dir"], "choose another --out_dir")
    todo = [c for c in cells if not os.path.exists(os.path.join(cfg["out_dir"], c[0], f"seed{c[1]}", "result.json"))]
    grid = Grid(code=code, record=grid_record, differences=differences, todo=todo, init=init_weights, bundle=bundle)
    for arm, seed in cells:
        with cell_lock(os.path.join(cfg["out_dir"], arm, f"seed{seed}"), runtime.master):
            train_cell(arm, seed, cfg, grid, train_shards, val, runtime)
    if runtime.world > 1:
        dist.barrier()  # every result.json (rank 0's) written before any rank reads one


if __name__ == "__main__":
    try:
        main(sys.argv[1:])
    except UserError as e:
        sys.exit(f"error: {e}")
    except KeyboardInterrupt:
        sys.exit("interrupted: run the same command again to resume each unfinished cell from its last checkpoint")
