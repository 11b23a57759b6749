"""
The GPU check: everything a machine with one GPU should show, in about 8 minutes on an H100/H200,
written into one folder (gpu_check.json, gpu_check.log and what each step wrote).

$ python gpu_check.py                    # -> gpu_check/
$ python gpu_check.py --out=runs/h200    # another folder
$ python gpu_check.py --dry_run          # the same steps at a tiny shape on the CPU (minutes)

Steps: (1) tests/test_cuda.py; (2) each benchmarked variant compiled once at the 120m shape in its
own process, all at once (cold compiles are single-threaded, so this fills the machine's cores
and fills the inductor cache; each variant's cold compile time is recorded); (3) bench.py at the
120m shape for standard, attnres_block, rd_attnres and dar, interleaved, on the warm cache;
(4) a 40-step single-GPU training smoke of config/rd_120m.py on the bundled corpus: ms/step, MFU
and evaluation seconds; (5) the MoE expert paths (moe_paths): the grouped path against the loop.
After (3) the log shows the GPU speed table of the README, targets beside.
"""

import json
import os
import shutil
import subprocess
import sys
import time

from common import write_json

HERE = os.path.dirname(os.path.abspath(__file__))
VARIANTS = ["standard", "attnres_block", "rd_attnres", "dar"]
SHAPE = ["--n_layer=12", "--n_embd=768", "--n_head=12", "--block_size=1024", "--batch_size=32"]
TINY = ["--n_layer=2", "--n_embd=64", "--n_head=2", "--block_size=64", "--batch_size=2", "--device=cpu"]


def start(name, argv, out):
    """One step as a subprocess writing its output to out/name.log."""
    log = open(os.path.join(out, f"{name}.log"), "w")
    return subprocess.Popen(
        [sys.executable, *argv], cwd=HERE, stdout=log, stderr=subprocess.STDOUT
    ), time.perf_counter()


def finish(name, started, timeout, summary, log):
    """Wait for a step (at most timeout seconds from its start); record and log how it went."""
    proc, t0 = started
    try:
        rc = proc.wait(timeout=None if timeout is None else max(1, timeout - (time.perf_counter() - t0)))
    except subprocess.TimeoutExpired:
        proc.kill()
        rc = "timeout"
    seconds = time.perf_counter() - t0
    summary["steps"][name] = dict(ok=rc == 0, seconds=round(seconds, 1))
    log(f"{name}: {'ok' if rc == 0 else f'FAILED ({rc})'} in {seconds:.0f}s - see {name}.log")
    return rc == 0


def speed_table(records, cold_compile_s):
    """The GPU speed issue's table (markdown) from bench.py's records, with its targets."""
    rows = {r["variant"]: r for r in records}
    target = dict(
        standard="MFU >= 45%",
        attnres_block="<= 1.06x / <= 1.10x",
        rd_attnres="<= 1.02x attnres_block",
        dar="<= 1.30x / <= 1.30x",
    )
    lines = [
        "| variant | ms/step | time x standard | saved x standard | MFU | cold compile (<= 60 s) | target |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, r in rows.items():
        time_x = f"{r['time_ratio']:.3f}"
        if name == "rd_attnres" and "attnres_block" in rows:
            time_x += f" ({r['time_ratio'] / rows['attnres_block']['time_ratio']:.3f}x attnres_block)"
        mfu = f"{100 * r['mfu']:.1f}%" if r.get("mfu") else "-"
        compile_s = cold_compile_s.get(name)
        lines.append(
            f"| {name} | {r['ms_per_step']:.1f} | {time_x} | {r['mem_ratio']:.3f} | {mfu} | "
            f"{'-' if compile_s is None else f'{compile_s:.0f} s'} | {target.get(name, '')} |"
        )
    return lines


def moe_paths(device="cuda", d=768, hidden=1536, experts=8, top_k=2, tokens=32 * 1024, steps=10):
    """
    One MoE layer at the 120m width (8 experts of width 1536, top-2: the dense MLP's active FLOPs),
    32 x 1024 tokens, bf16 autocast: the grouped path (grouped_mm; compiled fullgraph, so a graph
    break fails loudly) against the per-expert loop - output and gradients (of the input and of every
    expert weight), relative errors - and ms per forward + backward of each; then the whole layer as
    training runs it (compiled: routing, the path forward() chooses) beside the dense MLP (compiled).
    """
    import torch
    from model import MLP, GPTConfig, MoE

    sync = torch.cuda.synchronize if device == "cuda" else lambda: None

    def ms_per_call(fn):
        for _ in range(3):
            fn()
        sync()
        t0 = time.perf_counter()
        for _ in range(steps):
            fn()
        sync()
        return round((time.perf_counter() - t0) / steps * 1000, 3)

    torch.manual_seed(0)
    layer = MoE(GPTConfig(n_embd=d, n_head=d // 64, n_experts=experts, moe_top_k=top_k, moe_expert_hidden=hidden)).to(
        device
    )
    dense = MLP(GPTConfig(n_embd=d, n_head=d // 64)).to(device)  # width 4d = top_k * hidden at the defaults
    x = torch.randn(tokens, d, device=device, requires_grad=True)
    chosen, _, _ = layer.route(x)
    load = torch.zeros(experts, dtype=torch.long, device=device).scatter_add_(
        0, chosen.flatten(), torch.ones_like(chosen.flatten())
    )
    upstream = torch.randn(tokens, top_k, d, device=device)
    inputs = [x] + [p for e in layer.experts for p in e.parameters()]
    with torch.autocast(device, dtype=torch.bfloat16):
        result = dict(grouped_chosen=layer.grouped(x))  # what MoE.forward runs here
    runs = {}
    for name, path in (
        ("loop", layer.experts_loop),
        ("grouped", torch.compile(layer.experts_grouped, fullgraph=True, dynamic=False)),
    ):

        def step():
            with torch.autocast(device, dtype=torch.bfloat16):
                y = path(x, chosen, load).float()
            return y, torch.autograd.grad((y * upstream).sum(), inputs)

        try:
            runs[name] = step()
        except RuntimeError as e:  # a CPU (--dry_run) whose torch has no grouped_mm kernel there
            if device == "cuda" or name == "loop":
                raise
            result["grouped_skipped"] = str(e).splitlines()[0]
            break
        result[f"{name}_ms"] = ms_per_call(step)
    for name, module in (("moe_layer", layer), ("dense_mlp", dense)):
        compiled = torch.compile(module)

        def step():
            with torch.autocast(device, dtype=torch.bfloat16):
                y = compiled(x).float()
            torch.autograd.grad((y * upstream[:, 0]).sum(), [x, *module.parameters()])

        result[f"{name}_ms"] = ms_per_call(step)
    rel = lambda a, b: ((a - b).norm() / b.norm()).item()
    if "grouped" in runs:
        (y_g, g_g), (y_l, g_l) = runs["grouped"], runs["loop"]
        result["output_rel_err"] = rel(y_g, y_l)
        result["grad_rel_err"] = dict(
            x=rel(g_g[0], g_l[0]),
            experts=rel(torch.cat([g.flatten() for g in g_g[1:]]), torch.cat([g.flatten() for g in g_l[1:]])),
        )
    # both bf16 with fp32 accumulation: they differ by rounding only (a wrong sort is off by O(1))
    close = "grouped" not in runs or (result["output_rel_err"] < 1e-2 and max(result["grad_rel_err"].values()) < 2e-2)
    result["ok"] = close and (result["grouped_chosen"] or device != "cuda")
    return result


def moe_step(path, dry):
    """Step (5) in a process of its own: moe_paths on the GPU (--dry_run: a tiny layer on the CPU) into path."""
    small = dict(device="cpu", d=64, hidden=128, tokens=512, steps=2) if dry else {}
    result = moe_paths(**small)
    write_json(path, result)
    print(json.dumps(result))
    return 0 if result["ok"] else 1


def main(argv):
    dry = "--dry_run" in argv
    out = next((a.split("=", 1)[1] for a in argv if a.startswith("--out=")), "gpu_check")
    unknown = [a for a in argv if a != "--dry_run" and not a.startswith("--out=")]
    if unknown:
        sys.exit(f"error: unknown arguments {' '.join(unknown)}; usage: python gpu_check.py [--out=DIR] [--dry_run]")
    out = os.path.abspath(out)
    os.makedirs(out, exist_ok=True)
    shape = TINY if dry else SHAPE
    logfile = open(os.path.join(out, "gpu_check.log"), "w")

    def log(line):
        print(line, flush=True)
        logfile.write(line + "\n")
        logfile.flush()

    import torch

    if not dry and not torch.cuda.is_available():
        sys.exit("error: no CUDA GPU here; run on a GPU machine, or try the steps on CPU with --dry_run")
    summary = dict(
        device=torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
        torch=torch.__version__,
        dry_run=dry,
        steps={},
    )
    log(f"GPU check on {summary['device']}, torch {summary['torch']}, into {out}")
    t_start = time.perf_counter()

    # (1) and (2) at once: the tests need the GPU for seconds at a time, the compiles need CPU cores
    # time caps keep the GPU check inside its 8 minutes; a --dry_run on a busy CPU takes what it takes
    cap = lambda seconds: None if dry else seconds
    running = {
        "cuda_tests": start(
            "cuda_tests",
            ["-m", "pytest", "tests/test_cuda.py", "-q", f"--junitxml={os.path.join(out, 'cuda_tests.xml')}"],
            out,
        )
    }
    for v in VARIANTS:
        running[f"compile_{v}"] = start(
            f"compile_{v}",
            [
                "bench.py",
                *shape,
                f"--variants={v}",
                "--compile_only=True",
                f"--out={os.path.join(out, f'compile_{v}.json')}",
            ],
            out,
        )
    for name, started in running.items():
        finish(name, started, cap(300), summary, log)
    summary["cold_compile_s"] = {}
    for v in VARIANTS:
        path = os.path.join(out, f"compile_{v}.json")
        if os.path.exists(path):
            summary["cold_compile_s"][v] = json.load(open(path))[0]["compile_s"]
    log(f"cold compile seconds (in parallel, one process each): {summary['cold_compile_s']}")

    # (3) the interleaved benchmark on the warm cache
    bench_json = os.path.join(out, "bench.json")
    bench = [
        "bench.py",
        *shape,
        f"--variants={','.join(VARIANTS)}",
        "--rounds=1" if dry else "--rounds=6",
        "--steps=2" if dry else "--steps=10",
        "--peak_mem=False" if dry else "--peak_mem=True",
        f"--out={bench_json}",
    ]
    if finish("bench", start("bench", bench, out), cap(240), summary, log):
        summary["bench"] = json.load(open(bench_json))
        for line in speed_table(summary["bench"], summary["cold_compile_s"]):
            log(line)

    # (4) 40 training steps of the RD-AttnRes 120m config on the bundled corpus, one GPU
    train_out = os.path.join(out, "train_smoke")
    shutil.rmtree(train_out, ignore_errors=True)  # a rerun of the check measures again, not "done already"
    smoke = [
        "train.py",
        "config/rd_120m.py",
        "--data_dir=data/shakespeare_gpt2",
        "--seeds=0",
        "--arms=rd_attnres",
        "--max_iters=40",
        "--gradient_accumulation_steps=1",
        "--warmup_iters=10",
        "--eval_interval=20",
        "--log_interval=10",
        "--eval_tokens=61441",  # 60 sequences of 1,024 and 60 for tuning between them: 120 of the 125 slots
        f"--out_dir={train_out}",
    ]
    if dry:
        smoke += [a for a in TINY if not a.startswith("--batch_size")] + [
            "--batch_size=2",
            "--eval_tokens=4096",
            "--max_iters=4",
            "--eval_interval=2",
            "--log_interval=1",
        ]
    finish("train_smoke", start("train_smoke", smoke, out), cap(240), summary, log)
    log_path = os.path.join(train_out, "rd_attnres", "seed0", "log.jsonl")
    if os.path.exists(log_path):
        records = []
        for line in open(log_path):
            try:
                records.append(json.loads(line))
            except ValueError:  # a line torn when the time cap stopped the smoke
                pass
        train_records = [r for r in records if "loss" in r][1:]  # the first interval includes the compile
        evals = [r for r in records if "val_loss" in r]
        summary["train_smoke"] = dict(
            ms_per_step=[round(r["ms_per_step"], 1) for r in train_records],
            mfu=[r.get("mfu") for r in train_records],
            val_loss=[round(r["val_loss"], 4) for r in evals],
            eval_s=[r.get("eval_s") for r in evals],
        )
        log(f"train smoke: {summary['train_smoke']}")

    # (5) the MoE expert paths: the grouped kernels that MoE training on CUDA runs, against the loop
    moe_json = os.path.join(out, "moe_paths.json")
    if os.path.exists(moe_json):  # a rerun of the check measures again: no earlier run's numbers
        os.remove(moe_json)
    moe = ["-c", f"import sys, gpu_check; sys.exit(gpu_check.moe_step({moe_json!r}, {dry!r}))"]
    finish("moe_paths", start("moe_paths", moe, out), cap(180), summary, log)
    if os.path.exists(moe_json):
        summary["moe_paths"] = json.load(open(moe_json))
        log(f"moe paths: {summary['moe_paths']}")
    summary["total_s"] = round(time.perf_counter() - t_start, 1)
    summary["ok"] = all(s["ok"] for s in summary["steps"].values())
    write_json(os.path.join(out, "gpu_check.json"), summary)
    log(
        f"{'all steps passed' if summary['ok'] else 'SOME STEPS FAILED'} in {summary['total_s']:.0f}s; "
        f"summary in {os.path.join(out, 'gpu_check.json')}"
    )
    sys.exit(0 if summary["ok"] else 1)


if __name__ == "__main__":
    main(sys.argv[1:])
