"""
A grid on a SLURM cluster (or on this machine), through submitit: a job array of workers on one
out_dir, each a torchrun of train.py over its nodes' GPUs. Workers share the grid (train.py): each
takes the next cell that no live worker holds, and the last to finish writes the report. A worker
warned of its time limit or a preemption stops its cell at a step boundary, checkpointed, and is
requeued with the same command, which resumes it. --status says where the grid stands.

$ python launch.py config/rd_120m.py --workers=4 --partition=gpu          # 4 nodes of 8 GPUs, a cell each at a time
$ python launch.py config/dar_1b.py --workers=1 --nodes=2 --partition=gpu  # every cell over 2 nodes (16 GPUs)
$ python launch.py config/rd_120m.py --status                             # each cell; GPU-hours spent and left
$ python launch.py site.py config/rd_120m.py --workers=4 --dry_run        # site.py: account, qos, setup...
$ python launch.py config/rd_120m.py --cancel                             # running cells checkpoint, jobs end
$ python launch.py --cluster=local --workers=3 --gpus_per_node=0 --arms=standard,attnres --seeds=0,1,2  # here

The keys below are launch.py's own (--key=value, or a config file that sets only these keys, in the
paper configs' style; --setup=... and --sbatch=... add one entry each, commas kept); every other argument
goes to train.py as given (config files, --key=value). Before anything is queued (and by --dry_run) the config
is checked as train.py would at the workers' world size, the data as train.py would find it. When
the workers end (cluster=local, or --wait on SLURM) it says what each cell and worker came to, and
exits non-zero unless every cell finished and the report was written. docs/cluster.md: what lives
on the shared filesystem, what a preemption costs, a one-node SLURM to try this on.
"""

import contextlib
import difflib
import io
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
from types import SimpleNamespace

# no torch at the top: submitit's job process imports this file to run a Worker, which starts train.py
from common import ConfigError, DataError, read_json, run, write_json
from configurator import coerce, configure, parse_literal, read_config_file
from grid_files import DONE, KINDS, cell_dir, cell_state, grid_cells, read_record, report_is_current

HERE = os.path.dirname(os.path.abspath(__file__))

_before_config = set(globals())
# -----------------------------------------------------------------------------
cluster = "slurm"  # 'slurm' (sbatch through submitit) or 'local' (submitit's local executor: this machine)
workers = 1  # array tasks: each trains cells of the grid, one at a time, until none is left
nodes = 1  # nodes per worker: above 1, every cell trains across them (a c10d rendezvous on the first)
gpus_per_node = 8  # processes per node, one per GPU (local rank picks the GPU); 0 = one CPU process
partition = ""  # SLURM partition; "" = the cluster's default
time_min = 24 * 60  # a job's time limit in minutes; warned before it, the worker checkpoints and is requeued
warn_s = 300  # SLURM's warning (SIGUSR2) comes this long before the time limit (it may come up to 60 s early)
concurrency = 0  # at most this many workers at once (SLURM's array throttle); 0 = all
cpus_per_gpu = 8  # CPU cores per process (data loading is light: a few suffice)
cpus_per_task = 0  # CPU cores per task; 0 = cpus_per_gpu x gpus_per_node, for a CPU worker its threads (below)
mem = ""  # memory per node, sbatch --mem (64G); "" = the partition's default
account = ""  # sbatch --account (the allocation the hours are charged to); "" = your default
qos = ""  # sbatch --qos; "" = the default
constraint = ""  # sbatch --constraint, node features (a100&ib); "" = any node of the partition
exclusive = False  # whole nodes for each task (sbatch --exclusive)
gres = ""  # sbatch --gres: gpu:a100:8 names the GPU type, more GRES after a comma; "" = gpu:<gpus_per_node>
sbatch = []  # more sbatch options, each a long option as on an #SBATCH line: ["--mail-type=END"]
setup = []  # shell lines each job runs before its worker: ["module load cuda/12.1", "source .venv/bin/activate"]
logs = ""  # submitit's folder (job scripts and each worker's output); "" = <out_dir>_launch, beside the grid
dry_run = False  # print the sbatch script and the cells each task would take; submit nothing
wait = False  # on SLURM, stay until the array leaves the queue and say what happened (cluster=local always does)
status = False  # say where the grid stands (each cell, each queued task; GPU-hours spent and left); launch nothing
cancel = False  # end the grid's jobs: running cells checkpoint first (SIGTERM, then scancel); say what is resumable
# -----------------------------------------------------------------------------
DEFAULTS = {k: v for k, v in globals().items() if k not in _before_config and k != "_before_config"}
# on the command line each --sbatch=... and --setup=... adds one entry, taken as written (a config file gives a list)
LIST_KEYS = [k for k, v in DEFAULTS.items() if isinstance(v, list)]
# torchrun stops its workers on these; not on SIGTERM, which it would pass on and then, 30 s later, kill them with,
# however far their checkpoint is (a worker's processes ignore SIGTERM unless they handle it, as train.py does)
TORCHRUN_SIGNALS = "SIGINT,SIGHUP,SIGQUIT"
RDZV_PORT = 29500
# of the warning's lead time (warn_s), the checkpoint hook waits at most this share for train.py to checkpoint
# and exit (a step may be an evaluation or a compile), then requeues anyway, leaving submitit time to: a job
# killed at its limit unrequeued would end its worker for good
WARNED_WAIT_SHARE = 0.8
RESEND_S = 2  # meanwhile the stop is sent again this often (one that reached train.py before its handler is lost)
# a CPU worker's threads when cpus_per_task is 0 and this environment sets no OMP_NUM_THREADS: one (the Makefile's;
# a CPU run's thread count is a setting, so every worker must compute with the same)
CPU_THREADS = 1
# submitit requeues a job that reaches its time limit at most this many times (its default, 3, would end a
# worker on its 4th time limit, however many cells are left); preemptions are requeued without a count
MAX_TIME_LIMITS = 10_000


def split_args(argv):
    """(launch.py's settings, train.py's arguments): --key=value of launch.py's keys (--status alone
    means --status=True), and config files that set only launch.py's keys, are its own; everything
    else is train.py's."""
    own, train_args = dict(DEFAULTS), []
    for arg in argv:
        key, eq, text = arg[2:].partition("=") if arg.startswith("--") else ("", "", "")
        if key in LIST_KEYS:  # one entry per flag, verbatim: a shell line or an sbatch option keeps its commas
            if not eq:
                raise ConfigError(f"{arg}: give one entry, --{key}=..., and the flag again for each further one")
            own[key] = [*own[key], text]
        elif key in DEFAULTS:
            own[key] = coerce(key, parse_literal(text) if eq else True, DEFAULTS[key])
        elif not arg.startswith("--") and (settings := launch_file(arg)) is not None:
            for k, v in settings.items():  # a file's string for a list key is one entry too
                own[k] = coerce(k, [v] if k in LIST_KEYS and isinstance(v, str) else v, DEFAULTS[k])
        else:
            train_args.append(arg)
    if own["cluster"] not in ("slurm", "local"):
        raise ConfigError(f"cluster={own['cluster']!r}: choose slurm or local")
    for key in ("workers", "nodes"):
        if own[key] < 1:
            raise ConfigError(f"{key}={own[key]}: give at least 1")
    if min(own["gpus_per_node"], own["concurrency"], own["cpus_per_task"]) < 0 or own["time_min"] < 1:
        raise ConfigError(
            "gpus_per_node, concurrency and cpus_per_task are counts (0 or more), time_min at least 1 minute"
        )
    if not 0 < own["warn_s"] < own["time_min"] * 60:
        raise ConfigError(
            f"warn_s={own['warn_s']}: the warning comes that many seconds before the time limit; give "
            f"fewer than time_min's {own['time_min'] * 60} s, more than 0"
        )
    if own["cluster"] == "local" and own["nodes"] > 1:
        raise ConfigError(f"nodes={own['nodes']} on cluster=local: this machine is one node; use --nodes=1")
    if own["nodes"] > 1 and own["gpus_per_node"] == 0:
        raise ConfigError(
            f"nodes={own['nodes']} with gpus_per_node=0: a CPU worker is one process on one node; "
            f"use --nodes=1, or give each node's GPUs with --gpus_per_node"
        )
    if sum(own[k] for k in ("status", "cancel", "dry_run")) > 1:
        raise ConfigError("give one of --status, --cancel and --dry_run")
    sbatch_options(own["sbatch"])  # a malformed option or memory is refused before anything is read or written
    memory_mb(own["mem"])
    gres_request(own)
    return own, train_args


def launch_file(arg):
    """A config file's settings when every one is launch.py's key (a site's account, QoS, setup lines), else
    None: the file is train.py's (one that mixes both is train.py's, which names the launch key it refuses)."""
    if not (os.path.isfile(arg) or os.path.isfile(os.path.join(HERE, arg))):
        return None
    settings = read_config_file(arg)
    return settings if settings.keys() <= DEFAULTS.keys() else None


def sbatch_options(lines):
    """The sbatch key: {option: value} for submitit's additional_parameters (True for a flag)."""
    options = {}
    for line in lines:
        option = line.strip().removeprefix("#SBATCH").strip()
        name, eq, value = option[2:].partition("=")
        if not option.startswith("--") or not name or " " in name:
            raise ConfigError(
                f"sbatch option {line!r}: give a long option as on an #SBATCH line, e.g. "
                f"--mail-type=END or --reservation=paper"
            )
        options[name] = value if eq else True
    return options


def gres_request(own):
    """sbatch's --gres: the GPUs (gpu:<gpus_per_node>, or the gres key's gpu entry, which names their type)
    and any other GRES the gres key gives; None for none."""
    entries = [e for e in own["gres"].split(",") if e]
    gpu = [e for e in entries if e.split(":")[0] == "gpu"]
    gpus = own["gpus_per_node"]
    if gpu and (len(gpu) > 1 or not gpu[0].split(":")[-1].isdigit() or int(gpu[0].split(":")[-1]) != gpus):
        raise ConfigError(
            f"gres={own['gres']!r} with gpus_per_node={gpus}: give one gpu entry ending in the "
            f"GPUs per node, e.g. --gres=gpu:a100:{gpus or 8} (with --gpus_per_node={gpus or 8})"
        )
    if gpus and not gpu:
        entries.insert(0, f"gpu:{gpus}")
    return ",".join(entries) or None


def task_cpus(own):
    """CPU cores per task: the key, else cpus_per_gpu per GPU, else (a CPU worker) the threads one training
    process computes with: OMP_NUM_THREADS here (exported to the job), else CPU_THREADS."""
    if own["cpus_per_task"]:
        return own["cpus_per_task"]
    if own["gpus_per_node"]:
        return own["cpus_per_gpu"] * own["gpus_per_node"]
    threads = os.environ.get("OMP_NUM_THREADS", "")
    return int(threads) if threads.isdigit() and int(threads) > 0 else CPU_THREADS


def worker_command(train_args, nodes, gpus_per_node, hosts, job_id):
    """What a worker runs on each of its nodes: train.py itself for one process, else a torchrun of
    it over the node's GPUs, across nodes through a c10d rendezvous on the first node."""
    script = os.path.join(HERE, "train.py")
    if nodes == 1 and gpus_per_node <= 1:
        return [sys.executable, script, *train_args]
    where = (
        ["--standalone"]
        if nodes == 1
        else [
            f"--nnodes={nodes}",
            "--rdzv_backend=c10d",
            f"--rdzv_endpoint={hosts[0]}:{RDZV_PORT}",
            f"--rdzv_id={job_id}",
        ]
    )
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        *where,
        f"--nproc_per_node={gpus_per_node}",
        script,
        *train_args,
    ]


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
    worker is requeued and resumes it; it waits at most wait_s for that."""

    def __init__(self, train_args, nodes, gpus_per_node, cwd, wait_s):
        self.train_args, self.nodes, self.gpus_per_node, self.cwd, self.wait_s = (
            train_args,
            nodes,
            gpus_per_node,
            cwd,
            wait_s,
        )
        self.process = None

    def __call__(self):
        import submitit

        env = submitit.JobEnvironment()
        command = worker_command(self.train_args, self.nodes, self.gpus_per_node, env.hostnames, env.job_id)
        # a session of its own: checkpoint signals the whole run (torchrun and its ranks) at once
        self.process = subprocess.Popen(
            command,
            cwd=self.cwd,
            preexec_fn=leave_stops_to_train,
            start_new_session=True,
            env=dict(os.environ, TORCHELASTIC_SIGNALS_TO_HANDLE=TORCHRUN_SIGNALS),
        )
        while self.process.poll() is None:  # not wait(): checkpoint, run by a signal handler meanwhile, waits
            time.sleep(1)
        if self.process.returncode:
            if command[1] == "-m":  # torchrun exits 1 whether a rank failed or stopped (exit 75, checkpointed)
                why = "ended (a rank failed or was stopped by a signal: each rank's last line above says which)"
            else:  # cells.PREEMPTED, named here: this runs in submitit's process, which may not find cells.py
                why = "stopped by a signal, its cell checkpointed" if self.process.returncode == 75 else "failed"
            raise RuntimeError(
                f"{' '.join(command)} {why} (exit status {self.process.returncode}); see this worker's output"
            )

    def checkpoint(self):
        import submitit

        deadline = time.monotonic() + self.wait_s
        while self.process is not None and self.process.poll() is None and time.monotonic() < deadline:
            # again every few seconds: train.py still starting (importing torch) ignores one until it handles them
            os.killpg(self.process.pid, signal.SIGTERM)
            try:
                self.process.wait(timeout=max(min(RESEND_S, deadline - time.monotonic()), 0.01))
            except subprocess.TimeoutExpired:
                pass
        if self.process is not None and self.process.poll() is None:  # the cell resumes from its last checkpoint
            print(
                f"train.py did not stop within {self.wait_s:g} s of the warning; requeued without its checkpoint",
                flush=True,
            )
        return submitit.helpers.DelayedSubmission(
            Worker(self.train_args, self.nodes, self.gpus_per_node, self.cwd, self.wait_s)
        )


def train_config(train_args):
    """train.py's config for these arguments, as train.py reads them (before it touches data or devices)."""
    import train

    for arg in train_args:  # a misspelt launch key (--dry-run, --wokers=2) is named as one, not as train.py's
        key = arg[2:].partition("=")[0] if arg.startswith("--") else ""
        close = difflib.get_close_matches(key.replace("-", "_"), [*train.DEFAULTS, *DEFAULTS], n=1)
        if key and key not in train.DEFAULTS and close and close[0] in DEFAULTS:
            raise ConfigError(f"{arg}: no such key; did you mean launch.py's --{close[0]}?")
    try:
        return configure(train.DEFAULTS, train_args, entries=dict(arms=train.SCHEME_ARMS))
    except ConfigError as e:
        key = str(e).partition("unknown config key '")[2].partition("'")[0]
        if key in DEFAULTS:  # a config file of train.py's keys that sets one of launch.py's too
            raise ConfigError(
                f"a config file sets launch.py's key {key!r} beside train.py's: give launch.py's keys "
                f"in a file of their own (launch.py site.py config/x.py) or as --{key}=..."
            ) from None
        raise


def check_train_config(train_args, world):
    """train.py's config for these arguments, refused with one line where train.py would refuse it at the
    workers' world size (records.check_config, the tuning grid's too): a typo fails here, not in every task.
    The data's vocabulary is not read here: a stand-in checks the rest."""
    import records
    import tune

    given = train_config(train_args)
    cfg = dict(given, vocab_size=given["vocab_size"] or 50304, arms=records.typed_arms(given), world_size=world)
    records.check_config(cfg, world, [a[2:].partition("=")[0] for a in train_args if a.startswith("--")])
    if cfg["tune_learning_rates"]:
        records.check_config(tune.tuning_config(cfg), world)
    return given


def check_data(cfg):
    """train.py's look at the data (data.shards.find_data: the folder, its shards and their manifest), here: a
    missing data_dir is one line on the login node, not a failure in every task after its queue wait. A bundled
    corpus not prepared yet is left to the first worker, which prepares it."""
    from data.shards import BUNDLED, find_data, resolve_data_dir

    data_dir = resolve_data_dir(cfg["data_dir"]) if cfg["data_dir"] else None
    if data_dir and not (data_dir in BUNDLED and not os.path.exists(os.path.join(data_dir, "manifest.json"))):
        find_data(cfg, SimpleNamespace(master=False, world=1))  # not master: the shards' sizes, not their sha256s


def check_folders(own, out_dir):
    """The grid's folder and submitit's must be folders that can be made: a file in their place, or under a
    parent that cannot be written, is one line here (submitit would raise on its folder, each task on the grid's)."""
    for what, path, way_on in (
        ("out_dir", out_dir, "give --out_dir a folder of a writable filesystem"),
        ("logs", logs_folder(own, out_dir), "give --logs a folder of a writable filesystem"),
    ):
        existing = os.path.abspath(path)
        while not os.path.exists(existing):
            existing = os.path.dirname(existing)
        if not os.path.isdir(existing):
            there = "is a file" if existing == os.path.abspath(path) else f"cannot be made: {existing} is a file"
            raise ConfigError(f"{what} {path} {there}, not a folder; {way_on}")
        if existing != os.path.abspath(path) and not os.access(existing, os.W_OK | os.X_OK):
            raise ConfigError(f"{what} {path} cannot be made: {existing} is not writable; {way_on}")


def slurm_parameters(own, out_dir):
    """submitit's SlurmExecutor parameters: each task one process per node (torchrun starts the GPUs' ranks), the
    cluster's resources as the launch keys give them, and setup lines that let the job find this checkout."""
    gpus, cpus = own["gpus_per_node"], task_cpus(own)
    # the job imports launch.py to run a Worker, wherever sbatch was run from; a CPU worker computes with what it asks
    setup = [
        f"export PYTHONPATH={shlex.quote(HERE)}${{PYTHONPATH:+:$PYTHONPATH}}",
        *([] if gpus else [f"export OMP_NUM_THREADS={cpus}"]),
        *own["setup"],
    ]
    optional = {k: own[k] for k in ("partition", "account", "qos", "constraint", "mem") if own[k]}
    return dict(
        job_name=os.path.basename(os.path.abspath(out_dir)),
        time=own["time_min"],
        nodes=own["nodes"],
        ntasks_per_node=1,
        cpus_per_task=cpus,
        stderr_to_stdout=True,
        signal_delay_s=own["warn_s"],
        array_parallelism=own["concurrency"] or own["workers"],
        setup=setup,
        additional_parameters=sbatch_options(own["sbatch"]),
        **optional,
        **({"gres": gres_request(own)} if gres_request(own) else {}),
        **({"exclusive": True} if own["exclusive"] else {}),
    )


def logs_folder(own, out_dir):
    return own["logs"] or os.path.normpath(out_dir) + "_launch"  # not inside: the report would take it for an arm


def executor(own, out_dir):
    import submitit

    folder = logs_folder(own, out_dir)
    if own["cluster"] == "slurm":
        ex = submitit.SlurmExecutor(folder=folder, max_num_timeout=MAX_TIME_LIMITS)
        ex.update_parameters(**slurm_parameters(own, out_dir))
        return ex
    ex = submitit.AutoExecutor(folder=folder, cluster="local")
    ex.update_parameters(
        name=os.path.basename(os.path.abspath(out_dir)),
        timeout_min=own["time_min"],
        nodes=1,
        tasks_per_node=1,
        gpus_per_node=own["gpus_per_node"],
        cpus_per_task=task_cpus(own),
        stderr_to_stdout=True,
    )
    return ex


def check_partition(own):
    """A request that no node of the partition can meet, refused with one line from sinfo (what its nodes
    have) rather than left pending (PartitionConfig) forever. Nothing to check where sinfo lists no node:
    sbatch then says what is wrong (an unknown partition)."""
    where = ["--partition", own["partition"]] if own["partition"] else []
    try:
        out = subprocess.run(
            ["sinfo", "--noheader", "--Node", "--format=%c|%m|%G|%P", *where],
            capture_output=True,
            text=True,
            timeout=60,
        ).stdout
    except (OSError, subprocess.TimeoutExpired):
        return
    rows = [line.split("|") for line in out.splitlines() if line.count("|") == 3]
    if not own["partition"]:  # the default partition, marked with a *
        rows = [r for r in rows if r[3].endswith("*")]
    nodes = []
    for cpus, mem, node_gres, _ in rows:
        gpus = re.findall(r"(?:^|,)gpu(?::[^:,(]+)?:(\d+)", node_gres)
        nodes.append(
            (
                int(cpus.rstrip("+")) if cpus.rstrip("+").isdigit() else 0,
                int(mem.rstrip("+")) if mem.rstrip("+").isdigit() else 0,
                sum(map(int, gpus)),
            )
        )
    if not nodes:
        return
    need_cpus, need_gpus, need_mem = task_cpus(own), own["gpus_per_node"], memory_mb(own["mem"])
    if not any(c >= need_cpus and g >= need_gpus and m >= need_mem for c, m, g in nodes):
        have = "; ".join(sorted({f"{c} CPUs, {m} MB, {g} GPUs" for c, m, g in nodes}))
        name = own["partition"] or "the default partition"
        raise ConfigError(
            f"no node of {name} has {need_cpus} CPUs, {need_gpus} GPUs"
            + (f", {own['mem']}" if need_mem else "")
            + f" (sinfo: {have}): ask for less (--cpus_per_task, --gpus_per_node, --mem) or "
            f"choose another --partition"
        )


def memory_mb(mem):
    """sbatch's --mem in MB (a number is MB; K, M, G, T suffixes), 0 for the default."""
    match = re.fullmatch(r"(\d+)([KMGT]?)B?", mem.strip().upper())
    if not mem:
        return 0
    if not match:
        raise ConfigError(f"mem={mem!r}: give sbatch's --mem, e.g. 64G or 64000 (MB)")
    return int(int(match.group(1)) * {"K": 1 / 1024, "": 1, "M": 1, "G": 1024, "T": 1024**2}[match.group(2)])


def sbatch_script(own, out_dir):
    """The sbatch script the array is submitted with (submitit's), as submitit writes it."""
    from submitit.slurm.slurm import _make_sbatch_string  # submitit's own: no copy of it to drift

    folder = os.path.abspath(logs_folder(own, out_dir))
    command = " ".join([shlex.quote(sys.executable), "-u -m submitit.core._submit", shlex.quote(folder)])
    return _make_sbatch_string(
        command=command, folder=folder, map_count=own["workers"], **slurm_parameters(own, out_dir)
    )


def launch(own, train_args, argv=None):
    """Submit the workers as one array; returns their jobs (submitit's). argv: launch.py's command line (default
    train_args), which the record of the submission keeps."""
    argv = train_args if argv is None else argv
    if own["cluster"] == "slurm" and not own["dry_run"] and not shutil.which("sbatch"):
        raise ConfigError(
            "cluster=slurm but this machine has no sbatch (not a SLURM login node); submit from one, "
            "or run the workers on this machine with --cluster=local"
        )
    world = own["nodes"] * max(own["gpus_per_node"], 1)
    # what a task would refuse is one line here, before anything is submitted, and a dry run checks it all too
    cfg = check_train_config(train_args, world)
    check_data(cfg)
    check_folders(own, cfg["out_dir"])
    if own["cluster"] == "slurm":
        check_partition(own)
    if own["dry_run"]:
        print(dry_run_text(own, cfg, argv))
        return []
    ex = executor(own, cfg["out_dir"])
    folder = str(ex.folder)
    before = set(os.listdir(folder)) if os.path.isdir(folder) else None
    # the job process imports launch.py to run a Worker: from anywhere, as on SLURM (slurm_parameters' setup)
    os.environ["PYTHONPATH"] = os.pathsep.join([HERE, *filter(None, [os.environ.get("PYTHONPATH")])])
    if own["cluster"] == "local" and not own["gpus_per_node"]:  # a CPU worker's threads, as SLURM's job exports them
        os.environ["OMP_NUM_THREADS"] = str(task_cpus(own))
    try:
        with contextlib.redirect_stderr(io.StringIO()):  # a refusal's sbatch lines, which submitit prints, once below
            jobs = ex.submit_array(
                [
                    Worker(
                        train_args, own["nodes"], own["gpus_per_node"], os.getcwd(), WARNED_WAIT_SHARE * own["warn_s"]
                    )
                    for _ in range(own["workers"])
                ]
            )
    except Exception as e:  # submitit's FailedJobError holds sbatch's own message
        remove_new_files(folder, before)
        if type(e).__name__ not in ("FailedJobError", "CalledProcessError"):
            raise
        said = [line.strip() for line in str(e).splitlines() if "error:" in line]
        raise ConfigError(
            f"sbatch refused the array: {said[-1] if said else str(e).strip().splitlines()[-1]}; nothing was submitted"
        ) from None
    record_array(folder, own, jobs, argv)
    status = " ".join(["python", "launch.py", *map(shlex.quote, [a for a in argv if a != "--wait"]), "--status"])
    print(
        f"{len(jobs)} worker(s) on {cfg['out_dir']}: job(s) {', '.join(j.job_id for j in jobs)}; their output in "
        f"{ex.folder}; where the grid stands: {status}",
        flush=True,
    )
    return jobs


def remove_new_files(folder, before):
    """What a refused submission left in submitit's folder (the workers' pickles, the script): all it added."""
    if before is None:
        shutil.rmtree(folder, ignore_errors=True)
        return
    for name in set(os.listdir(folder)) - before:
        os.remove(os.path.join(folder, name))


ARRAYS = "arrays.json"  # in submitit's folder: each array submitted on the grid (job id, tasks, command line)


def record_array(folder, own, jobs, argv):
    path = os.path.join(folder, ARRAYS)
    arrays = read_arrays(folder)
    arrays.append(
        dict(
            cluster=own["cluster"],
            job_id=jobs[0].job_id.split("_")[0] if own["cluster"] == "slurm" else None,
            tasks=[j.job_id for j in jobs],
            argv=list(argv),
        )
    )
    write_json(path, arrays)


def read_arrays(folder):
    path = os.path.join(folder, ARRAYS)
    try:
        arrays = read_json(path)
    except FileNotFoundError:
        return []
    except (OSError, ValueError) as e:
        raise DataError(f"{path} cannot be read ({e}); delete it (it only names the grid's jobs)") from None
    if not isinstance(arrays, list) or not all(
        isinstance(a, dict) and isinstance(a.get("tasks"), list) for a in arrays
    ):
        raise DataError(f"{path} is not what launch.py writes; delete it (it only names the grid's jobs)")
    return arrays


def dry_run_text(own, cfg, argv):
    """What a launch would submit: the sbatch script (SLURM) and the cells each task would take first, in the
    order train.py takes them (each worker the next free cell: with cells of equal length, round robin)."""
    cells = [f"{arm} seed{seed}" for g in grids(cfg) for arm, seed in grid_cells(g)]
    lines = [
        sbatch_script(own, cfg["out_dir"])
        if own["cluster"] == "slurm"
        else f"# cluster=local: {own['workers']} worker process(es) on this machine"
    ]
    for task in range(own["workers"]):
        lines.append(
            f"# task {task}: " + (", ".join(cells[task :: own["workers"]]) or "no cell (more tasks than cells)")
        )
    # the same launch: every argument but the dry run's (one a config file sets is undone on the command line)
    command = [a for a in argv if not a.startswith("--dry_run")]
    command += [] if len(command) < len(argv) else ["--dry_run=False"]
    no_sbatch = own["cluster"] == "slurm" and not shutil.which("sbatch")
    return "\n".join(
        lines
        + [
            "# dry run: nothing submitted"
            + (" (this machine has no sbatch: submit from a SLURM login node)" if no_sbatch else "")
            + f"; without --dry_run: python launch.py {' '.join(map(shlex.quote, command))}"
        ]
    )


def grids(cfg):
    """The grids a run trains: under the tuned protocol its tuning grid (tune.tuning_config) first, then its own."""
    import tune

    return ([tune.tuning_config(cfg)] if cfg["tune_learning_rates"] else []) + [cfg]


def grid_status(cfg):
    """Where cfg's grid stands: each cell (its tuning grid's first, under the tuned protocol) as
    (arm, seed, what it is doing), the device-seconds (wall time x processes) spent, and those left at
    the rate measured on the cells with a result: their arm's seconds per step, else every arm's; done: whether
    every cell has a result."""
    cells, kinds, spent, measured, left = [], [], 0.0, {}, []  # measured: arm -> [device-seconds, steps]
    for g in grids(cfg):
        for arm, seed in grid_cells(g):
            try:
                kind, text, used, step = cell_state(cell_dir(g["out_dir"], arm, seed), g["max_iters"])
            except DataError as e:  # the grid's other cells are still worth seeing
                kind, text, used, step = "unreadable", f"unreadable: {e}", 0.0, 0
            cells.append((arm, seed, text))
            kinds.append(kind)
            spent += used
            if kind in DONE:
                seconds_steps = measured.setdefault(arm, [0.0, 0])
                seconds_steps[0] += used
                seconds_steps[1] += step
            else:
                left.append((arm, g["max_iters"] - step))
    seconds, steps = sum(v[0] for v in measured.values()), sum(v[1] for v in measured.values())
    rate = {arm: v[0] / v[1] for arm, v in measured.items() if v[1]}
    left_s = sum(n * rate.get(arm, seconds / steps) for arm, n in left) if steps else None
    return dict(
        out_dir=cfg["out_dir"],
        cells=cells,
        kinds=kinds,
        spent_s=spent,
        left_s=left_s,
        measured=len(kinds) - len(left),
        done=not left,
    )


def grid_device(cfg):
    """The device the grid trains on, as its record says (out_dir/config.json, or the tuning grid's: every cell
    of a grid shares it), not this machine's: --status may run on a login node without GPUs. Before any cell
    trained, the one cfg names (auto: this machine's)."""
    import torch

    for g in grids(cfg):
        path = os.path.join(g["out_dir"], "config.json")
        if os.path.exists(path):
            return str(read_record(path, "restore it, or delete the folder to start the grid again")["device"])
    return "cuda" if cfg["device"] == "auto" and torch.cuda.is_available() else cfg["device"]


def status_text(status, unit):
    counts = ", ".join(f"{status['kinds'].count(k)} {k}" for k in KINDS if k != "unreadable" or k in status["kinds"])
    left = (
        "the time left is known once a cell has a result"
        if status["left_s"] is None
        else f"{status['left_s'] / 3600:.2f} left at the rate measured on {status['measured']} cell(s)"
    )
    return "\n".join(
        [
            f"{status['out_dir']}: {len(status['cells'])} cells: {counts}",
            *(f"  {arm} seed{seed}: {text}" for arm, seed, text in status["cells"]),
            f"{unit}: {status['spent_s'] / 3600:.2f} spent, {left}",
        ]
    )


def worker_outcome(folder, task):
    """(how a worker of the array ended, its output file), from what submitit left in its folder: its result
    (finished, or the error it raised: stopped with its cell checkpointed, or failed), else none (killed: a
    scancel, a node failure, memory; or not ended yet)."""
    import pickle

    log = os.path.join(folder, f"{task}_0_log.out")
    try:
        with open(os.path.join(folder, f"{task}_0_result.pkl"), "rb") as f:
            outcome, value = pickle.load(f)
    except FileNotFoundError:
        return "ended without a result (cancelled or killed: its output's last lines say which)", log
    except (OSError, EOFError, ValueError, pickle.UnpicklingError, AttributeError, ImportError, TypeError) as e:
        return f"ended, its result unreadable ({type(e).__name__})", log
    if outcome == "success":
        return "finished", log
    if "stopped by a signal, its cell checkpointed" in str(value):
        return f"stopped by a signal (exit status {PREEMPTED}), its cell checkpointed", log
    # torchrun exits 1 however its ranks ended: stopped if the last line naming a cell is train.py's stop
    if "a rank failed or was stopped by a signal" in str(value) and STOPPED.search(last_cell_line(log)):
        return "stopped by a signal (its ranks' exit status 75), its cell checkpointed", log
    return "failed", log


STOPPED = re.compile(r"stopped by a signal: \[[^\]\s]+ seed\d+\] checkpointed at step \d+")  # train.py's, each rank's
CELL = re.compile(r"\[([^\]\s]+) seed(\d+)\]|/([^/\s]+)/seed(\d+)\b")  # [arm seedk], or a cell's folder in an error


def last_cell_line(log):
    """The last line of a worker's output that names a cell ("" for none)."""
    try:
        with open(log, errors="replace") as f:
            return next((line for line in reversed(f.readlines()) if CELL.search(line)), "")
    except OSError:
        return ""


PREEMPTED = 75  # cells.PREEMPTED: train.py's exit on a stop, its cell checkpointed (not imported: no torch here)


def last_cell(log):
    """The last cell ('arm seedk') a worker's output names ([arm seedk], or its folder .../arm/seedk in an error):
    the one it was on when it ended."""
    found = CELL.findall(last_cell_line(log))
    return f"{found[-1][0] or found[-1][2]} seed{found[-1][1] or found[-1][3]}" if found else None


def outcome_text(cfg, own, tasks, folder, command):
    """What happened, once the workers ended: each worker, each cell (a failed worker's log beside the cell it
    was on), and the report. Returns (text, whether the grid is done: every cell finished and the report written)."""
    status = grid_status(cfg)
    workers = {task: worker_outcome(folder, task) for task in tasks}
    failed = {last_cell(log): (task, log) for task, (outcome, log) in workers.items() if outcome != "finished"}
    lines = [
        f"worker {task}: {outcome}" + ("" if outcome == "finished" else f"; its output: {log}")
        for task, (outcome, log) in workers.items()
    ]
    for (arm, seed, text), kind in zip(status["cells"], status["kinds"]):
        where = failed.get(f"{arm} seed{seed}")
        if kind not in DONE and where:
            text += f"; its worker {where[0]} {workers[where[0]][0].split(' (')[0]}: {where[1]}"
        lines.append(f"  {arm} seed{seed}: {text}")
    report, done = os.path.join(cfg["out_dir"], "report.md"), status["done"]
    written = done and report_is_current(cfg["out_dir"], grid_cells(cfg))  # as train.py's last worker decides it
    counts = ", ".join(f"{status['kinds'].count(k)} {k}" for k in KINDS if status["kinds"].count(k))
    lines.insert(len(workers), f"{cfg['out_dir']}: {len(status['cells'])} cells: {counts}")
    if written:
        lines.append(f"every cell finished; the report: {report}")
    elif done:
        lines.append(f"every cell finished but {report} was not written; python report.py {cfg['out_dir']} writes it")
    else:
        lines.append(f"the grid is not finished: what is resumable resumes, what is pending starts, with: {command}")
    return "\n".join(lines), written


QUEUE_POLL_S = 5  # --wait: how often one squeue call asks where the array stands


def queue(job_ids):
    """{task: (state, reason, nodes)} of the arrays' tasks still in SLURM's queue: one squeue call for all of
    them (never one per task: a grid's polling must not load the scheduler), each task on its own line
    (--array), every field whole ('|'-separated, no width: a state is never cut); None when squeue fails."""
    if not job_ids:
        return {}
    try:
        proc = subprocess.run(
            ["squeue", "--noheader", "--array", f"--jobs={','.join(job_ids)}", "--format=%i|%T|%r|%N"],
            capture_output=True,
            text=True,
            timeout=60,
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    if proc.returncode and "Invalid job id" not in proc.stderr:  # every job gone from the queue: no error
        return None
    rows = [line.split("|") for line in proc.stdout.splitlines() if line.count("|") == 3]
    return {task: (state, reason, nodes) for task, state, reason, nodes in rows}


# what a pending task's reason means, beside SLURM's word for it
REASONS = {
    "BeginTime": "requeued: SLURM holds a requeued job (AuthInfo's cred_expire, 120 s by default) before it may start",
    "Resources": "waiting for free nodes",
    "Priority": "jobs of higher priority first",
    "PartitionConfig": "no node of the partition fits the request: cancel it (--cancel) and ask for less",
    "JobHeldUser": "held: scontrol release JOBID",
    "JobHeldAdmin": "held by an administrator",
    "QOSMaxJobsPerUserLimit": "the QoS's limit on running jobs",
    "AssocGrpGRES": "the account's GPU limit",
    "JobArrayTaskLimit": "the array's concurrency limit",
}


def queue_text(arrays, folder):
    """The queue beside the cells: each task of the grid's SLURM arrays, its state and reason, the cell its
    output last named."""
    ids = [a["job_id"] for a in arrays if a.get("cluster") == "slurm" and a.get("job_id")]
    if not ids:
        return None
    tasks = queue(ids)
    if tasks is None:
        return "the queue: squeue did not answer"
    lines = []
    for a in arrays:
        for task in a["tasks"] if a.get("cluster") == "slurm" else []:
            if task in tasks:
                state, reason, nodes = tasks[task]
                why = (
                    f" ({reason}: {REASONS[reason]})"
                    if reason in REASONS
                    else f" ({reason})"
                    if reason not in ("None", "")
                    else ""
                )
                where = f" on {nodes}" if state == "RUNNING" and nodes else ""
            else:
                state, why, where = f"not in the queue, {worker_outcome(folder, task)[0]}", "", ""
            cell = last_cell(os.path.join(folder, f"{task}_0_log.out"))
            lines.append(f"  task {task}: {state}{where}{why}" + (f", last on [{cell}]" if cell else ""))
    return "\n".join(["the queue (squeue):", *lines])


def wait_for(arrays, folder):
    """Until every task of these SLURM arrays has left the queue (one squeue call every QUEUE_POLL_S) for good:
    with its result written, or unseen at 3 looks running (a task being requeued may be missing from one look)."""
    ids, tasks = [a["job_id"] for a in arrays], [t for a in arrays for t in a["tasks"]]
    unseen = dict.fromkeys(tasks, 0)
    while True:
        queued = queue(ids)
        for task in tasks if queued is not None else []:
            ended = task not in queued or queued[task][0] in ENDED
            unseen[task] = unseen[task] + 1 if ended else 0
        if all(n >= 3 or (n and os.path.exists(os.path.join(folder, f"{t}_0_result.pkl"))) for t, n in unseen.items()):
            return
        time.sleep(QUEUE_POLL_S)


ENDED = (
    "COMPLETED",
    "FAILED",
    "CANCELLED",
    "TIMEOUT",
    "OUT_OF_MEMORY",
    "NODE_FAIL",
    "BOOT_FAIL",
    "DEADLINE",
    "PREEMPTED",
)


def cancel_jobs(cfg, own, arrays, folder, command):
    """End the grid's SLURM jobs so that running cells checkpoint first: pending tasks are cancelled, running
    ones sent SIGTERM (train.py's stop: its cell checkpointed at the step boundary, exit 75; the worker is not
    requeued, unlike on the time limit's warning), waited for (at most the warning's share), then cancelled."""
    ids = [a["job_id"] for a in arrays if a.get("cluster") == "slurm" and a.get("job_id")]
    if not ids:
        raise ConfigError(
            f"no SLURM job of this grid is recorded in {os.path.join(folder, ARRAYS)}; a grid on "
            f"cluster=local stops with Ctrl-C (its cells checkpointed)"
        )
    queued = queue(ids)
    if queued is None:
        raise DataError("squeue did not answer, so nothing was cancelled; run the same --cancel again")
    # a task no longer queued, or queued as ended, had ended before: it is said so, with how (squeue's state, else
    # what submitit's folder holds), never counted as cancelled
    ended = {
        t: queued[t][0] if t in queued else worker_outcome(folder, t)[0].split(" (")[0]
        for a in arrays
        if a.get("cluster") == "slurm" and a.get("job_id")
        for t in a["tasks"]
        if t not in queued or queued[t][0] in ENDED
    }
    live = sorted({t.split("_")[0] for t, (state, _, _) in queued.items() if state not in ENDED})
    if live:
        for extra in (["--state=PENDING"], ["--signal=TERM"]):
            subprocess.run(["scancel", *extra, *live], capture_output=True, timeout=60)
        deadline = time.monotonic() + WARNED_WAIT_SHARE * own["warn_s"]
        while time.monotonic() < deadline and any(s == "RUNNING" for s, _, _ in (queue(live) or {}).values()):
            time.sleep(1)
        subprocess.run(["scancel", *live], capture_output=True, timeout=60)
    status = grid_status(cfg)
    resumable = [f"{arm} seed{seed}" for (arm, seed, _), k in zip(status["cells"], status["kinds"]) if k == "resumable"]
    before = ", ".join(f"{t} ({how})" for t, how in ended.items())
    print(
        (f"cancelled job(s) {', '.join(live)}" if live else "nothing to cancel")
        + (f"; task(s) that had already ended: {before}" if ended else "")
        + "; "
        + (
            "every cell finished"
            if status["done"]
            else (f"resumable: {', '.join(resumable)}" if resumable else "no cell resumable") + f"; to go on: {command}"
        )
    )


def main(argv):
    own, train_args = split_args(argv)
    command = " ".join(
        [
            "python",
            "launch.py",
            *map(shlex.quote, [a for a in argv if not a.startswith(("--status", "--cancel", "--dry_run", "--wait"))]),
        ]
    )
    if own["status"] or own["cancel"]:
        cfg = train_config(train_args)
        folder = logs_folder(own, cfg["out_dir"])
        arrays = read_arrays(folder)
        if own["cancel"]:
            return cancel_jobs(cfg, own, arrays, folder, command)
        print(status_text(grid_status(cfg), "GPU-hours" if grid_device(cfg).startswith("cuda") else "process-hours"))
        if text := queue_text(arrays, folder):
            print(text)
        return
    jobs = launch(own, train_args, argv)
    if not jobs or (own["cluster"] == "slurm" and not own["wait"]):  # on SLURM they run on without this process
        return
    folder = str(jobs[0].paths.folder)
    if own["cluster"] == "local":
        for job in jobs:
            job.wait()
    else:
        wait_for(read_arrays(folder)[-1:], folder)
    text, done = outcome_text(train_config(train_args), own, [j.job_id for j in jobs], folder, command)
    print(text)
    if not done:
        raise DataError("the grid did not finish (above: each worker and cell); " + text.splitlines()[-1])


if __name__ == "__main__":
    run(main)
