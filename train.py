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

Each cell writes out_dir/<arm>/seed<k>/: config.json, log.jsonl, ckpt.pt and, when done, result.json.
Run the same command again: finished cells are skipped, a killed cell resumes (checkpoint.py), a cell
recorded with other settings, data or code is refused unless allow_changes=True (records.py,
docs/protocol.md). This file is the config, the data order, the step, the loop and the grid; machine.py
sets up the processes and device, cells.py opens, checkpoints and finishes a cell, data/shards.py finds
and checks the data. The grid ends with the paired report (report.py).
"""

import hashlib
import math
import os
import sys
import time

import numpy as np
import torch
import torch.distributed as dist
from torch.nn import functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

import checkpoint
import downstream
import records
import tune
from cells import DATA_ORDER, PREEMPTED, Grid, Preempted, evaluate_downstream, finish_cell, open_cell, rank0s
from cells import save_cell, seed_for, stop_on_signals, stop_requested, write_report
from grid_files import grid_cells, stalled, unfinished
from common import DataError, UserError, cell_lock, check_writable
from configurator import configure
from data.prepare import find_or_prepare_data as find_data  # main's name for it (fingerprinted)
from data.shards import data_vocab_size, open_data
from machine import cpu_threads, exit_without_finalizing, resolve_compile, setup
from model import RESIDUALS

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
eval_tokens = 8192  # the fixed validation set: (eval_tokens - 1) // block_size whole sequences of the validation shard
eval_layout = "spread"  # where they lie: evenly across the whole shard ('first': its first eval_tokens; records.py)
eval_batch_size = 8  # sequences per evaluation forward; does not change the result
allow_changes = False  # go on with cells recorded under other settings or code (recorded in them)
# downstream: the CORE in-context tasks (downstream.py) on each cell's model, logged, and written as downstream.json
downstream_bundle = ""  # the CORE bundle folder (python downstream.py --download: data/eval_bundle); "" = off
downstream_interval = 0  # 0: at each cell's last step only; else also every N steps (a multiple of eval_interval)
downstream_max_per_task = 500  # the first N items of each task (nanochat's in-training setting); 0 = every item
# the paired grid: every arm (a named set of model settings) runs with every seed
arms = {"attnres": {"residual": "attnres"}, "rd_attnres": {"residual": "rd_attnres"}}
seeds = [0, 1]
reference_arm = ""  # the report's references, comma-separated; "" = arms standard and scaled_residual, else the first
# the tuned protocol (tune.py): each arm's learning rate chosen on tune_seeds first; [] = one rate for every arm
tune_learning_rates = []  # e.g. [1e-3, 3e-3, 1e-2]: every arm runs at each on the tuning seeds, then at its best
tune_seeds = [1000, 1001, 1002]  # never a compared seed; enough to see the noise a rate must beat
tune_iters = 0  # the tuning cells' steps (their whole schedule); 0 = a quarter of max_iters
tune_routing_lr_scales = []  # e.g. [0.1, 1]: also each routed arm's routing_lr_scale, at its chosen rate (tune.py)
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
# data: the same batches for every arm of a seed, the same validation tokens for every cell


class TrainData:
    """Sequences of block_size + 1 tokens cut from the train shards. Each epoch visits them in a
    permutation drawn from the data seed, so a step's batch depends only on (data seed, step):
    every arm sees the same batches, and resuming needs nothing but the step. `hash` chains the
    sha256 of every batch drawn with batch(), from data_hash (a resumed cell's)."""

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
        return np.stack([self.shards[s][o : o + self.block_size + 1] for s, o in zip(shard, offsets)])

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


def validation_batch(val_rows, seq_ids, device):
    """Validation sequences seq_ids (rows of records.ValidationText.rows, T + 1 tokens each) as (inputs, targets)."""
    return to_device(val_rows[np.asarray(seq_ids, dtype=np.int64)], device)


def micro_batches(n, batch_size):
    """Sizes of the fewest micro-batches of at most batch_size that hold n sequences, as even as can be."""
    count = -(-n // batch_size)
    return [n // count + (i < n % count) for i in range(count)]


# -----------------------------------------------------------------------------
# one step, the schedule, evaluation


def backward_step(train_model, batches, step_sequences, runtime):
    """Accumulate into .grad the gradient of the step's mean token loss: each micro-batch's mean
    weighted by its share of the step's sequences, times the world size (which DDP's gradient
    average divides out). Returns this rank's part of the step's mean loss (detached)."""
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
def sequence_losses(model, val_rows, cell, runtime):
    """The mean NLL (nats/token) of each sequence of the fixed validation set, as a float64 array in
    sequence order, whole on every rank (the text's share of the uncertainty: report.py). The set: the cell's
    rows of records.ValidationText (sequences of cell.block_size + 1 tokens), split
    over ranks, each sequence's token losses summed in fp64, so the result does not depend on eval_batch_size
    or the world size beyond fp32 rounding. model may be the compiled module: every batch has one shape (a
    short last one padded with ignored targets), so evaluation compiles once; every rank runs as many."""
    T = cell.block_size
    n_seq = len(val_rows)
    ours = np.arange(runtime.rank, n_seq, runtime.world)
    per_rank = -(-n_seq // runtime.world)
    B = min(cell.eval_batch_size, per_rank)
    sums = torch.zeros(n_seq, dtype=torch.float64, device=runtime.device)  # each sequence's NLL; other ranks' 0 here
    model.eval()
    for i in range(0, per_rank, B):
        rows = ours[i : i + B]
        x, y = validation_batch(val_rows, rows, runtime.device)
        x, y = F.pad(x, (0, 0, 0, B - len(x))), F.pad(y, (0, 0, 0, B - len(y)), value=-1)
        with runtime.autocast:
            _, loss = model(x, y, reduction="none")
        sums[torch.from_numpy(rows).to(runtime.device)] = loss[: len(rows)].double().sum(1)
    if runtime.world > 1:
        dist.all_reduce(sums)
    model.train()
    return (sums / T).cpu().numpy()


def evaluate(model, val_rows, cell, runtime):
    """Mean NLL (nats/token) on the fixed validation set: the mean of sequence_losses (every sequence
    has block_size tokens)."""
    return float(sequence_losses(model, val_rows, cell, runtime).mean())


@torch.no_grad()
def routing_summary(model, val_rows, runtime):
    """Routing diagnostics (GPT.routing_diagnostics) on the first few validation sequences."""
    x, _ = validation_batch(val_rows, range(min(4, len(val_rows))), runtime.device)
    model.eval()
    with runtime.autocast:
        diag = model.routing_diagnostics(x)
    model.train()
    return records.rounded(diag)


# -----------------------------------------------------------------------------
# one cell, the grid


def train_cell(arm, seed, cfg, grid, train_shards, val, runtime):
    """Train (or resume, or skip) one cell of the grid; a finished or diverged cell has result.json."""
    cell = open_cell(arm, seed, cfg, grid, val, runtime)
    if cell is None:
        return
    s, model, optimizer, state, log = cell.settings, cell.model, cell.optimizer, cell.state, cell.log
    data = TrainData(train_shards, s.block_size, seed_for(seed, DATA_ORDER), state.data_hash)
    step_sequences = s.gradient_accumulation_steps * s.batch_size  # all ranks together
    per_rank = step_sequences // runtime.world
    sizes = micro_batches(per_rank, s.batch_size)
    # the log interval's loss on this rank; under several ranks in float64, where the ranks' float32 parts add
    # exactly in any order, so a cell resumed mid-interval (its sum on rank 0) logs what it would have
    loss_sum = torch.tensor(
        state.loss_sum, device=runtime.device, dtype=torch.float64 if runtime.world > 1 else torch.float32
    )
    diverged = val_loss = losses = routing = None
    while True:
        if state.step % s.eval_interval == 0 or state.step == s.max_iters:
            t_eval = time.monotonic()
            losses = sequence_losses(cell.compiled, cell.val_rows, s, runtime)
            val_loss = float(losses.mean())
            if not math.isfinite(val_loss):
                diverged = f"validation loss {val_loss} at step {state.step}"
                break
            routing = routing_summary(model, cell.val_rows, runtime)  # on every rank: an FSDP forward is collective
            log.evaluated(state.step, val_loss, routing, time.monotonic() - t_eval)
            evaluate_downstream(cell, grid, runtime)
            if state.step > 0:
                save_cell(cell, data, loss_sum, grid, runtime)
            log.paused(time.monotonic() - t_eval)  # evaluation time is not training time
        if state.step == s.max_iters:
            break
        lr = learning_rate_at(state.step, s)
        for group in optimizer.param_groups:
            group["lr"] = lr * group["lr_scale"]
        tokens = data.batch(state.step, step_sequences)[runtime.rank * per_rank : (runtime.rank + 1) * per_rank]
        batches = [to_device(tokens[a : a + n], runtime.device) for a, n in zip(np.cumsum([0] + sizes), sizes)]
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
        # SIGTERM or SIGUSR1: checkpoint at this step boundary, then exit. Over ranks, learning of a stop is an
        # all-reduce read on the host (a GPU sync): only at log steps, which sync already and are the same on every rank
        if (runtime.world == 1 or state.step % s.log_interval == 0) and stop_requested(runtime):
            save_cell(cell, data, loss_sum, grid, runtime)
            if runtime.world > 1:
                dist.barrier()  # no rank exits (and has torchrun stop the others) before rank 0 has written it
            raise Preempted(f"[{arm} seed{seed}] checkpointed at step {state.step}")
    finish_cell(cell, data, val_loss, losses, diverged, routing, grid, runtime)


def train_grid(cfg, code, val, train_shards, init_weights, bundle, runtime, wait=False):
    """Train every cell of cfg's grid (arms x seeds) in turn that no live process holds: finished cells
    skipped, killed ones resumed, one that another worker trains left to it (any number of processes may
    share a grid). wait: then wait until the other workers' cells have results too, taking over any whose
    worker died."""
    # a rerun goes on only with the recorded settings, data and code (or allow_changes=True)
    grid_record = records.GridRecord(cfg, code)
    cells = grid_cells(cfg)
    differences = {(arm, seed): records.check_cell(cfg, arm, seed, code, val) for arm, seed in cells}
    if runtime.master:
        check_writable(cfg["out_dir"], "choose another --out_dir")
    todo = unfinished(cfg, cells)
    grid = Grid(code=code, record=grid_record, differences=differences, todo=todo, init=init_weights, bundle=bundle)
    turn, left_to_others, seen = cells, set(), {}
    while turn:
        for arm, seed in turn:
            if stop_requested(runtime):
                raise Preempted(f"stopped before [{arm} seed{seed}]")
            with cell_lock(records.cell_dir(cfg["out_dir"], arm, seed), runtime.master) as holder:
                if rank0s(holder, runtime) is None:
                    train_cell(arm, seed, cfg, grid, train_shards, val, runtime)
                elif runtime.master and (arm, seed) not in left_to_others:
                    print(
                        f"[{arm} seed{seed}] being trained by {holder}: left to it (if that process is gone, rm "
                        f"{os.path.join(records.cell_dir(cfg['out_dir'], arm, seed), 'lock')} and run again)"
                    )
                    left_to_others.add((arm, seed))
        if runtime.world > 1:
            dist.barrier()  # every result.json (rank 0's) written before any rank reads one
        turn = rank0s(unfinished(cfg, cells), runtime) if wait else []
        given_up = rank0s(stalled(cfg, turn, seen) if runtime.master else None, runtime)
        if given_up:
            raise DataError(given_up)
        if turn:
            time.sleep(10)  # other workers' cells: their results, or their locks free when a worker dies


def build_config(given, runtime, data, init):
    """The run's config, as out_dir/config.json records it (each cell's config.json adds its arm's
    settings over it; docs/protocol.md lists the keys). given: DEFAULTS updated by config files and
    --key=value. Over it: each arm's settings typed, and what this run found: the data's absolute
    folder, tokenizer and train shards' fingerprint (other train data is a change, like other
    weights), the vocabulary (the data's unless given), the machine as used, and the warm start's
    sha256 (a rerun from other weights is a change). The tuned protocol's grids are this config with
    other arms (tune.py)."""
    vocab_size = given["vocab_size"]
    if vocab_size is None and data:  # the data sets the vocabulary
        vocab_size = data_vocab_size(data.tokenizer)
    # the machine as used, so a rerun compares what ran (--device=cpu and --device=auto on a CPU are the same); the
    # world size changes a step's rounding, and on a CPU compiled kernels round differently on another thread count
    # (measured), so both are settings. torch.__version__ is a str subclass, which weights_only loads refuse. No data
    # (an empty data_dir) is check_config's line.
    return dict(
        given,
        data_dir=data.dir if data else given["data_dir"],
        tokenizer=data and data.tokenizer,
        vocab_size=vocab_size,
        arms=records.typed_arms(given),
        device=runtime.device.split(":")[0],
        dtype=runtime.dtype,
        torch_version=str(torch.__version__),
        world_size=runtime.world,
        compile=resolve_compile(given["compile"], runtime.device),
        cpu_threads=cpu_threads(runtime) if runtime.device == "cpu" else None,
        init_from_sha256=init.sha256,
        train_data_sha256=data and records.train_data_fingerprint(data.train_paths, data.manifest),
    )


def main(argv):
    given = configure(DEFAULTS, argv, entries=dict(arms=SCHEME_ARMS))
    runtime = setup(given)
    data = find_data(given, runtime) if given["data_dir"] else None
    init = checkpoint.load_init_from(given["init_from"])
    cfg = build_config(given, runtime, data, init)
    records.check_config(cfg, runtime.world, [a[2:].partition("=")[0] for a in argv if a.startswith("--")])
    checkpoint.check_init_fits(init, cfg)
    models = {arm: records.model_config(cfg, settings) for arm, settings in cfg["arms"].items()}
    for note in records.notes(cfg, models) if runtime.master else []:  # allowed (a sweep over context), said
        print(note)
    code = records.code_record()
    bundle = (
        downstream.load_bundle(cfg["downstream_bundle"], cfg["downstream_max_per_task"] or None)
        if cfg["downstream_bundle"]
        else None
    )  # every rank
    shard, train_shards = open_data(cfg, data, min(m.vocab_size for m in models.values()), init.tokenizer)
    val = records.ValidationText(shard, cfg["tokenizer"])
    for config in models.values():  # enough tokens for a sequence of every arm, before anything is written
        TrainData(train_shards, config.block_size, 0)
        val.starts(cfg["eval_tokens"], config.block_size, cfg["eval_layout"])  # and for its validation sequences
    if cfg["tune_learning_rates"]:  # the tuned protocol: each arm's rate chosen on the tuning seeds, then the grid
        records.GridRecord(dict(cfg, arms={}), code)  # a rerun under other settings or code: refused before tuning
        tuning = tune.tuning_config(cfg)
        records.check_config(tuning, runtime.world)  # its arms' rates, as any arm's
        # no downstream tasks (tune.py); the choice needs every tuning cell, other workers' too
        # on the validation text after the reported one (tune.tuning_text): the choice never reads a test token
        train_grid(tuning, code, tune.tuning_text(cfg, val), train_shards, init.weights, None, runtime, wait=True)
        cfg = dict(cfg, arms=tune.tuned_arms(cfg, tune.choose(cfg, tuning["out_dir"], runtime.master)))
    train_grid(cfg, code, val, train_shards, init.weights, bundle, runtime)
    if runtime.world > 1:
        dist.destroy_process_group()
    if runtime.master:
        write_report(cfg)


if __name__ == "__main__":
    with exit_without_finalizing():  # under torchrun: no interpreter finalization beside live gloo threads
        try:
            with stop_on_signals():
                main(sys.argv[1:])
        except UserError as e:
            sys.exit(f"error: {e}")
        except Preempted as e:
            print(f"stopped by a signal: {e}; run the same command again to resume", file=sys.stderr)
            sys.exit(PREEMPTED)
        except KeyboardInterrupt:
            sys.exit("interrupted: run the same command again to resume each unfinished cell from its last checkpoint")
