"""
The grid on a real SLURM: a one-node cluster on this machine (dev/slurm_local.sh, which .ci/run
starts), driven through launch.py --cluster=slurm with CPU workers on a tiny grid, every cell compared
bit for bit with the grid trained by one process. An array of 2 workers warned of their time limit
mid-cell checkpoints, is requeued and resumes; a scancel mid-cell then the same launch again finishes
the grid; a worker whose train.py fails is reported, not requeued. Skipped where sbatch is absent.

    dev/slurm_local.sh && OMP_NUM_THREADS=1 .venv/bin/python -m pytest tests/test_slurm.py -q
"""

import os
import pickle
import re
import shutil
import signal
import subprocess
import sys
import threading
import time

import pytest

import grid_files
import launch
import train
from common import DataError
from helpers import log_records, result, tiny, without_timings

if shutil.which("sbatch") is None or subprocess.run(["sinfo"], capture_output=True).returncode:  # one line for all
    pytest.skip("no SLURM here: start a one-node one with dev/slurm_local.sh", allow_module_level=True)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# two cells long enough to be caught mid-cell (40 steps), checkpointed every 10
GRID = ["--arms=standard,attnres", "--seeds=0", "--max_iters=40", "--eval_interval=10", "--log_interval=2"]
CELLS = [("standard", 0), ("attnres", 0)]
CPU = ["--cluster=slurm", "--gpus_per_node=0"]


@pytest.fixture(scope="module")
def alone(shards, tmp_path_factory):
    """The grid trained by one process."""
    out = tmp_path_factory.mktemp("alone")
    train.main(tiny(shards, out, *GRID))
    return out


def same_cells(a, b):
    for arm, seed in CELLS:
        assert without_timings(log_records(a, arm, seed)) == without_timings(log_records(b, arm, seed)), (arm, seed)
        assert result(a, arm, seed)["val_loss"] == result(b, arm, seed)["val_loss"], (arm, seed)


class Launch(threading.Thread):
    """launch.main(argv) on a thread, so the test can act on the queue meanwhile; error: what it raised."""

    def __init__(self, argv):
        super().__init__(daemon=True)
        self.argv, self.error = argv, None
        self.start()

    def run(self):
        try:
            launch.main(self.argv)
        except Exception as e:  # noqa: BLE001 (the test asserts on it)
            self.error = e


def until(condition, what, timeout=120):
    deadline = time.monotonic() + timeout
    while not (value := condition()):
        assert time.monotonic() < deadline, f"gave up waiting for {what}"
        time.sleep(0.1)
    return value


def job_of(logs):
    return until(lambda: os.path.exists(logs / launch.ARRAYS) and launch.read_arrays(str(logs))[-1]["job_id"], "sbatch")


def trainer(out, arm, at_step):
    """The pid of the process training the cell, once its log has reached at_step."""
    cell = out / arm / "seed0"
    until(lambda: grid_files.last_log_record(str(cell / "log.jsonl")).get("step", 0) >= at_step, f"{arm} at {at_step}")
    return int((cell / "lock").read_text().split()[0])


def output(logs, task):
    path = logs / f"{task}_0_log.out"
    return path.read_text(errors="replace") if path.exists() else ""


def test_an_array_warned_of_its_time_limit_mid_cell_checkpoints_is_requeued_and_resumes_as_one_process(
    shards, tmp_path, alone, capsys, monkeypatch
):
    monkeypatch.setattr(launch, "QUEUE_POLL_S", 0.5)
    out, logs = tmp_path / "grid", tmp_path / "logs"
    # warned 45 s before the time limit, as launch.py asks (--warn_s); SLURM looks at time limits every 30 s and
    # may warn up to a minute early, so the test holds each cell mid-cell (SIGSTOP: no CPU spent), then lowers
    # the running jobs' limit to 1 minute, as --time_min=1 would have set it: the warning comes at the next look
    args = [*CPU, "--workers=2", "--time_min=10", "--warn_s=45", f"--logs={logs}", "--wait", *tiny(shards, out, *GRID)]
    run = Launch(args)
    job = job_of(logs)
    held = []
    for arm, _ in CELLS:
        held.append(trainer(out, arm, 2))
        os.kill(held[-1], signal.SIGSTOP)
    tasks = [f"{job}_0", f"{job}_1"]
    for task in tasks:
        subprocess.run(["scontrol", "update", f"JobId={task}", "TimeLimit=1"], check=True)
    until(lambda: all("Caught signal SIGUSR2" in output(logs, t) for t in tasks), "the warnings", timeout=90)
    for pid in held:  # the warning reached train.py too (SLURM signals every process of the step)
        os.kill(pid, signal.SIGCONT)
    # requeued: SLURM holds a requeued job (BeginTime) for AuthInfo's cred_expire, 10 s here (dev/slurm_local.sh); the
    # test gives it back its limit, so it is not warned again (only an operator may raise a limit: a user's resumed
    # job may be warned and requeued again, which it survives, only later)
    until(lambda: all(launch.queue([job]).get(t, ("",))[:2] == ("PENDING", "BeginTime") for t in tasks), "requeues")
    for task in tasks:
        subprocess.run(["scontrol", "update", f"JobId={task}", "TimeLimit=10"], capture_output=True)
    capsys.readouterr()
    launch.main([*args, "--status"])
    status = capsys.readouterr().out
    for task in tasks:
        assert re.search(rf"task {task}: (PENDING \(BeginTime: requeued|PENDING, |RUNNING)", status), status  # 10 s
        # the project's requeue limit, not submitit's default of 3, less the time limit just reached
        with open(logs / f"{task}_submitted.pkl", "rb") as f:
            assert pickle.load(f)._timeout_countdown == launch.MAX_TIME_LIMITS - 1
    run.join(timeout=300)
    assert not run.is_alive() and run.error is None, run.error
    said = capsys.readouterr().out
    assert f"worker {job}_0: finished\nworker {job}_1: finished\n" in said and "every cell finished; the report" in said
    outputs = "".join(output(logs, task) for task in tasks)
    for task in tasks:  # each cell stopped mid-cell by the warning, at a step boundary, and resumed there
        stop = re.search(r"stopped by a signal: \[(\w+) seed0\] checkpointed at step (\d+)", output(logs, task))
        assert stop and 2 <= int(stop.group(2)) < 40 and "Requeued job" in output(logs, task), output(logs, task)
        assert f"[{stop.group(1)} seed0] resuming from step {stop.group(2)}" in outputs
    same_cells(out, alone)


def test_a_task_cancelled_mid_cell_leaves_it_resumable_and_the_same_launch_again_finishes_the_grid(
    shards, tmp_path, alone, capsys, monkeypatch
):
    monkeypatch.setattr(launch, "QUEUE_POLL_S", 0.5)
    out, logs = tmp_path / "grid", tmp_path / "logs"
    args = [*CPU, "--workers=1", f"--logs={logs}", "--wait", *tiny(shards, out, *GRID)]
    run = Launch(args)
    job_of(logs)
    task = launch.read_arrays(str(logs))[-1]["tasks"][0]  # one worker: a job, not an array
    trainer(out, "standard", 2)
    subprocess.run(["scancel", task], check=True)
    run.join(timeout=120)
    said = capsys.readouterr().out
    assert isinstance(run.error, DataError) and "the grid did not finish" in str(run.error), (run.error, said)
    stop = re.search(r"standard seed0: resumable at step (\d+)", said)
    assert stop and int(stop.group(1)) >= 2, said
    # its train.py checkpointed and exited 75; its worker said so, unless SLURM's kill (KillWait after the
    # scancel) came first
    assert re.search(
        rf"worker {task}: (stopped by a signal \(exit status 75\), its cell checkpointed|ended without "
        rf"a result \(cancelled or killed.*\)); its output: ",
        said,
    ), said
    assert "attnres seed0: pending" in said
    assert f"with: python launch.py {' '.join(a for a in args if a != '--wait')}\n" in said
    launch.main(args)  # the same launch again
    assert "every cell finished; the report" in capsys.readouterr().out
    same_cells(out, alone)


def test_a_worker_whose_train_py_fails_is_reported_with_its_log_not_requeued_also_from_outside_the_checkout(
    shards, tmp_path
):
    out, logs = tmp_path / "grid", tmp_path / "logs"
    out.mkdir()
    (out / "standard").write_text("a file where the arm's folder should be")  # train.py fails there, not at submit
    proc = subprocess.run(
        [
            sys.executable,
            os.path.join(ROOT, "launch.py"),
            *CPU,
            f"--logs={logs}",
            "--wait",
            *tiny(shards, out, "--arms=standard", "--max_iters=2", "--eval_interval=2"),
        ],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    job = launch.read_arrays(str(logs))[-1]["job_id"]
    log = logs / f"{job}_0_log.out"
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert f"worker {job}: failed; its output: {log}" in proc.stdout
    cell = next(line for line in proc.stdout.splitlines() if line.startswith("  standard seed0: "))
    assert cell.endswith(f"; its worker {job} failed: {log}"), proc.stdout  # (the cell's folder is unreadable)
    assert proc.stderr.startswith("error: the grid did not finish"), proc.stderr
    text = log.read_text()
    assert "cannot create the cell folder" in text and "No module named" not in text and "Requeued" not in text
    assert launch.queue([job]) == {}  # ended, not requeued


def test_cancel_ends_the_grid_s_jobs_after_their_running_cells_checkpoint_and_says_what_is_resumable(
    shards, tmp_path, capsys, monkeypatch
):
    monkeypatch.setattr(launch, "QUEUE_POLL_S", 0.5)
    out, logs = tmp_path / "grid", tmp_path / "logs"
    # one runs, one waits; 4,000 steps: on an idle machine the grid's 40 can end before the cancel reaches the cell
    args = [*CPU, "--workers=2", "--concurrency=1", f"--logs={logs}", *tiny(shards, out, *GRID, "--max_iters=4000")]
    launch.main(args)
    job = job_of(logs)
    trainer(out, "standard", 2)
    launch.main([*args, "--cancel"])
    said = capsys.readouterr().out
    assert re.search(rf"cancelled job\(s\) {job}; resumable: standard seed0; to go on: python launch.py ", said), said
    assert all(s in (*launch.ENDED, "COMPLETING") for s, _, _ in launch.queue([job]).values())  # the waiting one too
    assert re.search(r"stopped by a signal: \[standard seed0\] checkpointed at step \d+", output(logs, f"{job}_0"))


def test_what_no_node_has_and_what_sbatch_refuses_are_one_line_each_and_leave_nothing(shards, tmp_path):
    from common import ConfigError

    args = [*CPU, f"--logs={tmp_path / 'logs'}", *tiny(shards, tmp_path / "grid", "--arms=standard")]
    cpus = (
        int(re.search(r"CPUs=(\d+)", subprocess.run(["slurmd", "-C"], capture_output=True, text=True).stdout)[1])
        if shutil.which("slurmd")
        else os.cpu_count()
    )
    with pytest.raises(
        ConfigError,
        match=rf"^no node of the default partition has {cpus + 1} CPUs, 0 GPUs \(sinfo: "
        rf"{cpus} CPUs, \d+ MB, 0 GPUs\)",
    ):
        launch.main([*args, f"--cpus_per_task={cpus + 1}"])  # not left pending (PartitionConfig) forever
    for bad, said in (("--gres=nonesuch:1", "Invalid generic resource"), ("--partition=nonesuch", "partition")):
        with pytest.raises(
            ConfigError,
            match=rf"^sbatch refused the array: sbatch: error: .*{said}.*; nothing was "
            rf"submitted$",
        ):
            launch.main([*args, bad])
    assert os.listdir(tmp_path) == []  # no pickle, no script, no grid


def test_setup_lines_and_sbatch_options_keep_their_commas_and_cancel_after_the_end_says_the_jobs_had_ended(
    shards, tmp_path, capsys, monkeypatch
):
    monkeypatch.setattr(launch, "QUEUE_POLL_S", 0.5)
    out, logs = tmp_path / "grid", tmp_path / "logs"
    args = [
        *CPU,
        f"--logs={logs}",
        "--setup=echo setup saw 0,1",
        "--sbatch=--mail-type=END,FAIL",  # sbatch takes the list whole
        *tiny(shards, out, "--arms=standard", "--max_iters=2", "--eval_interval=2"),
    ]
    launch.main([*args, "--wait"])
    job = launch.read_arrays(str(logs))[-1]["job_id"]
    assert "every cell finished; the report" in capsys.readouterr().out
    assert output(logs, job).startswith("setup saw 0,1\n")  # one line of the job's script, run as written
    launch.main([*args, "--cancel"])  # long after the job ended: nothing cancelled, and said so
    said = capsys.readouterr().out
    assert re.fullmatch(
        rf"nothing to cancel; task\(s\) that had already ended: {job} \((COMPLETED|finished)\); every cell finished\n",
        said,
    ), said
