"""machine.py: which device a process trains on, the CPU thread count it says, and how a torchrun process ends;
conftest.torchrun's per-rank output."""

import os
import subprocess
import sys
from contextlib import nullcontext

import pytest
import torch

import machine
from common import ConfigError
from helpers import ROOT

ONE_PROCESS = machine.Runtime(
    world=1, rank=0, local_rank=0, device="cpu", dtype="float32", autocast=nullcontext(), peak_flops=None, fsdp=False
)
torch.set_num_threads(1)


@pytest.mark.parametrize(
    "requested, world, local_rank, cuda, mps, expected",
    [
        ("auto", 1, 0, 0, False, "cpu"),
        ("auto", 1, 0, 0, True, "mps"),
        ("auto", 1, 0, 1, True, "cuda:0"),  # one process: an indexed device, as torch.cuda.set_device needs
        ("auto", 4, 3, 8, False, "cuda:3"),  # torchrun: the process's own GPU
        ("cuda", 1, 0, 2, False, "cuda:0"),
        ("cuda", 1, 1, 2, False, "cuda:1"),  # torchrun --nproc_per_node=1 on a later local rank
        ("cuda", 2, 1, 2, False, "cuda:1"),
        ("cuda:1", 1, 0, 2, False, "cuda:1"),
        ("cpu", 1, 0, 8, True, "cpu"),
        ("cpu", 2, 1, 0, False, "cpu"),
        ("mps", 1, 0, 0, True, "mps"),
        ("cuda", 1, 0, 0, False, "sees no CUDA GPU"),
        ("cuda:0", 1, 0, 0, True, "sees no CUDA GPU"),
        ("cuda:1", 2, 0, 2, False, "names one GPU for 2 processes"),
        ("cuda:2", 1, 0, 2, False, "cuda:2 does not exist"),
        ("cuda", 4, 3, 2, False, "cuda:3 does not exist"),
        ("mps", 1, 0, 1, False, "sees no MPS device"),
        ("gpu", 1, 0, 1, False, "choose auto, cpu, cuda, cuda:N or mps"),
        ("cpu:0", 1, 0, 1, False, "choose auto, cpu, cuda, cuda:N or mps"),
        ("cuda:x", 1, 0, 1, False, "choose auto, cpu, cuda, cuda:N or mps"),
    ],
)
def test_resolve_device(requested, world, local_rank, cuda, mps, expected):
    if expected in ("cpu", "mps") or expected.startswith("cuda:") and " " not in expected:
        assert machine.resolve_device(requested, world, local_rank, cuda, mps) == expected
    else:
        with pytest.raises(ConfigError, match=expected):
            machine.resolve_device(requested, world, local_rank, cuda, mps)


def test_the_cpu_thread_count_is_said_and_a_busy_machine_warned_of(monkeypatch, capsys):
    monkeypatch.setattr(os, "getloadavg", lambda: (3.5, 3.0, 2.0))
    monkeypatch.setattr(os, "cpu_count", lambda: 2)
    assert machine.cpu_threads(ONE_PROCESS) == torch.get_num_threads() == 1
    out = capsys.readouterr().out
    assert "cpu: 1 thread(s) per process" in out and "load (3.5) exceeds its 2 cores" in out
    assert "one thread already: run fewer processes" in out and "OMP_NUM_THREADS=1" not in out  # it is 1
    monkeypatch.setattr(torch, "get_num_threads", lambda: 2)
    machine.cpu_threads(ONE_PROCESS)
    assert "with OMP_NUM_THREADS=1 it waits least" in capsys.readouterr().out
    monkeypatch.setattr(os, "getloadavg", lambda: (1.5, 3.0, 2.0))
    machine.cpu_threads(ONE_PROCESS)
    assert "warning" not in capsys.readouterr().out


def test_setup_on_a_cpu_turns_on_the_deterministic_kernels_in_fp32():
    # a global flag: a cell's numbers repeat run to run only with it (issue #41: setup dropping it failed no test)
    was = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(False)
    try:
        runtime = machine.setup(dict(device="cpu", dtype="auto", fsdp=False))
        assert torch.are_deterministic_algorithms_enabled()
        assert (runtime.device, runtime.dtype, runtime.world, runtime.rank) == ("cpu", "float32", 1, 0)
        assert not torch.is_autocast_enabled("cpu") and isinstance(runtime.autocast, nullcontext)
    finally:
        torch.use_deterministic_algorithms(was)


CPUINFO = """processor\t: 0
model name\t: AMD EPYC 7B13
flags\t\t: fpu sse4_2 avx avx2 fma bmi2
processor\t: 1
model name\t: AMD EPYC 7B13
flags\t\t: fpu sse4_2 avx avx2 fma bmi2
"""


def test_the_machine_record_names_the_cpu_its_rounding_flags_and_the_torch_build(monkeypatch):
    import io
    import records

    monkeypatch.setattr(machine, "open", lambda path, *a: io.StringIO(CPUINFO), raising=False)
    m = machine.machine_record(ONE_PROCESS)
    assert m["cpu"] == "AMD EPYC 7B13" and m["cpu_flags"] == ["avx2", "fma"]  # avx, sse4_2, bmi2 round as the rest
    assert m["torch"] == torch.__version__ and m["cpu_capability"] == torch.backends.cpu.get_cpu_capability()
    assert m["gpu"] is None and m["cuda"] == torch.version.cuda

    def no_cpuinfo(path, *a):  # not Linux
        raise FileNotFoundError(path)

    monkeypatch.setattr(machine, "open", no_cpuinfo, raising=False)
    assert machine.machine_record(ONE_PROCESS)["cpu"] and machine.machine_record(ONE_PROCESS)["cpu_flags"] == []
    # provenance, not a setting: a cell resumed or rerun on another machine is no change
    assert records.differences(dict(lr=1, machine=m), dict(lr=1, machine=dict(m, cpu="Intel"))) == {}


ENDING = """
import atexit, sys
sys.path.insert(0, {root!r})
import machine
atexit.register(print, "finalized")  # atexit runs only when the interpreter finalizes
with machine.exit_without_finalizing():
    print("ran")
    {end}
"""


@pytest.mark.parametrize(
    "end, status, stderr", [("pass", 0, ""), ("sys.exit('error: one line')", 1, "error: one line\n")]
)
def test_a_torchrun_process_ends_without_interpreter_finalization(end, status, stderr, monkeypatch):
    # under torchrun FSDP2 leaves gloo threads running past destroy_process_group: a process must not
    # finalize beside them (machine.exit_without_finalizing), and ends with the status sys.exit gives
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    proc = subprocess.run(
        [sys.executable, "-c", ENDING.format(root=root, end=end)],
        capture_output=True,
        text=True,
        env={**os.environ, "WORLD_SIZE": "2"},
        timeout=120,
    )
    assert (proc.returncode, proc.stdout, proc.stderr) == (status, "ran\n", stderr)  # no atexit: not finalized
    monkeypatch.delenv("WORLD_SIZE", raising=False)  # alone, as usual: sys.exit reaches the interpreter
    with pytest.raises(SystemExit, match="error: one line"), machine.exit_without_finalizing():
        sys.exit("error: one line")


def test_torchrun_shows_each_ranks_own_error(tmp_path):
    # a failed multi-process test shows what each rank said, not only the launcher's summary
    from helpers import torchrun

    script = tmp_path / "fails.py"
    script.write_text(
        "import torch.distributed as dist\ndist.init_process_group('gloo')\n"
        "if dist.get_rank() == 1:\n    raise SystemExit('rank 1 stops here')\ndist.barrier()\n"
    )
    proc = torchrun(str(script), [])
    assert proc.returncode != 0
    tail = proc.stderr[-2000:]
    assert (
        "--- rank 1 stderr ---\nrank 1 stops here\n" in tail
        and "Connection closed by peer" in tail.split("--- rank 0")[1]
    )


def test_importing_machine_changes_the_compile_caches_policy_and_nothing_else():
    """cache_routed_graphs is declared non-computing (grid_files.NOT_COMPUTING), so no grid would notice an edit to
    it: it may touch only the two cache settings that let the routed schemes' graphs be cached, nothing that compiles
    otherwise (an inductor precision flag, say)."""
    probe = (
        "import json, torch._functorch.config as f, torch._inductor.config as i\n"
        "copy = lambda: {**{'functorch.' + k: repr(v) for k, v in f.get_config_copy().items()},"
        " **{'inductor.' + k: repr(v) for k, v in i.get_config_copy().items()}}\n"
        "before = copy()\n"
        "import machine\n"
        "after = copy()\n"
        "print(json.dumps(sorted(k for k in before | after if before.get(k) != after.get(k))))\n"
    )
    proc = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, cwd=ROOT, check=True)
    assert proc.stdout.split("\n")[-2] == (
        '["functorch.autograd_cache_allow_custom_autograd_functions", "inductor.unsafe_marked_cacheable_functions"]'
    )
