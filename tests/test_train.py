"""
train.py and progress.py: the runtime, the data order, one step's gradient, the schedule, evaluation,
time left, and whole tiny grids run through train.main on synthetic shards (the run contract, pairing,
reruns, warm starts, DDP/FSDP against one process, compile, timings). The checkpoint and resume are
in test_checkpoint.py.

    OMP_NUM_THREADS=1 .venv/bin/python -m pytest tests/test_train.py -q -p no:cacheprovider
(minutes: most tests train; `-k NAME` for one)
"""

import dataclasses
import errno
import hashlib
import importlib.machinery
import json
import os
import shutil
import socket
import subprocess
import sys
import types
from contextlib import nullcontext
from types import SimpleNamespace

import numpy as np
import pytest
import torch

import cells
import checkpoint
import machine
import progress
import records
import train
from common import ConfigError, DataError
from configurator import configure
from helpers import log_records, logged, result, starts_as_standard, tiny, torchrun, without_timings
from data.shards import BUNDLED, data_vocab_size, find_data, open_shard, resolve_data_dir, write_shard
from model import GPT, RESIDUALS, GPTConfig

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ENV = {**os.environ, "OMP_NUM_THREADS": "1"}
torch.set_num_threads(1)  # tiny models: threads only contend with each other on a shared machine (3-20x slower)
ONE_PROCESS = machine.Runtime(
    world=1, rank=0, local_rank=0, device="cpu", dtype="float32", autocast=nullcontext(), peak_flops=None, fsdp=False
)


def test_micro_batches():
    assert train.micro_batches(8, 8) == [8] and train.micro_batches(4, 8) == [4]
    assert train.micro_batches(8, 4) == [4, 4] and train.micro_batches(5, 4) == [3, 2]
    for n in range(1, 30):
        for b in range(1, 10):
            sizes = train.micro_batches(n, b)
            assert sum(sizes) == n and max(sizes) <= b and len(sizes) == -(-n // b) and max(sizes) - min(sizes) <= 1


def test_every_epoch_is_a_new_permutation_of_every_sequence():
    # two shards of 5 and 3 whole sequences (block_size 4): 8 sequences an epoch
    shards = [np.arange(21, dtype=np.uint16), np.arange(100, 113, dtype=np.uint16)]
    data = train.TrainData(shards, 4, seed=7)
    epochs = data.sequence_ids(0, 24).reshape(3, 8)
    assert all(sorted(e) == list(range(8)) for e in epochs)  # each sequence once per epoch
    assert len({tuple(e) for e in epochs}) == 3  # a new order every epoch
    assert (train.TrainData(shards, 4, seed=7).sequence_ids(11, 5) == epochs.flatten()[11:16]).all()  # from any step
    assert (data.sequences(np.array([5]))[0] == shards[1][:5]).all()  # sequence 5 opens the second shard


def test_a_batch_chains_its_tokens_into_the_data_hash():
    shards = [np.arange(21, dtype=np.uint16), np.arange(100, 113, dtype=np.uint16)]
    data = train.TrainData(shards, 4, seed=7)
    first, second = data.batch(0, 3), data.batch(1, 3)
    assert (first == data.sequences(data.sequence_ids(0, 3))).all() and (
        second == data.sequences(data.sequence_ids(3, 3))
    ).all()
    h = hashlib.sha256(b"" + first.tobytes()).hexdigest()
    assert data.hash == hashlib.sha256(h.encode() + second.tobytes()).hexdigest()
    resumed = train.TrainData(shards, 4, seed=7, data_hash=h)  # from a checkpoint after step 0
    assert (resumed.batch(1, 3) == second).all() and resumed.hash == data.hash


def test_learning_rate_schedules():
    cell = dict(learning_rate=1.0, min_lr=0.1, warmup_iters=10, max_iters=110, lr_schedule="cosine", cooldown_frac=0.2)
    lr = lambda s, **kw: train.learning_rate_at(s, SimpleNamespace(**cell | kw))
    assert lr(0) == pytest.approx(0.1) and lr(9) == pytest.approx(1.0) and lr(10) == pytest.approx(1.0)
    assert lr(60) == pytest.approx(0.55) and lr(110) == pytest.approx(0.1)
    assert lr(50, lr_schedule="wsd") == 1.0 and lr(88, lr_schedule="wsd") == 1.0
    assert lr(99, lr_schedule="wsd") == pytest.approx(0.55) and lr(110, lr_schedule="wsd") == pytest.approx(0.1)


@pytest.mark.parametrize(
    "path, world",
    [
        ("config/rd_120m.py", 8),
        ("config/rd_343m.py", 8),
        ("config/rd_controls_120m.py", 8),
        ("config/dar_120m.py", 8),
        ("config/dar_ablations_120m.py", 8),
        ("config/dar_1b.py", 8),
        ("config/dar_shakespeare.py", 1),
    ],
)
def test_config_files_are_valid(path, world, monkeypatch):
    monkeypatch.chdir(ROOT)
    cfg = configure(train.DEFAULTS, [path])
    if cfg["vocab_size"] is None:  # the data sets it, as main does
        cfg["vocab_size"] = data_vocab_size(BUNDLED[resolve_data_dir(cfg["data_dir"])])
    records.check_config(cfg, world)
    if world == 8:  # the paper protocol: GPT-2 tokens, 2^19 tokens per step, 2.0B (controls: 0.5B) tokens per run
        assert cfg["vocab_size"] == 50304
        assert cfg["batch_size"] * cfg["gradient_accumulation_steps"] * cfg["block_size"] == 2**19
        assert cfg["max_iters"] * 2**19 == pytest.approx(0.5e9 if "controls" in path else 2.0e9, rel=1e-3)


# --- the step's gradient and the evaluation, in process ----------------------------------------


def tiny_model(residual="rd_attnres", dropout=0.0):
    torch.manual_seed(0)
    model = GPT(
        GPTConfig(n_layer=2, n_head=2, n_embd=32, block_size=16, vocab_size=64, residual=residual, dropout=dropout)
    )
    with torch.no_grad():  # routing away from its zero init, so the routes matter
        for p in model.residual.parameters():
            p.normal_()
    return model


def test_gradients_equal_for_any_split_of_the_step():
    model = tiny_model(dropout=0.0)
    g = torch.Generator().manual_seed(1)
    batch = torch.randint(0, 64, (8, 17), generator=g)
    x, y = batch[:, :-1], batch[:, 1:]

    def grads(ranks):
        """Gradients of one step of 8 sequences; ranks: each rank's micro-batch sizes over consecutive
        sequences; the ranks' gradients are averaged, as DDP's all-reduce does."""
        total, loss, start = {}, 0.0, 0
        for sizes in ranks:
            batches = []
            for n in sizes:
                batches.append((x[start : start + n], y[start : start + n]))
                start += n
            loss += train.backward_step(model, batches, 8, SimpleNamespace(world=len(ranks), autocast=nullcontext()))
            for name, p in model.named_parameters():
                total[name] = total.get(name, 0) + p.grad / len(ranks)
            model.zero_grad(set_to_none=True)
        return total, loss

    # the reference, from the definition: the gradient of the mean token loss over the 8 sequences
    logits = model.lm_head(model.hidden(x))
    torch.nn.functional.cross_entropy(logits.flatten(0, 1), y.flatten()).backward()
    reference = {name: p.grad.clone() for name, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    for ranks in ([[8]], [[4, 4]], [[3, 3, 2]], [[4], [4]], [[2, 2], [2, 2]]):
        grad, loss = grads(ranks)
        assert abs(loss.item() - model(x, y)[1].item()) < 1e-6, ranks
        for name in reference:
            # fp32 sums in another order: a few ulps of the tensor's largest entry (a wrong weighting is off by ~10%)
            torch.testing.assert_close(
                grad[name],
                reference[name],
                rtol=1e-5,
                atol=1e-6 * reference[name].abs().max().item(),
                msg=f"{ranks} {name}",
            )


def test_evaluation_is_independent_of_eval_batch_size(shards):
    model = tiny_model()
    shard = open_shard(os.path.join(shards, "val_000000.bin"))
    val = records.ValidationText(shard, None).rows(1000, 16, "first")  # the first 1000 tokens' 62 sequences
    cell = dict(block_size=16, eval_tokens=1000)
    losses = [
        train.evaluate(model, val, SimpleNamespace(**cell, eval_batch_size=b), ONE_PROCESS) for b in (1, 7, 62, 100)
    ]
    assert max(losses) - min(losses) < 1e-6
    # the reference: per-token losses of the 62 whole sequences in the first 1000 tokens, one pass
    seqs = torch.from_numpy(np.stack([shard[j * 16 : j * 16 + 17] for j in range(62)]).astype(np.int64))
    with torch.no_grad():
        logits, _ = model(seqs[:, :-1], seqs[:, 1:])
        expected = torch.nn.functional.cross_entropy(logits.flatten(0, 1), seqs[:, 1:].flatten()).item()
    assert abs(losses[0] - expected) < 1e-6
    # each sequence's loss on its own, in order; val_loss is their mean
    per_sequence = train.sequence_losses(model, val, SimpleNamespace(**cell, eval_batch_size=7), ONE_PROCESS)
    with torch.no_grad():
        one_by_one = [model(seqs[j : j + 1, :-1], seqs[j : j + 1, 1:])[1].item() for j in range(62)]
    assert per_sequence.dtype == np.float64 and per_sequence == pytest.approx(one_by_one, abs=1e-6)
    assert per_sequence.mean() == pytest.approx(losses[1], abs=1e-12)
    # two ranks' halves, summed as the all-reduce does, are the same set
    half = SimpleNamespace(**cell | dict(eval_tokens=500, eval_batch_size=7))
    assert abs(train.evaluate(model, val[:31], half, ONE_PROCESS) - losses[0]) > 1e-6


# --- the run contract: one tiny grid (2 arms x 2 seeds), trained once, one behaviour per test -------


def shared_pairing(pairing):
    """A pairing record without what differs across arms by design: what the arm sets itself (arm_settings),
    its scheme's code (scheme_code) and the options of one scheme (rd_control, ...), which only its arms record."""
    options = {k for scheme in RESIDUALS.values() for k in scheme.options}
    shared = {k: v for k, v in pairing.items() if k not in ("arm_settings", "scheme_code")}
    return dict(shared, settings={k: v for k, v in pairing["settings"].items() if k not in options})


@pytest.fixture(scope="module")
def grid(shards, tmp_path_factory):
    """The out_dir of tiny(shards, ..., '--seeds=0,1'), report included. Tests that change a grid copy it."""
    out = str(tmp_path_factory.mktemp("grid") / "grid")
    train.main(tiny(shards, out, "--seeds=0,1"))
    return out


CELLS = [(arm, seed) for arm in ("attnres", "rd_attnres") for seed in (0, 1)]


@pytest.mark.parametrize("arm, seed", CELLS)
def test_every_cell_writes_its_files_and_result(grid, arm, seed):
    cell = os.path.join(grid, arm, f"seed{seed}")
    assert {"config.json", "log.jsonl", "ckpt.pt", "result.json"} <= set(os.listdir(cell))
    r = result(grid, arm, seed)
    assert r["tokens"] == 8 * 4 * 16 and r["steps"] == 8 and np.isfinite(r["val_loss"])
    assert r["status"] == "finished" and r["diverged_at"] is None and r["reason"] is None and r["wall_time_s"] > 0
    # the final evaluation per validation sequence (62 whole sequences of 16 + 1 in the first 1000 tokens)
    assert len(r["val_sequence_losses"]) == 62 and np.mean(r["val_sequence_losses"]) == pytest.approx(
        r["val_loss"], abs=1e-12
    )
    assert r["config"]["machine"]["cpu"] and r["config"]["machine"]["torch"] == torch.__version__


def test_the_grids_config_json_is_what_build_config_assembles(grid, shards):
    """One function builds the run's config: the grid's config.json is build_config's output (keys, their order
    and values) plus the grid's own record; the given settings are not changed; docs/protocol.md names each key
    it adds or replaces."""
    given = configure(train.DEFAULTS, tiny(shards, grid, "--seeds=0,1"), entries=dict(arms=train.SCHEME_ARMS))
    before = json.dumps(given)
    runtime = machine.setup(given)
    data = find_data(given, runtime)
    cfg = train.build_config(given, runtime, data, checkpoint.load_init_from(""))
    assert json.dumps(given) == before
    recorded = json.load(open(os.path.join(grid, "config.json")))
    assert list(recorded) == list(cfg) + ["code", "changes"] and {k: recorded[k] for k in cfg} == cfg
    added = [k for k in cfg if k not in given]
    assert added == ["tokenizer", "torch_version", "world_size", "cpu_threads", "init_from_sha256", "train_data_sha256"]
    assert cfg["data_dir"] == os.path.abspath(shards) and cfg["tokenizer"] == "gpt2" and cfg["init_from_sha256"] is None
    assert (cfg["device"], cfg["compile"], cfg["world_size"]) == ("cpu", False, 1) and given["device"] == "cpu"
    # the data sets the vocabulary unless given; each arm's settings typed as --key=value types them
    unset = train.build_config(
        dict(given, vocab_size=None, arms={"a": {"dropout": 0}}), runtime, data, checkpoint.load_init_from("")
    )
    assert unset["vocab_size"] == 50304 and type(unset["arms"]["a"]["dropout"]) is float
    with open(os.path.join(ROOT, "docs", "protocol.md")) as f:
        protocol = f.read()
    assert all(
        f"`{key}`" in protocol for key in added + ["data_dir", "vocab_size", "arms", "device", "dtype", "compile"]
    )


@pytest.mark.parametrize("arm, seed", CELLS)
def test_every_cell_records_its_settings_and_code(grid, arm, seed):
    code = records.code_record()
    assert len(code["fingerprint"]) == 64 and set(code) == {
        "fingerprint",
        "definitions",
        "schemes",
        "git_commit",
        "git_dirty",
    }
    config = json.load(open(os.path.join(grid, arm, f"seed{seed}", "config.json")))
    r = result(grid, arm, seed)
    assert config["residual"] == arm and config["model"]["residual"] == arm and config["code"] == code
    assert config["arm"] == arm and config["seed"] == seed and r["config"] == config and r["code"] == code
    assert set(train.DEFAULTS) <= set(config) and config["learning_rate"] == 1e-2


@pytest.mark.parametrize("arm, seed", CELLS)
def test_every_cell_logs_each_step_evaluation_and_time_left(grid, arm, seed):
    log = log_records(grid, arm, seed)
    assert [x["step"] for x in log if "loss" in x] == list(range(1, 9))
    assert all({"step", "loss", "lr", "eta_cell_s", "eta_grid_s"} <= set(x) for x in log if "loss" in x)
    assert log[-2]["step"] == 8 and log[-2]["eta_cell_s"] == 0 and log[1]["eta_cell_s"] > 0
    assert (log[-2]["eta_grid_s"] == 0) == ((arm, seed) == ("rd_attnres", 1))  # the grid's last cell
    assert [x["step"] for x in log if "val_loss" in x] == [0, 4, 8]
    assert all(x["eval_s"] > 0 for x in log if "val_loss" in x)


@pytest.mark.parametrize("arm", ["attnres", "rd_attnres"])
def test_every_arm_learns(grid, arm):
    assert logged(grid, arm)[-1] < logged(grid, arm)[0]


@pytest.mark.parametrize("seed", [0, 1])
def test_the_arms_of_a_seed_pair(grid, seed):
    # within a seed: the same shared init, batches and settings
    a, b = result(grid, "attnres", seed)["pairing"], result(grid, "rd_attnres", seed)["pairing"]
    assert (a.pop("arm_settings"), b.pop("arm_settings")) == ({"residual": "attnres"}, {"residual": "rd_attnres"})
    code = records.code_record()  # the arms share the code but their schemes', which is each arm's own
    assert (a.pop("scheme_code"), b.pop("scheme_code")) == tuple(
        records.code_fingerprints(code, s)[1] for s in ("attnres", "rd_attnres")
    )
    # a scheme's own options (rd_control) are recorded by its arms only: report.py pairs on the rest
    assert b["settings"].pop("rd_control") == "none" and "rd_control" not in a["settings"]
    assert a == b and set(a) == {"init_hash", "data_hash", "eval_tokens", "val_hash", "code", "init_from", "settings"}
    assert a["eval_tokens"] == 62 * 16 and a["code"] == records.code_fingerprints(code, "attnres")[0]
    assert a["init_from"] is None
    assert a["settings"]["learning_rate"] == 1e-2 and "residual" not in a["settings"]
    assert not {"arm", "seed", "seeds", "arms", "out_dir", "log_interval", "eval_batch_size"} & set(a["settings"])


def test_seeds_differ_in_init_and_data(grid):
    p0, p1 = result(grid, "attnres", 0)["pairing"], result(grid, "attnres", 1)["pairing"]
    assert p0["init_hash"] != p1["init_hash"] and p0["data_hash"] != p1["data_hash"]


def test_the_init_hash_is_the_seeds_standard_model(grid):
    torch.manual_seed(cells.seed_for(0, cells.INIT))
    standard = GPT(GPTConfig(n_layer=2, n_head=2, n_embd=32, block_size=16, vocab_size=64))
    assert records.shared_init_hash(standard) == result(grid, "attnres", 0)["pairing"]["init_hash"]


def test_routing_diagnostics_and_the_paired_report(grid):
    routing = result(grid, "rd_attnres")["routing"]
    assert set(routing["qk_v_jsd"]) == {"0", "1"} and len(routing["weights"]["out"]) == 2
    paired = json.load(open(os.path.join(grid, "paired.json")))
    assert paired["reference"] == "attnres" and paired["arms"]["rd_attnres"]["n"] == 2


def test_a_finished_cell_is_skipped_and_the_grid_keeps_every_arm_and_seed(grid, shards):
    # --arms/--seeds select a subset, and the grid's config.json keeps both
    before = os.path.getmtime(os.path.join(grid, "attnres", "seed0", "result.json"))
    train.main(tiny(shards, grid, "--seeds=0", "--arms=attnres"))
    assert os.path.getmtime(os.path.join(grid, "attnres", "seed0", "result.json")) == before
    recorded = json.load(open(os.path.join(grid, "config.json")))
    assert recorded["seeds"] == [0, 1] and list(recorded["arms"]) == ["attnres", "rd_attnres"]


def test_a_changed_rerun_is_refused_naming_what_changed(grid, shards):
    before = open(os.path.join(grid, "config.json")).read()
    with pytest.raises(
        ConfigError,
        match=r"config.json was made with other settings: learning_rate \(0.01 -> 0.002\), "
        r"max_iters \(8 -> 50\); .*--allow_changes=True",
    ):
        train.main(tiny(shards, grid, "--learning_rate=2e-3", "--max_iters=50"))
    assert open(os.path.join(grid, "config.json")).read() == before  # nothing is written


def other_code(code, definition="GPT"):
    return dict(code, fingerprint="0" * 64, definitions=dict(code["definitions"], **{definition: "0" * 16}))


def test_a_code_change_is_refused_naming_the_definition(grid, shards, monkeypatch):
    code = records.code_record()
    monkeypatch.setattr(records, "code_record", lambda: other_code(code))
    with pytest.raises(ConfigError, match=r"made with other settings: code changed \(GPT\); .*a new --out_dir"):
        train.main(tiny(shards, grid))
    assert json.load(open(os.path.join(grid, "config.json")))["code"] == code


def test_a_change_to_a_scheme_no_arm_trains_locks_nothing(grid, shards, monkeypatch, capsys):
    code = records.code_record()
    monkeypatch.setattr(records, "code_record", lambda: other_code(code, "HyperConnections"))
    train.main(tiny(shards, grid))  # every cell done: nothing trains, nothing is refused
    assert "recorded with other settings" not in capsys.readouterr().out
    monkeypatch.setattr(records, "code_record", lambda: other_code(code, "AttnRes"))  # rd_attnres derives from it
    with pytest.raises(ConfigError, match=r"code changed \(AttnRes\)"):
        train.main(tiny(shards, grid, "--arms=rd_attnres"))


def test_a_grid_extended_under_new_code_records_it(grid, shards, tmp_path, monkeypatch, capsys):
    # opted in: old cells stay as they were, new ones record the new code
    out = str(tmp_path / "grid")
    shutil.copytree(grid, out)
    code = records.code_record()
    monkeypatch.setattr(records, "code_record", lambda: other_code(code))
    train.main(tiny(shards, out, "--seeds=0,2", "--allow_changes=True"))
    assert "(recorded with other settings: code; not retrained)" in capsys.readouterr().out
    assert result(out, "attnres", 0)["pairing"]["code"] == records.code_fingerprints(code, "attnres")[0]
    assert result(out, "attnres", 2)["pairing"]["code"] == records.code_fingerprints(other_code(code), "attnres")[0]
    recorded = json.load(open(os.path.join(out, "config.json")))
    assert recorded["seeds"] == [0, 1, 2] and recorded["code"]["fingerprint"] == "0" * 64
    assert recorded["changes"] == [{"code": [code["fingerprint"], "0" * 64]}]


def test_the_data_sets_the_vocabulary(shards, tmp_path, monkeypatch):
    # vocab_size unset: GPT-2-headered shards without a manifest are GPT-2's (50257 ids -> 50304), a bytes
    # manifest's 257 ids -> 320; the resolved number is what the cell records, so a rerun that sets it is no change
    import report
    from data.prepare import prepare

    monkeypatch.setattr(report, "main", lambda argv: None)
    unset = lambda data, out: [
        a for a in tiny(data, out, "--max_iters=1", "--arms=attnres", "--eval_tokens=900") if "vocab_size" not in a
    ]  # 900: the 2 x 56 sequences of 17 tokens that eval_layout='spread' reads fit the 2,000-token validation shard
    train.main(unset(shards, tmp_path / "gpt2"))
    assert result(tmp_path / "gpt2", "attnres")["config"]["vocab_size"] == 50304
    (tmp_path / "a.txt").write_text("the quick brown fox jumps over the lazy dog. " * 400)
    prepare(
        str(tmp_path / "bytes"),
        input=str(tmp_path / "*.txt"),
        tokenizer="bytes",
        val_tokens=2000,
        shard_tokens=100_000,
        workers=1,
        quiet=True,
    )
    train.main(unset(str(tmp_path / "bytes"), tmp_path / "o"))
    r = result(tmp_path / "o", "attnres")
    assert r["config"]["vocab_size"] == r["config"]["model"]["vocab_size"] == 320
    os.remove(tmp_path / "o" / "attnres" / "seed0" / "result.json")  # resumed, not refused: the same number
    train.main(unset(str(tmp_path / "bytes"), tmp_path / "o") + ["--vocab_size=320"])
    assert result(tmp_path / "o", "attnres")["config"] == r["config"]
    with pytest.raises(ConfigError, match="vocab_size=64 is less than the 257 ids .* set --vocab_size=320"):
        train.main(tiny(str(tmp_path / "bytes"), tmp_path / "small"))


# --- warm starts: a standard model's weights under every arm ------------------------------------------
# with a tiny norm_eps every variant's init is the standard residual, so each arm warm-started from a
# standard model starts at that model's validation loss

EPS = "--norm_eps=1e-10"
WARM_ARMS = {name: {"residual": name} for name in RESIDUALS if starts_as_standard(name)}


@pytest.fixture(scope="module")
def warm(shards, tmp_path_factory):
    """A trained standard cell (std), and every arm warm-started from its ckpt.pt over seeds 0 and 1 (warm)."""
    import report

    real, report.main = report.main, lambda argv: None  # its plots take most of the time; tested in test_report
    try:
        root = tmp_path_factory.mktemp("warm")
        train.main(tiny(shards, root / "std", EPS, "--arms={'standard': {}}"))
        ckpt = root / "std" / "standard" / "seed0" / "ckpt.pt"
        args = tiny(
            shards, root / "warm", EPS, f"--arms={WARM_ARMS!r}", "--max_iters=2", "--eval_interval=2", "--seeds=0,1"
        )
        train.main(args + [f"--init_from={ckpt}"])
    finally:
        report.main = real
    return SimpleNamespace(root=root, ckpt=ckpt, args=args, trained=torch.load(ckpt, weights_only=True)["model"])


@pytest.mark.parametrize("seed", [0, 1])
def test_warm_started_arms_pair_on_the_checkpoints_weights(warm, seed):
    model = GPT(GPTConfig(n_layer=2, n_head=2, n_embd=32, block_size=16, vocab_size=64))
    model.load_state_dict(warm.trained)
    pairings = [shared_pairing(result(warm.root / "warm", arm, seed)["pairing"]) for arm in WARM_ARMS]
    assert all(p == pairings[0] for p in pairings)
    assert pairings[0]["init_from"] == {
        "path": str(warm.ckpt),
        "sha256": hashlib.sha256(warm.ckpt.read_bytes()).hexdigest(),
    }
    assert pairings[0]["init_hash"] == records.shared_init_hash(model)  # the checkpoint's weights, whatever the seed


@pytest.mark.parametrize("arm", list(WARM_ARMS))
def test_a_warm_started_arm_starts_at_the_checkpoints_loss_with_a_fresh_optimizer(warm, arm):
    assert logged(warm.root / "warm", arm, key="val_loss")[0] == pytest.approx(
        logged(warm.root / "std", "standard", key="val_loss")[-1], rel=1e-4
    )
    config = json.load(open(warm.root / "warm" / arm / "seed0" / "config.json"))
    assert config["init_from"] == str(warm.ckpt)
    assert config["init_from_sha256"] == hashlib.sha256(warm.ckpt.read_bytes()).hexdigest()
    state = torch.load(warm.root / "warm" / arm / "seed0" / "ckpt.pt", weights_only=True)["optimizer"]["state"]
    assert all(s["step"] == 2 for s in state.values())  # a fresh optimizer: 2 steps, not the checkpoint's 8 more


def test_the_seed_still_orders_a_warm_starts_data(warm):
    assert len({result(warm.root / "warm", "dar", seed)["pairing"]["data_hash"] for seed in (0, 1)}) == 2


def test_a_plain_state_dict_warm_starts_as_its_checkpoint(warm, shards, tmp_path):
    torch.save(warm.trained, tmp_path / "weights.pt")
    train.main(
        tiny(shards, tmp_path / "sd", EPS, "--arms=attnres", "--max_iters=1", f"--init_from={tmp_path / 'weights.pt'}")
    )
    assert (
        logged(tmp_path / "sd", "attnres", key="val_loss")[0]
        == logged(warm.root / "warm", "attnres", key="val_loss")[0]
    )


def test_a_rerun_from_other_weights_or_another_path_is_a_change(warm, tmp_path):
    shutil.copy(warm.ckpt, tmp_path / "copy.pt")
    with pytest.raises(ConfigError, match=r"made with other settings: init_from \("):
        train.main(warm.args + [f"--init_from={tmp_path / 'copy.pt'}"])
    original = warm.ckpt.read_bytes()
    try:
        torch.save(dict(torch.load(warm.ckpt, weights_only=True), step=9), warm.ckpt)
        with pytest.raises(ConfigError, match=r"made with other settings: init_from_sha256 \("):
            train.main(warm.args + [f"--init_from={warm.ckpt}"])
    finally:
        warm.ckpt.write_bytes(original)


@pytest.mark.parametrize(
    "path, extra, message",
    [
        ("none.pt", [], "none.pt is missing or unreadable .*No such file"),
        ("junk.pt", [], "junk.pt is missing or unreadable"),
        ("list.pt", [], "list.pt holds neither a train.py ckpt.pt nor a state_dict"),
        ("dar", [], r"not a standard checkpoint \(residual='dar'"),
        ("std", ["--n_embd=64"], "has n_embd=32, arm 'attnres' has n_embd=64"),
        ("std", ["--n_head=4"], "has n_head=2, arm 'attnres' has n_head=4"),
        ("weights.pt", ["--n_layer=4"], r"does not fit arm 'attnres': transformer.h.2.attn.* is absent"),
        ("weights.pt", ["--vocab_size=128"], r"lm_head.weight is \(64, 32\) there, \(128, 32\) in the arm"),
    ],
)
def test_an_unusable_warm_start_is_one_line_before_training(warm, shards, tmp_path, path, extra, message):
    # checkpoints that are missing, unreadable, not standard or of another shape
    (tmp_path / "junk.pt").write_bytes(b"not a checkpoint")
    torch.save([1, 2], tmp_path / "list.pt")
    torch.save(warm.trained, tmp_path / "weights.pt")
    path = {"std": warm.ckpt, "dar": warm.root / "warm" / "dar" / "seed0" / "ckpt.pt"}.get(path, tmp_path / path)
    with pytest.raises(ConfigError, match=message) as e:
        train.main(tiny(shards, tmp_path / "bad", "--arms=attnres", f"--init_from={path}", *extra))
    assert "\n" not in str(e.value)
    assert not os.path.exists(tmp_path / "bad")


# --- the report at the grid's end: written once, again when an input is newer, never silently not at all --------


def finished_grid(out_dir, monkeypatch, tuned=False):
    """A grid of one finished cell (attnres seed0) whose report.main writes report.md and counts its calls."""
    cfg = dict(
        out_dir=str(out_dir),
        arms={"attnres": {}},
        seeds=[0],
        reference_arm="",
        tune_learning_rates=[1e-3, 1e-2] if tuned else [],
    )
    cell = out_dir / "attnres" / "seed0"
    cell.mkdir(parents=True)
    (cell / "result.json").write_text("{}")
    calls = []
    import report

    def fake_report(argv):
        calls.append(argv)
        (out_dir / "report.md").write_text(f"report {len(calls)}")

    monkeypatch.setattr(report, "main", fake_report)
    return cfg, calls


def age(path, seconds):
    """Set path's modification time seconds in the past (negative: in the future)."""
    when = os.path.getmtime(path) - seconds
    os.utime(path, (when, when))


def test_the_report_is_written_again_after_a_newer_downstream_result_or_tuning_choice(tmp_path, monkeypatch, capsys):
    cfg, calls = finished_grid(tmp_path, monkeypatch, tuned=True)
    (tmp_path / "tune").mkdir()
    (tmp_path / "tune" / "choice.json").write_text("{}")
    cells.write_report(cfg)
    cells.write_report(cfg)
    assert len(calls) == 1 and "report.md is up to date with every result" in capsys.readouterr().out
    for newer in (tmp_path / "attnres" / "seed0" / "downstream.json", tmp_path / "tune" / "choice.json"):
        newer.write_text("{}")  # scored later (python downstream.py), or the tuning chose again (--allow_changes)
        age(newer, -10)
        before = len(calls)
        cells.write_report(cfg)
        assert len(calls) == before + 1, f"the report ignores a newer {newer.name}"
        age(newer, 100)  # older than the report again: the next one is up to date
        cells.write_report(cfg)
        assert len(calls) == before + 1
    assert not (tmp_path / "report.lock").exists()


@pytest.mark.parametrize("lock_text", ["123 another-host", "not a lock"])
def test_a_report_lock_this_host_cannot_check_is_named_with_the_command_that_frees_it(tmp_path, monkeypatch, lock_text):
    cfg, calls = finished_grid(tmp_path, monkeypatch)
    lock = tmp_path / "report.lock"
    lock.write_text(lock_text)  # left by a worker on another host of a shared filesystem, or by hand
    monkeypatch.setattr(cells, "REPORT_WAIT_S", 0)
    with pytest.raises(DataError) as err:
        cells.write_report(cfg)
    assert str(err.value).startswith(f"no report written: {lock} is held by ") and str(err.value).endswith(
        f"; if no run is writing it: rm {lock}; python report.py {tmp_path}"
    ), str(err.value)
    assert not calls and lock.read_text() == lock_text
    # another host's worker writing it: this one waits for its lock to go, then finds the report written
    monkeypatch.setattr(cells, "REPORT_WAIT_S", 60)
    monkeypatch.setattr(cells.time, "sleep", lambda seconds: lock.unlink())
    cells.write_report(cfg)
    assert len(calls) == 1 and not lock.exists()


def test_a_report_lock_of_a_live_process_here_is_left_to_it(tmp_path, monkeypatch, capsys):
    cfg, calls = finished_grid(tmp_path, monkeypatch)
    (tmp_path / "report.lock").write_text(f"{os.getppid()} {socket.gethostname()}")
    cells.write_report(cfg)
    assert not calls and f"report.md is being written by pid {os.getppid()} on " in capsys.readouterr().out


# --- damaged inputs and outputs: one line each ----------------------------------------------------------


def test_a_torn_result_is_one_line(shards, tmp_path):
    out = tmp_path / "o"
    args = tiny(shards, out, "--max_iters=2", "--eval_interval=2", "--arms=attnres")
    train.main(args)
    path = out / "attnres" / "seed0" / "result.json"
    path.write_text(path.read_text()[: len(path.read_text()) // 2])
    with pytest.raises(
        ConfigError, match="result.json is unreadable or damaged .*; delete it to finish the cell again"
    ):
        train.main(args)


def test_an_out_dir_that_cannot_be_written_is_one_line_before_training(shards, tmp_path):
    (tmp_path / "file").write_text("")
    with pytest.raises(DataError, match="cannot write into .*file/o .*; choose another --out_dir") as e:
        train.main(tiny(shards, tmp_path / "file" / "o"))
    assert "\n" not in str(e.value)


@pytest.mark.parametrize(
    "extra, error, message",
    [
        (
            ["--eval_tokens=5000"],
            ConfigError,
            "eval_tokens=5000 is more than the validation shard .* holds .3,000 tokens",
        ),
        (["--vocab_size=16"], DataError, r"token id .* >= vocab_size 16"),
    ],
)
def test_data_that_does_not_fit_the_settings_is_one_line(shards, tmp_path, extra, error, message):
    with pytest.raises(error, match=message):
        train.main(tiny(shards, tmp_path / "o", *extra))


def test_a_damaged_shard_is_one_line(shards, tmp_path):
    bad = tmp_path / "bad"
    shutil.copytree(shards, bad)
    with open(bad / "train_000002.bin", "r+b") as f:
        f.truncate(2000)
    with pytest.raises(DataError, match="train_000002.bin"):
        train.main(tiny(str(bad), tmp_path / "o"))


def test_divergence_stops_the_cell_and_the_grid_goes_on(shards, tmp_path, capsys):
    out = str(tmp_path / "o")
    train.main(tiny(shards, out, "--learning_rate=1e9", "--warmup_iters=0", "--grad_clip=0", "--seeds=0,1"))
    lines = capsys.readouterr().out
    for arm in ("attnres", "rd_attnres"):
        for seed in (0, 1):
            r = result(out, arm, seed)
            assert r["status"] == "diverged" and r["val_loss"] is None and r["routing"] is None
            assert r["diverged_at"] == 2 and r["reason"] == "train loss nan over steps 2-2"
            assert f"[{arm} seed{seed}] diverged: train loss nan" in lines
    # logged after the next evaluation: the validation loss stops it
    train.main(
        tiny(
            shards,
            tmp_path / "val",
            "--learning_rate=1e9",
            "--warmup_iters=0",
            "--grad_clip=0",
            "--log_interval=100",
            "--arms=attnres",
        )
    )
    r = result(tmp_path / "val", "attnres")
    assert r["status"] == "diverged" and r["diverged_at"] == 4 and r["reason"] == "validation loss nan at step 4"
    train.main(tiny(shards, out, "--learning_rate=1e9", "--warmup_iters=0", "--grad_clip=0", "--seeds=0,1"))
    assert "[attnres seed0] done already: diverged at step" in capsys.readouterr().out


def test_shards_are_checked_against_their_manifest(tmp_path):
    from data.prepare import prepare

    (tmp_path / "a.txt").write_text("the quick brown fox jumps over the lazy dog. " * 400)
    data = tmp_path / "data"
    prepare(str(data), input=str(tmp_path / "*.txt"), val_tokens=1000, shard_tokens=100_000, workers=1, quiet=True)
    args = tiny(str(data), tmp_path / "o", "--vocab_size=50304")
    write_shard(str(data / "train_000099.bin"), np.zeros(100, dtype=np.uint16))
    with pytest.raises(DataError, match="train_000099.bin is not listed in manifest.json"):
        train.main(args)
    os.remove(data / "train_000099.bin")
    with open(data / "train_000001.bin", "r+b") as f:  # other tokens, same size: only the sha256 tells
        f.seek(-2, 2)
        f.write(b"\x01\x00")
    with pytest.raises(DataError, match="train_000001.bin: its tokens differ from manifest.json"):
        train.main(args + ["--verify_shards=True"])


def test_relative_data_dir_is_under_the_project_from_any_directory(shards, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    train.main(tiny(os.path.relpath(shards, ROOT), "rel", "--max_iters=1", "--arms=attnres"))
    assert result(tmp_path / "rel", "attnres")["steps"] == 1  # out_dir: under the working directory
    assert result(tmp_path / "rel", "attnres")["config"]["data_dir"] == shards  # recorded resolved
    assert BUNDLED[resolve_data_dir(train.DEFAULTS["data_dir"])] == "bytes"
    # one that is there from the working directory is taken from there
    os.makedirs("data/shakespeare_bytes")
    assert resolve_data_dir(train.DEFAULTS["data_dir"]) == str(tmp_path / "data" / "shakespeare_bytes")


def test_pairing_and_reruns_cover_the_data_and_what_ran(shards, tmp_path, monkeypatch):
    import report

    monkeypatch.setattr(report, "main", lambda argv: None)  # tested in test_report
    data = tmp_path / "data"
    shutil.copytree(shards, data)
    args = tiny(str(data), tmp_path / "o", "--max_iters=2", "--eval_interval=2")
    train.main(args + ["--arms=attnres"])
    first = result(tmp_path / "o", "attnres")
    config = first["config"]
    val = np.fromfile(data / "val_000000.bin", dtype=np.uint16)[-3000:]  # past the header: the tokens themselves
    # the 62 reported sequences: every other one of 124 slots of 17 tokens, each the middle of 124 equal stretches
    starts = np.array([(2 * j + 1) * (3000 // 17) // (4 * 62) * 17 for j in range(0, 124, 2)], dtype=np.int64)
    rows = np.stack([val[s : s + 17] for s in starts])
    spread = hashlib.sha256(b"spread" + starts.tobytes() + rows.tobytes()).hexdigest()
    assert first["pairing"]["val_hash"] == config["val_hash"] == spread
    assert (config["device"], config["dtype"], config["torch_version"]) == ("cpu", "float32", torch.__version__)
    assert first["pairing"]["settings"]["dtype"] == "float32" and config["data_dir"] == str(data)
    # the same run asked for differently is no change: --device=auto on this CPU, data_dir relative to here
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    monkeypatch.setattr(torch.backends.mps, "is_available", lambda: False)
    monkeypatch.chdir(tmp_path)
    train.main(args + ["--arms=attnres", "--device=auto", "--data_dir=data"])

    def change_tokens(path, n):
        """The last n tokens of a shard, each one higher (mod 64): same length, other content."""
        tokens = np.fromfile(path, dtype=np.uint16)
        tokens[-n:] = (tokens[-n:] + 1) % 64
        tokens.tofile(path)

    # other tokens in a train shard, same length: a rerun is refused before training
    change_tokens(data / "train_000001.bin", 27000)
    with pytest.raises(ConfigError, match=r"other settings: train_data_sha256 \("):
        train.main(args + ["--arms=attnres"])
    # opted in, another arm of the seed on that data: the same sequence ids, other content, another record
    train.main(args + ["--arms=rd_attnres", "--allow_changes=True"])
    second = result(tmp_path / "o", "rd_attnres")["pairing"]
    assert second["data_hash"] != first["pairing"]["data_hash"] and second["val_hash"] == first["pairing"]["val_hash"]
    # other validation tokens: each started cell's val_hash tells
    change_tokens(data / "val_000000.bin", 3000)
    with pytest.raises(ConfigError, match=r"rd_attnres/seed0/config.json was made with other settings: val_hash \("):
        train.main(args + ["--arms=rd_attnres"])


def test_the_cpu_thread_count_is_a_setting(shards, tmp_path, monkeypatch):
    # compiled CPU kernels round differently on another thread count: recorded, so a rerun under
    # another count is refused and two cells that differ in it do not pair
    import report

    monkeypatch.setattr(report, "main", lambda argv: None)
    args = tiny(shards, tmp_path / "o", "--max_iters=1", "--arms=attnres")
    train.main(args)
    r = result(tmp_path / "o", "attnres")
    assert r["config"]["cpu_threads"] == r["pairing"]["settings"]["cpu_threads"] == torch.get_num_threads() == 1
    monkeypatch.setattr(torch, "get_num_threads", lambda: 2)
    with pytest.raises(ConfigError, match=r"other settings: cpu_threads \(1 -> 2\)"):
        train.main(args)


def run_cli(args, env=ENV, **kwargs):
    return subprocess.run(
        [sys.executable, "train.py", *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300, **kwargs
    )


def test_cli_errors_are_one_line(shards, tmp_path):
    proc = run_cli(tiny(shards, tmp_path / "o", "--seeds=a,b"))
    assert proc.returncode == 1 and proc.stderr.strip().count("\n") == 0, proc.stderr[-2000:]
    assert proc.stderr.startswith("error: seeds=['a', 'b']: give distinct non-negative integers")


def test_ddp_default_batch_equals_single_process(shards, tmp_path):
    # the default batch (8 sequences x 1 micro-step) under 2 ranks: each rank takes half of each step;
    # checkpoints (every 3 steps) fall inside log intervals (every 2), where the ranks' losses are carried
    args = [
        "--batch_size=8",
        "--gradient_accumulation_steps=1",
        "--arms=attnres",
        "--max_iters=6",
        "--eval_interval=3",
        "--log_interval=2",
    ]
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc_per_node=2",
            "train.py",
            *tiny(shards, tmp_path / "ddp", *args),
        ],
        cwd=ROOT,
        env=ENV,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    # the reference runs as a process too, with the ranks' thread count (it changes fp32 rounding)
    single = run_cli(tiny(shards, tmp_path / "single", *args))
    assert single.returncode == 0, single.stderr[-2000:]
    np.testing.assert_allclose(logged(tmp_path / "ddp", "attnres"), logged(tmp_path / "single", "attnres"), rtol=1e-5)
    np.testing.assert_allclose(
        logged(tmp_path / "ddp", "attnres", key="val_loss"),
        logged(tmp_path / "single", "attnres", key="val_loss"),
        rtol=1e-6,
    )
    # each rank evaluates every other sequence: gathered, the final losses per sequence are in order
    np.testing.assert_allclose(
        *(result(tmp_path / d, "attnres")["val_sequence_losses"] for d in ("ddp", "single")), rtol=1e-5
    )
    # the same cell but for the world size, which changes a step's rounding: recorded, so the two do not pair
    ddp, single = (result(tmp_path / d, "attnres")["pairing"] for d in ("ddp", "single"))
    assert (ddp["settings"].pop("world_size"), single["settings"].pop("world_size")) == (2, 1) and ddp == single


def test_compiled_runs_repeat_exactly_and_evaluate_as_eager(shards, tmp_path):
    # on two threads, compiled CPU kernels differ from run to run unless train.py asks for the
    # deterministic ones; each run is a fresh process, as a rerun would be. eval_tokens leaves a
    # short last evaluation batch, which must not recompile. The second run's graphs come from the compile cache
    # (attnres switches autocast off for its depth read and applies a custom autograd Function, which the cache
    # refused until machine.py allowed them: every cell traced its graphs again), and train the same numbers as the
    # first run's, traced
    args = [
        "--compile=True",
        "--max_iters=12",
        "--eval_interval=6",
        "--log_interval=3",
        "--arms=attnres",
        "--eval_tokens=600",
        "--eval_batch_size=8",
    ]
    logs = "recompiles,torch._functorch._aot_autograd.autograd_cache"
    cache = {"TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "cache")}  # cold: nothing of an earlier test
    for run, compiled in (("a", "AOTAutograd cache miss"), ("b", "AOTAutograd cache hit")):
        proc = run_cli(
            tiny(shards, tmp_path / run, *args), env={**ENV, "OMP_NUM_THREADS": "2", "TORCH_LOGS": logs, **cache}
        )
        assert proc.returncode == 0, proc.stderr[-2000:]
        assert proc.stderr.count(compiled) == 2 and "Bypassing" not in proc.stderr, proc.stderr[-3000:]  # train, eval
        # training and evaluation graphs, compiled once each (the evaluation graph is the one recompile,
        # for grad mode): none for a batch shape (the short last evaluation batch is padded), none per
        # evaluation (dynamo stops recompiling after 8), none for model attributes set after the first
        assert "size mismatch" not in proc.stderr and proc.stderr.count("Recompiling function") <= 1, proc.stderr[
            -3000:
        ]
    assert logged(tmp_path / "a", "attnres") == logged(tmp_path / "b", "attnres")
    assert logged(tmp_path / "a", "attnres", key="val_loss") == logged(tmp_path / "b", "attnres", key="val_loss")
    # the compiled evaluation at the last checkpoint equals an eager one of the same weights
    ckpt = torch.load(tmp_path / "a" / "attnres" / "seed0" / "ckpt.pt", weights_only=True)
    model = GPT(GPTConfig(**ckpt["config"]["model"]))
    model.load_state_dict(ckpt["model"])
    val = records.ValidationText(open_shard(os.path.join(shards, "val_000000.bin")), None)
    rows = val.rows(600, 16, ckpt["config"]["eval_layout"])  # the cell's own sequences
    eager = train.evaluate(model, rows, SimpleNamespace(block_size=16, eval_tokens=600, eval_batch_size=8), ONE_PROCESS)
    assert abs(eager - logged(tmp_path / "a", "attnres", key="val_loss")[-1]) < 1e-5


# --- what users see: the evaluated tokens, the timings, the keys that change a result ---------------


class TargetMean(torch.nn.Module):
    """A stand-in model whose per-token 'loss' is its target id (0 where ignored): evaluate() then returns
    the mean id of the tokens it evaluated, and sequence_losses each sequence's, which a direct count can check."""

    def forward(self, x, y, reduction="none"):
        return None, (y * (y != -1)).float()


@pytest.mark.parametrize("eval_tokens", [1024, 1000, 17, 33, 32])
def test_evaluation_covers_every_whole_sequence_in_eval_tokens(eval_tokens):
    T = 16
    val = np.arange(1, 3001, dtype=np.uint16)  # token i + 1 at position i: a sum tells which ones were read
    # the direct count: sequence j predicts positions j*T+1 .. j*T+T and needs positions up to j*T+T
    targets = [p for j in range(eval_tokens) for p in range(j * T + 1, j * T + T + 1) if j * T + T < eval_tokens]
    for batch in (1, 3, 64):
        cell = SimpleNamespace(block_size=T, eval_tokens=eval_tokens, eval_batch_size=batch)
        rows = records.ValidationText(val, None).rows(eval_tokens, T, "first")
        mean = train.evaluate(TargetMean(), rows, cell, ONE_PROCESS)
        assert mean == pytest.approx(np.mean(val[targets].astype(np.float64)), rel=1e-12)
        per_sequence = [
            np.mean(val[j * T + 1 : j * T + T + 1].astype(np.float64)) for j in range((eval_tokens - 1) // T)
        ]
        assert train.sequence_losses(TargetMean(), rows, cell, ONE_PROCESS).tolist() == pytest.approx(
            per_sequence, rel=1e-12
        )
    assert len(targets) == (eval_tokens - 1) // T * T  # what result.json records as eval_tokens


def test_timings_count_training_apart_from_evaluation(shards, tmp_path, monkeypatch):
    # a fake clock: each training step takes 1 s, each evaluation 100 s, nothing else takes time; and a
    # wall clock set back an hour, then forward ten days, mid-cell: no duration may follow it
    import report

    monkeypatch.setattr(report, "main", lambda argv: None)
    clock, tick, steps = [0.0], {"step": 1.0, "evaluation": 100.0}, [0]
    wall = lambda: clock[0] + {0: 0, 1: -3600, 2: 10 * 86400}[min(steps[0] // 3, 2)]
    fake = type("FakeTime", (), {"monotonic": staticmethod(lambda: clock[0]), "time": staticmethod(wall)})
    monkeypatch.setattr(train, "time", fake)
    monkeypatch.setattr(progress, "time", fake)
    real_step, real_eval, real_setup = train.backward_step, train.sequence_losses, train.setup

    def step(*args):
        clock[0] += tick["step"]
        steps[0] += 1
        return real_step(*args)

    def evaluation(*args):
        clock[0] += tick["evaluation"]
        return real_eval(*args)

    monkeypatch.setattr(train, "backward_step", step)
    monkeypatch.setattr(train, "sequence_losses", evaluation)
    # as on a GPU of a 1 TFLOP/s peak, so that MFU is reported
    monkeypatch.setattr(train, "setup", lambda cfg: dataclasses.replace(real_setup(cfg), peak_flops=1e12))
    args = ["--max_iters=8", "--eval_interval=4", "--log_interval=2", "--arms=attnres"]
    train.main(tiny(shards, tmp_path / "o", *args, "--seeds=0,1"))
    n, evals, tokens_per_step = 8, 3, 4 * 16
    flops_per_step = (
        GPT(
            GPTConfig(n_layer=2, n_head=2, n_embd=32, block_size=16, vocab_size=64, residual="attnres")
        ).flops_per_token(16)
        * tokens_per_step
    )
    for seed in (0, 1):
        log = log_records(tmp_path / "o", "attnres", seed)
        assert [r["eval_s"] for r in log if "val_loss" in r] == [100.0] * evals
        for r in (r for r in log if "loss" in r):
            assert r["ms_per_step"] == 1000.0 and r["tokens_per_s"] == tokens_per_step
            assert r["mfu"] == pytest.approx(flops_per_step / 1e12, rel=1e-12)
            evals_left = sum(1 for s in range(r["step"] + 1, n + 1) if s % 4 == 0 or s == n)
            assert r["eta_cell_s"] == (n - r["step"]) * 1.0 + evals_left * 100.0
            later_cells = 1 - seed  # seed 1 is the grid's last cell
            assert r["eta_grid_s"] == r["eta_cell_s"] + later_cells * (n * 1.0 + evals * 100.0)
        assert result(tmp_path / "o", "attnres", seed)["wall_time_s"] == n * 1.0 + evals * 100.0
    # a frozen clock (the same time throughout): no time measured, so the rates are unknown, not a crash
    tick.update(step=0.0, evaluation=0.0)
    train.main(tiny(shards, tmp_path / "frozen", *args))
    trained = [r for r in log_records(tmp_path / "frozen", "attnres") if "loss" in r]
    assert [r["step"] for r in trained] == [2, 4, 6, 8]
    assert all(r["ms_per_step"] == 0 and r["tokens_per_s"] is None and r["mfu"] is None for r in trained)
    assert all(r["eta_cell_s"] == r["eta_grid_s"] == 0 for r in trained)
    assert result(tmp_path / "frozen", "attnres")["wall_time_s"] == 0


class FullDisk:
    """log.jsonl as a disk that fills up: its write fails with ENOSPC from the line of step `full` on."""

    def __init__(self, path, mode, full):
        self.file, self.full = open(path, mode), full

    def write(self, line):
        if json.loads(line)["step"] >= self.full:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return self.file.write(line)

    def __getattr__(self, name):
        return getattr(self.file, name)


def test_a_full_disk_while_logging_is_one_line_and_the_rerun_resumes(shards, tmp_path, monkeypatch):
    import report

    monkeypatch.setattr(report, "main", lambda argv: None)
    args = ["--max_iters=8", "--eval_interval=4", "--log_interval=1", "--arms=attnres"]
    train.main(tiny(shards, tmp_path / "whole", *args))
    monkeypatch.setattr(progress, "open", lambda path, mode: FullDisk(path, mode, full=6), raising=False)
    with pytest.raises(DataError) as e:
        train.main(tiny(shards, tmp_path / "o", *args))
    cell = tmp_path / "o" / "attnres" / "seed0"
    assert str(e.value) == (
        f"cannot write {cell / 'log.jsonl'} (No space left on device); the cell's last checkpoint "
        f"is kept: free disk space, then run the same command again to resume from it"
    )
    assert torch.load(cell / "ckpt.pt", weights_only=True)["step"] == 4 and not (cell / "result.json").exists()
    monkeypatch.undo()
    monkeypatch.setattr(report, "main", lambda argv: None)
    train.main(tiny(shards, tmp_path / "o", *args))  # space freed: resumes from step 4, as if never stopped
    assert without_timings(log_records(tmp_path / "o", "attnres")) == without_timings(
        log_records(tmp_path / "whole", "attnres")
    )
    assert result(tmp_path / "o", "attnres")["val_loss"] == result(tmp_path / "whole", "attnres")["val_loss"]


def test_evals_after_counts_the_evaluations_to_come():
    for n in range(1, 25):
        for k in range(1, 12):
            for step in range(-1, n + 1):  # -1: a cell not started, whose step 0 is evaluated too
                expected = sum(1 for s in range(step + 1, n + 1) if s % k == 0 or s == n)
                assert progress.evals_after(step, n, k) == expected


def test_time_left_counts_training_and_evaluation_apart():
    cell = SimpleNamespace(arm="a", seed=0, max_iters=100, eval_interval=25)
    todo = [("a", 0), ("b", 0), ("a", 1)]
    rates = {}
    clock = progress.TimeLeft(cell, todo, rates)
    clock.evaluated(30.0)  # step 0's evaluation: compiles
    left, grid = clock.after(10, 10, 50.0)  # the first interval compiles too: 5 s/step, not kept
    assert left == pytest.approx(90 * 5.0 + 4 * 30.0)
    assert clock.after(20, 10, 10.0)[0] == pytest.approx(80 * 1.0 + 4 * 30.0)  # 1 s/step from here
    clock.evaluated(2.0)  # the fastest evaluation is the one that counts
    left, grid = clock.after(30, 10, 30.0)  # (10 + 30) s / 20 steps = 2 s/step
    assert left == pytest.approx(70 * 2.0 + 3 * 2.0)
    # the two cells after this one, at this arm's rates (no other arm measured yet): 100 steps, 5 evaluations
    assert grid == pytest.approx(left + 2 * (100 * 2.0 + 5 * 2.0))
    rates["b"] = (0.5, 1.0)  # once arm b has run in this process, its own rates
    assert clock.after(40, 10, 20.0)[1] == pytest.approx(60 * 2.0 + 3 * 2.0 + (100 * 0.5 + 5) + (200 + 10))


def test_time_left_before_any_evaluation():
    # a cell resumed off its evaluation steps (eval_interval changed, allow_changes) logs before it evaluates
    clock = progress.TimeLeft(SimpleNamespace(arm="a", seed=0, max_iters=100, eval_interval=30), [("a", 0)], {})
    assert clock.after(50, 10, 10.0) == pytest.approx((50 * 1.0, 50 * 1.0))  # no evaluation time measured yet


# every key of the config: how a rerun that changes only it must go. Values: a valid other value.
RERUN_GOES_ON = dict(
    seeds=[0],
    arms="attnres",
    reference_arm="rd_attnres,attnres",
    log_interval=2,
    eval_batch_size=3,
    verify_shards=True,
    allow_changes=True,
    device="auto",
    data_dir="COPY",
    wandb_project="other",
    wandb_run_name="other",
    downstream_interval=2,
    downstream_max_per_task=0,
)
RERUN_REFUSED = dict(
    block_size=8,
    vocab_size=128,
    n_layer=4,
    n_head=4,
    n_embd=64,
    dropout=0.1,
    norm_eps=1e-5,
    attnres_block_size=2,
    rd_control="dup",
    routing_lr_scale=2.0,
    learning_rate=2e-2,
    max_iters=3,
    weight_decay=0.0,
    beta1=0.8,
    beta2=0.99,
    grad_clip=0.5,
    lr_schedule="wsd",
    warmup_iters=1,
    min_lr=1e-4,
    batch_size=2,
    gradient_accumulation_steps=2,
    dtype="bfloat16",
    compile=True,
    eval_interval=1,
    eval_tokens=900,
    eval_layout="first",
    optimizer="muon",
    activation_checkpointing=True,
    n_experts=2,
    tune_learning_rates=[1e-3],
)
RERUN_OTHERWISE = dict(
    out_dir="another out_dir is another grid",
    residual="every arm sets it: refused as overridden",
    dar_keys="no dar arm: refused as an option no arm trains",
    dar_start="likewise",
    hc_streams="no hc arm: likewise",
    init_from="tested in test_warm_start_from_a_standard_checkpoint",
    fsdp="needs torchrun; a setting, as world_size (test_fsdp_and_muon_under_torchrun_equal_one_process)",
    wandb_log="needs wandb; goes on (test_wandb_logs_one_run_per_cell)",
    downstream_bundle="needs byte-token data; goes on (test_downstream.py: test_the_downstream_evaluation_changes_no_training)",  # noqa: E501
    **dict.fromkeys(
        ("moe_top_k", "moe_shared_experts", "moe_expert_hidden", "moe_bias_rate", "moe_router_lr_scale"),
        "needs n_experts > 1: GPTConfig refuses it alone",
    ),
    **dict.fromkeys(
        ("muon_learning_rate", "cooldown_frac", "tune_seeds", "tune_iters", "tune_routing_lr_scales"),
        "unused alone (AdamW, cosine, no tuning): refused where given (test_records.py: "
        "test_a_setting_that_changes_nothing_is_refused_where_it_is_given)",
    ),
)


def test_a_rerun_goes_on_or_is_refused_key_by_key(shards, tmp_path, monkeypatch):
    import report

    reports = []  # the report's arguments (its plots would take most of the time; tested in test_report)
    monkeypatch.setattr(report, "main", reports.append)
    assert set(RERUN_GOES_ON) | set(RERUN_REFUSED) | set(RERUN_OTHERWISE) == set(train.DEFAULTS)
    shutil.copytree(shards, tmp_path / "copy")
    args = tiny(shards, tmp_path / "o", "--max_iters=2", "--eval_interval=2", "--seeds=0,1")
    train.main(args)
    grid = (tmp_path / "o" / "config.json").read_text()
    results = {p: p.read_text() for p in (tmp_path / "o").glob("*/seed*/result.json")}
    monkeypatch.setattr(cells, "GPT", lambda *a: pytest.fail("a rerun with a changed key trained"))
    for key, value in RERUN_GOES_ON.items():
        value = str(tmp_path / "copy") if value == "COPY" else value
        train.main(args + [f"--{key}={value}"])
        if key == "reference_arm":  # report.py's references, passed on
            assert reports[-1] == [str(tmp_path / "o"), "--reference=rd_attnres,attnres"]
    for key, value in RERUN_REFUSED.items():
        with pytest.raises(ConfigError, match=rf"config.json was made with other settings: {key} \("):
            train.main(args + [f"--{key}={value}"])
    assert (tmp_path / "o" / "config.json").read_text() == grid  # nothing was recorded
    assert {p: p.read_text() for p in results} == results


def test_the_grid_is_recorded_once_a_cell_trains(shards, tmp_path, monkeypatch):
    import report

    monkeypatch.setattr(report, "main", lambda argv: None)
    short = tmp_path / "short"
    short.mkdir()
    shutil.copy(os.path.join(shards, "val_000000.bin"), short)
    write_shard(str(short / "train_000001.bin"), np.arange(10, dtype=np.uint16))  # less than one sequence
    with pytest.raises(DataError, match="fewer than block_size"):
        train.main(tiny(str(short), tmp_path / "o"))
    assert not (tmp_path / "o" / "config.json").exists()  # the corrected rerun is not refused
    args = tiny(shards, tmp_path / "o", "--max_iters=2", "--eval_interval=2")
    train.main(args)
    grid = (tmp_path / "o" / "config.json").read_text()
    train.main(args + ["--learning_rate=0.5", "--allow_changes=True"])  # trains nothing: records nothing
    assert (tmp_path / "o" / "config.json").read_text() == grid


def test_a_copied_cell_folder_is_not_a_new_seed(shards, tmp_path, monkeypatch):
    import report

    monkeypatch.setattr(report, "main", lambda argv: None)
    args = tiny(shards, tmp_path / "o", "--max_iters=2", "--eval_interval=2", "--arms=attnres")
    train.main(args)
    cells = tmp_path / "o" / "attnres"
    shutil.copytree(cells / "seed0", cells / "seed7")
    with pytest.raises(ConfigError, match=r"seed7/result.json is the record of arm 'attnres' seed 0 \(a copied"):
        train.main(args + ["--seeds=0,7"])
    os.remove(cells / "seed7" / "result.json")
    with pytest.raises(ConfigError, match=r"seed7/config.json is the record of arm 'attnres' seed 0 \(a copied"):
        train.main(args + ["--seeds=0,7"])
    (cells / "seed0" / "config.json").write_text("[]")
    with pytest.raises(ConfigError, match="seed0/config.json holds list, not a train.py record"):
        train.main(args)


# --- optimizers, sharding, activation checkpointing, wandb ---------------------------------------


def test_muon_under_ddp_equals_one_process(shards, tmp_path):
    # DDP averages the gradients before Muon's step, so every rank orthogonalizes the same whole matrices
    args = [
        "--batch_size=8",
        "--arms=rd_attnres",
        "--max_iters=6",
        "--eval_interval=3",
        "--log_interval=2",
        "--optimizer=muon",
    ]
    ddp = torchrun("train.py", tiny(shards, tmp_path / "ddp", *args))
    assert ddp.returncode == 0, ddp.stderr[-2000:]
    train.main(tiny(shards, tmp_path / "single", *args))
    np.testing.assert_allclose(
        logged(tmp_path / "ddp", "rd_attnres"), logged(tmp_path / "single", "rd_attnres"), rtol=1e-5
    )
    # Newton-Schulz amplifies the gradient average's rounding (DDP adds two ranks' halves, one process the whole):
    # 2e-5 relative at step 6 on an AVX-512 Xeon, under 1e-5 on the machine this test was written on
    np.testing.assert_allclose(
        logged(tmp_path / "ddp", "rd_attnres", key="val_loss"),
        logged(tmp_path / "single", "rd_attnres", key="val_loss"),
        rtol=1e-4,
    )


class FakeWandb:
    """Stands in for the wandb package: records what train.py asks of it."""

    def __init__(self):
        self.runs, self.__spec__ = [], importlib.machinery.ModuleSpec("wandb", None)

    def init(self, **kwargs):
        run = types.SimpleNamespace(id=f"run{len(self.runs)}", kwargs=kwargs, logged=[], summary={}, finished=False)
        run.log = lambda entry, step: run.logged.append((step, entry))
        run.finish = lambda: setattr(run, "finished", True)
        self.runs.append(run)
        return run


def test_wandb_logs_one_run_per_cell(shards, tmp_path, monkeypatch):
    import report

    monkeypatch.setattr(report, "main", lambda argv: None)
    args = ["--max_iters=4", "--eval_interval=2", "--log_interval=2"]
    # off (the default): wandb is never imported
    monkeypatch.delitem(sys.modules, "wandb", raising=False)
    train.main(tiny(shards, tmp_path / "off", *args))
    assert "wandb" not in sys.modules
    fake = FakeWandb()
    monkeypatch.setitem(sys.modules, "wandb", fake)
    monkeypatch.setenv("WANDB_MODE", "offline")  # no login needed (records.check_wandb)
    train.main(tiny(shards, tmp_path / "on", *args, "--wandb_log=True", "--wandb_project=p", "--wandb_run_name=g"))
    assert [run.kwargs["name"] for run in fake.runs] == ["g/attnres/seed0", "g/rd_attnres/seed0"]
    for run, arm in zip(fake.runs, ("attnres", "rd_attnres")):
        r = result(tmp_path / "on", arm)
        assert run.kwargs["project"] == "p" and run.kwargs["group"] == "g" and run.finished
        assert {k: v for k, v in run.kwargs["config"].items() if k != "init_hash"} == r["config"]
        assert run.kwargs["config"]["init_hash"] == r["pairing"]["init_hash"]
        assert run.summary["pairing"] == r["pairing"] and run.summary["val_loss"] == r["val_loss"]
        logged = [dict(entry, step=step) for step, entry in run.logged]
        assert logged == [{k: v for k, v in e.items() if k != "routing"} for e in log_records(tmp_path / "on", arm)]
    # the same results as without it, timings aside
    for arm in ("attnres", "rd_attnres"):
        assert without_timings(log_records(tmp_path / "on", arm)) == without_timings(log_records(tmp_path / "off", arm))
    # a resumed cell continues its run
    os.remove(tmp_path / "on" / "attnres" / "seed0" / "result.json")
    train.main(
        tiny(
            shards,
            tmp_path / "on",
            *args,
            "--wandb_log=True",
            "--wandb_project=p",
            "--wandb_run_name=g",
            "--arms=attnres",
        )
    )
    assert fake.runs[-1].kwargs["id"] == "run0" and fake.runs[-1].kwargs["resume"] == "allow"


def test_a_warm_start_on_another_tokenizer_is_refused(shards, tmp_path, monkeypatch):
    import report
    from data.prepare import prepare

    monkeypatch.setattr(report, "main", lambda argv: None)
    (tmp_path / "a.txt").write_text("the quick brown fox jumps over the lazy dog. " * 400)
    prepare(
        str(tmp_path / "bytes"),
        input=str(tmp_path / "*.txt"),
        tokenizer="bytes",
        val_tokens=2000,
        shard_tokens=100_000,
        workers=1,
        quiet=True,
    )
    train.main(
        tiny(shards, tmp_path / "std", "--arms=standard", "--max_iters=2", "--eval_interval=2", "--vocab_size=320")
    )
    ckpt = tmp_path / "std" / "standard" / "seed0" / "ckpt.pt"  # trained on shards made elsewhere: GPT-2 ids
    with pytest.raises(ConfigError, match=r"was trained on gpt2 tokens, data_dir .*bytes holds bytes tokens"):
        train.main(
            tiny(
                str(tmp_path / "bytes"), tmp_path / "warm", "--arms=attnres", "--vocab_size=320", f"--init_from={ckpt}"
            )
        )
