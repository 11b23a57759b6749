import hashlib
import importlib.machinery
import io
import json
import os
import shutil
import socket
import subprocess
import sys
import types
from contextlib import nullcontext

import numpy as np
import pytest
import torch

import bookkeeping
import train
from configurator import ConfigError, configure
from data.prepare import BUNDLED, DataError, open_shard, write_shard
from model import GPT, RESIDUALS, GPTConfig

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ENV = {**os.environ, "OMP_NUM_THREADS": "1"}
torch.set_num_threads(1)  # tiny models: threads only contend with each other on a shared machine (3-20x slower)
TIMINGS = ("ms_per_step", "tokens_per_s", "mfu", "eta_cell_s", "eta_grid_s", "eval_s")


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


def test_learning_rate_schedules():
    cfg = dict(learning_rate=1.0, min_lr=0.1, warmup_iters=10, max_iters=110, lr_schedule="cosine", cooldown_frac=0.2)
    lr = lambda s, **kw: train.learning_rate_at(s, dict(cfg, **kw))
    assert lr(0) == pytest.approx(0.1) and lr(9) == pytest.approx(1.0) and lr(10) == pytest.approx(1.0)
    assert lr(60) == pytest.approx(0.55) and lr(110) == pytest.approx(0.1)
    assert lr(50, lr_schedule="wsd") == 1.0 and lr(88, lr_schedule="wsd") == 1.0
    assert lr(99, lr_schedule="wsd") == pytest.approx(0.55) and lr(110, lr_schedule="wsd") == pytest.approx(0.1)


@pytest.mark.parametrize("path, world", [("config/rd_120m.py", 8), ("config/rd_343m.py", 8),
                                         ("config/rd_controls_120m.py", 8), ("config/dar_120m.py", 8),
                                         ("config/dar_ablations_120m.py", 8), ("config/dar_1b.py", 8),
                                         ("config/dar_shakespeare.py", 1)])
def test_config_files_are_valid(path, world, monkeypatch):
    monkeypatch.chdir(ROOT)
    cfg = configure(train.DEFAULTS, [path])
    bookkeeping.check_config(cfg, world)
    if world == 8:  # the paper protocol: GPT-2 tokens, 2^19 tokens per step, 2.0B (controls: 0.5B) tokens per run
        assert cfg["vocab_size"] == 50304
        assert cfg["batch_size"] * cfg["gradient_accumulation_steps"] * cfg["block_size"] == 2 ** 19
        assert cfg["max_iters"] * 2 ** 19 == pytest.approx(0.5e9 if "controls" in path else 2.0e9, rel=1e-3)


# --- the step's gradient and the evaluation, in process ----------------------------------------

def tiny_model(residual="rd_attnres", dropout=0.0):
    torch.manual_seed(0)
    model = GPT(GPTConfig(n_layer=2, n_head=2, n_embd=32, block_size=16, vocab_size=64, residual=residual,
                          dropout=dropout))
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
                batches.append((x[start:start + n], y[start:start + n]))
                start += n
            loss += train.backward_step(model, batches, 8, dict(world=len(ranks), autocast=nullcontext()))
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
            torch.testing.assert_close(grad[name], reference[name], rtol=1e-5, atol=1e-6 * reference[name].abs().max().item(),
                                       msg=f"{ranks} {name}")


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    d = tmp_path_factory.mktemp("shards")
    rng = np.random.default_rng(0)
    # a learnable stream: a repeating pattern with noise, tokens < 64
    stream = (np.arange(60_000) % 17 + rng.integers(0, 3, 60_000)).astype(np.uint16)
    write_shard(str(d / "val_000000.bin"), stream[:3000])
    write_shard(str(d / "train_000001.bin"), stream[3000:30000])
    write_shard(str(d / "train_000002.bin"), stream[30000:])
    return str(d)


def test_evaluation_is_independent_of_eval_batch_size(shards):
    model = tiny_model()
    val = open_shard(os.path.join(shards, "val_000000.bin"))
    cfg = dict(block_size=16, eval_tokens=1000)
    ctx = dict(rank=0, world=1, device="cpu", autocast=nullcontext())
    losses = [train.evaluate(model, val, dict(cfg, eval_batch_size=b), ctx) for b in (1, 7, 62, 100)]
    assert max(losses) - min(losses) < 1e-6
    # the reference: per-token losses of the 62 whole sequences in the first 1000 tokens, one pass
    seqs = torch.from_numpy(np.stack([val[j * 16:j * 16 + 17] for j in range(62)]).astype(np.int64))
    with torch.no_grad():
        logits, _ = model(seqs[:, :-1], seqs[:, 1:])
        expected = torch.nn.functional.cross_entropy(logits.flatten(0, 1), seqs[:, 1:].flatten()).item()
    assert abs(losses[0] - expected) < 1e-6
    # two ranks' halves, summed as the all-reduce does, are the same set
    assert abs(train.evaluate(model, val, dict(cfg, eval_tokens=500, eval_batch_size=7), ctx) - losses[0]) > 1e-6


# --- tiny runs on synthetic shards -----------------------------------------------------------

def tiny(shards, out_dir, *extra):
    return [f"--data_dir={shards}", f"--out_dir={out_dir}", "--n_layer=2", "--n_head=2", "--n_embd=32",
            "--block_size=16", "--vocab_size=64", "--batch_size=4", "--max_iters=8", "--eval_interval=4",
            "--log_interval=1", "--eval_tokens=1000", "--compile=False", "--seeds=0", "--warmup_iters=2",
            "--learning_rate=1e-2", "--min_lr=1e-3", "--device=cpu", *extra]


def log_records(out_dir, arm, seed=0):
    with open(os.path.join(out_dir, arm, f"seed{seed}", "log.jsonl")) as f:
        return [json.loads(line) for line in f]


def records(out_dir, arm, seed=0, key="loss"):
    return [r[key] for r in log_records(out_dir, arm, seed) if key in r]


def result(out_dir, arm, seed=0):
    with open(os.path.join(out_dir, arm, f"seed{seed}", "result.json")) as f:
        return json.load(f)


def without_scheme_options(pairing):
    """A pairing record without the options of one scheme (rd_control, ...), which only its arms record."""
    options = {k for scheme in RESIDUALS.values() for k in scheme.options}
    return dict(pairing, settings={k: v for k, v in pairing["settings"].items() if k not in options})


def without_timings(log):
    return [{k: v for k, v in r.items() if k not in TIMINGS} for r in log]


def test_run_contract_pairing_provenance_and_reruns(shards, tmp_path, monkeypatch, capsys):
    out = str(tmp_path / "grid")
    train.main(tiny(shards, out, "--seeds=0,1"))
    code = bookkeeping.code_record()
    assert len(code["fingerprint"]) == 64 and set(code) == {"fingerprint", "files", "git_commit", "git_dirty"}
    for arm in ("attnres", "rd_attnres"):
        for seed in (0, 1):
            cell = os.path.join(out, arm, f"seed{seed}")
            assert {"config.json", "log.jsonl", "ckpt.pt", "result.json"} <= set(os.listdir(cell))
            r = result(out, arm, seed)
            assert r["tokens"] == 8 * 4 * 16 and r["steps"] == 8 and np.isfinite(r["val_loss"])
            assert r["status"] == "finished" and r["diverged_at"] is None and r["reason"] is None and r["wall_time_s"] > 0
            config = json.load(open(os.path.join(cell, "config.json")))
            assert config["residual"] == arm and config["model"]["residual"] == arm and config["code"] == code
            assert config["arm"] == arm and config["seed"] == seed and r["config"] == config and r["code"] == code
            assert set(train.DEFAULTS) <= set(config) and config["learning_rate"] == 1e-2
            log = log_records(out, arm, seed)
            assert [x["step"] for x in log if "loss" in x] == list(range(1, 9))
            assert all({"step", "loss", "lr", "eta_cell_s", "eta_grid_s"} <= set(x) for x in log if "loss" in x)
            assert log[-2]["step"] == 8 and log[-2]["eta_cell_s"] == 0 and log[1]["eta_cell_s"] > 0
            assert (log[-2]["eta_grid_s"] == 0) == ((arm, seed) == ("rd_attnres", 1))  # the grid's last cell
            assert [x["step"] for x in log if "val_loss" in x] == [0, 4, 8]
            assert all(x["eval_s"] > 0 for x in log if "val_loss" in x)
        assert records(out, arm)[-1] < records(out, arm)[0]  # it learns
    # pairing, checked: within a seed, the same shared init, batches and settings; across seeds not
    for seed in (0, 1):
        a, b = result(out, "attnres", seed)["pairing"], result(out, "rd_attnres", seed)["pairing"]
        # a scheme's own options (rd_control) are recorded by its arms only: report.py pairs on the rest
        assert b["settings"].pop("rd_control") == "none" and "rd_control" not in a["settings"]
        assert a == b and set(a) == {"init_hash", "data_hash", "eval_tokens", "val_hash", "code", "init_from", "settings"}
        assert a["eval_tokens"] == 62 * 16 and a["code"] == code["fingerprint"] and a["init_from"] is None
        assert a["settings"]["learning_rate"] == 1e-2 and "residual" not in a["settings"]
        assert not {"arm", "seed", "seeds", "arms", "out_dir", "log_interval", "eval_batch_size"} & set(a["settings"])
    p0, p1 = result(out, "attnres", 0)["pairing"], result(out, "attnres", 1)["pairing"]
    assert p0["init_hash"] != p1["init_hash"] and p0["data_hash"] != p1["data_hash"]
    torch.manual_seed(train.seed_for(0, 0))
    standard = GPT(GPTConfig(n_layer=2, n_head=2, n_embd=32, block_size=16, vocab_size=64))
    assert bookkeeping.shared_init_hash(standard) == p0["init_hash"]
    # the routing diagnostics are logged with each evaluation
    routing = result(out, "rd_attnres")["routing"]
    assert set(routing["qk_v_jsd"]) == {"0", "1"} and len(routing["weights"]["out"]) == 2
    paired = json.load(open(os.path.join(out, "paired.json")))
    assert paired["reference"] == "attnres" and paired["arms"]["rd_attnres"]["n"] == 2
    # a finished cell is skipped; --arms/--seeds select a subset, and the grid's config.json keeps both
    before = os.path.getmtime(os.path.join(out, "attnres", "seed0", "result.json"))
    train.main(tiny(shards, out, "--seeds=0", "--arms=attnres"))
    assert os.path.getmtime(os.path.join(out, "attnres", "seed0", "result.json")) == before
    grid = json.load(open(os.path.join(out, "config.json")))
    assert grid["seeds"] == [0, 1] and list(grid["arms"]) == ["attnres", "rd_attnres"]
    # a changed rerun is refused, naming what changed; nothing is written
    with pytest.raises(ConfigError, match=r"config.json was made with other settings: learning_rate \(0.01 -> 0.0001\), "
                                          r"max_iters \(8 -> 50\); .*--allow_changes=True"):
        train.main(tiny(shards, out, "--learning_rate=1e-4", "--max_iters=50"))
    monkeypatch.setattr(bookkeeping, "code_record",
                        lambda: dict(code, fingerprint="0" * 64, files=dict(code["files"], **{"model.py": "0" * 64})))
    with pytest.raises(ConfigError, match=r"made with other settings: code changed \(model.py\); .*a new --out_dir"):
        train.main(tiny(shards, out))
    assert json.load(open(os.path.join(out, "config.json")))["code"] == code
    # extending the grid under new code, opted in: old cells stay as they were, new ones record the new code
    capsys.readouterr()
    train.main(tiny(shards, out, "--seeds=0,2", "--allow_changes=True"))
    assert "(recorded with other settings: code; not retrained)" in capsys.readouterr().out
    assert result(out, "attnres", 0)["pairing"]["code"] == code["fingerprint"]
    assert result(out, "attnres", 2)["pairing"]["code"] == "0" * 64
    grid = json.load(open(os.path.join(out, "config.json")))
    assert grid["seeds"] == [0, 1, 2] and grid["code"]["fingerprint"] == "0" * 64
    assert grid["changes"] == [{"code": [code["fingerprint"], "0" * 64]}]


def test_changed_resume_is_recorded_and_unpairs(shards, tmp_path):
    out = str(tmp_path / "o")
    train.main(tiny(shards, out, "--max_iters=6", "--eval_interval=3"))
    for arm in ("attnres", "rd_attnres"):  # as if killed after the checkpoint at step 3
        os.remove(os.path.join(out, arm, "seed0", "result.json"))
    with pytest.raises(ConfigError, match=r"learning_rate \(0.01 -> 0.02\)"):
        train.main(tiny(shards, out, "--max_iters=6", "--eval_interval=3", "--learning_rate=2e-2"))
    # the same change to one arm only, opted in: recorded in its cell, and the seed is not paired
    train.main(tiny(shards, out, "--max_iters=6", "--eval_interval=3", "--learning_rate=2e-2", "--arms=attnres",
                    "--allow_changes=True"))
    train.main(tiny(shards, out, "--max_iters=6", "--eval_interval=3", "--arms=rd_attnres", "--allow_changes=True"))
    changed, same = result(out, "attnres"), result(out, "rd_attnres")
    assert changed["pairing"]["changes"] == [{"step": 6, "changed": {"learning_rate": [0.01, 0.02]}}]
    assert changed["config"]["changes"] == changed["pairing"]["changes"] and "changes" not in same["pairing"]
    assert changed["pairing"]["settings"]["learning_rate"] == 0.02 and changed["pairing"] != same["pairing"]


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
    train.main(tiny(shards, tmp_path / "val", "--learning_rate=1e9", "--warmup_iters=0", "--grad_clip=0",
                    "--log_interval=100", "--arms=attnres"))
    r = result(tmp_path / "val", "attnres")
    assert r["status"] == "diverged" and r["diverged_at"] == 4 and r["reason"] == "validation loss nan at step 4"
    train.main(tiny(shards, out, "--learning_rate=1e9", "--warmup_iters=0", "--grad_clip=0", "--seeds=0,1"))
    assert "[attnres seed0] done already: diverged at step" in capsys.readouterr().out


def test_warm_start_from_a_standard_checkpoint(shards, tmp_path, monkeypatch):
    # with a tiny norm_eps every variant's init is the standard residual, so each arm warm-started from a
    # standard model starts at that model's validation loss
    import report
    monkeypatch.setattr(report, "main", lambda argv: None)  # its plots take most of the time; tested in test_report
    eps = "--norm_eps=1e-10"
    train.main(tiny(shards, tmp_path / "std", eps, "--arms={'standard': {}}"))
    ckpt = tmp_path / "std" / "standard" / "seed0" / "ckpt.pt"
    trained = torch.load(ckpt, weights_only=True)["model"]
    sha256 = hashlib.sha256(ckpt.read_bytes()).hexdigest()
    arms = {name: {"residual": name} for name in RESIDUALS}
    warm = tiny(shards, tmp_path / "warm", eps, f"--arms={arms!r}", "--max_iters=2", "--eval_interval=2", "--seeds=0,1")
    train.main(warm + [f"--init_from={ckpt}"])
    model = GPT(GPTConfig(n_layer=2, n_head=2, n_embd=32, block_size=16, vocab_size=64))
    model.load_state_dict(trained)
    for seed in (0, 1):
        pairings = [without_scheme_options(result(tmp_path / "warm", arm, seed)["pairing"]) for arm in arms]
        assert all(p == pairings[0] for p in pairings)
        assert pairings[0]["init_from"] == {"path": str(ckpt), "sha256": sha256}
        assert pairings[0]["init_hash"] == bookkeeping.shared_init_hash(model)  # the checkpoint's weights, whatever the seed
    for arm in arms:
        assert records(tmp_path / "warm", arm, key="val_loss")[0] == pytest.approx(
            records(tmp_path / "std", "standard", key="val_loss")[-1], rel=1e-4), arm
        config = json.load(open(tmp_path / "warm" / arm / "seed0" / "config.json"))
        assert config["init_from"] == str(ckpt) and config["init_from_sha256"] == sha256
        state = torch.load(tmp_path / "warm" / arm / "seed0" / "ckpt.pt", weights_only=True)["optimizer"]["state"]
        assert all(s["step"] == 2 for s in state.values())  # a fresh optimizer: 2 steps, not the checkpoint's 8 more
    # the seed still orders the data
    assert len({result(tmp_path / "warm", "dar", seed)["pairing"]["data_hash"] for seed in (0, 1)}) == 2
    # a plain state_dict works too
    weights = tmp_path / "weights.pt"
    torch.save(trained, weights)
    train.main(tiny(shards, tmp_path / "sd", eps, "--arms=attnres", "--max_iters=1", f"--init_from={weights}"))
    from_weights, from_ckpt = (records(tmp_path / d, "attnres", key="val_loss")[0] for d in ("sd", "warm"))
    assert from_weights == from_ckpt
    # a rerun from other weights, or from the same weights at another path, is a change
    shutil.copy(ckpt, tmp_path / "copy.pt")
    with pytest.raises(ConfigError, match=r"made with other settings: init_from \("):
        train.main(warm + [f"--init_from={tmp_path / 'copy.pt'}"])
    torch.save(dict(torch.load(ckpt, weights_only=True), step=9), ckpt)
    with pytest.raises(ConfigError, match=r"made with other settings: init_from_sha256 \("):
        train.main(warm + [f"--init_from={ckpt}"])
    # checkpoints that are missing, unreadable, not standard or of another shape: one line, before training
    (tmp_path / "junk.pt").write_bytes(b"not a checkpoint")
    torch.save([1, 2], tmp_path / "list.pt")
    for path, extra, message in [
            (tmp_path / "none.pt", [], "none.pt is missing or unreadable .*No such file"),
            (tmp_path / "junk.pt", [], "junk.pt is missing or unreadable"),
            (tmp_path / "list.pt", [], "list.pt holds neither a train.py ckpt.pt nor a state_dict"),
            (tmp_path / "warm" / "dar" / "seed0" / "ckpt.pt", [], r"not a standard checkpoint \(residual='dar'"),
            (ckpt, ["--n_embd=64"], "has n_embd=32, arm 'attnres' has n_embd=64"),
            (ckpt, ["--n_head=4"], "has n_head=2, arm 'attnres' has n_head=4"),
            (weights, ["--n_layer=4"], r"does not fit arm 'attnres': transformer.h.2.attn.* is absent"),
            (weights, ["--vocab_size=128"], r"lm_head.weight is \(64, 32\) there, \(128, 32\) in the arm")]:
        with pytest.raises(ConfigError, match=message) as e:
            train.main(tiny(shards, tmp_path / "bad", "--arms=attnres", f"--init_from={path}", *extra))
        assert "\n" not in str(e.value)
    assert not os.path.exists(tmp_path / "bad")


def test_damaged_cells_and_outputs_are_one_line(shards, tmp_path):
    out = tmp_path / "o"
    args = tiny(shards, out, "--max_iters=4", "--eval_interval=2", "--log_interval=1", "--arms=attnres")
    train.main(args)
    cell = out / "attnres" / "seed0"
    whole = log_records(out, "attnres")
    text = (cell / "result.json").read_text()
    (cell / "result.json").write_text(text[:len(text) // 2])
    with pytest.raises(ConfigError, match="result.json is unreadable or damaged .*; delete it to finish the cell again"):
        train.main(args)
    os.remove(cell / "result.json")  # as if killed after the last checkpoint
    good = (cell / "ckpt.pt").read_bytes()
    older = io.BytesIO()
    torch.save({"model": {}, "step": 2}, older)
    for damage, message in [(good[:1000], "ckpt.pt is unreadable, truncated or empty"),
                            (b"", "ckpt.pt is unreadable, truncated or empty"),
                            (older.getvalue(), "ckpt.pt was written by an older train.py")]:
        (cell / "ckpt.pt").write_bytes(damage)
        with pytest.raises(ConfigError, match=message):
            train.main(args)
    (cell / "ckpt.pt").write_bytes(good)
    shutil.move(cell / "log.jsonl", tmp_path / "log.jsonl")
    with pytest.raises(ConfigError, match="log.jsonl is missing beside its ckpt.pt"):
        train.main(args)
    # a half-written last line (a full disk, a kill mid-write) is dropped on resume
    text = (tmp_path / "log.jsonl").read_text()
    (cell / "log.jsonl").write_text(text[:len(text) // 2] + "\n" + text[len(text) // 2:][:7])
    with pytest.raises(ConfigError, match="log.jsonl line .* is not a log record"):  # damage before the last line is not
        train.main(args)
    (cell / "log.jsonl").write_text(text + '{"step": 5, "lo')
    train.main(args)
    assert without_timings(log_records(out, "attnres")) == without_timings(whole)
    # an out_dir that cannot be written is reported before training
    (tmp_path / "file").write_text("")
    with pytest.raises(ConfigError, match="out_dir .*file/o is not writable"):
        train.main(tiny(shards, tmp_path / "file" / "o"))
    # eval_tokens beyond the validation shard, token ids beyond vocab_size, a damaged shard
    with pytest.raises(ConfigError, match="eval_tokens=5000 is more than the validation shard .* holds .3,000 tokens"):
        train.main(tiny(shards, tmp_path / "o3", "--eval_tokens=5000"))
    with pytest.raises(DataError, match=r"token id .* >= vocab_size 16"):
        train.main(tiny(shards, tmp_path / "o4", "--vocab_size=16"))
    bad = tmp_path / "bad"
    shutil.copytree(shards, bad)
    with open(bad / "train_000002.bin", "r+b") as f:
        f.truncate(2000)
    with pytest.raises(DataError, match="train_000002.bin"):
        train.main(tiny(str(bad), tmp_path / "o2"))


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
    assert BUNDLED[bookkeeping.resolve_data_dir(train.DEFAULTS["data_dir"])] == "bytes"
    # one that is there from the working directory is taken from there
    os.makedirs("data/shakespeare_bytes")
    assert bookkeeping.resolve_data_dir(train.DEFAULTS["data_dir"]) == str(tmp_path / "data" / "shakespeare_bytes")


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
    assert first["pairing"]["val_hash"] == config["val_hash"] == hashlib.sha256(val[:62 * 16 + 1].tobytes()).hexdigest()
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


def test_a_cell_is_trained_by_one_process_at_a_time(shards, tmp_path):
    cell, host = tmp_path / "o" / "attnres" / "seed0", socket.gethostname()
    lock = cell / "lock"
    with bookkeeping.cell_lock(str(cell), True):
        assert lock.read_text() == f"{os.getpid()} {host}"
        with pytest.raises(DataError, match=f"is being trained by pid {os.getpid()} on {host}; wait for it, or remove "):
            with bookkeeping.cell_lock(str(cell), True):
                pass
    assert not lock.exists()
    # a lock whose process is gone from this host is taken over, and released however the cell ends
    gone = subprocess.Popen([sys.executable, "-c", ""])
    gone.wait()
    lock.write_text(f"{gone.pid} {host}")
    with pytest.raises(KeyboardInterrupt):
        with bookkeeping.cell_lock(str(cell), True):
            assert lock.read_text() == f"{os.getpid()} {host}"
            raise KeyboardInterrupt
    assert not lock.exists()
    # another host's lock cannot be checked from here; ranks other than 0 take none
    lock.write_text(f"{gone.pid} elsewhere")
    with pytest.raises(DataError, match=f"by pid {gone.pid} on elsewhere"):
        with bookkeeping.cell_lock(str(cell), True):
            pass
    with bookkeeping.cell_lock(str(cell), False):
        assert lock.read_text() == f"{gone.pid} elsewhere"
    # train.py stops at a cell that a live process trains
    lock.write_text(f"{os.getppid()} {host}")
    with pytest.raises(DataError, match=f"attnres.seed0 is being trained by pid {os.getppid()}"):
        train.main(tiny(shards, tmp_path / "o", "--arms=attnres"))
    assert not os.path.exists(cell / "config.json")


def run_cli(args, env=ENV, **kwargs):
    return subprocess.run([sys.executable, "train.py", *args], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=300, **kwargs)


def test_cli_errors_are_one_line(shards, tmp_path):
    proc = run_cli(tiny(shards, tmp_path / "o", "--seeds=a,b"))
    assert proc.returncode == 1 and proc.stderr.strip().count("\n") == 0, proc.stderr[-2000:]
    assert proc.stderr.startswith("error: seeds=['a', 'b']: give distinct non-negative integers")


def test_ddp_default_batch_equals_single_process(shards, tmp_path):
    # the default batch (8 sequences x 1 micro-step) under 2 ranks: each rank takes half of each step;
    # checkpoints (every 3 steps) fall inside log intervals (every 2), where the ranks' losses are carried
    args = ["--batch_size=8", "--gradient_accumulation_steps=1", "--arms=attnres", "--max_iters=6", "--eval_interval=3",
            "--log_interval=2"]
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                           "train.py", *tiny(shards, tmp_path / "ddp", *args)], cwd=ROOT, env=ENV,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    # the reference runs as a process too, with the ranks' thread count (it changes fp32 rounding)
    single = run_cli(tiny(shards, tmp_path / "single", *args))
    assert single.returncode == 0, single.stderr[-2000:]
    np.testing.assert_allclose(records(tmp_path / "ddp", "attnres"), records(tmp_path / "single", "attnres"), rtol=1e-5)
    np.testing.assert_allclose(records(tmp_path / "ddp", "attnres", key="val_loss"),
                               records(tmp_path / "single", "attnres", key="val_loss"), rtol=1e-6)
    # the same cell but for the world size, which changes a step's rounding: recorded, so the two do not pair
    ddp, single = (result(tmp_path / d, "attnres")["pairing"] for d in ("ddp", "single"))
    assert (ddp["settings"].pop("world_size"), single["settings"].pop("world_size")) == (2, 1) and ddp == single


def test_compiled_runs_repeat_exactly_and_evaluate_as_eager(shards, tmp_path):
    # on two threads, compiled CPU kernels differ from run to run unless train.py asks for the
    # deterministic ones; each run is a fresh process, as a rerun would be. eval_tokens leaves a
    # short last evaluation batch, which must not recompile
    args = ["--compile=True", "--max_iters=12", "--eval_interval=6", "--log_interval=3", "--arms=attnres",
            "--eval_tokens=600", "--eval_batch_size=8"]
    for run in ("a", "b"):
        proc = run_cli(tiny(shards, tmp_path / run, *args), env={**ENV, "OMP_NUM_THREADS": "2", "TORCH_LOGS": "recompiles"})
        assert proc.returncode == 0, proc.stderr[-2000:]
        # training and evaluation graphs, compiled once each (the evaluation graph is the one recompile,
        # for grad mode): none for a batch shape (the short last evaluation batch is padded), none per
        # evaluation (dynamo stops recompiling after 8), none for model attributes set after the first
        assert "size mismatch" not in proc.stderr and proc.stderr.count("Recompiling function") <= 1, proc.stderr[-3000:]
    assert records(tmp_path / "a", "attnres") == records(tmp_path / "b", "attnres")
    assert records(tmp_path / "a", "attnres", key="val_loss") == records(tmp_path / "b", "attnres", key="val_loss")
    # the compiled evaluation at the last checkpoint equals an eager one of the same weights
    ckpt = torch.load(tmp_path / "a" / "attnres" / "seed0" / "ckpt.pt", weights_only=False)
    model = GPT(GPTConfig(**ckpt["config"]["model"]))
    model.load_state_dict(ckpt["model"])
    val = open_shard(os.path.join(shards, "val_000000.bin"))
    ctx = dict(rank=0, world=1, device="cpu", autocast=nullcontext())
    eager = train.evaluate(model, val, dict(block_size=16, eval_tokens=600, eval_batch_size=8), ctx)
    assert abs(eager - records(tmp_path / "a", "attnres", key="val_loss")[-1]) < 1e-5


def killed_at_step(kill, monkeypatch, argv):
    """train.main(argv) interrupted as a kill would, when it reaches step `kill` (after its checkpoints)."""
    real = train.learning_rate_at

    def dying(step, cfg):
        if step == kill:
            raise KeyboardInterrupt
        return real(step, cfg)
    monkeypatch.setattr(train, "learning_rate_at", dying)
    with pytest.raises(KeyboardInterrupt):
        train.main(argv)
    monkeypatch.setattr(train, "learning_rate_at", real)


def test_resume_equals_uninterrupted_line_for_line(shards, tmp_path, monkeypatch):
    # eval_interval (checkpoints) not a multiple of log_interval: a resumed interval holds steps from
    # before the interruption; and dropout, whose RNG state the checkpoint carries
    args = ["--max_iters=14", "--eval_interval=5", "--log_interval=3", "--dropout=0.1", "--arms=rd_attnres"]
    train.main(tiny(shards, tmp_path / "whole", *args))
    killed_at_step(12, monkeypatch, tiny(shards, tmp_path / "killed", *args))
    assert not os.path.exists(tmp_path / "killed" / "rd_attnres" / "seed0" / "result.json")
    train.main(tiny(shards, tmp_path / "killed", *args))
    whole, resumed = (log_records(tmp_path / d, "rd_attnres") for d in ("whole", "killed"))
    assert [r["step"] for r in whole if "loss" in r] == [3, 6, 9, 12, 14]
    assert without_timings(resumed) == without_timings(whole)
    assert result(tmp_path / "killed", "rd_attnres")["val_loss"] == result(tmp_path / "whole", "rd_attnres")["val_loss"]


# --- what users see: the evaluated tokens, the timings, the keys that change a result ---------------

class TargetMean(torch.nn.Module):
    """A stand-in model whose 'loss' is the sum of its (non-ignored) target ids: evaluate() then
    returns the mean id of the tokens it evaluated, which a direct count can check."""

    def forward(self, x, y, reduction="sum"):
        return None, (y * (y != -1)).sum().float()


@pytest.mark.parametrize("eval_tokens", [1024, 1000, 17, 33, 32])
def test_evaluation_covers_every_whole_sequence_in_eval_tokens(eval_tokens):
    T = 16
    val = np.arange(1, 3001, dtype=np.uint16)  # token i + 1 at position i: a sum tells which ones were read
    ctx = dict(rank=0, world=1, device="cpu", autocast=nullcontext())
    # the direct count: sequence j predicts positions j*T+1 .. j*T+T and needs positions up to j*T+T
    targets = [p for j in range(eval_tokens) for p in range(j * T + 1, j * T + T + 1) if j * T + T < eval_tokens]
    for batch in (1, 3, 64):
        mean = train.evaluate(TargetMean(), val, dict(block_size=T, eval_tokens=eval_tokens, eval_batch_size=batch), ctx)
        assert mean == pytest.approx(np.mean(val[targets].astype(np.float64)), rel=1e-12)
    assert len(targets) == (eval_tokens - 1) // T * T  # what result.json records as eval_tokens


def test_timings_count_training_apart_from_evaluation(shards, tmp_path, monkeypatch):
    # a fake clock: each training step takes 1 s, each evaluation 100 s, nothing else takes time
    import report
    monkeypatch.setattr(report, "main", lambda argv: None)
    clock = [0.0]
    monkeypatch.setattr(train, "time", type("FakeTime", (), {"time": staticmethod(lambda: clock[0])}))
    real_step, real_eval = train.backward_step, train.evaluate

    def step(*args):
        clock[0] += 1.0
        return real_step(*args)

    def evaluation(*args):
        clock[0] += 100.0
        return real_eval(*args)
    monkeypatch.setattr(train, "backward_step", step)
    monkeypatch.setattr(train, "evaluate", evaluation)
    train.main(tiny(shards, tmp_path / "o", "--max_iters=8", "--eval_interval=4", "--log_interval=2", "--seeds=0,1",
                    "--arms=attnres"))
    n, evals, tokens_per_step = 8, 3, 4 * 16
    for seed in (0, 1):
        log = log_records(tmp_path / "o", "attnres", seed)
        assert [r["eval_s"] for r in log if "val_loss" in r] == [100.0] * evals
        for r in (r for r in log if "loss" in r):
            assert r["ms_per_step"] == 1000.0 and r["tokens_per_s"] == tokens_per_step and r["mfu"] is None
            evals_left = sum(1 for s in range(r["step"] + 1, n + 1) if s % 4 == 0 or s == n)
            assert r["eta_cell_s"] == (n - r["step"]) * 1.0 + evals_left * 100.0
            later_cells = 1 - seed  # seed 1 is the grid's last cell
            assert r["eta_grid_s"] == r["eta_cell_s"] + later_cells * (n * 1.0 + evals * 100.0)
        assert result(tmp_path / "o", "attnres", seed)["wall_time_s"] == n * 1.0 + evals * 100.0


# every key of the config: how a rerun that changes only it must go. Values: a valid other value.
RERUN_GOES_ON = dict(seeds=[0], arms="attnres", reference_arm="rd_attnres", log_interval=2, eval_batch_size=3,
                     verify_shards=True, allow_changes=True, device="auto", data_dir="COPY", wandb_project="other",
                     wandb_run_name="other")
RERUN_REFUSED = dict(
    block_size=8, vocab_size=128, n_layer=4, n_head=4, n_embd=64, dropout=0.1, norm_eps=1e-5, attnres_block_size=2,
    rd_control="dup", routing_lr_scale=2.0, learning_rate=2e-2, max_iters=3, weight_decay=0.0, beta1=0.8, beta2=0.99,
    grad_clip=0.5, lr_schedule="wsd", warmup_iters=1, min_lr=1e-4, cooldown_frac=0.5, batch_size=2,
    gradient_accumulation_steps=2, dtype="bfloat16", compile=True, eval_interval=1, eval_tokens=900,
    optimizer="muon", muon_learning_rate=0.01, activation_checkpointing=True)
RERUN_OTHERWISE = dict(
    out_dir="another out_dir is another grid", residual="every arm sets it: refused as overridden",
    dar_keys="no dar arm: refused as an option no arm trains", hc_streams="no hc arm: likewise",
    init_from="tested in test_warm_start_from_a_standard_checkpoint",
    fsdp="needs torchrun; a setting, as world_size (test_fsdp_and_muon_under_torchrun_equal_one_process)",
    wandb_log="needs wandb; goes on (test_wandb_logs_one_run_per_cell)")


def test_a_rerun_goes_on_or_is_refused_key_by_key(shards, tmp_path, monkeypatch):
    import report
    monkeypatch.setattr(report, "main", lambda argv: None)
    assert set(RERUN_GOES_ON) | set(RERUN_REFUSED) | set(RERUN_OTHERWISE) == set(train.DEFAULTS)
    shutil.copytree(shards, tmp_path / "copy")
    args = tiny(shards, tmp_path / "o", "--max_iters=2", "--eval_interval=2", "--seeds=0,1")
    train.main(args)
    grid = (tmp_path / "o" / "config.json").read_text()
    results = {p: p.read_text() for p in (tmp_path / "o").glob("*/seed*/result.json")}
    monkeypatch.setattr(train, "GPT", lambda *a: pytest.fail("a rerun with a changed key trained"))
    for key, value in RERUN_GOES_ON.items():
        value = str(tmp_path / "copy") if value == "COPY" else value
        train.main(args + [f"--{key}={value}"])
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
    train.main(args + ["--seeds=1"])
    cells = tmp_path / "o" / "attnres"
    shutil.copytree(cells / "seed0", cells / "seed7")
    with pytest.raises(ConfigError, match=r"seed7/result.json is the result of arm 'attnres' seed 0 \(a copied"):
        train.main(args + ["--seeds=0,7"])
    os.remove(cells / "seed7" / "result.json")
    with pytest.raises(ConfigError, match=r"attnres/seed7 holds the record of arm 'attnres' seed 0 \(a copied"):
        train.main(args + ["--seeds=0,7"])
    # a checkpoint copied from another cell, or made with other settings, is not resumed
    os.remove(cells / "seed1" / "result.json")
    shutil.copy(cells / "seed0" / "ckpt.pt", cells / "seed1" / "ckpt.pt")
    with pytest.raises(ConfigError, match=r"seed1/ckpt.pt is the checkpoint of arm 'attnres' seed 0 \(a copied"):
        train.main(args + ["--seeds=1"])
    train.main(tiny(shards, tmp_path / "other", "--max_iters=2", "--eval_interval=2", "--arms=attnres", "--seeds=1",
                    "--learning_rate=2e-2"))
    shutil.copy(tmp_path / "other" / "attnres" / "seed1" / "ckpt.pt", cells / "seed1" / "ckpt.pt")
    with pytest.raises(ConfigError, match=r"seed1/ckpt.pt was saved with other settings: learning_rate; rerun"):
        train.main(args + ["--seeds=1"])
    # a checkpoint past a lowered max_iters is not trained on forever
    shutil.copy(tmp_path / "other" / "attnres" / "seed1" / "config.json", cells / "seed1" / "config.json")
    with pytest.raises(ConfigError, match=r"ckpt.pt is at step 2, past max_iters=1; set --max_iters=2 to finish it"):
        train.main(args + ["--seeds=1", "--max_iters=1", "--allow_changes=True"])
    (cells / "seed0" / "config.json").write_text("[]")
    with pytest.raises(ConfigError, match="seed0/config.json holds list, not a train.py record"):
        train.main(args)


# --- optimizers, sharding, activation checkpointing, wandb ---------------------------------------

KILLED_AT_STEP_4 = """
import sys
sys.path.insert(0, {root!r})
import train
real = train.learning_rate_at
def killed_at_step_4(step, cfg):
    if step == 4:
        raise KeyboardInterrupt
    return real(step, cfg)
train.learning_rate_at = killed_at_step_4
train.main(sys.argv[1:])
"""


def torchrun(script, args):
    return subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", script,
                           *args], cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=300)


def test_fsdp_killed_and_resumed_equals_one_process(shards, tmp_path):
    # 2 ranks under FSDP2, killed after the checkpoint at step 3 and resumed, against one process
    # uninterrupted: the same losses within fp32 rounding (the shards' sums run in another order)
    args = ["--batch_size=8", "--arms=attnres", "--max_iters=6", "--eval_interval=3", "--log_interval=2"]
    script = tmp_path / "killed.py"
    script.write_text(KILLED_AT_STEP_4.format(root=ROOT))
    cell = tmp_path / "fsdp" / "attnres" / "seed0"
    killed = torchrun(str(script), tiny(shards, tmp_path / "fsdp", *args, "--fsdp=True"))
    assert killed.returncode != 0 and (cell / "ckpt.pt").exists() and not (cell / "result.json").exists()
    assert torch.load(cell / "ckpt.pt", weights_only=False)["step"] == 3
    resumed = torchrun("train.py", tiny(shards, tmp_path / "fsdp", *args, "--fsdp=True"))
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    train.main(tiny(shards, tmp_path / "single", *args))
    np.testing.assert_allclose(records(tmp_path / "fsdp", "attnres"), records(tmp_path / "single", "attnres"), rtol=1e-5)
    np.testing.assert_allclose(records(tmp_path / "fsdp", "attnres", key="val_loss"),
                               records(tmp_path / "single", "attnres", key="val_loss"), rtol=1e-6)
    # the checkpoint gathered on rank 0 is a one-process checkpoint: the same names, the same optimizer layout
    fsdp, single = (torch.load(tmp_path / d / "attnres" / "seed0" / "ckpt.pt", weights_only=False) for d in ("fsdp", "single"))
    assert fsdp["model"].keys() == single["model"].keys()
    layout = lambda ckpt: [(g["params"], g["lr"], g["weight_decay"]) for g in ckpt["optimizer"]["param_groups"]]
    assert layout(fsdp) == layout(single)
    for name, tensor in single["model"].items():
        assert type(fsdp["model"][name]) is torch.Tensor
        torch.testing.assert_close(fsdp["model"][name], tensor, rtol=1e-4, atol=1e-5)
    for name, state in single["optimizer"]["state"].items():
        torch.testing.assert_close(fsdp["optimizer"]["state"][name]["exp_avg"], state["exp_avg"], rtol=1e-3, atol=1e-6)
    # a setting, as the world size: recorded, so the two do not pair
    a, b = (result(tmp_path / d, "attnres")["pairing"] for d in ("fsdp", "single"))
    assert (a["settings"].pop("fsdp"), b["settings"].pop("fsdp")) == (True, False)
    assert (a["settings"].pop("world_size"), b["settings"].pop("world_size")) == (2, 1) and a == b


def test_muon_under_ddp_equals_one_process(shards, tmp_path):
    # DDP averages the gradients before Muon's step, so every rank orthogonalizes the same whole matrices
    args = ["--batch_size=8", "--arms=rd_attnres", "--max_iters=6", "--eval_interval=3", "--log_interval=2",
            "--optimizer=muon"]
    ddp = torchrun("train.py", tiny(shards, tmp_path / "ddp", *args))
    assert ddp.returncode == 0, ddp.stderr[-2000:]
    train.main(tiny(shards, tmp_path / "single", *args))
    np.testing.assert_allclose(records(tmp_path / "ddp", "rd_attnres"), records(tmp_path / "single", "rd_attnres"),
                               rtol=1e-5)
    np.testing.assert_allclose(records(tmp_path / "ddp", "rd_attnres", key="val_loss"),
                               records(tmp_path / "single", "rd_attnres", key="val_loss"), rtol=1e-5)


def test_muon_trains_and_resumes_exactly(shards, tmp_path, monkeypatch):
    # Muon's momentum and AdamW's moments both go through the checkpoint: a killed run resumes line for line
    import report
    monkeypatch.setattr(report, "main", lambda argv: None)
    args = ["--max_iters=8", "--eval_interval=3", "--log_interval=2", "--arms=dar", "--optimizer=muon",
            "--activation_checkpointing=True"]
    train.main(tiny(shards, tmp_path / "whole", *args))
    losses = records(tmp_path / "whole", "dar")
    assert losses[-1] < losses[0] - 0.5  # it learns
    state = torch.load(tmp_path / "whole" / "dar" / "seed0" / "ckpt.pt", weights_only=False)["optimizer"]["state"]
    assert all("momentum_buffer" in s for name, s in state.items() if name.endswith(".mlp.c_fc.weight"))
    assert "exp_avg" in state["transformer.wte.weight"]
    killed_at_step(7, monkeypatch, tiny(shards, tmp_path / "killed", *args))
    train.main(tiny(shards, tmp_path / "killed", *args))
    whole, resumed = (log_records(tmp_path / d, "dar") for d in ("whole", "killed"))
    assert without_timings(resumed) == without_timings(whole)
    # another optimizer cannot take over the checkpoint: one line
    os.remove(tmp_path / "killed" / "dar" / "seed0" / "result.json")
    with pytest.raises(ConfigError, match="ckpt.pt was trained with optimizer='muon', whose state 'adamw' cannot take over"):
        train.main(tiny(shards, tmp_path / "killed", *args[:-2], "--allow_changes=True"))


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
    train.main(tiny(shards, tmp_path / "on", *args, "--wandb_log=True", "--wandb_project=p", "--wandb_run_name=g",
                    "--arms=attnres"))
    assert fake.runs[-1].kwargs["id"] == "run0" and fake.runs[-1].kwargs["resume"] == "allow"


def test_a_warm_start_on_another_tokenizer_is_refused(shards, tmp_path, monkeypatch):
    import report
    from data.prepare import prepare
    monkeypatch.setattr(report, "main", lambda argv: None)
    (tmp_path / "a.txt").write_text("the quick brown fox jumps over the lazy dog. " * 400)
    prepare(str(tmp_path / "bytes"), input=str(tmp_path / "*.txt"), tokenizer="bytes", val_tokens=2000,
            shard_tokens=100_000, workers=1, quiet=True)
    train.main(tiny(shards, tmp_path / "std", "--arms=standard", "--max_iters=2", "--eval_interval=2", "--vocab_size=320"))
    ckpt = tmp_path / "std" / "standard" / "seed0" / "ckpt.pt"  # trained on shards made elsewhere: GPT-2 ids
    with pytest.raises(ConfigError, match=r"was trained on gpt2 tokens, data_dir .*bytes holds bytes tokens"):
        train.main(tiny(str(tmp_path / "bytes"), tmp_path / "warm", "--arms=attnres", "--vocab_size=320",
                        f"--init_from={ckpt}"))
