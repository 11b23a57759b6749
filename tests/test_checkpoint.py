"""
checkpoint.py: what ckpt.pt holds (CellState beside the weights, optimizer state and RNG), saving that
never loses the last good copy, the checks before a checkpoint is resumed, and resuming itself: a killed
cell goes on line for line as if never stopped, alone, with Muon, and under FSDP.

    OMP_NUM_THREADS=1 .venv/bin/python -m pytest tests/test_checkpoint.py -q -p no:cacheprovider
(a few minutes: most tests train a tiny cell; `-k NAME` for one)
"""

import collections
import dataclasses
import io
import os
import shutil

import numpy as np
import pytest
import torch

import checkpoint
import machine
import train
from checkpoint import CellState
from common import ConfigError, DataError
from helpers import killed_at_step, log_records, logged, result, tiny, torchrun, without_timings
from model import GPT, GPTConfig

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
torch.set_num_threads(1)  # tiny models: threads only contend with each other on a shared machine
ONE_PROCESS = machine.Runtime(
    world=1, rank=0, local_rank=0, device="cpu", dtype="float32", autocast=None, peak_flops=None, fsdp=False
)


@pytest.fixture(autouse=True)
def no_report(monkeypatch):
    import report

    monkeypatch.setattr(report, "main", lambda argv: None)  # tested in test_report


# --- the file -------------------------------------------------------------------------------------------


def tiny_checkpoint(path, **state):
    """A real ckpt.pt of a tiny model after one AdamW step, saved with state."""
    torch.manual_seed(0)
    model = GPT(GPTConfig(n_layer=1, n_head=2, n_embd=16, block_size=8, vocab_size=32))
    optimizer = model.configure_optimizers(0.1, 1e-3, (0.9, 0.95), "cpu")
    model(torch.zeros(1, 8, dtype=torch.long), torch.zeros(1, 8, dtype=torch.long))[1].backward()
    optimizer.step()
    checkpoint.save_checkpoint(str(path), model, optimizer, CellState(**state), dict(arm="a", seed=0), ONE_PROCESS)
    return model


def test_the_checkpoint_holds_the_cell_state_and_loads_it_back(tmp_path):
    state = dict(
        step=4,
        data_hash="h" * 64,
        loss_sum=1.5,
        step_last=3,
        wall_time_s=2.5,
        wandb_id="run0",
        changes=[dict(step=2, changed={"learning_rate": [0.01, 0.02]})],
    )
    model = tiny_checkpoint(tmp_path / "ckpt.pt", **state)
    ckpt = checkpoint.load_checkpoint(str(tmp_path / "ckpt.pt"), "cpu")
    assert set(ckpt) == {"model", "optimizer", "rng", "config"} | {f.name for f in dataclasses.fields(CellState)}
    assert CellState(**{k: ckpt[k] for k in state}) == CellState(**state) and ckpt["config"] == dict(arm="a", seed=0)
    assert ckpt["model"].keys() == model.state_dict().keys() and len(ckpt["rng"]) == 1
    assert all(torch.equal(ckpt["model"][k], v) for k, v in model.state_dict().items())
    assert "exp_avg" in ckpt["optimizer"]["state"]["transformer.wte.weight"]  # keyed by parameter name


def test_an_older_checkpoint_loads_with_the_changes_of_its_record(tmp_path):
    # before CellState, a checkpoint had no wandb_id (older still) and its accepted changes in its record only
    tiny_checkpoint(tmp_path / "ckpt.pt")
    ckpt = torch.load(tmp_path / "ckpt.pt", weights_only=True)
    changes = [dict(step=2, changed={"learning_rate": [0.01, 0.02]})]
    del ckpt["changes"], ckpt["wandb_id"]
    torch.save(dict(ckpt, config=dict(arm="a", seed=0, changes=changes)), tmp_path / "ckpt.pt")
    loaded = checkpoint.load_checkpoint(str(tmp_path / "ckpt.pt"), "cpu")
    assert loaded["changes"] == changes and loaded["wandb_id"] is None


@pytest.mark.parametrize(
    "change",
    [
        dict(step="4"),
        dict(step=-1),
        dict(rng=None),
        dict(rng=[None]),
        dict(step_last=5),
        dict(loss_sum=True),
        dict(changes="none"),
        dict(wandb_id=3),
        dict(model=[1, 2]),
    ],
)
def test_a_checkpoint_with_a_field_of_the_wrong_type_or_value_is_one_line(tmp_path, change):
    good = dict(
        model={},
        optimizer={},
        step=4,
        rng=[dict(torch=torch.get_rng_state(), cuda=None)],
        data_hash="h",
        config={},
        loss_sum=0.0,
        step_last=4,
        wall_time_s=1.0,
        wandb_id=None,
        changes=[],
    )
    torch.save(dict(good, **change), tmp_path / "ckpt.pt")
    with pytest.raises(DataError, match="is not a checkpoint train.py wrote") as e:
        checkpoint.load_checkpoint(str(tmp_path / "ckpt.pt"), "cpu")
    assert "\n" not in str(e.value)


def test_failed_checkpoint_write_keeps_the_last_good_one(tmp_path):
    path = str(tmp_path / "ckpt.pt")
    checkpoint.save_atomically(path, {"step": 1})

    def full_disk(obj, p):
        with open(p, "wb") as f:
            f.write(b"half")
        raise RuntimeError("[enforce fail at inline_container.cc:603] . unexpected pos 64 vs 0\nbasic_ios::clear")

    with pytest.raises(DataError, match="could not write .*ckpt.pt .*unexpected pos.*last good copy is kept") as e:
        checkpoint.save_atomically(path, {"step": 2}, full_disk)
    assert "\n" not in str(e.value)
    assert os.listdir(tmp_path) == ["ckpt.pt"] and torch.load(path)["step"] == 1


def test_a_full_disk_says_so(tmp_path, monkeypatch):
    usage = collections.namedtuple("usage", "total used free")
    monkeypatch.setattr(checkpoint.shutil, "disk_usage", lambda p: usage(1 << 30, (1 << 30) - 4096, 4096))

    def torch_full(obj, p):
        with open(p, "wb") as f:
            f.write(b"half")
        raise RuntimeError("[enforce fail at inline_container.cc:603] . unexpected pos 64 vs 0")

    with pytest.raises(DataError, match=r"could not write .*ckpt.pt \(no space left on device\); the last good"):
        checkpoint.save_atomically(str(tmp_path / "ckpt.pt"), {}, torch_full)
    assert os.listdir(tmp_path) == []


def test_a_log_that_is_not_text_is_one_line(tmp_path):
    (tmp_path / "log.jsonl").write_bytes(b'{"step": 1}\n\xff\xfe\n')
    with pytest.raises(DataError, match="log.jsonl is not text"):
        checkpoint.log_until(str(tmp_path / "log.jsonl"), 4)


def test_the_log_is_cut_back_to_the_checkpoint(tmp_path):
    # records before the checkpoint's step, and its train record (its evaluation is redone); a torn last line dropped
    lines = [
        '{"step": 2, "loss": 1.0}',
        '{"step": 2, "val_loss": 1.0}',
        '{"step": 4, "loss": 0.9}',
        '{"step": 4, "val_loss": 0.9}',
        '{"step": 5, "loss": 0.8}',
        '{"step": 6, "lo',
    ]
    (tmp_path / "log.jsonl").write_text("\n".join(lines))
    assert checkpoint.log_until(str(tmp_path / "log.jsonl"), 4) == "".join(line + "\n" for line in lines[:3])


# --- resuming a cell ----------------------------------------------------------------------------------


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
    assert result(tmp_path / "killed", "rd_attnres")["pairing"] == result(tmp_path / "whole", "rd_attnres")["pairing"]


@pytest.fixture(scope="module")
def stopped(shards, tmp_path_factory):
    """A cell as if killed after its last checkpoint (result.json gone), and its whole log."""
    import report

    real, report.main = report.main, lambda argv: None
    try:
        out = tmp_path_factory.mktemp("stopped") / "o"
        train.main(tiny(shards, out, "--max_iters=4", "--eval_interval=2", "--log_interval=1", "--arms=attnres"))
    finally:
        report.main = real
    whole = log_records(out, "attnres")
    os.remove(out / "attnres" / "seed0" / "result.json")
    return out, whole


def copy_of(stopped, tmp_path, shards):
    """A copy of the stopped grid, its cell folder, and the arguments that resume it."""
    out = tmp_path / "o"
    shutil.copytree(stopped[0], out)
    return (
        out,
        out / "attnres" / "seed0",
        tiny(shards, out, "--max_iters=4", "--eval_interval=2", "--log_interval=1", "--arms=attnres"),
    )


def older_checkpoint():
    older = io.BytesIO()
    torch.save({"model": {}, "step": 2}, older)
    return older.getvalue()


@pytest.mark.parametrize(
    "damage, message",
    [
        (lambda good: good[:1000], "ckpt.pt is unreadable, truncated or empty"),
        (lambda good: b"", "ckpt.pt is unreadable, truncated or empty"),
        (lambda good: older_checkpoint(), "ckpt.pt was written by an older train.py"),
    ],
)
def test_a_damaged_checkpoint_is_one_line(stopped, shards, tmp_path, damage, message):
    out, cell, args = copy_of(stopped, tmp_path, shards)
    (cell / "ckpt.pt").write_bytes(damage((cell / "ckpt.pt").read_bytes()))
    with pytest.raises(DataError, match=message) as e:
        train.main(args)
    assert "\n" not in str(e.value)


def test_a_missing_log_is_one_line(stopped, shards, tmp_path):
    out, cell, args = copy_of(stopped, tmp_path, shards)
    os.remove(cell / "log.jsonl")
    with pytest.raises(DataError, match="log.jsonl is missing beside its ckpt.pt"):
        train.main(args)


def test_a_log_damaged_before_its_last_line_is_one_line(stopped, shards, tmp_path):
    out, cell, args = copy_of(stopped, tmp_path, shards)
    text = (cell / "log.jsonl").read_text()
    (cell / "log.jsonl").write_text(text[: len(text) // 2] + "\n" + text[len(text) // 2 :][:7])
    with pytest.raises(DataError, match="log.jsonl line .* is not a log record"):
        train.main(args)


def test_a_half_written_last_log_line_is_dropped_on_resume(stopped, shards, tmp_path):
    # a full disk, or a kill mid-write
    out, cell, args = copy_of(stopped, tmp_path, shards)
    (cell / "log.jsonl").write_text((cell / "log.jsonl").read_text() + '{"step": 5, "lo')
    train.main(args)
    assert without_timings(log_records(out, "attnres")) == without_timings(stopped[1])


def test_a_changed_resume_is_recorded_and_unpairs(shards, tmp_path):
    out = str(tmp_path / "o")
    train.main(tiny(shards, out, "--max_iters=6", "--eval_interval=3"))
    for arm in ("attnres", "rd_attnres"):  # as if killed after the checkpoint at step 3
        os.remove(os.path.join(out, arm, "seed0", "result.json"))
    with pytest.raises(ConfigError, match=r"learning_rate \(0.01 -> 0.02\)"):
        train.main(tiny(shards, out, "--max_iters=6", "--eval_interval=3", "--learning_rate=2e-2"))
    # the same change to one arm only, opted in: recorded in its cell, and the seed is not paired
    train.main(
        tiny(
            shards,
            out,
            "--max_iters=6",
            "--eval_interval=3",
            "--learning_rate=2e-2",
            "--arms=attnres",
            "--allow_changes=True",
        )
    )
    train.main(tiny(shards, out, "--max_iters=6", "--eval_interval=3", "--arms=rd_attnres", "--allow_changes=True"))
    changed, same = result(out, "attnres"), result(out, "rd_attnres")
    assert changed["pairing"]["changes"] == [{"step": 6, "changed": {"learning_rate": [0.01, 0.02]}}]
    assert changed["config"]["changes"] == changed["pairing"]["changes"] and "changes" not in same["pairing"]
    assert changed["pairing"]["settings"]["learning_rate"] == 0.02 and changed["pairing"] != same["pairing"]
    ckpt = checkpoint.load_checkpoint(os.path.join(out, "attnres", "seed0", "ckpt.pt"), "cpu")
    assert ckpt["changes"] == changed["pairing"]["changes"]  # carried by the cell's state too


@pytest.fixture
def two_seeds(shards, tmp_path):
    """An attnres grid of seeds 0 and 1 (2 steps), seed 1 as if killed after its checkpoint; the arguments."""
    args = tiny(shards, tmp_path / "o", "--max_iters=2", "--eval_interval=2", "--arms=attnres", "--seeds=0,1")
    train.main(args)
    os.remove(tmp_path / "o" / "attnres" / "seed1" / "result.json")
    return tmp_path / "o" / "attnres", args


def test_a_checkpoint_copied_from_another_cell_is_not_resumed(two_seeds):
    cells, args = two_seeds
    shutil.copy(cells / "seed0" / "ckpt.pt", cells / "seed1" / "ckpt.pt")
    with pytest.raises(ConfigError, match=r"seed1/ckpt.pt is the record of arm 'attnres' seed 0 \(a copied"):
        train.main(args)


def test_a_checkpoint_made_with_other_settings_is_not_resumed(two_seeds, shards, tmp_path):
    cells, args = two_seeds
    train.main(
        tiny(
            shards,
            tmp_path / "other",
            "--max_iters=2",
            "--eval_interval=2",
            "--arms=attnres",
            "--seeds=1",
            "--learning_rate=2e-2",
        )
    )
    shutil.copy(tmp_path / "other" / "attnres" / "seed1" / "ckpt.pt", cells / "seed1" / "ckpt.pt")
    with pytest.raises(
        ConfigError, match=r"seed1/ckpt.pt was made with other settings: learning_rate \(0.02 -> 0.01\); rerun"
    ):
        train.main(args)


def test_a_checkpoint_past_a_lowered_max_iters_is_not_trained_on_forever(two_seeds):
    cells, args = two_seeds
    with pytest.raises(ConfigError, match=r"ckpt.pt is at step 2, past max_iters=1; set --max_iters=2 to finish it"):
        train.main(args + ["--max_iters=1", "--allow_changes=True"])


def test_muon_trains_and_resumes_exactly(shards, tmp_path, monkeypatch):
    # Muon's momentum and AdamW's moments both go through the checkpoint: a killed run resumes line for line
    args = [
        "--max_iters=8",
        "--eval_interval=3",
        "--log_interval=2",
        "--arms=dar",
        "--optimizer=muon",
        "--activation_checkpointing=True",
    ]
    train.main(tiny(shards, tmp_path / "whole", *args))
    losses = logged(tmp_path / "whole", "dar")
    assert losses[-1] < losses[0] - 0.5  # it learns
    state = torch.load(tmp_path / "whole" / "dar" / "seed0" / "ckpt.pt", weights_only=True)["optimizer"]["state"]
    assert all("momentum_buffer" in s for name, s in state.items() if name.endswith(".mlp.c_fc.weight"))
    assert "exp_avg" in state["transformer.wte.weight"]
    killed_at_step(7, monkeypatch, tiny(shards, tmp_path / "killed", *args))
    train.main(tiny(shards, tmp_path / "killed", *args))
    whole, resumed = (log_records(tmp_path / d, "dar") for d in ("whole", "killed"))
    assert without_timings(resumed) == without_timings(whole)
    # another optimizer cannot take over the checkpoint: one line
    os.remove(tmp_path / "killed" / "dar" / "seed0" / "result.json")
    with pytest.raises(
        ConfigError, match="ckpt.pt was trained with optimizer='muon', whose state 'adamw' cannot take over"
    ):
        train.main(tiny(shards, tmp_path / "killed", *args[:-2], "--allow_changes=True"))


KILLED_AT_STEP_4 = """
import sys
sys.path.insert(0, {root!r})
import torch.distributed as dist
import machine
import train
real = train.learning_rate_at
def killed_at_step_4(step, cell):
    if step == 4:
        dist.barrier()  # rank 0 has written the checkpoint of step 3: a rank that ended first would stop its write
        raise KeyboardInterrupt
    return real(step, cell)
train.learning_rate_at = killed_at_step_4
with machine.exit_without_finalizing():
    train.main(sys.argv[1:])
"""


def test_fsdp_killed_and_resumed_equals_one_process(shards, tmp_path):
    # 2 ranks under FSDP2, killed after the checkpoint at step 3 and resumed, against one process
    # uninterrupted: the same losses within fp32 rounding (the shards' sums run in another order)
    args = ["--batch_size=8", "--arms=attnres", "--max_iters=6", "--eval_interval=3", "--log_interval=2"]
    script = tmp_path / "killed.py"
    script.write_text(KILLED_AT_STEP_4.format(root=ROOT))
    cell = tmp_path / "fsdp" / "attnres" / "seed0"
    killed = torchrun(str(script), tiny(shards, tmp_path / "fsdp", *args, "--fsdp=True"))
    assert killed.returncode != 0 and (cell / "ckpt.pt").exists() and not (cell / "result.json").exists()
    assert torch.load(cell / "ckpt.pt", weights_only=True)["step"] == 3
    resumed = torchrun("train.py", tiny(shards, tmp_path / "fsdp", *args, "--fsdp=True"))
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    train.main(tiny(shards, tmp_path / "single", *args))
    np.testing.assert_allclose(logged(tmp_path / "fsdp", "attnres"), logged(tmp_path / "single", "attnres"), rtol=1e-5)
    np.testing.assert_allclose(
        logged(tmp_path / "fsdp", "attnres", key="val_loss"),
        logged(tmp_path / "single", "attnres", key="val_loss"),
        rtol=1e-6,
    )
    # the checkpoint gathered on rank 0 is a one-process checkpoint: the same names, the same optimizer layout
    fsdp, single = (
        torch.load(tmp_path / d / "attnres" / "seed0" / "ckpt.pt", weights_only=True) for d in ("fsdp", "single")
    )
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


def test_open_trained_gives_the_cells_model_record_step_tokenizer_and_code_changes(stopped, shards, tmp_path):
    out, cell_dir, _ = copy_of(stopped, tmp_path, shards)
    ckpt = torch.load(cell_dir / "ckpt.pt", weights_only=True)
    cell = checkpoint.open_trained(str(cell_dir))
    assert (cell.step, cell.record, cell.code_changes, cell.changed()) == (4, ckpt["config"], [], "")
    assert not cell.model.training and all(torch.equal(v, ckpt["model"][k]) for k, v in cell.model.state_dict().items())
    assert cell.tokenizer_name == "gpt2" and cell.tokenizer.eot == 50256  # the shards' GPT-2 header, recorded
    assert checkpoint.open_trained(str(cell_dir / "ckpt.pt")).step == 4  # the checkpoint itself, as its folder
    # an older cell without a recorded tokenizer: asked of its data_dir, or one line when that is gone
    code = dict(cell.code, definitions=dict(cell.code["definitions"], GPT="0" * 16))
    for data_dir, expected in ((shards, "gpt2"), (str(tmp_path / "gone"), None)):
        record = {k: v for k, v in ckpt["config"].items() if k != "tokenizer"} | dict(data_dir=data_dir, code=code)
        torch.save(dict(ckpt, config=record), tmp_path / "older.pt")
        older = checkpoint.open_trained(str(tmp_path / "older.pt"))
        assert (older.code_changes, older.changed()) == (["GPT"], "GPT"), "the code changed since it trained: GPT"
        if expected:
            assert older.tokenizer_name == expected
        else:
            with pytest.raises(DataError, match=r"^the tokenizer of .*older.pt's data_dir is unknown: "):
                older.tokenizer
