"""machine.py: which device a process trains on, and the CPU thread count it says."""

import os
from contextlib import nullcontext

import pytest
import torch

import machine
from common import ConfigError

ONE_PROCESS = machine.Runtime(world=1, rank=0, local_rank=0, device="cpu", dtype="float32", autocast=nullcontext(),
                              peak_flops=None, fsdp=False)
torch.set_num_threads(1)


@pytest.mark.parametrize("requested, world, local_rank, cuda, mps, expected", [
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
])
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
    monkeypatch.setattr(os, "getloadavg", lambda: (1.5, 3.0, 2.0))
    machine.cpu_threads(ONE_PROCESS)
    assert "warning" not in capsys.readouterr().out
