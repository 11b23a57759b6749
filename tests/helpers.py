"""
Shared test helpers, imported by the tests that use them (`from helpers import make, tokens`); pytest's
fixtures stay in conftest.py, which also registers the README's example scheme before any test imports
this file (so VARIANTS below holds it).

Model helpers (test_model.py, test_cuda.py): the tiny GPTConfig, every scheme setting worth testing,
a seeded model and token batch, random routing parameters, and the depth read written from its
definition. Trained grids: train.py's command line for a tiny run, what a cell wrote, a cell's checkpoint
written directly, a run killed at a step, torchrun. Tuning cells as train.py leaves them.
"""

import json
import os

import pytest
import torch

from model import GPT, RESIDUALS, GPTConfig, depth_read, depth_read_extend

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

from conftest import README_SCHEME  # noqa: E402,F401 (the README's example, registered by conftest)

# --- model helpers (owner: test_model.py) ---------------------------------------------------------

TINY = dict(n_layer=4, n_head=2, n_embd=32, block_size=16, vocab_size=96)
# every scheme in the registry at its defaults (attnres, rd_attnres, dar: blocks of 4 sublayers), so a
# new scheme goes through every generic test with no edit to a test; then the other settings worth testing.
# Each name starts with its scheme's, so `pytest -k NAME` selects every test of scheme NAME.
VARIANTS = {name: dict(residual=name) for name in RESIDUALS} | {
    "attnres_full": dict(residual="attnres", attnres_block_size=1),
    "attnres_s2": dict(residual="attnres", attnres_block_size=2),
    "rd_attnres_dup": dict(residual="rd_attnres", rd_control="dup"),
    "rd_attnres_param": dict(residual="rd_attnres", rd_control="param"),
    "rd_attnres_fixed_v": dict(residual="rd_attnres", rd_control="fixed_v"),
    "rd_attnres_mix": dict(residual="rd_attnres", rd_control="mix"),
    "dar_full": dict(residual="dar", attnres_block_size=1),
    "dar_self": dict(residual="dar", dar_keys="self"),
    "dar_copy": dict(residual="dar", dar_start="copy"),
}
ROUTED = [v for v in VARIANTS if v != "standard"]


def starts_as_standard(residual):
    """Whether scheme `residual` is `standard` at init: every scheme is, unless it declares
    `standard_at_init = False` (Post-LN, whose normalised skip no init can undo); the zero-init tests run
    only where it is."""
    return getattr(RESIDUALS[residual], "standard_at_init", True)


STARTS_AS_STANDARD = [v for v in ROUTED if starts_as_standard(VARIANTS[v]["residual"])]


def make(variant, seed=0, **overrides):
    """The tiny model of a VARIANTS entry, drawn with torch.manual_seed(seed)."""
    torch.manual_seed(seed)
    return GPT(GPTConfig(**{**TINY, **VARIANTS[variant], **overrides}))


def tokens(B=2, T=16, seed=1):
    return torch.randint(0, TINY["vocab_size"], (B, T), generator=torch.Generator().manual_seed(seed))


def randomize_routing(model, seed=2):
    """Every routing parameter away from its init (key gains around 1, mHC's phi small enough for exp)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.residual.named_parameters():
            scale = 0.5 if "gain" in name else 0.1 if name.startswith("phi") else 1.0  # phi: keep exp() finite
            p.copy_(torch.randn(p.shape, generator=g) * scale + (1.0 if name == "key_gain" else 0.0))


def rel_err(a, b):
    return ((a - b).norm() / b.norm()).item()


def logits_of(model, idx):
    return model(idx, idx)[0]


def naive_depth_read(sources, queries, key_gain, eps, keys=None):
    """The depth read from its definition, with a stacked copy of the sources, in float64."""
    V = torch.stack(sources).double()  # (S, B, T, d)
    K = V if keys is None else torch.stack(keys).double()
    normed = key_gain.double() * K / torch.sqrt(K.pow(2).mean(-1, keepdim=True) + eps)
    alpha = torch.softmax(torch.einsum("sbtd,rd->sbtr", normed, queries.double()), dim=0)
    return [torch.einsum("sbt,sbtd->btd", alpha[..., r], V) for r in range(queries.size(0))]


def two_phase_read(sources, queries, key_gain, eps, keys=None):
    """The model's read over every source: phase 1 over all but the newest, phase 2 adds the newest."""
    keys = sources if keys is None else keys
    sealed = depth_read(keys[:-1], sources[:-1], queries * key_gain, eps)
    return depth_read_extend(sealed, keys[-1], sources[-1], queries * key_gain, eps).outputs


# --- trained grids (loop) -------------------------------------------------------------------------
# test_train.py and test_checkpoint.py: tiny synthetic shards, train.py's command line for a tiny run
# on them, what a cell wrote, and a run killed at a step.

TIMINGS = ("ms_per_step", "tokens_per_s", "mfu", "eta_cell_s", "eta_grid_s", "eval_s")


def tiny(shards, out_dir, *extra):
    """train.py's arguments for a tiny run on shards (8 steps, evaluated every 4, on the CPU); extra override."""
    return [
        f"--data_dir={shards}",
        f"--out_dir={out_dir}",
        "--n_layer=2",
        "--n_head=2",
        "--n_embd=32",
        "--block_size=16",
        "--vocab_size=64",
        "--batch_size=4",
        "--max_iters=8",
        "--eval_interval=4",
        "--log_interval=1",
        "--eval_tokens=1000",
        "--compile=False",
        "--seeds=0",
        "--warmup_iters=2",
        "--learning_rate=1e-2",
        "--min_lr=1e-3",
        "--device=cpu",
        *extra,
    ]


def log_records(out_dir, arm, seed=0):
    with open(os.path.join(out_dir, arm, f"seed{seed}", "log.jsonl")) as f:
        return [json.loads(line) for line in f]


def logged(out_dir, arm, seed=0, key="loss"):
    """The values of key in the cell's log, in order."""
    return [r[key] for r in log_records(out_dir, arm, seed) if key in r]


def result(out_dir, arm, seed=0):
    with open(os.path.join(out_dir, arm, f"seed{seed}", "result.json")) as f:
        return json.load(f)


def without_timings(log):
    return [{k: v for k, v in r.items() if k not in TIMINGS} for r in log]


def write_checkpoint(cell_dir, gpt, record, step):
    """A cell's ckpt.pt as train.py leaves it, without optimizer state: gpt's weights at step under record (the
    cell's config.json), what export.py and sample.py open."""
    os.makedirs(cell_dir, exist_ok=True)
    torch.save(
        dict(
            model=gpt.state_dict(),
            optimizer={},
            step=step,
            rng=[],
            data_hash="",
            config=record,
            loss_sum=0.0,
            step_last=0,
            wall_time_s=0.0,
        ),
        os.path.join(cell_dir, "ckpt.pt"),
    )


def killed_at_step(kill, monkeypatch, argv):
    """train.main(argv) interrupted as a kill would, when it reaches step `kill` (after its checkpoints)."""
    import train

    real = train.learning_rate_at

    def dying(step, cell):
        if step == kill:
            raise KeyboardInterrupt
        return real(step, cell)

    monkeypatch.setattr(train, "learning_rate_at", dying)
    with pytest.raises(KeyboardInterrupt):
        train.main(argv)
    monkeypatch.setattr(train, "learning_rate_at", real)


def torchrun(script, args):
    """script args under torchrun: 2 processes on the CPU, one thread each, from the project folder. Each
    rank writes its own stdout and stderr (torchrun's --log-dir, --redirects): the result's stdout and
    stderr are the launcher's followed by each rank's, so a failed test's stderr[-2000:] ends with every
    rank's own last lines (its traceback, or an abort's message), not only the launcher's summary."""
    import glob
    import subprocess
    import sys
    import tempfile

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    with tempfile.TemporaryDirectory() as logs:
        proc = subprocess.run(
            [
                sys.executable,
                "-m",
                "torch.distributed.run",
                "--standalone",
                "--nproc_per_node=2",
                f"--log-dir={logs}",
                "--redirects=3",
                script,
                *args,
            ],
            cwd=root,
            env={**os.environ, "OMP_NUM_THREADS": "1"},
            capture_output=True,
            text=True,
            timeout=300,
        )
        for stream in ("stdout", "stderr"):
            ranks = []
            for rank in range(2):  # <logs>/<run id>/attempt_<n>/<rank>/<stream>.log, the last attempt's
                found = sorted(glob.glob(os.path.join(logs, "*", "attempt_*", str(rank), f"{stream}.log")))
                text = open(found[-1], errors="replace").read() if found else "(no log: it did not start)\n"
                ranks.append(f"--- rank {rank} {stream} ---\n" + (text if stream == "stdout" else text[-900:]))
            setattr(proc, stream, getattr(proc, stream) + "".join(ranks))
    return proc


# --- tuning cells (owner: test_tune.py; test_report.py reads them too) --------------------------------


def write_tuning_cell(tune_dir, arm, rate, seed, val_loss, steps, initial=5.8):
    """A tuning cell of the tuned protocol as train.py leaves it (what tune.py and report.py read): result.json
    (val_loss None: diverged half way) and log.jsonl opening with the step-0 validation loss initial."""
    import tune

    name = tune.tuning_arm(arm, rate)
    cell = os.path.join(tune_dir, name, f"seed{seed}")
    os.makedirs(cell, exist_ok=True)
    finished = val_loss is not None
    with open(os.path.join(cell, "result.json"), "w") as f:
        json.dump(
            dict(
                arm=name,
                seed=seed,
                status="finished" if finished else "diverged",
                val_loss=val_loss,
                diverged_at=None if finished else steps // 2,
                reason=None if finished else "train loss nan",
                steps=steps if finished else steps // 2,
                tokens=1024 * steps,
                wall_time_s=float(steps),
                pairing=dict(arm_settings=dict(residual=arm, learning_rate=rate, min_lr=rate / 10)),
            ),
            f,
        )
    with open(os.path.join(cell, "log.jsonl"), "w") as f:
        f.write(json.dumps(dict(step=0, tokens=0, val_loss=initial, eval_s=0.1)) + "\n")
