"""
The life of one cell of the grid, around train.py's loop: open_cell builds it (the seed's shared
init, the warm start, a resume from its checkpoint, its config.json and log), save_cell checkpoints
it, evaluate_downstream scores the CORE tasks when due, finish_cell writes result.json (common.cell_lock
lets one process at a time train it). A stop signal (SIGTERM, SIGUSR1: stop_on_signals) ends it at a
step boundary, checkpointed (stop_requested, Preempted; exit status PREEMPTED). seed_for is the
pairing: a seed's init, data order and dropout seeds, the same for every arm. Among a grid's workers,
write_report writes the paired report once (grid_files.grid_cells and unfinished say which cells are left).
"""

import dataclasses
import os
import signal
import time
from contextlib import contextmanager
from types import SimpleNamespace

import numpy as np
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import checkpoint
import downstream
import records
from checkpoint import CellState
from common import DataError, LockHeld, pid_lock, write_json
from data.shards import get_tokenizer
from grid_files import grid_cells, report_is_current, unfinished
from machine import apply_fsdp, machine_record
from model import GPT, GPTConfig
from progress import CellLog


INIT, DATA_ORDER, DROPOUT = 0, 1, 2  # what a seed_for seed is for
# the exit status of a run stopped by SIGTERM or SIGUSR1 (SLURM's notice before a time limit or a
# preemption; torchrun passes SIGTERM on): its cell checkpointed at a step boundary, the same command
# resumes it. 75 is EX_TEMPFAIL, "try again later".
PREEMPTED = 75
STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)


def seed_for(seed, purpose, rank=0):
    """Independent integer seeds per run seed and purpose (INIT, DATA_ORDER, DROPOUT per rank)."""
    return int(np.random.SeedSequence([seed, purpose, rank]).generate_state(1)[0])


class Preempted(Exception):
    """A stop signal arrived: the cell in training is checkpointed (the message says where)."""


stop_received = []  # the stop signals this process received: the handler only appends, the loop reads


@contextmanager
def stop_on_signals():
    """SIGTERM and SIGUSR1 set a flag that the loop reads at its next step boundary (stop_requested),
    so a step is never cut in half; after, the handlers before are restored and the flag cleared (a
    stop is one run's)."""
    stop_received.clear()
    before = {sig: signal.signal(sig, lambda signum, frame: stop_received.append(signum)) for sig in STOP_SIGNALS}
    try:
        yield
    finally:
        for sig, handler in before.items():
            signal.signal(sig, handler)
        stop_received.clear()


def stop_requested(runtime):
    """Whether any rank received a stop signal: every rank learns it at the same step (a signal may
    reach only some ranks), so all stop there together."""
    if runtime.world == 1:
        return bool(stop_received)
    flag = torch.tensor([len(stop_received)], device=runtime.device)
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    return bool(flag.item())


def rank0s(value, runtime):
    """Rank 0's value on every rank (what rank 0 alone can see, such as who holds a cell's lock)."""
    if runtime.world == 1:
        return value
    box = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]


@dataclasses.dataclass
class Grid:
    """What the cells of one run share."""

    code: dict  # records.code_record()
    record: records.GridRecord  # out_dir/config.json: written once, when the first cell trains
    differences: dict  # (arm, seed) -> how the cell's config.json differs from this run (records.check_cell)
    todo: list  # the cells without a result, in order: for time left
    init: dict | None  # the warm start's weights (init_from), or None
    bundle: downstream.Bundle | None  # the CORE tasks (downstream_bundle), or None
    rates: dict = dataclasses.field(default_factory=dict)  # arm -> (s/step, s/evaluation), for time left


@dataclasses.dataclass
class Cell:
    """A cell ready to train (open_cell)."""

    settings: SimpleNamespace  # the cell's config (records.cell_config) as attributes
    record: dict  # its config.json
    model: GPT
    compiled: torch.nn.Module  # the model as it runs: compiled, or the model itself
    train_model: torch.nn.Module  # the compiled model under DDP, or the compiled model
    optimizer: object
    state: CellState
    log: CellLog
    init_hash: str
    val_rows: np.ndarray  # the validation sequences it is evaluated on (records.ValidationText.rows)
    validation: dict  # what they are, for the report (records.ValidationText.described)
    tasks: list | None  # this rank's share of the CORE tasks, encoded for the cell (downstream.encode_tasks)

    @property
    def dir(self):
        return records.cell_dir(self.settings.out_dir, self.settings.arm, self.settings.seed)


def open_cell(arm, seed, cfg, grid, val, runtime):
    """A cell ready to train, or None when it is done already (said on rank 0): its model at the
    seed's shared init (or the warm start's weights), resumed from its checkpoint when it has one,
    its config.json written and its log opened."""
    settings = SimpleNamespace(**records.cell_config(cfg, arm, seed))
    cell_dir = records.cell_dir(settings.out_dir, arm, seed)
    change = grid.differences[arm, seed]
    if os.path.exists(os.path.join(cell_dir, "result.json")):
        if runtime.master:
            done = records.describe_done(os.path.join(cell_dir, "result.json"), change)
            print(f"[{arm} seed{seed}] done already: {done}")
            if grid.bundle and not os.path.exists(os.path.join(cell_dir, "downstream.json")):  # trained without it
                print(
                    f"[{arm} seed{seed}] has no downstream.json: python downstream.py {cell_dir} "
                    f"--bundle={settings.downstream_bundle}"
                    + (
                        f" --max_per_task={settings.downstream_max_per_task}"
                        if settings.downstream_max_per_task
                        else ""
                    )
                )
        return None
    config = GPTConfig(**{k: getattr(settings, k) for k in records.MODEL_KEYS})
    # machine: where it computes, provenance only (records.differences skips it): another machine rounds differently
    record = dict(
        vars(settings),
        model=dataclasses.asdict(config),
        code=grid.code,
        machine=machine_record(runtime),
        val_hash=val.hash(settings.eval_tokens, settings.block_size, settings.eval_layout),
    )
    torch.manual_seed(seed_for(seed, INIT))  # the seed's shared init, bit-identical across arms
    model = GPT(config)
    if grid.init is not None:  # every shared weight replaced, routing left at its init
        model.load_state_dict(grid.init, strict=False)
    init_hash = records.shared_init_hash(model)
    model.to(runtime.device)
    model.activation_checkpointing = settings.activation_checkpointing
    if runtime.fsdp:
        apply_fsdp(model)
    optimizer = model.configure_optimizers(
        settings.weight_decay,
        settings.learning_rate,
        (settings.beta1, settings.beta2),
        runtime.device.split(":")[0],
        settings.optimizer,
        settings.muon_learning_rate,
    )
    torch.manual_seed(seed_for(seed, DROPOUT, runtime.rank))  # dropout masks: paired across arms, distinct per rank
    state = CellState()
    if os.path.exists(os.path.join(cell_dir, "ckpt.pt")):
        state = checkpoint.resume(cell_dir, record, settings.allow_changes, model, optimizer, runtime)
        if runtime.master:
            print(
                f"[{arm} seed{seed}] resuming from step {state.step}"
                + (f" with changes: {', '.join(change)}" if change else "")
            )
    if state.changes:
        record["changes"] = state.changes
    if runtime.master:
        write_json(os.path.join(cell_dir, "config.json"), record)
    torch._dynamo.reset()  # a new cell is a new model: compile afresh, not as the 9th recompile of forward
    # one graph per batch shape (training micro-batches, evaluation batches), never a dynamic one
    compiled = torch.compile(model, dynamic=False) if settings.compile else model
    train_model = (
        DDP(compiled, device_ids=[runtime.local_rank] if runtime.device.startswith("cuda") else None)
        if runtime.world > 1 and not runtime.fsdp
        else compiled
    )
    log = CellLog(settings, state, dict(record, init_hash=init_hash), model, grid, runtime)
    tasks = (
        None
        if grid.bundle is None
        else downstream.encode_tasks(
            grid.bundle.tasks, get_tokenizer(settings.tokenizer), settings.block_size, runtime.rank, runtime.world
        )
    )
    where = settings.eval_tokens, settings.block_size, settings.eval_layout
    return Cell(
        settings,
        record,
        model,
        compiled,
        train_model,
        optimizer,
        state,
        log,
        init_hash,
        val.rows(*where),
        val.described(*where),
        tasks,
    )


def save_cell(cell, data, loss_sum, grid, runtime):
    """The cell's checkpoint at its state's step. The log interval's loss so far is summed onto rank
    0 (the others' zeroed), which holds it in the checkpoint, so a resume restores it exactly."""
    if runtime.world > 1:
        dist.all_reduce(loss_sum)
        if not runtime.master:
            loss_sum.zero_()
    state = cell.state
    state.data_hash, state.loss_sum, state.wall_time_s = data.hash, loss_sum.item(), cell.log.wall_time_s()
    if runtime.master:
        grid.record.write_once()
    checkpoint.save_checkpoint(
        os.path.join(cell.dir, "ckpt.pt"), cell.model, cell.optimizer, state, cell.record, runtime
    )


def evaluate_downstream(cell, grid, runtime):
    """The CORE tasks on the cell's model when due (downstream_interval, and the cell's last step),
    on every rank, logged; at the last step rank 0 writes downstream.json (before result.json, so a
    finished cell has both). The uncompiled model: its batches vary in shape. Eval mode draws no
    random numbers, so training goes on as without it."""
    s, step = cell.settings, cell.state.step
    due = step == s.max_iters or (s.downstream_interval and step > 0 and step % s.downstream_interval == 0)
    if cell.tasks is None or not due:
        return
    t0 = time.monotonic()
    # eval_batch_size sequences of block_size per forward: the memory of a validation batch
    scores = downstream.evaluate_tasks(
        cell.model, cell.tasks, runtime.device, runtime.autocast, runtime.world, s.eval_batch_size * s.block_size
    )
    cell.log.downstream(step, scores, time.monotonic() - t0)
    if step == s.max_iters and runtime.master:
        downstream.write_scores(cell.dir, grid.bundle, step, scores, runtime.dtype)


def finish_cell(cell, data, val_loss, sequence_losses, diverged, routing, grid, runtime):
    """result.json: how the cell ended (rank 0), with the final evaluation's loss per validation sequence."""
    if not runtime.master:
        return
    s, state = cell.settings, cell.state
    if diverged:
        print(f"[{s.arm} seed{s.seed}] diverged: {diverged}; the cell stops here, the grid goes on")
    grid.record.write_once()
    cell.log.close(
        records.write_result(
            os.path.join(cell.dir, "result.json"),
            vars(s),
            cell.record,
            cell.model,
            grid.code,
            steps=state.step,
            tokens=state.step * cell.log.tokens_per_step,
            val_loss=val_loss,
            sequence_losses=sequence_losses,
            diverged=diverged,
            routing=routing,
            init_hash=cell.init_hash,
            data_hash=data.hash,
            eval_tokens=(s.eval_tokens - 1) // s.block_size * s.block_size,
            validation=cell.validation,
            changes=state.changes,
            wall_time_s=cell.log.wall_time_s(),
        )
    )


# -----------------------------------------------------------------------------
# the report the last of a grid's workers writes


# how long the last worker waits for a report.lock that this host cannot check (another host's, or one naming no
# process) to go: another host's worker writes a report in seconds
REPORT_WAIT_S = 120


def write_report(cfg):
    """The paired report, written once, by the worker that finds every cell of the grid finished (the
    last to finish): under out_dir/report.lock, and only when no report is newer than every file it reads
    (grid_files.report_is_current: a worker finished at the same time, or a rerun of a finished grid,
    finds it written). A lock this host cannot check that stays REPORT_WAIT_S is an error
    naming it: the grid finished without a report."""
    cells = grid_cells(cfg)
    left = unfinished(cfg, cells)
    if left:
        print(
            f"{len(left)} cell(s) without a result, trained by other workers (or stopped): the last worker "
            f"to finish writes the report"
        )
        return
    path, lock = os.path.join(cfg["out_dir"], "report.md"), os.path.join(cfg["out_dir"], "report.lock")
    command = [cfg["out_dir"]] + ([f"--reference={cfg['reference_arm']}"] if cfg["reference_arm"] else [])
    give_up = time.monotonic() + REPORT_WAIT_S
    while True:
        try:
            with pid_lock(lock, "the report is being written"):
                if report_is_current(cfg["out_dir"], cells):
                    print(
                        f"{path} is up to date with every result; python report.py {' '.join(command)} writes it again"
                    )
                    return
                import report

                report.main(command)
                return
        except LockHeld as e:
            if e.alive:
                print(f"{path} is being written by {e.holder} (lock {lock})")
                return
            if time.monotonic() >= give_up:
                raise DataError(
                    f"no report written: {lock} is held by {e.holder}, which this host cannot check; "
                    f"if no run is writing it: rm {lock}; python report.py {' '.join(command)}"
                ) from None
            time.sleep(2)
