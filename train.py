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
its last checkpoint, and a cell recorded with other settings, data or code is refused unless
allow_changes=True. That bookkeeping lives in bookkeeping.py (docs/protocol.md says what it
records); this file is the loop. The grid ends with the paired report (report.py).
"""

import dataclasses
import hashlib
import math
import os
import sys
import time

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.fsdp import fully_shard, register_fsdp_forward_method
from torch.nn import functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

import bookkeeping
from bookkeeping import MODEL_DEFAULTS, MODEL_KEYS, rounded
from configurator import ConfigError, configure
from data.prepare import DataError, write_json
from model import GPT, RESIDUALS, GPTConfig

_before_config = set(globals())
# -----------------------------------------------------------------------------
# default config: a small paired run on the bundled Shakespeare corpus in bytes, minutes on a 2-core CPU
# I/O
out_dir = "out"  # relative to the working directory
data_dir = "data/shakespeare_bytes"  # relative: from the working directory if there, else from this file's
# directory (recorded absolute); the bundled corpus (shakespeare_bytes, shakespeare_gpt2) is prepared on demand
verify_shards = False  # at start, also check each shard's sha256 against manifest.json (file names and sizes always)
init_from = ""  # warm start: every cell from this standard checkpoint's weights (docs/protocol.md); "" = the seed's init
eval_interval = 25  # evaluate, and checkpoint, every N steps
log_interval = 10
eval_tokens = 8192  # the fixed validation set: the whole sequences within the first N tokens of the validation shard
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
vocab_size = 320  # the bytes tokenizer's 257 ids padded to a multiple of 64 (GPT-2 data: 50304, model.py's default)
# optimizer: AdamW; routing parameters and norms are never decayed (routing_lr_scale: a model key)
optimizer = "adamw"  # or 'muon': attention and MLP matrices in torch.optim.Muon; embedding, norms, routing in AdamW
learning_rate = 3e-3
muon_learning_rate = 0.02  # muon: the hidden matrices' peak learning rate, on the schedule of learning_rate
max_iters = 250
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
compile = "auto"  # 'auto': compiled on CUDA, eager elsewhere (on 2 CPU cores a cell's compile took ~60 s and
# saved ~8 s at the default size); True or False to choose; recorded as used
fsdp = False  # under torchrun: FSDP2 shards weights, gradients and optimizer state over the processes (not DDP)
activation_checkpointing = False  # recompute each sublayer in backward: less memory, about one more forward
# wandb: one run per cell (pip install wandb; WANDB_MODE=offline works without a network)
wandb_log = False
wandb_project = "nanodepth"
wandb_run_name = ""  # the runs' group, each run named <group>/<arm>/seed<k>; "" = out_dir's name
# -----------------------------------------------------------------------------
DEFAULTS = {k: v for k, v in globals().items() if k not in _before_config and k != "_before_config"}
DEFAULTS = MODEL_DEFAULTS | DEFAULTS  # every GPTConfig field is a key; the globals above override its defaults
# --arms=NAME,... may name a scheme of model.py: the arm of that name trains it at the run's settings
SCHEME_ARMS = {name: {"residual": name} for name in RESIDUALS}


def seed_for(seed, purpose, rank=0):
    """Independent integer seeds per run seed: init (0), data order (1), dropout (2, per rank)."""
    return int(np.random.SeedSequence([seed, purpose, rank]).generate_state(1)[0])


# -----------------------------------------------------------------------------
# data: the same batches for every arm of a seed, the same validation tokens for every cell

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

def backward_step(train_model, batches, step_sequences, ctx):
    """
    Accumulate into .grad the gradient of the step's mean token loss: each micro-batch's mean
    weighted by its share of the step's sequences, times the world size (which DDP's gradient
    average divides out). Returns this rank's part of the step's mean loss (detached).
    """
    part = 0.0
    for i, (x, y) in enumerate(batches):
        if isinstance(train_model, DDP):  # sync gradients on the last micro-step only (FSDP reduces each one:
            train_model.require_backward_grad_sync = i == len(batches) - 1  # its gradients stay sharded)
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


@torch.no_grad()
def evaluate(model, val, cfg, ctx):
    """Mean NLL (nats/token) on the fixed validation set: the first eval_tokens tokens of the
    validation shard as whole sequences, split over ranks, batch sums added in fp64, so the result
    does not depend on eval_batch_size or the world size beyond fp32 rounding. model may be the
    compiled module: every batch has one shape (a short last one is padded with ignored targets),
    so evaluation compiles once. Every rank runs as many batches (an FSDP forward is collective)."""
    T = cfg["block_size"]
    n_seq = (cfg["eval_tokens"] - 1) // T
    mine = np.arange(ctx["rank"], n_seq, ctx["world"])
    per_rank = -(-n_seq // ctx["world"])
    B = min(cfg["eval_batch_size"], per_rank)
    total = torch.zeros(2, dtype=torch.float64, device=ctx["device"])
    model.eval()
    for i in range(0, per_rank, B):
        x, y = validation_batch(val, mine[i:i + B], T, ctx["device"])
        x, y = F.pad(x, (0, 0, 0, B - len(x))), F.pad(y, (0, 0, 0, B - len(y)), value=-1)
        with ctx["autocast"]:
            _, loss = model(x, y, reduction="sum")
        total += torch.stack([loss.double(), (y != -1).sum().double()])
    if ctx["world"] > 1:
        dist.all_reduce(total)
    model.train()
    return (total[0] / total[1]).item()


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


def shard(model):
    """FSDP2 over the processes: each sublayer's weights a unit (the scheme calls attention and MLP
    apart, so they are gathered apart), then the root with the rest (embedding, norms, routing)."""
    for block in model.transformer.h:
        fully_shard(block.attn)
        fully_shard(block.mlp)
    fully_shard(model)
    register_fsdp_forward_method(model, "routing_diagnostics")  # gathers the root's weights, as forward does


# -----------------------------------------------------------------------------
# the life of one cell

def train_cell(arm, seed, cfg, code, grid, train_shards, val, ctx):
    """Train (or resume, or skip) one cell of the grid; a finished or diverged cell has result.json."""
    master, world = ctx["rank"] == 0, ctx["world"]
    cell_dir = os.path.join(cfg["out_dir"], arm, f"seed{seed}")
    ckpt_path, log_path, result_path = (os.path.join(cell_dir, f) for f in ("ckpt.pt", "log.jsonl", "result.json"))
    prefix = f"[{arm} seed{seed}]"
    change = grid["records"][arm, seed][1]  # how the cell's config.json differs from this run (check_cell)
    if os.path.exists(result_path):
        if master:
            print(f"{prefix} done already: {bookkeeping.describe_done(result_path, change)}")
        return
    cell = bookkeeping.cell_config(cfg, arm, seed)
    config = GPTConfig(**{k: cell[k] for k in MODEL_KEYS})
    T, max_iters = cell["block_size"], cell["max_iters"]
    record = dict(cell, model=dataclasses.asdict(config), code=code,
                  val_hash=bookkeeping.validation_hash(val, cell["eval_tokens"], T))

    # the model: the seed's shared init, bit-identical across arms (a warm start replaces it)
    torch.manual_seed(seed_for(seed, 0))
    model = GPT(config)
    if grid["init"] is not None:  # every shared weight replaced, routing left at its init
        model.load_state_dict(grid["init"], strict=False)
    init_hash = bookkeeping.shared_init_hash(model)
    model.to(ctx["device"])
    model.activation_checkpointing = cell["activation_checkpointing"]
    if ctx["fsdp"]:
        shard(model)
    optimizer = model.configure_optimizers(cell["weight_decay"], cell["learning_rate"], (cell["beta1"], cell["beta2"]),
                                           ctx["device"].split(":")[0], cell["optimizer"], cell["muon_learning_rate"])
    data = TrainData(train_shards, T, seed_for(seed, 1))
    torch.manual_seed(seed_for(seed, 2, ctx["rank"]))  # dropout masks: paired across arms, distinct per rank
    # where training stands: the step, the hash of every batch so far, the log interval's loss so far
    # (rank 0 holds it all after a checkpoint) and where that interval began
    step, data_hash, loss_sum, step_last, wall_before, changes, wandb_id = 0, "", 0.0, 0, 0.0, [], None
    if os.path.exists(ckpt_path):
        step, data_hash, loss_sum, step_last, wall_before, changes, wandb_id = bookkeeping.resume(
            cell_dir, record, cell["allow_changes"], model, optimizer, ctx)
        if master:
            print(f"{prefix} resuming from step {step}" + (f" with changes: {', '.join(change)}" if change else ""))
    if changes:
        record["changes"] = changes
    if master:
        write_json(os.path.join(cell_dir, "config.json"), record)
    torch._dynamo.reset()  # a new cell is a new model: compile afresh, not as the 9th recompile of forward
    # one graph per batch shape (training micro-batches, evaluation batches), never a dynamic one
    compiled = torch.compile(model, dynamic=False) if cell["compile"] else model
    train_model = DDP(compiled, device_ids=[ctx["local_rank"]] if ctx["device"].startswith("cuda") else None) \
        if world > 1 and not ctx["fsdp"] else compiled

    step_sequences = cell["gradient_accumulation_steps"] * cell["batch_size"]  # all ranks together
    mine = step_sequences // world
    sizes = micro_batches(mine, cell["batch_size"])
    tokens_per_step = step_sequences * T
    flops_per_step = model.flops_per_token(T) * tokens_per_step
    log = bookkeeping.CellLog(log_path, step > 0, cell, dict(record, init_hash=init_hash), wandb_id) if master else None
    if master and step == 0:
        print(f"{prefix} {model.num_params() / 1e6:.2f}M non-embedding parameters, "
              f"{tokens_per_step:,} tokens/step, {max_iters} steps")
    loss_sum = torch.tensor(loss_sum, device=ctx["device"])
    time_left = bookkeeping.TimeLeft(cell, grid["todo"], grid["rates"])
    t_start = t_last = time.time()
    diverged = val_loss = routing = None
    while True:
        if step % cell["eval_interval"] == 0 or step == max_iters:
            t_eval = time.time()
            val_loss = evaluate(compiled, val, cell, ctx)
            if not math.isfinite(val_loss):
                diverged = f"validation loss {val_loss} at step {step}"
                break
            routing = routing_summary(model, val, cell, ctx)  # on every rank: an FSDP forward is collective
            if master:
                print(f"{prefix} step {step}: val_loss {val_loss:.4f}")
                log.write(dict(step=step, tokens=step * tokens_per_step, val_loss=val_loss,
                               eval_s=round(time.time() - t_eval, 3)), routing=routing)
            rng = bookkeeping.gather_rng(ctx)
            if world > 1:  # the interval's loss so far, on rank 0 alone: a resume restores it exactly
                dist.all_reduce(loss_sum)
                if not master:
                    loss_sum.zero_()
            state = bookkeeping.training_state(model, optimizer, ctx) if step > 0 else None  # FSDP: every rank
            if master and step > 0:
                grid["record"]()
                bookkeeping.save_atomically(dict(model=state[0], optimizer=state[1],
                                                 step=step, rng=rng, data_hash=data_hash, config=record,
                                                 loss_sum=loss_sum.item(), step_last=step_last,
                                                 wall_time_s=wall_before + time.time() - t_start,
                                                 wandb_id=log.wandb_id), ckpt_path)
            time_left.evaluated(time.time() - t_eval)
            t_last += time.time() - t_eval  # evaluation time is not training time
        if step == max_iters:
            break
        lr = learning_rate_at(step, cell)
        for group in optimizer.param_groups:
            group["lr"] = lr * group["lr_scale"]
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
        if step % cell["log_interval"] == 0 or step == max_iters:
            if world > 1:
                dist.all_reduce(loss_sum)
            loss_avg = loss_sum.item() / (step - step_last)
            if not math.isfinite(loss_avg):
                diverged = f"train loss {loss_avg} over steps {step_last + 1}-{step}"
                break
            dt = (time.time() - t_last) / (step - step_last)
            eta_cell, eta_grid = time_left.logged(arm, seed, step, step - step_last, dt * (step - step_last))
            mfu = flops_per_step / dt / ctx["peak_flops"] if ctx["peak_flops"] else None
            if master:
                print(f"{prefix} step {step}/{max_iters} | loss {loss_avg:.4f} | lr {lr:.2e} | "
                      f"{dt * 1000:.1f} ms/step | {tokens_per_step / dt:,.0f} tok/s"
                      + (f" | mfu {100 * mfu:.1f}%" if mfu else "")
                      + f" | left: cell {bookkeeping.duration(eta_cell)}, grid {bookkeeping.duration(eta_grid)}")
                log.write(dict(step=step, tokens=step * tokens_per_step, loss=loss_avg, lr=lr, ms_per_step=dt * 1000,
                               tokens_per_s=tokens_per_step / dt, mfu=mfu, eta_cell_s=round(eta_cell, 1),
                               eta_grid_s=round(eta_grid, 1)))
            loss_sum.zero_()
            t_last, step_last = time.time(), step
    if master:
        if diverged:
            print(f"{prefix} diverged: {diverged}; the cell stops here, the grid goes on")
        grid["record"]()
        log.close(bookkeeping.write_result(
            result_path, cell, record, model, code, steps=step, tokens=step * tokens_per_step, val_loss=val_loss,
            diverged=diverged, routing=routing, init_hash=init_hash, data_hash=data_hash,
            eval_tokens=(cell["eval_tokens"] - 1) // T * T, changes=changes,
            wall_time_s=wall_before + time.time() - t_start))


# -----------------------------------------------------------------------------
# the grid

def main(argv):
    cfg = configure(DEFAULTS, argv, entries=dict(arms=SCHEME_ARMS))
    ctx = bookkeeping.setup(cfg)
    bookkeeping.check_config(cfg, ctx["world"], [a[2:].partition("=")[0] for a in argv if a.startswith("--")])
    master = ctx["rank"] == 0
    models = {arm: bookkeeping.model_config(cfg, settings) for arm, settings in cfg["arms"].items()}
    if master and len({m.block_size for m in models.values()}) > 1:  # allowed (a sweep over context), never paired
        print(f"note: the arms' block_size differ ({', '.join(f'{a} {m.block_size}' for a, m in models.items())}): "
              f"their batches differ, so the report pairs none of them with another")
    code = bookkeeping.code_record()
    # recorded as used, so a rerun compares what ran (--device=cpu and --device=auto on a CPU are the
    # same); the world size changes a step's rounding, so it is a setting too
    # (torch.__version__ is a str subclass, which weights_only checkpoint loads refuse)
    cfg.update(device=ctx["device"].split(":")[0], dtype=ctx["dtype"], torch_version=str(torch.__version__),
               world_size=ctx["world"], compile=bookkeeping.resolve_compile(cfg["compile"], ctx["device"]))
    # the checkpoint's hash joins the config: recorded in every cell, and a rerun from other weights is a change
    init_weights, cfg["init_from_sha256"], init_tokenizer = bookkeeping.load_init_from(cfg)
    val, train_shards = bookkeeping.open_data(cfg, min(m.vocab_size for m in models.values()), init_tokenizer, ctx)
    for config in models.values():  # enough tokens for a sequence of every arm, before anything is written
        TrainData(train_shards, config.block_size, 0)
    # a rerun goes on only with the recorded settings, data and code (or allow_changes=True)
    grid_record = bookkeeping.GridRecord(cfg, code)
    cells = [(arm, seed) for seed in cfg["seeds"] for arm in cfg["arms"]]
    records = {(arm, seed): bookkeeping.check_cell(cfg, arm, seed, code, val) for arm, seed in cells}
    if master:
        bookkeeping.check_writable(cfg["out_dir"])
    todo = [c for c in cells if not os.path.exists(os.path.join(cfg["out_dir"], c[0], f"seed{c[1]}", "result.json"))]
    grid = dict(records=records, todo=todo, rates={}, init=init_weights, record=grid_record.write_once)
    for arm, seed in cells:
        with bookkeeping.cell_lock(os.path.join(cfg["out_dir"], arm, f"seed{seed}"), master):
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
    except KeyboardInterrupt:
        sys.exit("interrupted: run the same command again to resume each unfinished cell from its last checkpoint")
