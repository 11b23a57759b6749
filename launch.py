"""
A grid on a SLURM cluster (or on this machine), through submitit: a job array of workers on one
out_dir, each a torchrun of train.py over its nodes' GPUs. Workers share the grid (train.py): each
takes the next cell that no live worker holds, and the last to finish writes the report. A worker
warned of its time limit or a preemption stops its cell at a step boundary, checkpointed, and is
requeued with the same command, which resumes it. --status says where the grid stands.

$ python launch.py config/rd_120m.py --workers=4 --partition=gpu          # 4 nodes of 8 GPUs, a cell each at a time
$ python launch.py config/dar_1b.py --workers=1 --nodes=2 --partition=gpu  # every cell over 2 nodes (16 GPUs)
$ python launch.py config/rd_120m.py --status                             # each cell; GPU-hours spent and left
$ python launch.py --cluster=local --workers=3 --gpus_per_node=0 --arms=standard,attnres --seeds=0,1,2  # here

The keys below are launch.py's own; every other argument goes to train.py as given (config files,
--key=value). docs/cluster.md: what lives on the shared filesystem, what a preemption costs.
"""

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time

# no torch at the top: submitit's job process imports this file to run a Worker, which starts train.py
from common import ConfigError, DataError, process_exists, read_json, read_lock, run
from configurator import coerce, configure, parse_literal

HERE = os.path.dirname(os.path.abspath(__file__))

_before_config = set(globals())
# -----------------------------------------------------------------------------
cluster = "slurm"  # 'slurm' (sbatch through submitit) or 'local' (submitit's local executor: this machine)
workers = 1  # array tasks: each trains cells of the grid, one at a time, until none is left
nodes = 1  # nodes per worker: above 1, every cell trains across them (a c10d rendezvous on the first)
gpus_per_node = 8  # processes per node, one per GPU (local rank picks the GPU); 0 = one CPU process
partition = ""  # SLURM partition; "" = the cluster's default
time_min = 24 * 60  # a job's time limit in minutes; warned before it, the worker checkpoints and is requeued
concurrency = 0  # at most this many workers at once (SLURM's array throttle); 0 = all
cpus_per_gpu = 8  # CPU cores per process (data loading is light: a few suffice)
logs = ""  # submitit's folder (job scripts and each worker's output); "" = <out_dir>_launch, beside the grid
status = False  # say where the grid stands (each cell; GPU-hours spent and left) instead of launching
# -----------------------------------------------------------------------------
DEFAULTS = {k: v for k, v in globals().items() if k not in _before_config and k != "_before_config"}
# torchrun stops its workers on these; not on SIGTERM, which it would pass on and then, 30 s later, kill them with,
# however far their checkpoint is (a worker's processes ignore SIGTERM unless they handle it, as train.py does)
TORCHRUN_SIGNALS = "SIGINT,SIGHUP,SIGQUIT"
RDZV_PORT = 29500
# submitit's warning (SIGUSR2) comes this long before a job's time limit; the checkpoint hook waits at most
# WARNED_WAIT_S of it for train.py to checkpoint and exit (a step may be an evaluation or a compile), then
# requeues anyway, leaving submitit time to: a job killed at its limit unrequeued would end its worker for good
SIGNAL_DELAY_S = 300
WARNED_WAIT_S = SIGNAL_DELAY_S - 60
# submitit requeues a job that reaches its time limit at most this many times (its default, 3, would end a
# worker on its 4th time limit, however many cells are left); preemptions are requeued without a count
MAX_TIME_LIMITS = 10_000


def split_args(argv):
    """(launch.py's settings, train.py's arguments): --key=value of launch.py's keys (--status alone
    means --status=True) are its own; everything else is train.py's."""
    own, train_args = dict(DEFAULTS), []
    for arg in argv:
        key, eq, text = arg[2:].partition("=") if arg.startswith("--") else ("", "", "")
        if key in DEFAULTS:
            own[key] = coerce(key, parse_literal(text) if eq else True, DEFAULTS[key])
        else:
            train_args.append(arg)
    if own["cluster"] not in ("slurm", "local"):
        raise ConfigError(f"cluster={own['cluster']!r}: choose slurm or local")
    for key in ("workers", "nodes"):
        if own[key] < 1:
            raise ConfigError(f"{key}={own[key]}: give at least 1")
    if own["gpus_per_node"] < 0 or own["concurrency"] < 0 or own["time_min"] < 1:
        raise ConfigError("gpus_per_node and concurrency are counts (0 or more), time_min at least 1 minute")
    if own["cluster"] == "local" and own["nodes"] > 1:
        raise ConfigError(f"nodes={own['nodes']} on cluster=local: this machine is one node; use --nodes=1")
    if own["nodes"] > 1 and own["gpus_per_node"] == 0:
        raise ConfigError(f"nodes={own['nodes']} with gpus_per_node=0: a CPU worker is one process on one node; "
                          f"use --nodes=1, or give each node's GPUs with --gpus_per_node")
    return own, train_args


def worker_command(train_args, nodes, gpus_per_node, hosts, job_id):
    """What a worker runs on each of its nodes: train.py itself for one process, else a torchrun of
    it over the node's GPUs, across nodes through a c10d rendezvous on the first node."""
    script = os.path.join(HERE, "train.py")
    if nodes == 1 and gpus_per_node <= 1:
        return [sys.executable, script, *train_args]
    where = ["--standalone"] if nodes == 1 else [f"--nnodes={nodes}", "--rdzv_backend=c10d",
                                                 f"--rdzv_endpoint={hosts[0]}:{RDZV_PORT}", f"--rdzv_id={job_id}"]
    return [sys.executable, "-m", "torch.distributed.run", *where, f"--nproc_per_node={gpus_per_node}", script,
            *train_args]


def leave_stops_to_train():
    """In a worker's processes, before they start: SIGTERM and SIGUSR1 (a stop) are ignored by any that
    does not handle them (torchrun), so only train.py's ranks act on one, checkpointing; SIGUSR2
    (submitit's warning, which SLURM sends to every process of the job) is ignored: submitit handles
    it (Worker.checkpoint)."""
    for sig in (signal.SIGTERM, signal.SIGUSR1, signal.SIGUSR2):
        signal.signal(sig, signal.SIG_IGN)


class Worker:
    """One task of the array, run by submitit on each node of the worker: train.py (or its torchrun)
    until no cell is left. checkpoint is submitit's hook on a time limit or a preemption (on the first
    node): SIGTERM makes train.py checkpoint its cell at the next step boundary and exit, then the same
    worker is requeued and resumes it."""

    def __init__(self, train_args, nodes, gpus_per_node, cwd):
        self.train_args, self.nodes, self.gpus_per_node, self.cwd = train_args, nodes, gpus_per_node, cwd
        self.process = None

    def __call__(self):
        import submitit
        env = submitit.JobEnvironment()
        command = worker_command(self.train_args, self.nodes, self.gpus_per_node, env.hostnames, env.job_id)
        # a session of its own: checkpoint signals the whole run (torchrun and its ranks) at once
        self.process = subprocess.Popen(command, cwd=self.cwd, preexec_fn=leave_stops_to_train, start_new_session=True,
                                        env=dict(os.environ, TORCHELASTIC_SIGNALS_TO_HANDLE=TORCHRUN_SIGNALS))
        while self.process.poll() is None:  # not wait(): checkpoint, run by a signal handler meanwhile, waits
            time.sleep(1)
        if self.process.returncode:
            from cells import PREEMPTED
            if command[1] == "-m":  # torchrun exits 1 whether a rank failed or stopped (exit 75, checkpointed)
                why = "ended (a rank failed or was stopped by a signal: each rank's last line above says which)"
            else:
                why = "stopped by a signal, its cell checkpointed" if self.process.returncode == PREEMPTED else "failed"
            raise RuntimeError(f"{' '.join(command)} {why} (exit status {self.process.returncode}); see this "
                               f"worker's output")

    def checkpoint(self):
        import submitit
        if self.process is not None and self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGTERM)
            try:
                self.process.wait(timeout=WARNED_WAIT_S)
            except subprocess.TimeoutExpired:  # the cell resumes from its last checkpoint (every eval_interval steps)
                print(f"train.py did not stop within {WARNED_WAIT_S} s of the warning; requeued without its "
                      f"checkpoint", flush=True)
        return submitit.helpers.DelayedSubmission(Worker(self.train_args, self.nodes, self.gpus_per_node, self.cwd))


def train_config(train_args):
    """train.py's config for these arguments, as train.py reads them (before it touches data or devices)."""
    import train
    return configure(train.DEFAULTS, train_args, entries=dict(arms=train.SCHEME_ARMS))


def executor(own, out_dir):
    import submitit
    folder = own["logs"] or os.path.normpath(out_dir) + "_launch"  # not inside: the report would take it for an arm
    ex = submitit.AutoExecutor(folder=folder, cluster=own["cluster"], slurm_max_num_timeout=MAX_TIME_LIMITS)
    gpus = own["gpus_per_node"]
    ex.update_parameters(name=os.path.basename(os.path.abspath(out_dir)), timeout_min=own["time_min"],
                         nodes=own["nodes"], tasks_per_node=1, gpus_per_node=gpus,
                         cpus_per_task=own["cpus_per_gpu"] * max(gpus, 1), stderr_to_stdout=True,
                         slurm_signal_delay_s=SIGNAL_DELAY_S)
    ex.update_parameters(slurm_array_parallelism=own["concurrency"] or own["workers"],
                         **({"slurm_partition": own["partition"]} if own["partition"] else {}))
    return ex


def launch(own, train_args):
    """Submit the workers as one array; returns their jobs (submitit's)."""
    if own["cluster"] == "slurm" and not shutil.which("sbatch"):
        raise ConfigError("cluster=slurm but this machine has no sbatch (not a SLURM login node); submit from one, "
                          "or run the workers on this machine with --cluster=local")
    cfg = train_config(train_args)  # a bad argument is one line here, before anything is submitted
    ex = executor(own, cfg["out_dir"])
    jobs = ex.submit_array([Worker(train_args, own["nodes"], own["gpus_per_node"], os.getcwd())
                            for _ in range(own["workers"])])
    status = " ".join(["python", "launch.py", *train_args, "--status"])
    print(f"{len(jobs)} worker(s) on {cfg['out_dir']}: job(s) {', '.join(j.job_id for j in jobs)}; their output in "
          f"{ex.folder}; where the grid stands: {status}")
    return jobs


def grid_status(cfg):
    """Where cfg's grid stands: each cell (its tuning grid's first, under the tuned protocol) as
    (arm, seed, what it is doing), the device-seconds (wall time x processes) spent, and those left at
    the rate measured on the cells with a result: their arm's seconds per step, else every arm's."""
    import records
    import tune
    grids = ([tune.tuning_config(cfg)] if cfg["tune_learning_rates"] else []) + [cfg]
    cells, kinds, spent, measured, left = [], [], 0.0, {}, []  # measured: arm -> [device-seconds, steps]
    for g in grids:
        for seed in g["seeds"]:
            for arm in g["arms"]:
                kind, text, used, step = cell_state(records.cell_dir(g["out_dir"], arm, seed), g["max_iters"])
                cells.append((arm, seed, text))
                kinds.append(kind)
                spent += used
                if kind in ("finished", "diverged"):
                    seconds_steps = measured.setdefault(arm, [0.0, 0])
                    seconds_steps[0] += used
                    seconds_steps[1] += step
                else:
                    left.append((arm, g["max_iters"] - step))
    seconds, steps = sum(v[0] for v in measured.values()), sum(v[1] for v in measured.values())
    rate = {arm: v[0] / v[1] for arm, v in measured.items() if v[1]}
    left_s = sum(n * rate.get(arm, seconds / steps) for arm, n in left) if steps else None
    return dict(out_dir=cfg["out_dir"], cells=cells, kinds=kinds, spent_s=spent, left_s=left_s,
                measured=len(kinds) - len(left))


def grid_device(cfg):
    """The device the grid trains on, as its record says (out_dir/config.json, or the tuning grid's: every cell
    of a grid shares it), not this machine's: --status may run on a login node without GPUs. Before any cell
    trained, the one cfg names (auto: this machine's)."""
    import records
    import torch
    import tune
    for g in ([tune.tuning_config(cfg)] if cfg["tune_learning_rates"] else []) + [cfg]:
        path = os.path.join(g["out_dir"], "config.json")
        if os.path.exists(path):
            return str(records.read_record(path, "restore it, or delete the folder to start the grid again")["device"])
    return "cuda" if cfg["device"] == "auto" and torch.cuda.is_available() else cfg["device"]


def status_text(status, unit):
    counts = ", ".join(f"{status['kinds'].count(k)} {k}" for k in KINDS)
    left = "the time left is known once a cell has a result" if status["left_s"] is None else \
        f"{status['left_s'] / 3600:.2f} left at the rate measured on {status['measured']} cell(s)"
    return "\n".join([f"{status['out_dir']}: {len(status['cells'])} cells: {counts}",
                      *(f"  {arm} seed{seed}: {text}" for arm, seed, text in status["cells"]),
                      f"{unit}: {status['spent_s'] / 3600:.2f} spent, {left}"])


KINDS = ("finished", "diverged", "training", "resumable", "pending")


def cell_state(cell_dir, max_iters):
    """(kind, what the cell is doing, the device-seconds it has used, its step). Device-seconds are
    wall time x processes, from its result, else its checkpoint (a cell in training: at its last one)."""
    from progress import duration
    result_path, ckpt_path = os.path.join(cell_dir, "result.json"), os.path.join(cell_dir, "ckpt.pt")
    if os.path.exists(result_path):
        r = read_json(result_path, strict=False)
        try:
            used = r["wall_time_s"] * r["config"]["world_size"]
            if r["status"] == "diverged":
                return "diverged", f"diverged at step {r['steps']} ({r['reason']})", used, r["steps"]
            return "finished", f"finished, val_loss {r['val_loss']:.4f}", used, r["steps"]
        except (KeyError, TypeError) as e:
            why = f"no {e}" if isinstance(e, KeyError) else e
            raise DataError(f"{result_path} is not a result train.py writes ({why}); move it aside to train the "
                            f"cell again") from None
    ckpt = checkpoint_summary(ckpt_path) if os.path.exists(ckpt_path) else dict(step=0, wall_time_s=0.0, world=1)
    used = ckpt["wall_time_s"] * ckpt["world"]
    pid, host = read_lock(os.path.join(cell_dir, "lock"))
    if pid and (host != socket.gethostname() or not pid.isdigit() or process_exists(int(pid))):
        last = last_log_record(os.path.join(cell_dir, "log.jsonl"))
        eta = f", {duration(last['eta_cell_s'])} left" if last.get("eta_cell_s") is not None else ""
        return "training", f"training: {host} pid {pid}, step {last.get('step', 0)}/{max_iters}{eta}", used, ckpt["step"]
    if ckpt["step"]:
        return "resumable", f"resumable at step {ckpt['step']}", used, ckpt["step"]
    return "pending", "pending", used, 0


def checkpoint_summary(path):
    """A checkpoint's step, wall time and world size, read without loading its tensors (mmap)."""
    import pickle

    import torch
    try:
        ckpt = torch.load(path, map_location="cpu", mmap=True, weights_only=True)
    except (OSError, EOFError, RuntimeError, ValueError, KeyError, pickle.UnpicklingError) as e:
        raise DataError(f"{path} cannot be read as a checkpoint ({str(e).splitlines()[0] if str(e) else type(e).__name__}); "
                        f"delete it to train the cell from scratch") from None
    return dict(step=ckpt["step"], wall_time_s=ckpt["wall_time_s"], world=ckpt["config"]["world_size"])


def last_log_record(path):
    """The log's last whole record ({} without one)."""
    try:
        with open(path) as f:
            lines = f.read().splitlines()
    except OSError:
        return {}
    for line in reversed(lines):
        try:
            return json.loads(line)
        except ValueError:
            continue  # a line being written
    return {}


def main(argv):
    own, train_args = split_args(argv)
    if own["status"]:
        cfg = train_config(train_args)
        print(status_text(grid_status(cfg), "GPU-hours" if grid_device(cfg).startswith("cuda") else "process-hours"))
        return
    jobs = launch(own, train_args)
    for job in jobs if own["cluster"] == "local" else []:  # on SLURM they run on without this process
        job.wait()
        print(f"worker {job.job_id}: {job.state.lower()}")


if __name__ == "__main__":
    run(main)
