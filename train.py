"""
Pretrain the paired-seed grid: every (seed, arm) cell in turn, paired within a seed (same
shared-parameter init, same data order, same dropout RNG) and evaluated on one fixed validation set.

$ python train.py                                       # default: a small paired run on the bundled corpus
$ python train.py config/rd_120m.py --seeds=0 --arms=rd_attnres   # one cell, one GPU
$ torchrun --standalone --nproc_per_node=8 train.py config/rd_343m.py
$ torchrun --nnodes=2 --node_rank=0 --master_addr=10.0.0.1 --master_port=29500 \
      --nproc_per_node=8 train.py config/rd_343m.py     # multi-node: out_dir on a shared filesystem

Each cell writes out_dir/<arm>/seed<k>/: config.json, log.jsonl, ckpt.pt and, when done,
result.json. Run the same command again: finished cells are skipped, a killed cell resumes from
its last checkpoint. The grid ends with the paired report (report.py).
"""

import hashlib
import json
import math
import os
import sys
import time
from contextlib import nullcontext

import numpy as np
import torch
import torch.distributed as dist
from torch.nn import functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

from configurator import ConfigError, configure
from data.prepare import BUNDLED_OUT, DataError, open_shard, prepare_bundled, write_json
from model import GPT, GPTConfig

_before_config = set(globals())
# -----------------------------------------------------------------------------
# default config: a small paired run on the bundled Shakespeare corpus, minutes on a 2-core CPU
# I/O
out_dir = "out"
data_dir = "data/shakespeare_gpt2"  # shards from data/prepare.py; the bundled corpus is prepared on demand
eval_interval = 100
log_interval = 10
eval_tokens = 32768  # the fixed validation set: the first N tokens of the validation shard
eval_batch_size = 8  # sequences per evaluation forward; does not change the result
# the paired grid: each arm is a named set of model settings; every arm runs with every seed
arms = {"attnres": {"residual": "attnres"}, "rd_attnres": {"residual": "rd_attnres"}}
seeds = [0, 1]
reference_arm = ""  # the paired report's reference; empty = the first arm
# model (shared by every arm unless the arm overrides it)
n_layer = 4
n_head = 4
n_embd = 128
block_size = 128
vocab_size = 50304
dropout = 0.0
norm_eps = 1e-6
residual = "standard"
attnres_block_size = 4
rd_control = "none"
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
batch_size = 8
gradient_accumulation_steps = 1
# system
device = "auto"  # 'auto' (cuda, then mps, then cpu), or e.g. 'cpu', 'cuda', 'cuda:1', 'mps'
dtype = "auto"  # 'auto' (bfloat16 autocast where supported, else float32), 'bfloat16', 'float32'
compile = True
# -----------------------------------------------------------------------------
DEFAULTS = {k: v for k, v in globals().items() if k not in _before_config and k != "_before_config"}

MODEL_KEYS = ("n_layer", "n_head", "n_embd", "block_size", "vocab_size", "dropout", "norm_eps",
              "residual", "attnres_block_size", "rd_control")
# dense bf16 peak FLOP/s per GPU, for MFU (matched against torch.cuda.get_device_name)
PEAK_FLOPS = {"H100": 989e12, "H200": 989e12, "H800": 989e12, "B200": 2250e12, "A100": 312e12,
              "A800": 312e12, "L40S": 362e12, "L4": 121e12, "A10G": 125e12, "RTX 4090": 165e12,
              "RTX 3090": 71e12}


def model_config(cfg, settings):
    """The model of one arm: the run's model keys, overridden by the arm's settings."""
    return GPTConfig(**{k: cfg[k] for k in MODEL_KEYS} | settings)


def seed_for(seed, purpose, rank=0):
    """Independent integer seeds per run seed: init (0), data order (1), dropout (2, per rank)."""
    return int(np.random.SeedSequence([seed, purpose, rank]).generate_state(1)[0])


class TrainData:
    """
    Sequences of block_size + 1 tokens cut from the train shards. Each epoch visits them in a
    permutation drawn from the data seed, so a step's batch depends only on (data seed, step):
    every arm sees the same batches, and resuming needs nothing but the step.
    """

    def __init__(self, paths, block_size, seed):
        self.shards = [open_shard(p) for p in paths]
        counts = [(len(s) - 1) // block_size for s in self.shards]
        self.starts = np.cumsum([0] + counts)
        if self.starts[-1] == 0:
            raise DataError(f"train shards in {os.path.dirname(paths[0])} hold fewer than block_size+1 tokens")
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
        shard = np.searchsorted(self.starts, ids, side="right") - 1
        offsets = (ids - self.starts[shard]) * self.block_size
        rows = [self.shards[s][o:o + self.block_size + 1] for s, o in zip(shard, offsets)]
        return torch.from_numpy(np.stack(rows).astype(np.int64))


def to_device(batch, device):
    x, y = batch[:, :-1], batch[:, 1:]
    if device.startswith("cuda"):
        return x.pin_memory().to(device, non_blocking=True), y.pin_memory().to(device, non_blocking=True)
    return x.to(device), y.to(device)


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
    rows = [val[j * T: j * T + T + 1] for j in seq_ids]
    return to_device(torch.from_numpy(np.stack(rows).astype(np.int64)), device)


@torch.no_grad()
def evaluate(model, val, cfg, ctx):
    """Mean NLL (nats/token) on the fixed validation set: the first eval_tokens tokens of the
    validation shard as whole sequences, split over ranks, summed in fp64 per token, so the
    result does not depend on eval_batch_size or the world size."""
    T = cfg["block_size"]
    n_seq = (min(cfg["eval_tokens"], len(val)) - 1) // T
    mine = np.arange(ctx["rank"], n_seq, ctx["world"])
    total = torch.zeros(2, dtype=torch.float64, device=ctx["device"])
    model.eval()
    for i in range(0, len(mine), cfg["eval_batch_size"]):
        x, y = validation_batch(val, mine[i:i + cfg["eval_batch_size"]], T, ctx["device"])
        with ctx["autocast"]:
            logits = model.lm_head(model.hidden(x))  # per-token losses, not the model's mean
        nll = F.cross_entropy(logits.float().flatten(0, 1), y.flatten(), reduction="none")
        total += torch.stack([nll.double().sum(), torch.tensor(nll.numel(), dtype=torch.float64, device=nll.device)])
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
    """Write to a temporary name, then rename: a crash never leaves a half-written file behind."""
    writer(obj, path + ".tmp")
    os.replace(path + ".tmp", path)


def write_text(text, path):
    with open(path, "w") as f:
        f.write(text)


def gather_rng(ctx):
    state = dict(torch=torch.get_rng_state(),
                 cuda=torch.cuda.get_rng_state() if ctx["device"].startswith("cuda") else None)
    if ctx["world"] == 1:
        return [state]
    states = [None] * ctx["world"]
    dist.all_gather_object(states, state)
    return states


def train_cell(arm, seed, cfg, data_paths, val, ctx):
    """Train (or resume, or skip) one cell of the grid; a finished cell has result.json."""
    master = ctx["rank"] == 0
    cell_dir = os.path.join(cfg["out_dir"], arm, f"seed{seed}")
    result_path, ckpt_path, log_path = (os.path.join(cell_dir, f) for f in ("result.json", "ckpt.pt", "log.jsonl"))
    if os.path.exists(result_path):
        if master:
            print(f"[{arm} seed{seed}] done already: val_loss {json.load(open(result_path))['val_loss']:.4f}")
        return
    config = model_config(cfg, cfg["arms"][arm])
    cell_config = dict(cfg, arm=arm, seed=seed, model=vars(config))
    torch.manual_seed(seed_for(seed, 0))
    model = GPT(config)
    init_hash = shared_init_hash(model)
    model.to(ctx["device"])
    optimizer = model.configure_optimizers(cfg["weight_decay"], cfg["learning_rate"], (cfg["beta1"], cfg["beta2"]),
                                           ctx["device"].split(":")[0])
    data = TrainData(data_paths, cfg["block_size"], seed_for(seed, 1))
    step, data_hash = 0, ""
    torch.manual_seed(seed_for(seed, 2, ctx["rank"]))  # dropout masks: paired across arms, distinct per rank
    if os.path.exists(ckpt_path):
        ckpt = torch.load(ckpt_path, map_location=ctx["device"], weights_only=False)
        if ckpt["config"]["model"] != cell_config["model"]:
            raise ConfigError(f"{ckpt_path} was written for another model config; use another out_dir")
        model.load_state_dict(ckpt["model"])
        optimizer.load_state_dict(ckpt["optimizer"])
        step, data_hash = ckpt["step"], ckpt["data_hash"]
        if len(ckpt["rng"]) == ctx["world"]:
            rng = ckpt["rng"][ctx["rank"]]
            torch.set_rng_state(rng["torch"].cpu())
            if rng["cuda"] is not None and ctx["device"].startswith("cuda"):
                torch.cuda.set_rng_state(rng["cuda"].cpu())
        elif master:
            print(f"[{arm} seed{seed}] checkpoint from {len(ckpt['rng'])} ranks, now {ctx['world']}: "
                  f"dropout RNG streams are not restored exactly")
        if master:  # drop log records past the checkpoint (its own evaluation is redone too)
            with open(log_path) as f:
                kept = [line for line in f if (r := json.loads(line))["step"] < step
                        or (r["step"] == step and "loss" in r)]
            save_atomically("".join(kept), log_path, write_text)
            print(f"[{arm} seed{seed}] resuming from step {step}")
        del ckpt
    if master:
        os.makedirs(cell_dir, exist_ok=True)
        write_json(os.path.join(cell_dir, "config.json"), cell_config)
    torch._dynamo.reset()  # a new cell is a new model: compile afresh, not as the 9th recompile of forward
    compiled = torch.compile(model) if cfg["compile"] else model
    train_model = DDP(compiled, device_ids=[ctx["local_rank"]] if ctx["device"].startswith("cuda") else None) \
        if ctx["world"] > 1 else compiled

    accum = cfg["gradient_accumulation_steps"] // ctx["world"]  # micro-steps per rank
    B, T = cfg["batch_size"], cfg["block_size"]
    step_sequences = accum * ctx["world"] * B
    tokens_per_step = step_sequences * T
    flops_per_step = model.flops_per_token(T) * tokens_per_step
    log = open(log_path, "a") if master else None
    prefix = f"[{arm} seed{seed}]"
    if master and step == 0:
        print(f"{prefix} {model.num_params() / 1e6:.2f}M non-embedding parameters, "
              f"{tokens_per_step:,} tokens/step, {cfg['max_iters']} steps")
    loss_sum, t_last, step_last = torch.zeros((), device=ctx["device"]), time.time(), step
    while True:
        if step % cfg["eval_interval"] == 0 or step == cfg["max_iters"]:
            val_loss = evaluate(model, val, cfg, ctx)
            routing = routing_summary(model, val, cfg, ctx) if master else None
            if master:
                print(f"{prefix} step {step}: val_loss {val_loss:.4f}")
                log.write(json.dumps(dict(step=step, tokens=step * tokens_per_step, val_loss=val_loss,
                                          routing=routing)) + "\n")
                log.flush()
            rng = gather_rng(ctx)
            if master and step > 0:
                save_atomically(dict(model=model.state_dict(), optimizer=optimizer.state_dict(), step=step,
                                     rng=rng, data_hash=data_hash, config=cell_config), ckpt_path)
            t_last = time.time()  # evaluation time is not training time
        if step == cfg["max_iters"]:
            break
        lr = learning_rate_at(step, cfg)
        for group in optimizer.param_groups:
            group["lr"] = lr
        ids = data.sequence_ids(step * step_sequences, step_sequences)
        data_hash = hashlib.sha256((data_hash + ids.tobytes().hex()).encode()).hexdigest()
        for micro in range(accum):
            # rank r's micro-step m takes slots (m * world + r) * B ... + B of the step's sequences
            first = (micro * ctx["world"] + ctx["rank"]) * B
            x, y = to_device(data.sequences(ids[first:first + B]), ctx["device"])
            if ctx["world"] > 1:  # sync gradients on the last micro-step only
                train_model.require_backward_grad_sync = micro == accum - 1
            with ctx["autocast"]:
                _, loss = train_model(x, y)
            (loss / accum).backward()
            loss_sum += loss.detach() / accum
        if cfg["grad_clip"] > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), cfg["grad_clip"])
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        step += 1
        if step % cfg["log_interval"] == 0 or step == cfg["max_iters"]:
            if ctx["world"] > 1:
                dist.all_reduce(loss_sum)
            loss_avg = loss_sum.item() / ctx["world"] / (step - step_last)
            dt = (time.time() - t_last) / (step - step_last)
            mfu = flops_per_step / dt / ctx["peak_flops"] if ctx["peak_flops"] else None
            if master:
                print(f"{prefix} step {step}/{cfg['max_iters']} | loss {loss_avg:.4f} | lr {lr:.2e} | "
                      f"{dt * 1000:.1f} ms/step | {tokens_per_step / dt:,.0f} tok/s"
                      + (f" | mfu {100 * mfu:.1f}%" if mfu else ""))
                log.write(json.dumps(dict(step=step, tokens=step * tokens_per_step, loss=loss_avg, lr=lr,
                                          ms_per_step=dt * 1000, tokens_per_s=tokens_per_step / dt, mfu=mfu)) + "\n")
                log.flush()
            loss_sum.zero_()
            t_last, step_last = time.time(), step
    if master:
        log.close()
        write_json(result_path, dict(arm=arm, seed=seed, val_loss=val_loss, val_ppl=math.exp(val_loss),
                        tokens=step * tokens_per_step, steps=step, params=model.num_params(non_embedding=False),
                        non_embedding_params=model.num_params(), init_hash=init_hash, data_hash=data_hash,
                        eval_tokens=(min(cfg["eval_tokens"], len(val)) - 1) // T * T, routing=routing))


def setup(cfg):
    """Device, dtype, distributed context: returns ctx."""
    world = int(os.environ.get("WORLD_SIZE", 1))
    rank, local_rank = int(os.environ.get("RANK", 0)), int(os.environ.get("LOCAL_RANK", 0))
    device = cfg["device"]
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "mps" if torch.backends.mps.is_available() else "cpu"
    if device == "cuda" and world > 1:
        device = f"cuda:{local_rank}"
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
    dtype = cfg["dtype"]
    if dtype == "auto":
        dtype = "bfloat16" if device.startswith("cuda") and torch.cuda.is_bf16_supported() else "float32"
    if dtype not in ("bfloat16", "float32"):
        raise ConfigError(f"dtype={dtype!r}: choose auto, bfloat16 or float32")
    autocast = torch.autocast(device.split(":")[0], dtype=torch.bfloat16) if dtype == "bfloat16" else nullcontext()
    peak = None
    if device.startswith("cuda") and dtype == "bfloat16":
        name = torch.cuda.get_device_name()
        peak = next((v for k, v in PEAK_FLOPS.items() if k in name), None)
    return dict(world=world, rank=rank, local_rank=local_rank, device=device, autocast=autocast, peak_flops=peak)


def check_config(cfg, world):
    if not cfg["arms"]:
        raise ConfigError("arms is empty; give at least one arm, e.g. arms = {'standard': {}}")
    for arm, settings in cfg["arms"].items():
        if not isinstance(settings, dict) or set(settings) - set(MODEL_KEYS):
            raise ConfigError(f"arm {arm!r}: settings must be a dict of model keys ({', '.join(MODEL_KEYS)})")
        try:
            model_config(cfg, settings)
        except ValueError as e:
            raise ConfigError(f"arm {arm!r}: {e}") from None
    if cfg["gradient_accumulation_steps"] < 1 or cfg["gradient_accumulation_steps"] % world != 0:
        raise ConfigError(f"gradient_accumulation_steps={cfg['gradient_accumulation_steps']} must be a positive "
                          f"multiple of the world size {world}")
    if cfg["lr_schedule"] not in ("cosine", "wsd"):
        raise ConfigError(f"lr_schedule={cfg['lr_schedule']!r}: choose cosine or wsd")
    if cfg["reference_arm"] and cfg["reference_arm"] not in cfg["arms"]:
        raise ConfigError(f"reference_arm={cfg['reference_arm']!r} is not an arm ({', '.join(cfg['arms'])})")


def find_shards(cfg, ctx):
    """Validation shard and train shard paths; the bundled corpus is prepared on demand."""
    data_dir = cfg["data_dir"]
    if os.path.abspath(data_dir) == BUNDLED_OUT and not os.path.exists(os.path.join(data_dir, "manifest.json")):
        if ctx["rank"] == 0:
            prepare_bundled(data_dir)
        if ctx["world"] > 1:
            dist.barrier()
    if not os.path.isdir(data_dir):
        raise DataError(f"data_dir {data_dir} does not exist; create it with data/prepare.py")
    names = sorted(os.listdir(data_dir))
    val = [n for n in names if n.startswith("val_") and n.endswith(".bin")]
    train = [os.path.join(data_dir, n) for n in names if n.startswith("train_") and n.endswith(".bin")]
    if len(val) != 1 or not train:
        raise DataError(f"data_dir {data_dir} needs one val_*.bin and at least one train_*.bin shard "
                        f"(found {len(val)} and {len(train)}); create them with data/prepare.py")
    return os.path.join(data_dir, val[0]), train


def main(argv):
    cfg = configure(DEFAULTS, argv)
    ctx = setup(cfg)
    check_config(cfg, ctx["world"])
    val_path, train_paths = find_shards(cfg, ctx)
    val = open_shard(val_path)
    if (len(val) - 1) // cfg["block_size"] == 0:
        raise DataError(f"{val_path} holds fewer than block_size+1 tokens")
    for path in train_paths:
        open_shard(path)  # validate every shard before any training
    if ctx["rank"] == 0:
        os.makedirs(cfg["out_dir"], exist_ok=True)
        write_json(os.path.join(cfg["out_dir"], "config.json"), cfg)
    for seed in cfg["seeds"]:
        for arm in cfg["arms"]:
            train_cell(arm, seed, cfg, train_paths, val, ctx)
    if ctx["world"] > 1:
        dist.barrier()
        dist.destroy_process_group()
    if ctx["rank"] == 0:
        import report
        report.main([cfg["out_dir"]] + ([f"--reference={cfg['reference_arm']}"] if cfg["reference_arm"] else []))


if __name__ == "__main__":
    try:
        main(sys.argv[1:])
    except (ConfigError, DataError) as e:
        sys.exit(f"error: {e}")
