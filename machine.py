"""
Where a process trains: its place among the torchrun processes, its device and precision, whether the
model is compiled, and FSDP2's sharding. train.py, analyze.py, bench.py and downstream.py set up
through setup(). Part of the recorded code (records.CODE_FILES): TF32 and the deterministic CPU
kernels change what a cell computes.
"""

import dataclasses
import os
import platform
import sys
import traceback
from contextlib import contextmanager, nullcontext

import torch
import torch._functorch.config
import torch._inductor.config
import torch.distributed as dist
from torch.distributed.fsdp import fully_shard, register_fsdp_forward_method

from common import ConfigError


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
PEAK_FLOPS = {
    "H100": 989e12,
    "H200": 989e12,
    "H800": 989e12,
    "B200": 2250e12,
    "A100": 312e12,
    "A800": 312e12,
    "L40S": 362e12,
    "L4": 121e12,
    "A10G": 125e12,
    "RTX 4090": 165e12,
    "RTX 3090": 71e12,
}


def setup(cfg):
    """The Runtime of this process from cfg's device, dtype and fsdp (and torchrun's environment)."""
    world = int(os.environ.get("WORLD_SIZE", 1))
    rank, local_rank = int(os.environ.get("RANK", 0)), int(os.environ.get("LOCAL_RANK", 0))
    device = resolve_device(
        cfg["device"], world, local_rank, torch.cuda.device_count(), torch.backends.mps.is_available()
    )
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
    return Runtime(
        world=world,
        rank=rank,
        local_rank=local_rank,
        device=device,
        dtype=dtype,
        autocast=autocast,
        peak_flops=peak,
        fsdp=cfg["fsdp"],
    )


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
        raise ConfigError(
            f"device={requested!r} names one GPU for {world} processes; use --device=cuda "
            f"(each process takes cuda:LOCAL_RANK)"
        )
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


# AOTAutograd's cache will not store a graph that switches autocast, as most routed schemes do (their routing in fp32),
# nor one that applies a custom autograd Function (AttnRes's and RD-AttnRes's OnlineSoftmaxStep). So each compiled
# cell of those schemes traced and partitioned its graphs again after cells.open_cell's dynamo reset: 50-58 s a cell
# in the compiled leaderboard grid, where `standard`'s, which the cache keeps, took 5 s. Both are nodes of the graph
# the cache keys on, with their arguments and the Function's traced forward and backward, so a hit is this same graph
# compiled: allowing them changes no number (tests/test_train.py, AttnRes on a CPU), only how often a worker compiles.
# These two settings and nothing else (tests/test_machine.py): this definition is declared non-computing.
def cache_routed_graphs():
    torch._functorch.config.autograd_cache_allow_custom_autograd_functions = True
    marked = {f"torch.amp.autocast_mode.{name}": torch.__version__ for name in ("_enter_autocast", "_exit_autocast")}
    torch._inductor.config.unsafe_marked_cacheable_functions.update(marked)
    return marked


ROUTED_GRAPHS_CACHED = cache_routed_graphs()  # on import: every process that trains or benches imports this file


def cpu_threads(runtime):
    """The CPU threads this process computes with, said on rank 0; and a warning when the machine
    is busier than its cores (threads then wait on each other: 2 threads on 2 busy cores ran 13x slower)."""
    threads = torch.get_num_threads()
    if runtime.master:
        print(f"cpu: {threads} thread(s) per process (set with OMP_NUM_THREADS)")
        load, cores = os.getloadavg()[0], os.cpu_count()
        if load > cores:  # one thread is the advice; with one already, only fewer processes help
            way_on = (
                "with OMP_NUM_THREADS=1 it waits least"
                if threads > 1
                else "it computes with one thread already: run fewer processes at once, or wait for a quieter machine"
            )
            print(
                f"warning: this machine's load ({load:.1f}) exceeds its {cores} cores: training will be slow; {way_on}"
            )
    return threads


# instruction sets whose kernels round differently (fused multiply-add, wider vectors, matrix units): a CPU flag
# that begins with one of these joins the machine record
ROUNDING_FLAGS = ("avx2", "avx512", "fma", "amx")


def machine_record(runtime):
    """Where this process computes, as provenance (recorded in each result, never a setting that refuses
    pairing: another machine rounds differently, it computes the same thing): the CPU model and its
    rounding-relevant instruction sets, the kernels torch dispatches to on it, the GPU, the torch build."""
    cpu, flags = platform.processor() or platform.machine(), []
    try:
        with open("/proc/cpuinfo") as f:
            info = {
                k.strip(): v.strip() for k, v in (line.split(":", 1) for line in f if ":" in line)
            }  # the last core's
        cpu = info.get("model name", cpu)
        flags = sorted(flag for flag in info.get("flags", "").split() if flag.startswith(ROUNDING_FLAGS))
    except OSError:  # not Linux: the platform's name alone
        pass
    gpu = torch.cuda.get_device_name(runtime.device) if runtime.device.startswith("cuda") else None
    return dict(
        cpu=cpu,
        cpu_flags=flags,
        cpu_capability=torch.backends.cpu.get_cpu_capability(),
        gpu=gpu,
        torch=str(torch.__version__),
        torch_git=torch.version.git_version,
        cuda=torch.version.cuda,
    )


def apply_fsdp(model):
    """FSDP2 over the processes: each sublayer's weights a unit (the scheme calls attention and MLP
    apart, so they are gathered apart), then the root with the rest (embedding, norms, routing)."""
    for block in model.transformer.h:
        fully_shard(block.attn)
        fully_shard(block.mlp)
    fully_shard(model)
    register_fsdp_forward_method(model, "routing_diagnostics")  # gathers the root's weights, as forward does


@contextmanager
def exit_without_finalizing():
    """
    Around a script's main: under torchrun (WORLD_SIZE > 1) the process ends with os._exit, its
    output flushed and its exit status as sys.exit gives it, instead of through Python's interpreter
    finalization; alone, as usual. Why: FSDP2 keeps the gloo process group alive past
    destroy_process_group (its transport thread and two worker threads run on, measured), and a C++
    thread that takes the GIL while the interpreter finalizes is ended by force (pthread_exit, which
    unwinds); met by C++ code that cannot unwind, that is std::terminate: 'terminate called without an
    active exception', SIGABRT, at random, more often on a busy machine (2-rank FSDP tests, issue #46).
    """
    if int(os.environ.get("WORLD_SIZE", 1)) < 2:
        yield
        return
    status = 0
    try:
        yield
    except SystemExit as e:  # sys.exit(None | int | message), as the interpreter would end with it
        status = e.code if isinstance(e.code, int) else 0 if e.code is None else 1
        if not isinstance(e.code, (int, type(None))):
            print(e.code, file=sys.stderr)
    except BaseException:  # a traceback, as without this
        traceback.print_exc()
        status = 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)
