"""
A grid on a cluster: workers share a grid and train each cell once, bit for bit as one process
would (through launch.py and submitit's local executor); a worker started while the bundled corpus
is prepared waits for it; a stop signal checkpoints at a step boundary and the same command resumes
as if never stopped (one process, and 2 ranks under torchrun); two torchrun "nodes" on this machine
equal one process; launch.py --status says where each cell stands.

    OMP_NUM_THREADS=1 .venv/bin/python -m pytest tests/test_cluster.py -q -p no:cacheprovider
"""

import json
import os
import random
import re
import shlex
import signal
import socket
import subprocess
import sys
import time
from types import SimpleNamespace

import numpy as np
import pytest
import torch

import grid_files
import launch
import train
from cells import PREEMPTED, Preempted, stop_on_signals
from common import ConfigError, DataError
from helpers import log_records, logged, result, tiny, without_timings
from data.shards import BUNDLED

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ENV = {**os.environ, "OMP_NUM_THREADS": "1"}


def same_cells(a, b, cells):
    """Every cell of a and b trained alike: the same log (timings aside) and the same result."""
    for arm, seed in cells:
        assert without_timings(log_records(a, arm, seed)) == without_timings(log_records(b, arm, seed)), (arm, seed)
        ra, rb = result(a, arm, seed), result(b, arm, seed)
        assert (ra["val_loss"], ra["pairing"]["data_hash"]) == (rb["val_loss"], rb["pairing"]["data_hash"]), (arm, seed)


def test_workers_share_a_grid_and_train_each_cell_once_as_one_process(shards, tmp_path):
    grid = ["--arms=attnres,rd_attnres", "--seeds=0,1,2", "--max_iters=6", "--eval_interval=3"]
    args = tiny(shards, tmp_path / "workers", *grid)
    jobs = launch.launch(launch.split_args(["--cluster=local", "--workers=3", "--gpus_per_node=0", *args])[0], args)
    # SLURM's warning before a time limit (SIGUSR2 to the job's processes) reaches one worker mid-cell:
    # submitit's checkpoint hook stops its cell at a step boundary and requeues the worker, which resumes it
    while not (warned := next((job for job in jobs if re.search(r"\] step [1-4]/6 ", job.stdout() or "")), None)):
        assert not all(job.done() for job in jobs)
        time.sleep(0.05)
    with open(f"/proc/{warned._process.pid}/task/{warned._process.pid}/children") as f:
        worker = int(f.read().split()[0])  # the worker's process
    with open(f"/proc/{worker}/task/{worker}/children") as f:
        run = int(f.read().split()[0])  # its train.py
    # SLURM signals every process of the job: train.py too, first here, which must leave the warning to the worker
    os.kill(run, signal.SIGUSR2)
    os.kill(worker, signal.SIGUSR2)
    assert [job.result() for job in jobs] == [None] * 3  # a worker that failed raises here, with its output
    outputs = [job.stdout() for job in jobs]
    assert re.search(r"stopped by a signal: \[\w+ seed\d\] checkpointed at step [1-5]", warned.stdout()), (
        warned.stdout()
    )
    assert "Requeued job" in warned.stdout(), warned.stdout()
    cells = [(arm, seed) for seed in (0, 1, 2) for arm in ("attnres", "rd_attnres")]
    for arm, seed in cells:  # each started by one worker (which says its size then; a resume does not)
        started = rf"\[{arm} seed{seed}\] [\d.]+M non-embedding parameters"
        assert sum(len(re.findall(started, out)) for out in outputs) == 1, (arm, seed)
    assert sum(out.count("# Paired report") for out in outputs) == 1  # the last to finish wrote the report, once
    train.main(tiny(shards, tmp_path / "alone", *grid))
    same_cells(tmp_path / "workers", tmp_path / "alone", cells)


def test_a_launch_that_cannot_run_is_one_line_before_anything_is_submitted(tmp_path, monkeypatch):
    with pytest.raises(
        ConfigError,
        match=r"^nodes=2 with gpus_per_node=0: a CPU worker is one process on one node; "
        r"use --nodes=1",
    ):
        launch.split_args(["--nodes=2", "--gpus_per_node=0"])
    monkeypatch.setenv("PATH", str(tmp_path))  # no sbatch: not a SLURM login node
    with pytest.raises(ConfigError, match=r"^cluster=slurm but this machine has no sbatch .*--cluster=local$"):
        launch.main([f"--out_dir={tmp_path / 'grid'}", "--arms=attnres"])
    assert os.listdir(tmp_path) == []  # no submitit folder, no grid


def test_a_warned_worker_whose_run_does_not_stop_in_time_is_requeued_anyway(tmp_path, monkeypatch, capsys):
    # train.py mid-evaluation or mid-compile past the wait: the hook requeues before SLURM's kill at the time
    # limit, which would end the worker unrequeued; the cell resumes from its last checkpoint
    worker = launch.Worker(["--arms=attnres"], 1, 0, str(tmp_path), 0.5)
    worker.process = subprocess.Popen(
        [sys.executable, "-c", "import time; time.sleep(60)"],
        preexec_fn=launch.leave_stops_to_train,
        start_new_session=True,
    )  # SIGTERM unheeded
    try:
        started = time.time()
        requeued = worker.checkpoint()
        assert time.time() - started < 10 and worker.process.poll() is None
        assert requeued.function.train_args == worker.train_args and requeued.function.process is None
        assert (
            "train.py did not stop within 0.5 s of the warning; requeued without its checkpoint"
            in capsys.readouterr().out
        )
    finally:
        worker.process.kill()
        worker.process.wait()


def test_a_warning_that_comes_while_train_py_is_still_starting_is_not_lost(tmp_path):
    # train.py ignores a stop until it handles them (importing torch takes seconds, on a cluster's shared disk more):
    # the worker sends it again until the run checkpoints and exits, within the warning's wait
    starting = (
        "import signal, sys, time; time.sleep(1.5); signal.signal(signal.SIGTERM, lambda *a: sys.exit(75)); "
        "time.sleep(60)"
    )
    worker = launch.Worker(["--arms=attnres"], 1, 0, str(tmp_path), 20)
    worker.process = subprocess.Popen(
        [sys.executable, "-c", starting], preexec_fn=launch.leave_stops_to_train, start_new_session=True
    )
    try:
        started = time.time()
        worker.checkpoint()
        assert worker.process.poll() == 75 and time.time() - started < 1.5 + 2 * launch.RESEND_S
    finally:
        worker.process.kill()
        worker.process.wait()


def test_a_worker_started_while_the_bundled_corpus_is_prepared_waits_for_it(shards, tmp_path, monkeypatch, capsys):
    corpus = str(tmp_path / "shakespeare_bytes")
    monkeypatch.setitem(BUNDLED, corpus, "bytes")  # a bundled corpus of its own, prepared here
    slow = (
        "import sys, time; import data.prepare as P; real = P.prepare_locked; "
        "P.prepare_locked = lambda *a: (time.sleep(3), real(*a))[1]; P.prepare_bundled(sys.argv[1], 'bytes', quiet=True)"  # noqa: E501
    )
    preparer = subprocess.Popen([sys.executable, "-c", slow, corpus], cwd=ROOT, env=ENV)
    while not os.path.exists(os.path.join(corpus, "lock")):
        assert preparer.poll() is None
        time.sleep(0.05)
    train.main(
        tiny(
            shards,
            tmp_path / "o",
            "--arms=attnres",
            f"--data_dir={corpus}",
            "--vocab_size=None",
            "--max_iters=2",
            "--eval_interval=2",
        )
    )
    assert preparer.wait() == 0
    assert (
        f"waiting for {corpus}: being prepared by pid {preparer.pid} on {socket.gethostname()}"
        in capsys.readouterr().out
    )
    assert result(tmp_path / "o", "attnres")["status"] == "finished"


def stopped_at_random_step(argv, monkeypatch, signum, max_iters, seed=0):
    """train.main(argv) (cell attnres seed) sent signum at a random step, as SLURM would: the step it stopped at."""
    real, at = train.learning_rate_at, random.randrange(max_iters)

    def signalled(step, cell):
        if step == at:
            os.kill(os.getpid(), signum)
        return real(step, cell)

    monkeypatch.setattr(train, "learning_rate_at", signalled)
    with stop_on_signals(), pytest.raises(Preempted, match=rf"\[attnres seed{seed}\] checkpointed at step {at + 1}$"):
        train.main(argv)
    monkeypatch.setattr(train, "learning_rate_at", real)
    return at + 1


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGUSR1])
def test_a_signal_checkpoints_at_a_step_boundary_and_the_same_command_resumes_as_never_stopped(
    shards, tmp_path, monkeypatch, signum
):
    handler = signal.getsignal(signum)
    # checkpoints every 4 steps, log lines every 3: a stop lands between both, or on one
    args = ["--arms=attnres", "--max_iters=10", "--eval_interval=4", "--log_interval=3"]
    train.main(tiny(shards, tmp_path / "whole", *args))
    stop = stopped_at_random_step(tiny(shards, tmp_path / "stopped", *args), monkeypatch, signum, 10)
    cell = tmp_path / "stopped" / "attnres" / "seed0"
    assert not (cell / "result.json").exists() and not (cell / "lock").exists()
    assert grid_files.cell_state(str(cell), 10)[:2] == ("resumable", f"resumable at step {stop}")
    with stop_on_signals():
        train.main(tiny(shards, tmp_path / "stopped", *args))
    same_cells(tmp_path / "stopped", tmp_path / "whole", [("attnres", 0)])
    assert signal.getsignal(signum) == handler  # restored after the run


STEPS = 16


def torchrun(out_dir, shards, where=("--standalone",), wait=True):
    """train.py on 2 CPU processes for STEPS steps: 2 ranks, or 1 on each of two 'nodes' (where: a
    2-node rendezvous, started twice)."""
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        *where,
        "--nproc_per_node=" + ("1" if len(where) > 1 else "2"),
        "train.py",
        *tiny(shards, out_dir, "--arms=attnres", f"--max_iters={STEPS}", "--eval_interval=5", "--log_interval=3"),
    ]
    proc = subprocess.Popen(command, cwd=ROOT, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    return proc.communicate(timeout=300) + (proc.returncode,) if wait else proc


@pytest.fixture(scope="module")
def two_nodes(shards, tmp_path_factory):
    """The cell trained by two torchrun 'nodes' on this machine, one process each, through a c10d
    rendezvous on localhost."""
    out = tmp_path_factory.mktemp("two_nodes")
    with socket.socket() as s:
        s.bind(("localhost", 0))
        port = s.getsockname()[1]
    where = ("--nnodes=2", "--rdzv_backend=c10d", f"--rdzv_endpoint=localhost:{port}", "--rdzv_id=two_nodes")
    nodes = [torchrun(out, shards, where=where, wait=False) for _ in range(2)]
    outcomes = [node.communicate(timeout=300) + (node.returncode,) for node in nodes]
    assert [code for _, _, code in outcomes] == [0, 0], [err[-3000:] for _, err, _ in outcomes]
    return out


def test_two_nodes_equal_one_process(two_nodes, shards, tmp_path):
    # as 2 ranks on one machine equal one process (test_train.py): the world size rounds a step differently
    train.main(
        tiny(shards, tmp_path, "--arms=attnres", f"--max_iters={STEPS}", "--eval_interval=5", "--log_interval=3")
    )
    np.testing.assert_allclose(logged(two_nodes, "attnres"), logged(tmp_path, "attnres"), rtol=1e-5)
    np.testing.assert_allclose(
        logged(two_nodes, "attnres", key="val_loss"), logged(tmp_path, "attnres", key="val_loss"), rtol=1e-6
    )
    assert result(two_nodes, "attnres")["config"]["world_size"] == 2


def test_two_ranks_stopped_by_a_signal_resume_as_never_stopped(two_nodes, shards, tmp_path):
    # and bit for bit as the two nodes: the same world size
    proc = torchrun(tmp_path, shards, wait=False)
    at, log = random.randrange(1, STEPS // 2), tmp_path / "attnres" / "seed0" / "log.jsonl"
    while grid_files.last_log_record(str(log)).get("step", 0) < at:
        assert proc.poll() is None, proc.communicate()[1][-3000:]
        time.sleep(0.01)
    with open(f"/proc/{proc.pid}/task/{proc.pid}/children") as f:  # torchrun's workers, one per rank
        workers = [int(pid) for pid in f.read().split()]
    os.kill(workers[-1], signal.SIGTERM)  # one rank only: both stop at the same step
    _, err = proc.communicate(timeout=300)
    stops = re.findall(r"checkpointed at step (\d+)", err)  # each rank says where it stopped
    assert proc.returncode != 0 and f"(exitcode: {PREEMPTED})" in err, err[-3000:]
    assert len(stops) == 2 and len(set(stops)) == 1 and int(stops[0]) >= at, err[-3000:]
    assert int(stops[0]) % 3 == 0  # a log step (--log_interval=3): ranks learn of a stop only there
    assert not (tmp_path / "attnres" / "seed0" / "result.json").exists()
    _, err, code = torchrun(tmp_path, shards)
    assert code == 0, err[-3000:]
    same_cells(tmp_path, two_nodes, [("attnres", 0)])


def test_status_lists_each_cell_and_the_hours_spent_and_left(shards, tmp_path, monkeypatch):
    args = tiny(shards, tmp_path, "--arms=attnres,rd_attnres", "--seeds=0,1")
    train.main(tiny(shards, tmp_path, "--arms=attnres", "--seeds=0"))  # finished
    stop = stopped_at_random_step(
        tiny(shards, tmp_path, "--arms=attnres", "--seeds=1"), monkeypatch, signal.SIGTERM, 8, seed=1
    )
    training = tmp_path / "rd_attnres" / "seed0"  # a live process holds it and has logged step 3
    training.mkdir(parents=True)
    (training / "lock").write_text(f"{os.getppid()} {socket.gethostname()}")
    (training / "log.jsonl").write_text(json.dumps(dict(step=3, loss=4.0, eta_cell_s=75.0)) + "\n")
    status = launch.grid_status(launch.train_config(args))
    assert [line for _, _, line in status["cells"]] == [
        f"finished, val_loss {result(tmp_path, 'attnres', 0)['val_loss']:.4f}",
        f"training: {socket.gethostname()} pid {os.getppid()}, step 3/8, 1m15s left",
        f"resumable at step {stop}",
        "pending",
    ]
    finished = result(tmp_path, "attnres", 0)["wall_time_s"]
    resumable = grid_files.checkpoint_summary(str(tmp_path / "attnres" / "seed1" / "ckpt.pt"))["wall_time_s"]
    assert status["spent_s"] == pytest.approx(finished + resumable)
    # at the measured rate of attnres (its finished cell's seconds per step), every arm's for rd_attnres
    assert status["left_s"] == pytest.approx(finished / 8 * ((8 - stop) + 8 + 8))
    text = launch.status_text(status, "process-hours")
    assert text.startswith(f"{tmp_path}: 4 cells: 1 finished, 0 diverged, 1 training, 1 resumable, 1 pending\n")
    assert "process-hours: 0.00 spent, 0.00 left at the rate measured on 1 cell(s)" in text


def test_status_counts_gpu_hours_for_a_grid_trained_on_gpus_from_a_machine_without_one(shards, tmp_path, capsys):
    args = tiny(shards, tmp_path, "--arms=attnres", "--seeds=0", "--device=auto")
    launch.main([*args, "--status"])
    here = "GPU-hours" if torch.cuda.is_available() else "process-hours"  # nothing trained yet: this machine's device
    assert f"\n{here}: 0.00 spent" in capsys.readouterr().out
    (tmp_path / "config.json").write_text(json.dumps(dict(device="cuda")))  # as the grid's record says where it trains
    launch.main([*args, "--status"])
    assert "\nGPU-hours: 0.00 spent" in capsys.readouterr().out


def test_the_report_is_written_once_and_again_only_after_a_newer_result(shards, tmp_path, capsys):
    args = tiny(shards, tmp_path, "--arms=attnres", "--max_iters=2", "--eval_interval=2")
    train.main(args)
    written = os.path.getmtime(tmp_path / "report.md")
    train.main(args)  # a rerun of the finished grid, or a worker that starts after the last one finished
    assert (
        f"{tmp_path / 'report.md'} is up to date with every result; python report.py {tmp_path} writes it again"
        in capsys.readouterr().out
    )
    assert os.path.getmtime(tmp_path / "report.md") == written
    later = written + 10  # a result (or downstream.json) newer than the report: written again
    os.utime(tmp_path / "attnres" / "seed0" / "result.json", (later, later))
    train.main(args)
    assert os.path.getmtime(tmp_path / "report.md") > written and not (tmp_path / "report.lock").exists()


def test_a_worker_waits_for_the_tuning_cells_of_others_and_takes_over_a_dead_ones(
    shards, tmp_path, monkeypatch, capsys
):
    import tune

    # the rates are chosen from every tuning cell: another worker holds one, and dies while this one waits
    args = tiny(
        shards,
        tmp_path,
        "--arms=attnres",
        "--tune_learning_rates=1e-3,1e-2",
        "--tune_seeds=1000,1001",
        "--tune_iters=3",
        "--max_iters=4",
        "--eval_interval=2",
    )
    held = tmp_path / "tune" / tune.tuning_arm("attnres", 1e-2) / "seed1001"
    held.mkdir(parents=True)
    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    (held / "lock").write_text(f"{other.pid} {socket.gethostname()}")

    def the_other_worker_dies(seconds):  # the wait between looks at the others' cells
        other.kill()
        other.wait()

    monkeypatch.setattr(train, "time", SimpleNamespace(sleep=the_other_worker_dies, monotonic=time.monotonic))
    train.main(args)
    out = capsys.readouterr().out
    assert f"being trained by pid {other.pid} on {socket.gethostname()}: left to it" in out
    assert result(tmp_path / "tune", tune.tuning_arm("attnres", 1e-2), 1001)["status"] == "finished"
    assert (tmp_path / "tune" / "choice.json").exists() and result(tmp_path, "attnres")["status"] == "finished"


def test_a_worker_waiting_on_a_tuning_cell_of_a_silent_worker_on_another_host_gives_up_saying_how_to_free_it(
    shards, tmp_path, monkeypatch
):
    import tune

    args = tiny(
        shards,
        tmp_path,
        "--arms=attnres",
        "--tune_learning_rates=1e-3,1e-2",
        "--tune_seeds=1000,1001",
        "--tune_iters=3",
        "--max_iters=4",
        "--eval_interval=2",
    )
    held = tmp_path / "tune" / tune.tuning_arm("attnres", 1e-2) / "seed1000"
    held.mkdir(parents=True)
    (held / "lock").write_text("12 another-host")  # its lock cannot be checked from here
    ahead, logged_at = [0.0], []

    def clock():
        return time.monotonic() + ahead[0]

    def wait(seconds):  # the wait between looks, 60 times as long; the cell's log changes twice meanwhile
        ahead[0] += seconds * 60
        if len(logged_at) < 2:
            logged_at.append(clock())
            (held / "log.jsonl").write_text(json.dumps(dict(step=len(logged_at))) + "\n")
            os.utime(held / "log.jsonl", (len(logged_at), len(logged_at)))  # a coarse clock's mtime changes too

    monkeypatch.setattr(train, "time", SimpleNamespace(sleep=wait, monotonic=clock))
    monkeypatch.setattr(grid_files, "time", SimpleNamespace(sleep=wait, monotonic=clock))  # stalled's clock
    with pytest.raises(DataError) as err:
        train.main(args)
    gave_up = clock()
    assert str(err.value) == (
        f"[{tune.tuning_arm('attnres', 1e-2)} seed1000] is held by pid 12 on another-host, and its "
        f"log and checkpoint have not changed in {grid_files.WAIT_GIVE_UP_S // 60} minutes; if that "
        f"worker is gone: rm {held / 'lock'}, and run the same command again"
    )
    assert (
        grid_files.WAIT_GIVE_UP_S <= gave_up - logged_at[-1] < grid_files.WAIT_GIVE_UP_S + 2 * 600
    )  # a change restarts the count
    assert not (tmp_path / "attnres").exists()  # the grid waits for the rates


def test_the_state_of_a_cell_whose_result_lacks_a_field_is_one_line(tmp_path):
    good = dict(status="finished", steps=10, val_loss=2.5, wall_time_s=3.0, config=dict(world_size=2))
    (tmp_path / "result.json").write_text(json.dumps(good))
    assert grid_files.cell_state(str(tmp_path), 10) == ("finished", "finished, val_loss 2.5000", 6.0, 10)
    for broken, why in (
        (dict(good, config=None), "'NoneType' object is not subscriptable"),
        ({k: v for k, v in good.items() if k != "wall_time_s"}, "no 'wall_time_s'"),
    ):
        (tmp_path / "result.json").write_text(json.dumps(broken))
        with pytest.raises(DataError, match=rf"result.json is not a result train.py writes \({why}\); move it aside"):
            grid_files.cell_state(str(tmp_path), 10)


def fake_slurm(tmp_path, monkeypatch, sbatch="echo 'Submitted batch job 7'", sinfo="echo '2|24105|(null)|debug*'"):
    """sinfo, sbatch and srun as scripts on PATH: a cluster of one 2-CPU node without GPUs, as sinfo says."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, body in (("sinfo", sinfo), ("sbatch", sbatch), ("srun", "true")):
        (bin_dir / name).write_text(f"#!/bin/sh\n{body}\n")
        (bin_dir / name).chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")


def test_cpu_workers_ask_for_one_process_s_threads_and_a_request_no_node_meets_is_refused_at_submit(
    tmp_path, monkeypatch
):
    fake_slurm(tmp_path, monkeypatch)
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    out = f"--out_dir={tmp_path / 'grid'}"
    cpu, _ = launch.split_args(["--gpus_per_node=0"])
    params = launch.slurm_parameters(cpu, "grid")
    assert params["cpus_per_task"] == 1 and "gres" not in params
    assert "export OMP_NUM_THREADS=1" in params["setup"]  # what it asked for
    gpu, _ = launch.split_args([])
    params = launch.slurm_parameters(gpu, "grid")
    assert (params["cpus_per_task"], params["gres"]) == (64, "gpu:8")
    for flags, need in (
        (["--gpus_per_node=0", "--cpus_per_task=8"], "8 CPUs, 0 GPUs"),
        ([], "64 CPUs, 8 GPUs"),
        (["--gpus_per_node=0", "--mem=32G"], "1 CPUs, 0 GPUs, 32G"),
    ):
        with pytest.raises(
            ConfigError,
            match=rf"^no node of the default partition has {need} \(sinfo: 2 CPUs, "
            rf"24105 MB, 0 GPUs\): ask for less .* or choose another --partition$",
        ):
            launch.main([*flags, out, "--arms=attnres"])
    assert os.listdir(tmp_path) == ["bin"]  # nothing submitted, nothing written


def test_a_site_s_resources_pass_through_a_dry_run_submits_nothing_and_sbatch_s_refusal_is_one_line(
    tmp_path, monkeypatch, capsys
):
    fake_slurm(
        tmp_path,
        monkeypatch,
        sbatch="echo 'sbatch: error: Invalid generic resource (gres) specification' >&2; exit 1",
        sinfo="echo '64|512000|gpu:a100:8(S:0-1)|gpu*'",
    )
    site = tmp_path / "site.py"  # launch.py's keys in a config file of their own, as the paper configs are written
    site.write_text(
        'account = "myproj"\nqos = "high"\ngres = "gpu:a100:8"\nmem = "400G"\nconstraint = "ib"\n'
        'exclusive = True\nsbatch = ["--mail-type=END"]\nworkers = 2\n'
        'setup = ["module load cuda/12.1", "source ~/venv/bin/activate"]\n'
    )
    args = [str(site), f"--out_dir={tmp_path / 'grid'}", "--arms=attnres,standard", "--seeds=0,1"]
    launch.main([*args, "--dry_run"])
    script = capsys.readouterr().out
    for line in (
        "#SBATCH --account=myproj",
        "#SBATCH --qos=high",
        "#SBATCH --gres=gpu:a100:8",
        "#SBATCH --mem=400G",
        "#SBATCH --constraint=ib",
        "#SBATCH --exclusive",
        "#SBATCH --mail-type=END",
        "#SBATCH --array=0-1%2",
        "#SBATCH --cpus-per-task=64",
        "#SBATCH --signal=USR2@300",
        "\nmodule load cuda/12.1\n",
        "\nsource ~/venv/bin/activate\n",
        "# task 0: attnres seed0, attnres seed1",
        "# task 1: standard seed0, standard seed1",
        "# dry run: nothing submitted",
    ):
        assert line in script, (line, script)
    assert sorted(os.listdir(tmp_path)) == ["bin", "site.py"]
    with pytest.raises(
        ConfigError,
        match=r"^sbatch refused the array: sbatch: error: Invalid generic resource "
        r"\(gres\) specification; nothing was submitted$",
    ):
        launch.main(args)
    assert "sbatch: error" not in capsys.readouterr().err  # said once, in the error
    assert not os.path.exists(tmp_path / "grid_launch")  # no stray pickle, no script
    (tmp_path / "mixed.py").write_text("workers = 3\nmax_iters = 5\n")
    with pytest.raises(ConfigError, match=r"^a config file sets launch.py's key 'workers' beside train.py's: give"):
        launch.main([str(tmp_path / "mixed.py"), f"--out_dir={tmp_path / 'grid'}", "--dry_run"])
    for bad, why in (
        (["--sbatch=-A x"], r"sbatch option '-A x': give a long option"),
        (["--gres=gpu:a100:4"], r"gres='gpu:a100:4' with gpus_per_node=8: give one gpu entry"),
        (["--warn_s=7200", "--time_min=60"], r"warn_s=7200: the warning comes"),
    ):
        with pytest.raises(ConfigError, match=rf"^{why}"):
            launch.main([*bad, *args[1:], "--dry_run"])


def test_a_config_train_py_would_refuse_at_the_workers_world_size_is_refused_before_anything_is_queued(
    tmp_path, monkeypatch
):
    fake_slurm(
        tmp_path,
        monkeypatch,
        sbatch="echo submitted >> $0.calls; echo 'Submitted batch job 7'",
        sinfo="echo '64|512000|gpu:8|gpu*'",
    )
    out = f"--out_dir={tmp_path / 'grid'}"
    for args, why in (
        (["--max_iters=0"], r"max_iters=0 must be at least 1"),
        (["--arms=attnres,standrad"], r"arms has no entry standrad \(did you mean standard\?\)"),
        (["--batch_size=4", "--gradient_accumulation_steps=1"], r".*over 8 processes"),  # 8 GPUs
        (["--tune_learning_rates=-1e-3"], r".*"),
        (["--max_iter=10"], r"unknown config key 'max_iter'"),
    ):
        with pytest.raises(ConfigError, match=f"^{why}"):
            launch.main([out, "--arms=attnres", *args])
    assert not (tmp_path / "bin" / "sbatch.calls").exists() and not (tmp_path / "grid_launch").exists()


def test_a_failed_worker_is_reported_with_its_log_and_the_exit_is_not_zero_also_from_outside_the_checkout(
    shards, tmp_path
):
    out = tmp_path / "grid"
    (out / "attnres").mkdir(parents=True)
    (out / "attnres" / "seed0").write_text("a file where the cell's folder should be")  # train.py fails there
    proc = subprocess.run(
        [
            sys.executable,
            os.path.join(ROOT, "launch.py"),
            "--cluster=local",
            "--gpus_per_node=0",
            *tiny(shards, out, "--arms=attnres", "--max_iters=2", "--eval_interval=2"),
        ],
        cwd=tmp_path,
        env=ENV,
        capture_output=True,
        text=True,
        timeout=300,
    )
    logs = tmp_path / "grid_launch"
    task = launch.read_arrays(str(logs))[-1]["tasks"][0]
    log = logs / f"{task}_0_log.out"
    assert proc.returncode == 1 and proc.stderr.startswith("error: the grid did not finish"), proc.stdout + proc.stderr
    assert f"worker {task}: failed; its output: {log}" in proc.stdout, proc.stdout
    assert re.search(rf"\n  attnres seed0: .*; its worker {task} failed: {re.escape(str(log))}\n", proc.stdout)
    assert "cannot create the cell folder" in log.read_text() and "No module named" not in log.read_text()


def write_result(cell, wall_time_s, steps=8, **fields):
    cell.mkdir(parents=True, exist_ok=True)
    (cell / "result.json").write_text(
        json.dumps(
            dict(
                dict(status="finished", steps=steps, val_loss=2.0, config=dict(world_size=1), wall_time_s=wall_time_s),
                **fields,
            )
        )
    )


def test_status_reports_an_unreadable_file_in_its_row_another_host_s_lock_and_each_arm_s_own_rate(tmp_path):
    args = [f"--out_dir={tmp_path}", "--arms=attnres,standard,rd_attnres", "--seeds=0,1,2", "--max_iters=8"]
    write_result(tmp_path / "attnres" / "seed0", 8.0)  # 1 s a step
    write_result(tmp_path / "standard" / "seed0", 2.0)  # 4 times faster
    write_result(tmp_path / "standard" / "seed2", 2.0)
    (tmp_path / "attnres" / "seed1").mkdir()
    (tmp_path / "attnres" / "seed1" / "result.json").write_text('{"status": "finish')  # torn
    write_result(tmp_path / "standard" / "seed1", "3.5")  # hand-edited: a string
    (tmp_path / "rd_attnres" / "seed0").mkdir(parents=True)
    torch.save({"model": {}}, tmp_path / "rd_attnres" / "seed0" / "ckpt.pt")  # a ckpt.pt train.py did not write
    held = tmp_path / "rd_attnres" / "seed1"
    held.mkdir()
    (held / "lock").write_text("12 another-host")  # cannot be checked from here: shown as its holder's
    (held / "log.jsonl").write_text(json.dumps(dict(step=5, eta_cell_s=30.0)) + "\n")
    status = launch.grid_status(launch.train_config(args))
    rows = dict(((arm, seed), text) for arm, seed, text in status["cells"])
    assert rows["attnres", 1].startswith(f"unreadable: {tmp_path / 'attnres' / 'seed1' / 'result.json'} cannot be read")
    assert rows["standard", 1] == (
        f"unreadable: {tmp_path / 'standard' / 'seed1' / 'result.json'} is not a result "
        f"train.py writes (wall_time_s is '3.5', not a number); move it aside to train the "
        f"cell again"
    )
    assert rows["rd_attnres", 0] == (
        f"unreadable: {tmp_path / 'rd_attnres' / 'seed0' / 'ckpt.pt'} is not a checkpoint "
        f"train.py writes (no 'step'); delete it to train the cell from scratch"
    )
    assert rows["rd_attnres", 1] == "training: another-host pid 12, step 5/8, 0m30s left"
    # left at each arm's own rate: attnres 1 s a step, standard 0.25, rd_attnres (none finished) every arm's 12/24
    assert status["left_s"] == pytest.approx(8 * 1.0 * 2 + 8 * 0.25 * 1 + 8 * 0.5 * 3)
    assert status["spent_s"] == pytest.approx(12.0)
    text = launch.status_text(status, "process-hours")
    assert text.startswith(
        f"{tmp_path}: 9 cells: 3 finished, 0 diverged, 1 training, 0 resumable, 2 pending, 3 unreadable\n"
    )


def test_status_lists_the_tuning_cells_first_and_counts_their_hours(tmp_path):
    import tune

    args = [
        f"--out_dir={tmp_path}",
        "--arms=attnres",
        "--seeds=0",
        "--tune_learning_rates=1e-3,1e-2",
        "--tune_seeds=1000,1001",
        "--tune_iters=4",
        "--max_iters=8",
        "--warmup_iters=2",
    ]
    write_result(tmp_path / "tune" / tune.tuning_arm("attnres", 1e-3) / "seed1000", 360.0, steps=4)
    status = launch.grid_status(launch.train_config(args))
    low, high = tune.tuning_arm("attnres", 1e-3), tune.tuning_arm("attnres", 1e-2)
    assert [(arm, seed) for arm, seed, _ in status["cells"]] == [
        (low, 1000),
        (high, 1000),
        (low, 1001),
        (high, 1001),
        ("attnres", 0),
    ]
    assert status["spent_s"] == 360.0 and status["kinds"] == ["finished"] + ["pending"] * 4
    assert status["left_s"] == pytest.approx(90.0 * (3 * 4 + 8))  # at the tuning cell's rate, 90 s a step
    assert "process-hours: 0.10 spent, 0.50 left at the rate measured on 1 cell(s)" in launch.status_text(
        status, "process-hours"
    )


def test_status_asks_squeue_once_for_the_whole_array_and_shows_each_task_s_state_and_reason(
    tmp_path, monkeypatch, capsys
):
    calls = tmp_path / "squeue.calls"
    rows = (
        "7_0|RUNNING|None|node3\n7_1|PENDING|BeginTime|\n7_2|PENDING|PartitionConfig|\n7_3|PENDING|JobHeldUser|\n"
        "9|PENDING|Resources|"
    )
    fake_slurm(tmp_path, monkeypatch)
    (tmp_path / "bin" / "squeue").write_text(f"#!/bin/sh\necho \"$@\" >> {calls}\nprintf '{rows}\\n'\n")
    (tmp_path / "bin" / "squeue").chmod(0o755)
    logs = tmp_path / "grid_launch"
    logs.mkdir()
    arrays = [
        dict(cluster="slurm", job_id="7", tasks=[f"7_{i}" for i in range(5)], argv=[]),
        dict(cluster="slurm", job_id="9", tasks=["9"], argv=[]),
    ]
    (logs / launch.ARRAYS).write_text(json.dumps(arrays))
    (logs / "7_0_0_log.out").write_text("[attnres seed0] step 3/8 | loss 4.0\n")
    launch.main([f"--out_dir={tmp_path / 'grid'}", "--arms=attnres", "--status"])
    out = capsys.readouterr().out
    # one call for every task of both arrays (a launch again adds an array)
    assert calls.read_text().splitlines() == ["--noheader --array --jobs=7,9 --format=%i|%T|%r|%N"]
    for line in (
        "  task 7_0: RUNNING on node3, last on [attnres seed0]",
        "  task 7_1: PENDING (BeginTime: requeued: SLURM holds a requeued job (AuthInfo's cred_expire",
        "  task 7_2: PENDING (PartitionConfig: no node of the partition fits the request",
        "  task 7_3: PENDING (JobHeldUser: held: scontrol release JOBID)",
        "  task 7_4: not in the queue, ended without a result",
        "  task 9: PENDING (Resources: waiting",
    ):
        assert line in out, (line, out)


def test_a_submitted_worker_carries_the_project_s_requeue_limit_not_submitit_s_default(tmp_path, monkeypatch):
    import pickle

    fake_slurm(tmp_path, monkeypatch, sinfo="echo '64|512000|gpu:8|gpu*'")  # sbatch says: Submitted batch job 7
    jobs = launch.launch(*launch.split_args(["--workers=2", f"--out_dir={tmp_path / 'grid'}", "--arms=attnres"]))
    for job in jobs:  # what a requeue reruns: a worker's time limits are counted down from the project's value
        with open(tmp_path / "grid_launch" / f"{job.job_id}_submitted.pkl", "rb") as f:
            assert pickle.load(f)._timeout_countdown == launch.MAX_TIME_LIMITS > 3
    assert [a["tasks"] for a in launch.read_arrays(str(tmp_path / "grid_launch"))] == [["7_0", "7_1"]]


def dry_run_command(out):
    """The launch a dry run's last line says runs it for real, as its arguments."""
    return shlex.split(out.strip().splitlines()[-1].partition("without --dry_run: python launch.py ")[2])


def test_a_setup_line_and_an_sbatch_option_keep_their_commas_and_a_dry_run_prints_the_same_launch(
    shards, tmp_path, monkeypatch, capsys
):
    fake_slurm(tmp_path, monkeypatch, sinfo="echo '64|512000|gpu:8|gpu*'")
    site = tmp_path / "site.py"
    site.write_text('account = "myproj"\nsetup = "export CUDA_VISIBLE_DEVICES=0,1"\n')  # a string: one line too
    argv = [
        str(site),
        "--setup=module load cuda/12.1,cudnn",  # the flag again: one more line each
        "--setup=echo 'a, b'",
        "--sbatch=--mail-type=END,FAIL",
        "--workers=2",
        "--gpus_per_node=0",
        *tiny(shards, tmp_path / "grid", "--arms=attnres,standard"),
    ]
    own, _ = launch.split_args(argv)
    assert own["setup"] == ["export CUDA_VISIBLE_DEVICES=0,1", "module load cuda/12.1,cudnn", "echo 'a, b'"]
    assert own["sbatch"] == ["--mail-type=END,FAIL"]
    launch.main([*argv, "--dry_run"])
    out = capsys.readouterr().out
    for line in (
        "\nexport CUDA_VISIBLE_DEVICES=0,1\nmodule load cuda/12.1,cudnn\necho 'a, b'\n",
        "--mail-type=END,FAIL\n",
    ):
        assert line in out, (line, out)
    assert dry_run_command(out) == argv  # the site file and every launch key kept, as given
    local = ["--cluster=local", "--gpus_per_node=0", "--wait", *tiny(shards, tmp_path / "grid", "--arms=attnres")]
    launch.main([*local[:2], "--dry_run", *local[2:]])
    assert dry_run_command(capsys.readouterr().out) == local  # not SLURM workers of 8 GPUs
    (tmp_path / "dry.py").write_text("dry_run = True\n")  # a site file that sets it: undone on the command line
    launch.main([str(tmp_path / "dry.py"), *local])
    assert dry_run_command(capsys.readouterr().out) == [str(tmp_path / "dry.py"), *local, "--dry_run=False"]
    with pytest.raises(ConfigError, match=r"^--setup: give one entry, --setup=\.\.\., and the flag again"):
        launch.split_args(["--setup"])


def test_a_dry_run_refuses_what_the_launch_refuses_and_a_missing_folder_or_misspelt_launch_key_is_one_line(
    shards, tmp_path, monkeypatch
):
    fake_slurm(tmp_path, monkeypatch, sbatch="echo submitted >> $0.calls; echo 'Submitted batch job 7'")
    grid = tiny(shards, tmp_path / "grid", "--arms=attnres")
    (tmp_path / "a_file").write_text("")
    for args, error, why in (
        (["--mem=lots"], ConfigError, r"mem='lots': give sbatch's --mem, e.g. 64G"),
        (["--cpus_per_task=8"], ConfigError, r"no node of the default partition has 8 CPUs"),
        (
            [f"--data_dir={tmp_path / 'nowhere'}"],
            DataError,
            rf"data_dir {re.escape(str(tmp_path / 'nowhere'))} does not exist; ",
        ),
        ([f"--logs={tmp_path / 'a_file'}"], ConfigError, r"logs .*a_file is a file, not a folder; "),
        (
            [f"--out_dir={tmp_path / 'a_file' / 'grid'}"],
            ConfigError,
            r"out_dir .*grid cannot be made: .*a_file is a file, not a folder; give --out_dir a folder",
        ),
        (["--dry-run"], ConfigError, r"--dry-run: no such key; did you mean launch.py's --dry_run\?$"),
        (["--wokers=2"], ConfigError, r"--wokers=2: no such key; did you mean launch.py's --workers\?"),
    ):
        for dry in ([], ["--dry_run"]):  # the launch and its dry run alike
            with pytest.raises(error, match=f"^{why}"):
                launch.main(["--gpus_per_node=0", *grid, *args, *dry])
    assert not (tmp_path / "bin" / "sbatch.calls").exists()
    assert sorted(os.listdir(tmp_path)) == ["a_file", "bin"]  # no grid, no submitit folder


def test_local_cpu_workers_compute_with_the_thread_count_slurm_s_job_exports(shards, tmp_path, monkeypatch):
    # one thread unless OMP_NUM_THREADS says otherwise, as the SLURM script exports (torch's default is every core)
    for given, threads in ((None, 1), ("2", 2)):
        if given:
            monkeypatch.setenv("OMP_NUM_THREADS", given)
        else:
            monkeypatch.delenv("OMP_NUM_THREADS")
        out = tmp_path / f"threads{threads}"
        args = tiny(shards, out, "--arms=attnres", "--max_iters=2", "--eval_interval=2")
        (job,) = launch.launch(launch.split_args(["--cluster=local", "--gpus_per_node=0"])[0], args)
        assert job.result() is None
        assert result(out, "attnres")["config"]["cpu_threads"] == threads


def test_a_torchrun_worker_stopped_by_a_signal_is_reported_stopped_with_its_cell_resumable(shards, tmp_path):
    args = tiny(shards, tmp_path / "grid", "--arms=attnres", "--max_iters=400", "--eval_interval=100")
    own, _ = launch.split_args(["--cluster=local", "--gpus_per_node=2"])  # 2 CPU ranks under torchrun
    (job,) = launch.launch(own, args)
    log = tmp_path / "grid" / "attnres" / "seed0" / "log.jsonl"
    while grid_files.last_log_record(str(log)).get("step", 0) < 2:
        assert not job.done(), job.stdout()
        time.sleep(0.05)
    with open(f"/proc/{job._process.pid}/task/{job._process.pid}/children") as f:
        worker = int(f.read().split()[0])
    with open(f"/proc/{worker}/task/{worker}/children") as f:
        torchrun_pid = int(f.read().split()[0])
    os.killpg(torchrun_pid, signal.SIGTERM)  # a preemption: SIGTERM to torchrun and its ranks, which checkpoint
    with pytest.raises(Exception, match="a rank failed or was stopped by a signal"):
        job.result()
    text, done = launch.outcome_text(launch.train_config(args), own, [job.job_id], str(job.paths.folder), "CMD")
    assert not done
    assert f"worker {job.job_id}: stopped by a signal (its ranks' exit status 75), its cell checkpointed;" in text, text
    assert re.search(rf"\n  attnres seed0: resumable at step \d+; its worker {job.job_id} stopped by a signal: ", text)
    assert text.endswith("resumes, what is pending starts, with: CMD"), text
