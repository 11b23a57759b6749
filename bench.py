"""
Speed and memory of every residual variant against `standard`, or of data preparation.

$ python bench.py                        # the CPU reference shape: 12 layers, d=384, 6 heads, T=256, B=4
$ python bench.py --n_embd=768 --n_head=12 --block_size=1024 --batch_size=16   # 120m shape on a GPU
$ python bench.py --mode=prepare [--copies=40]   # data/prepare.py tokens/s against single-core tiktoken x cores

Model mode, per variant (the `moe` row: standard with 8 experts, top-2, at the dense MLP's active
FLOPs): parameters, all and active (one token's; MoE: k of E experts), median ms per training step
(forward, backward, AdamW step, the MoE balancing-bias update) and tokens/s;
the time ratio to `standard` measured in alternating rounds (standard, variant, standard, ...:
only interleaved ratios survive a machine whose speed drifts); bytes saved for backward by one
training step (unique storages seen by torch.autograd.graph.saved_tensors_hooks, in eager mode:
the same on any device) and their ratio to `standard`; peak memory (CUDA max_memory_allocated,
or the peak RSS of a fresh subprocess on CPU - noisy); MFU on GPUs with a known peak; on CUDA,
the bytes an eager forward leaves allocated for backward without and with activation
checkpointing (fwd, ckpt). Takes train.py's --key=value overrides (model shape, batch_size,
block_size, device, dtype, compile).
compile_s is the time to build, compile and warm up (3 steps) a variant: with a warm inductor
cache it is mostly the warm-up; --compile_only=True stops there.
"""

import glob
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time

import torch

import machine
import records
import train
from common import ConfigError, DataError, check_writable, run, write_json
from configurator import configure
from model import GPT, RESIDUALS

VARIANTS = {}  # one row per scheme in model.RESIDUALS at its defaults; AttnRes in its Full and Block forms; MoE
for name in RESIDUALS:
    if name == "attnres":
        VARIANTS |= dict(attnres_full=dict(residual=name, attnres_block_size=1), attnres_block=dict(residual=name))
    else:
        VARIANTS[name] = dict(residual=name)
VARIANTS["moe"] = dict(n_experts=8, moe_top_k=2)  # standard under a sparse MoE MLP at the dense MLP's active FLOPs
# every train.py key, so every GPTConfig field, is a bench key
BENCH_DEFAULTS = dict(
    train.DEFAULTS,
    n_layer=12,
    n_embd=384,
    n_head=6,
    block_size=256,
    batch_size=4,
    vocab_size=50304,
    compile=True,
    dtype="bfloat16",
    mode="model",
    variants=list(VARIANTS),
    rounds=5,
    steps=5,
    peak_mem=True,
    out="bench.json",
    input="",
    copies=40,
    one_variant="",
    compile_only=False,
)


def variant_config(cfg, name):
    """A row's GPTConfig: the run's model keys, a scheme's own options (--hc_streams=2) for its rows only."""
    try:
        return records.model_config(cfg, VARIANTS[name])
    except ValueError as e:
        raise ConfigError(f"{name}: {e}") from None


def setup_variant(name, cfg, device, autocast):
    """A model, its optimizer and a compiled training step for one variant."""
    torch.manual_seed(0)
    model = GPT(variant_config(cfg, name)).to(device)
    optimizer = model.configure_optimizers(0.1, 1e-4, (0.9, 0.95), device.split(":")[0])
    forward = torch.compile(model) if cfg["compile"] else model
    g = torch.Generator().manual_seed(0)
    shape = cfg["batch_size"], cfg["block_size"]
    x, y = (torch.randint(0, model.config.vocab_size, shape, generator=g).to(device) for _ in range(2))

    def step():
        with autocast:
            _, loss = forward(x, y)
        loss.backward()
        optimizer.step()
        model.update_expert_bias()  # MoE: as train.py steps it
        optimizer.zero_grad(set_to_none=True)

    return model, step, (x, y)


def sync(device):
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def timed(step, n, device):
    sync(device)
    t0 = time.perf_counter()
    for _ in range(n):
        step()
    sync(device)
    return (time.perf_counter() - t0) / n


def saved_bytes(model, batch, autocast):
    """Bytes of the unique storages autograd saves for backward in one eager training step."""
    storages = {}

    def pack(t):
        s = t.untyped_storage()
        storages[s.data_ptr()] = s.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), autocast:
        _, loss = model(*batch)
    loss.backward()
    model.zero_grad(set_to_none=True)
    return sum(storages.values())


def forward_memory(model, batch, autocast, device, checkpointing):
    """CUDA bytes an eager training forward leaves allocated for its backward, with or without
    activation checkpointing; None off CUDA (no allocator statistics there, and saved_tensors_hooks
    cannot see into checkpointed regions)."""
    if not device.startswith("cuda"):
        return None
    model.activation_checkpointing = checkpointing
    sync(device)
    before = torch.cuda.memory_allocated()
    with autocast:
        _, loss = model(*batch)
    sync(device)
    held = torch.cuda.memory_allocated() - before
    loss.backward()
    model.zero_grad(set_to_none=True)
    model.activation_checkpointing = False
    return held


def peak_memory(name, cfg, argv, device, step):
    if device.startswith("cuda"):
        torch.cuda.reset_peak_memory_stats()
        step()
        sync(device)
        return torch.cuda.max_memory_allocated()
    if not cfg["peak_mem"]:
        return None
    # a fresh process per variant: ru_maxrss never goes down, so one process cannot measure several
    proc = subprocess.run([sys.executable, __file__, *argv, f"--one_variant={name}"], capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"peak-memory subprocess for {name} failed: {proc.stderr.strip().splitlines()[-1]}")
    return int(proc.stdout.strip().splitlines()[-1])


def bench_models(cfg, argv):
    """measure_models with every variant kept compiled: dynamo keeps one graph of GPT.forward per scheme, and past its
    limit (8 by default) it falls back to eager silently (measured: the 9th variant's "compile" took 1.7 s and its
    step ran eager); so a limit for them all, and an error, not eager, past it (for this benchmark only)."""
    limit = max(torch._dynamo.config.recompile_limit, 2 * (len(cfg["variants"]) + 1))
    with torch._dynamo.config.patch(recompile_limit=limit, fail_on_recompile_limit_hit=True):
        return measure_models(cfg, argv)


def measure_models(cfg, argv):
    runtime = machine.setup(cfg)
    device, autocast = runtime.device, runtime.autocast
    if cfg["one_variant"]:  # the peak-RSS subprocess
        _, step, _ = setup_variant(cfg["one_variant"], cfg, device, autocast)
        for _ in range(3):
            step()
        print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)  # Linux reports KiB
        return
    names = ["standard"] + [v for v in cfg["variants"] if v != "standard"]
    if cfg["compile_only"]:  # warm the compile cache (gpu_check.py: one process per variant, all at once)
        names = cfg["variants"]
    print(
        f"device {device}, dtype {cfg['dtype']}, compile {cfg['compile']}, {cfg['n_layer']} layers, "
        f"d={cfg['n_embd']}, T={cfg['block_size']}, B={cfg['batch_size']}"
    )
    setups, ready_s = {}, {}
    for name in names:
        t0 = time.perf_counter()
        model, step, batch = setup_variant(name, cfg, device, autocast)
        for _ in range(3):  # compile and warm up
            step()
        sync(device)
        setups[name], ready_s[name] = (model, step, batch), time.perf_counter() - t0
        print(f"  {name}: compiled and warmed up in {ready_s[name]:.1f}s")
    if cfg["compile_only"]:
        return [dict(variant=name, compile_s=ready_s[name]) for name in names]
    times = {name: [] for name in names}
    ratios = {name: [] for name in names}
    for _ in range(cfg["rounds"]):
        if len(names) == 1:  # standard alone: nothing to interleave with
            times["standard"].append(timed(setups["standard"][1], cfg["steps"], device))
        for name in names[1:]:  # standard, variant, standard, variant, ...
            t_std = timed(setups["standard"][1], cfg["steps"], device)
            t_var = timed(setups[name][1], cfg["steps"], device)
            times["standard"].append(t_std)
            times[name].append(t_var)
            ratios[name].append(t_var / t_std)
    tokens = cfg["batch_size"] * cfg["block_size"]
    rows = []
    for name in names:
        model, step, batch = setups[name]
        ms = 1000 * statistics.median(times[name])
        rows.append(
            dict(
                variant=name,
                params=model.num_params(non_embedding=False),
                active_params=model.num_params(non_embedding=False, active=True),
                compile_s=ready_s[name],
                ms_per_step=ms,
                tokens_per_s=tokens / ms * 1000,
                time_ratio=statistics.median(ratios[name]) if ratios[name] else 1.0,
                saved_bytes=saved_bytes(model, batch, autocast),
                forward_bytes=forward_memory(model, batch, autocast, device, False),
                forward_bytes_checkpointed=forward_memory(model, batch, autocast, device, True),
                peak_mem_bytes=peak_memory(name, cfg, argv, device, step),
                mfu=model.flops_per_token(cfg["block_size"]) * tokens / (ms / 1000) / runtime.peak_flops
                if runtime.peak_flops
                else None,
            )
        )
    # what made the numbers, in every row (dev/leaderboard.py --cost refuses rows of another shape)
    made = dict(
        {k: cfg[k] for k in ("n_layer", "n_head", "n_embd", "block_size", "batch_size", "vocab_size", "dtype")},
        compile=cfg["compile"],
        device=device,
        machine=machine.machine_record(runtime),
        code=records.code_record()["git_commit"],
    )
    for r in rows:
        r["mem_ratio"] = r["saved_bytes"] / rows[0]["saved_bytes"]
        r["made"] = made
    print(
        f"{'variant':<15}{'params M':>10}{'active M':>10}{'ms/step':>10}{'tok/s':>10}{'time x':>9}{'saved MiB':>11}"
        f"{'saved x':>9}{'peak MiB':>10}{'MFU':>7}{'fwd MiB':>9}{'ckpt MiB':>10}"
    )
    mib = lambda b: f"{b / 2**20:.0f}" if b else "-"
    for r in rows:
        mfu = f"{100 * r['mfu']:.1f}%" if r["mfu"] else "-"
        print(
            f"{r['variant']:<15}{r['params'] / 1e6:>10.2f}{r['active_params'] / 1e6:>10.2f}{r['ms_per_step']:>10.1f}{r['tokens_per_s']:>10,.0f}{r['time_ratio']:>9.3f}"  # noqa: E501
            f"{r['saved_bytes'] / 2**20:>11.1f}{r['mem_ratio']:>9.3f}{mib(r['peak_mem_bytes']):>10}{mfu:>7}"
            f"{mib(r['forward_bytes']):>9}{mib(r['forward_bytes_checkpointed']):>10}"
        )
    return rows


def bench_prepare(cfg):
    """data/prepare.py end to end on local parquet, against single-core tiktoken x cores."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from data import prepare as P, shards as S

    with tempfile.TemporaryDirectory() as tmp:
        pattern = cfg["input"]
        if not pattern:  # the bundled corpus cut into ~4,000-character documents (about FineWeb-Edu's
            # average of ~1,000 tokens), one parquet file per copy: 1.57M tokens each
            corpus = "".join(
                open(f, encoding="utf-8").read() for f in sorted(glob.glob(os.path.join(P.BUNDLED_CORPUS, "*.txt")))
            )
            texts = [corpus[i : i + 4000] for i in range(0, len(corpus), 4000)]
            for i in range(cfg["copies"]):
                pq.write_table(
                    pa.table({"text": texts}), os.path.join(tmp, f"part{i:04d}.parquet"), row_group_size=1024
                )
            pattern = os.path.join(tmp, "*.parquet")
        texts = []
        for path in sorted(glob.glob(pattern)):
            try:
                texts += pq.read_table(path, columns=["text"]).column(0).to_pylist()
            except (pa.ArrowException, OSError) as e:
                raise DataError(
                    f"{path}: not a parquet file with a text column ({str(e).splitlines()[0]}); "
                    f"give --input a glob of such files"
                ) from None
        enc = S.gpt2_tokenizer()

        def single_core_rate():
            t0 = time.perf_counter()
            return sum(len(enc.encode_ordinary(t)) for t in texts) / (time.perf_counter() - t0)

        workers = os.cpu_count()
        before = single_core_rate()
        # the command line as a user runs it: a process of its own, whose workers do not import bench's torch
        out = os.path.join(tmp, "out")
        t0 = time.perf_counter()
        proc = subprocess.run(
            [
                sys.executable,
                os.path.join(P.HERE, "prepare.py"),
                f"--input={pattern}",
                f"--out_dir={out}",
                "--val_tokens=1e5",
                f"--workers={workers}",
            ],
            capture_output=True,
            text=True,
        )
        elapsed = time.perf_counter() - t0
        if proc.returncode != 0:
            raise DataError(
                f"data/prepare.py failed on {pattern}: "
                f"{(proc.stderr.strip().splitlines() or ['?'])[-1].removeprefix('error: ')}"
            )
        with open(os.path.join(out, "manifest.json")) as f:
            manifest = json.load(f)
        rate = manifest["total_tokens"] / elapsed
        single = (before + single_core_rate()) / 2  # measured before and after: the machine's speed drifts
    ideal = single * workers
    print(f"{manifest['total_tokens']:,} tokens from {len(texts):,} documents")
    print(f"single-core tiktoken: {single:,.0f} tok/s; x {workers} cores = {ideal:,.0f} tok/s")
    print(f"data/prepare.py with {workers} workers, end to end: {rate:,.0f} tok/s = {100 * rate / ideal:.0f}% of that")
    return [
        dict(
            mode="prepare",
            tokens=manifest["total_tokens"],
            single_core_tokens_per_s=single,
            workers=workers,
            tokens_per_s=rate,
            fraction_of_ideal=rate / ideal,
        )
    ]


def check_bench(cfg):
    """One line for each setting that cannot run, before anything is measured; the variants without repeats."""
    if cfg["mode"] not in ("model", "prepare"):
        raise ConfigError(f"mode={cfg['mode']!r}: choose model or prepare")
    for key in ("rounds", "steps", "batch_size", "copies"):
        if cfg[key] < 1:
            raise ConfigError(f"{key}={cfg[key]} must be at least 1")
    if cfg["mode"] == "prepare":
        if cfg["input"] and not glob.glob(cfg["input"]):
            raise ConfigError(f"input={cfg['input']} matches no file; give a glob of parquet files with a text column")
        return
    cfg["variants"] = list(dict.fromkeys(cfg["variants"]))  # a variant named twice is one row
    if not cfg["variants"]:
        raise ConfigError(f"variants is empty; give one or more of {', '.join(VARIANTS)}")
    unknown = [v for v in cfg["variants"] + ([cfg["one_variant"]] if cfg["one_variant"] else []) if v not in VARIANTS]
    if unknown:
        raise ConfigError(f"unknown variants {', '.join(map(repr, unknown))}; choose from {', '.join(VARIANTS)}")
    for name in ["standard"] + cfg["variants"]:  # a bad model setting now, not after the other variants compiled
        variant_config(cfg, name)


def check_out(path):
    """An --out that cannot be written fails before the benchmark, not after it."""
    if os.path.isdir(path):
        raise ConfigError(f"out={path} is a folder; give a file name, e.g. --out={os.path.join(path, 'bench.json')}")
    check_writable(os.path.dirname(os.path.abspath(path)), f"give --out={path} a path in a writable folder")


def main(argv):
    cfg = configure(BENCH_DEFAULTS, argv)
    check_bench(cfg)
    if not cfg["one_variant"]:  # the peak-RSS subprocess prints its number and writes nothing
        check_out(cfg["out"])
    rows = bench_prepare(cfg) if cfg["mode"] == "prepare" else bench_models(cfg, argv)
    if rows is not None:
        write_json(cfg["out"], rows)
        print(f"wrote {cfg['out']}")


if __name__ == "__main__":
    run(main)
