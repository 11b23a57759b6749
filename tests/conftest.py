"""
pytest's fixtures and session set-up for this folder; the helpers tests import live in helpers.py
(`from helpers import make, tokens`).
"""

import os
import re

import numpy as np
import pytest

import model as model_code
from model import RESIDUALS
# --- the README's example scheme, registered for the session ---------------------------------------
# README.md's "Add a scheme" promises that a correct new scheme passes every generic test without an
# edit to a test: its example, taken verbatim from the README, is registered as `gated` while the tests
# run (in this process only), so every run of the suite checks that promise on it.

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def readme_scheme():
    """The first python block of README.md's "Add a scheme" section: (source, class name)."""
    with open(os.path.join(ROOT, "README.md"), encoding="utf-8") as f:
        section = f.read().split("\n## Add a scheme\n")[1].split("\n## ")[0]
    source = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    return source, re.search(r"^class (\w+)\(", source, re.M).group(1)


README_SCHEME, README_CLASS = readme_scheme()
exec(compile(README_SCHEME, "README.md (Add a scheme)", "exec"), namespace := dict(vars(model_code)))
RESIDUALS["gated"] = namespace[README_CLASS]  # the name the README registers it under


# --- the fast lane: pytest -m "not slow" --------------------------------------------------------------
# Marked here by what a test does, not by hand in each file, so that a new test of a slow kind lands in the
# slow lane without anyone remembering to mark it: torch.compile (a minute cold), several processes
# (torchrun, DDP, FSDP, launch.py's workers, a scheduler), and the paper configs at a tiny size. Together
# they are about four fifths of the suite's time on the 2-core machine.
SLOW_FILES = {"test_cluster.py", "test_slurm.py", "test_configs.py"}
SLOW_NAMES = re.compile(r"compile|torchrun|ddp|fsdp|two_ranks|two_nodes|two_gpus")


def pytest_collection_modifyitems(config, items):
    for item in items:
        if item.path.name in SLOW_FILES or SLOW_NAMES.search(item.name):
            item.add_marker(pytest.mark.slow)


# --- tiny synthetic shards (train.py, checkpoint.py and their neighbours) ----------------------------


@pytest.fixture(scope="session")
def shards(tmp_path_factory):
    """A learnable stream (a repeating pattern with noise, tokens < 64) as GPT-2-headered shards without a
    manifest: a validation shard of 3,000 tokens and two train shards."""
    from data.shards import write_shard

    d = tmp_path_factory.mktemp("shards")
    rng = np.random.default_rng(0)
    stream = (np.arange(60_000) % 17 + rng.integers(0, 3, 60_000)).astype(np.uint16)
    write_shard(str(d / "val_000000.bin"), stream[:3000])
    write_shard(str(d / "train_000001.bin"), stream[3000:30000])
    write_shard(str(d / "train_000002.bin"), stream[30000:])
    return str(d)
