"""
What train_cell does, seen from outside: cells trained through train.main on tiny synthetic shards
and checked against what they should have done, not against what was built. Gradient accumulation
draws and trains on the step's whole batch; each optimizer group steps at the schedule's rate times
its scale (AdamW, Muon, the MoE router, the routing parameters); a short last log interval logs its
own mean; accepted changes survive a second resume; each rank draws its own dropout masks.
(Issue #41: bugs in each of these left every other test passing; dev/mutate.py keeps one of each.)

    OMP_NUM_THREADS=1 .venv/bin/python -m pytest tests/test_loop.py -q -p no:cacheprovider
"""

import os

import pytest
import torch

import checkpoint
import report
import train
from helpers import killed_at_step, log_records, logged, result

torch.set_num_threads(1)


@pytest.fixture(autouse=True)
def no_report(monkeypatch):
    monkeypatch.setattr(report, "main", lambda argv: None)  # each grid's report is tested in test_report.py


def small(shards, out_dir, *extra):
    """train.py's arguments for one tiny cell (attnres, seed 0) on shards; extra override."""
    return [
        f"--data_dir={shards}",
        f"--out_dir={out_dir}",
        "--arms=attnres",
        "--seeds=0",
        "--n_layer=2",
        "--n_head=2",
        "--n_embd=32",
        "--block_size=16",
        "--vocab_size=64",
        "--eval_interval=4",
        "--log_interval=1",
        "--eval_tokens=1000",
        "--compile=False",
        "--warmup_iters=2",
        "--learning_rate=1e-2",
        "--min_lr=1e-3",
        "--device=cpu",
        *extra,
    ]


def weights(out_dir, arm="attnres"):
    return checkpoint.load_checkpoint(os.path.join(out_dir, arm, "seed0", "ckpt.pt"), "cpu")["model"]


def test_gradient_accumulation_trains_on_the_whole_step(shards, tmp_path):
    # a step of 2 micro-batches of 4 sequences is a step of one batch of 8: the same data, the same training
    args = ["--max_iters=5"]
    train.main(small(shards, tmp_path / "one", "--batch_size=8", "--gradient_accumulation_steps=1", *args))
    train.main(small(shards, tmp_path / "two", "--batch_size=4", "--gradient_accumulation_steps=2", *args))
    one, two = result(tmp_path / "one", "attnres"), result(tmp_path / "two", "attnres")
    assert two["pairing"]["data_hash"] == one["pairing"]["data_hash"]  # the same sequences, in the same order
    assert two["tokens"] == one["tokens"] == 5 * 8 * 16
    assert logged(tmp_path / "two", "attnres") == pytest.approx(logged(tmp_path / "one", "attnres"), rel=1e-5)
    assert two["val_loss"] == pytest.approx(one["val_loss"], rel=1e-5)
    w1, w2 = weights(tmp_path / "one"), weights(tmp_path / "two")
    for name in w1:
        assert torch.allclose(w2[name], w1[name], rtol=0, atol=1e-4), name


def expected_scale(model, param, s):
    """What a parameter's learning rate is, over the schedule's, by what it is (docs: routing_lr_scale,
    moe_router_lr_scale, muon_learning_rate for the hidden matrices under Muon)."""
    if any(param is p for p in model.residual.parameters()):
        return s.routing_lr_scale
    if any(param is moe.router.weight for moe in model.moes().values()):
        return s.moe_router_lr_scale
    hidden = any(param is p for p in model.transformer.h.parameters()) and param.dim() == 2
    return s.muon_learning_rate / s.learning_rate if s.optimizer == "muon" and hidden else 1.0


@pytest.mark.parametrize("optimizer", ["adamw", "muon"])
def test_each_parameter_steps_at_the_schedules_rate_times_its_scale(optimizer, shards, tmp_path, monkeypatch):
    # an MoE model (its routers a group of their own) under AdamW and under Muon (AdamW for the rest);
    # the rates are read at each optimizer step of train_cell, and the first AdamW step's size measured
    steps = []  # per optimizer step: [(param, lr, before, after)]
    opened = []

    def open_and_watch(*a, **k):
        cell = real_open(*a, **k)
        opened.append(cell)
        real_step = cell.optimizer.step

        def step():
            before = [(p, g["lr"], p.detach().clone()) for g in cell.optimizer.param_groups for p in g["params"]]
            real_step()
            steps.append([(p, lr, old, p.detach().clone()) for p, lr, old in before])

        cell.optimizer.step = step
        return cell

    real_open = train.open_cell
    monkeypatch.setattr(train, "open_cell", open_and_watch)
    train.main(
        small(
            shards,
            tmp_path / "o",
            f"--optimizer={optimizer}",
            "--max_iters=4",
            "--n_experts=4",
            "--moe_top_k=2",
            "--routing_lr_scale=30",
            "--moe_router_lr_scale=0.25",
            "--batch_size=4",
            *(["--muon_learning_rate=0.05"] if optimizer == "muon" else []),
        )
    )  # AdamW refuses it as unused
    (cell,) = opened
    s, model = cell.settings, cell.model
    scales = {expected_scale(model, p, s) for p, *_ in steps[0]}
    assert scales == ({30, 0.25, 1.0} | ({5.0} if optimizer == "muon" else set()))  # every kind of group was there
    assert len(steps) == 4
    for k, params in enumerate(steps):
        for p, lr, *_ in params:
            assert lr == pytest.approx(train.learning_rate_at(k, s) * expected_scale(model, p, s), rel=1e-12)
    # AdamW's first step moves each element by lr * g / (|g| + eps): at most lr, and lr where the gradient is
    # not tiny; so the largest move of an undecayed parameter with a gradient is its rate (routing 30x, routers
    # 0.25x; a routing row that reads the embedding alone has none at init)
    moved = {}
    for p, lr, before, after in steps[0]:
        if expected_scale(model, p, s) in (30, 0.25) and (after - before).abs().max() > 0:
            assert (after - before).abs().max().item() == pytest.approx(lr, rel=1e-3)
            moved[expected_scale(model, p, s)] = moved.get(expected_scale(model, p, s), 0) + 1
    assert moved.keys() == {30, 0.25} and moved[0.25] == 2  # both routers and the routing moved


def test_a_short_last_log_interval_logs_its_own_mean(shards, tmp_path):
    # max_iters 7 at log_interval 3: intervals of 3, 3 and 1 steps; log_interval is not a setting (the same training)
    train.main(small(shards, tmp_path / "every", "--max_iters=7", "--batch_size=4"))
    train.main(small(shards, tmp_path / "threes", "--max_iters=7", "--batch_size=4", "--log_interval=3"))
    per_step = logged(tmp_path / "every", "attnres")
    assert len(per_step) == 7
    lines = [r for r in log_records(tmp_path / "threes", "attnres") if "loss" in r]
    assert [r["step"] for r in lines] == [3, 6, 7]
    means = [sum(per_step[0:3]) / 3, sum(per_step[3:6]) / 3, per_step[6]]
    assert [r["loss"] for r in lines] == pytest.approx(means, rel=1e-6)


def test_every_accepted_change_survives_later_resumes(shards, tmp_path, monkeypatch):
    # killed after the checkpoints at steps 2 and 4, resumed each time with another rate (allowed): both kept
    args = small(shards, tmp_path / "o", "--max_iters=6", "--eval_interval=2", "--batch_size=4")
    killed_at_step(3, monkeypatch, args)
    killed_at_step(5, monkeypatch, args + ["--learning_rate=2e-2", "--allow_changes=True"])
    train.main(args + ["--learning_rate=3e-2", "--allow_changes=True"])
    changes = [
        dict(step=2, changed=dict(learning_rate=[0.01, 0.02])),
        dict(step=4, changed=dict(learning_rate=[0.02, 0.03])),
    ]
    done = result(tmp_path / "o", "attnres")
    assert done["steps"] == 6 and done["pairing"]["changes"] == changes and done["config"]["changes"] == changes


def test_each_rank_draws_its_own_dropout_masks_and_each_arm_the_same(shards, tmp_path, monkeypatch):
    # the RNG each cell's training starts from (what dropout draws), per rank: in one process, as ranks 0 and 1
    # of a one-process world would open their cells (rank 1 writes nothing)
    states = {}

    def open_and_stop(*a, **k):
        cell = real_open(*a, **k)
        states[int(os.environ["RANK"]), cell.settings.arm] = torch.get_rng_state()
        return None  # as if done: nothing trains

    real_open = train.open_cell
    monkeypatch.setattr(train, "open_cell", open_and_stop)
    for rank in (0, 1):
        monkeypatch.setenv("RANK", str(rank))
        train.main(small(shards, tmp_path / f"rank{rank}", "--arms=attnres,rd_attnres", "--dropout=0.1"))
    assert torch.equal(states[0, "attnres"], states[0, "rd_attnres"])  # paired: the arms of a seed draw alike
    assert torch.equal(states[1, "attnres"], states[1, "rd_attnres"])
    assert not torch.equal(states[0, "attnres"], states[1, "attnres"])  # the ranks' masks differ
