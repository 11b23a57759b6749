"""
progress.py's clocks on a cell that the loop (train.py) stops and resumes: what the log says of the steps
each process timed. (The clocks of a cell trained at once: tests/test_train.py.)
"""

import pytest
from helpers import log_records, tiny

import cells
import progress
import train
from cells import Preempted


def test_a_resumed_interval_is_timed_over_the_steps_this_process_trained(shards, tmp_path, monkeypatch):
    # a fake clock: each step takes 1 s, each evaluation 100 s, nothing else takes time. The run stops after
    # step 2, between two log lines (every 4 steps); the rerun trains steps 3 and 4, so the log line of step 4
    # covers 4 steps of which this process timed 2: 1 s each, not 2 s over 4 (issue #66)
    import report

    monkeypatch.setattr(report, "main", lambda argv: None)
    clock, steps = [0.0], [0]
    fake = type("FakeTime", (), {"monotonic": staticmethod(lambda: clock[0]), "time": staticmethod(lambda: clock[0])})
    monkeypatch.setattr(train, "time", fake)
    monkeypatch.setattr(progress, "time", fake)
    real_step, real_eval = train.backward_step, train.sequence_losses

    def step(*args):
        clock[0] += 1.0
        steps[0] += 1
        return real_step(*args)

    def evaluation(*args):
        clock[0] += 100.0
        return real_eval(*args)

    monkeypatch.setattr(train, "backward_step", step)
    monkeypatch.setattr(train, "sequence_losses", evaluation)
    monkeypatch.setattr(train, "stop_requested", lambda runtime: steps[0] == 2)
    argv = tiny(shards, tmp_path / "o", "--max_iters=8", "--eval_interval=8", "--log_interval=4", "--arms=attnres")
    with pytest.raises(Preempted, match=r"checkpointed at step 2$"):
        train.main(argv)
    clock[0] += 3600.0  # the hour the cell waited to be resumed is no step's time
    monkeypatch.setattr(train, "stop_requested", cells.stop_requested)
    train.main(argv)
    trained = [r for r in log_records(tmp_path / "o", "attnres") if "loss" in r]
    assert [r["step"] for r in trained] == [4, 8]
    tokens_per_step = 4 * 16
    for r in trained:
        assert r["ms_per_step"] == 1000.0 and r["tokens_per_s"] == tokens_per_step, r
    # time left at step 4: 4 steps at 1 s, and the last evaluation, which this process has not timed yet (0 s)
    assert trained[0]["eta_cell_s"] == 4.0
