"""
What a cell says as it trains: log.jsonl and the console (rank 0), its wandb run, and its clocks:
wall time, step time (evaluation and checkpoints are not training time) and the time left in the
cell and the grid. None of it changes a result.
"""

import json
import os
import time

from common import DataError
from grid_files import cell_dir, duration


class CellLog:
    """
    What a cell says as it trains: log.jsonl and the console on rank 0, each record also logged to
    the cell's wandb run when wandb_log (one run per cell with its record as config, continued when
    the cell resumes, its result as the run's summary); and its clocks, on every rank: wall time,
    step time (evaluation and checkpoints are not training time) and time left.
    """

    def __init__(self, cell, state, config, model, grid, runtime):
        self.cell, self.runtime, self.prefix = cell, runtime, f"[{cell.arm} seed{cell.seed}]"
        self.tokens_per_step = cell.gradient_accumulation_steps * cell.batch_size * cell.block_size
        self.flops_per_step = model.flops_per_token(cell.block_size) * self.tokens_per_step
        self.time_left = TimeLeft(cell, grid.todo, grid.rates)
        self.wall_before, self.file, self.run = state.wall_time_s, None, None
        # the steps of the log interval under way that an earlier process trained (a cell resumed between two log
        # lines): its time is not on this process's clock, so the interval's step time leaves them out
        self.untimed = state.step - state.step_last
        self.path = os.path.join(cell_dir(cell.out_dir, cell.arm, cell.seed), "log.jsonl")
        if runtime.master:
            try:
                # a resumed log was cut back to its checkpoint
                self.file = open(self.path, "a" if state.step > 0 else "w")
            except OSError as e:
                raise self.cannot_write(e) from None
            if cell.wandb_log:
                import wandb

                group = cell.wandb_run_name or os.path.basename(os.path.abspath(cell.out_dir))
                self.run = wandb.init(
                    project=cell.wandb_project,
                    group=group,
                    name=f"{group}/{cell.arm}/seed{cell.seed}",
                    config=config,
                    **(dict(id=state.wandb_id, resume="allow") if state.wandb_id else {}),
                )
                state.wandb_id = self.run.id
            if state.step == 0:
                active = f" ({model.num_params(active=True) / 1e6:.2f}M active)" if model.moes() else ""
                print(
                    f"{self.prefix} {model.num_params() / 1e6:.2f}M non-embedding parameters{active}, "
                    f"{self.tokens_per_step:,} tokens/step, {cell.max_iters} steps"
                )
        # durations from the monotonic clock: a wall clock set back or forward mid-cell (NTP, a laptop's
        # sleep, a time zone fix) would give negative or days-long step and wall times
        self.t_start = self.t_last = time.monotonic()

    def cannot_write(self, e):
        return DataError(
            f"cannot write {self.path} ({e.strerror or e}); the cell's last checkpoint is kept: free disk "
            f"space, then run the same command again to resume from it"
        )

    def write(self, entry, **file_only):
        if not self.runtime.master:
            return
        try:
            self.file.write(json.dumps(dict(entry, **file_only)) + "\n")
            self.file.flush()
        except OSError as e:  # a full disk: the log past the checkpoint is cut back when the cell resumes
            raise self.cannot_write(e) from None
        if self.run:
            self.run.log(entry, step=entry["step"])

    def evaluated(self, step, val_loss, routing, seconds):
        if self.runtime.master:
            print(f"{self.prefix} step {step}: val_loss {val_loss:.4f}")
        self.write(
            dict(step=step, tokens=step * self.tokens_per_step, val_loss=val_loss, eval_s=round(seconds, 3)),
            routing=routing,
        )

    def downstream(self, step, scores, seconds):
        """The CORE score and mean bits per byte at step (downstream.evaluate_tasks), and each task's."""
        if self.runtime.master:
            print(
                f"{self.prefix} step {step}: CORE {scores['core']:.4f}, {scores['bits_per_byte']:.4f} bits per byte "
                f"over {len(scores['tasks'])} tasks"
            )
        self.write(
            dict(
                step=step,
                tokens=step * self.tokens_per_step,
                core=scores["core"],
                bits_per_byte=scores["bits_per_byte"],
                eval_s=round(seconds, 3),
                centered={label: task["centered"] for label, task in scores["tasks"].items()},
                task_bits_per_byte={label: task["bits_per_byte"] for label, task in scores["tasks"].items()},
            )
        )

    def paused(self, seconds):
        """seconds not spent training (an evaluation and its checkpoint): kept out of the step time."""
        self.time_left.evaluated(seconds)
        self.t_last += seconds

    def trained(self, step, steps, loss, lr):
        """The log line of the `steps` steps up to step, whose mean loss was loss."""
        timed, self.untimed = steps - self.untimed, 0
        dt = (time.monotonic() - self.t_last) / timed
        eta_cell, eta_grid = self.time_left.after(step, timed, dt * timed)
        # no time measured (a coarse or frozen clock): the rates are unknown (None), not infinite
        mfu = self.flops_per_step / dt / self.runtime.peak_flops if self.runtime.peak_flops and dt else None
        tokens_per_s = self.tokens_per_step / dt if dt else None
        if self.runtime.master:
            print(
                f"{self.prefix} step {step}/{self.cell.max_iters} | loss {loss:.4f} | lr {lr:.2e} | "
                f"{dt * 1000:.1f} ms/step | "
                + (f"{tokens_per_s:,.0f}" if tokens_per_s else "?")
                + " tok/s"
                + (f" | mfu {100 * mfu:.1f}%" if mfu else "")
                + f" | left: cell {duration(eta_cell)}, grid {duration(eta_grid)}"
            )
        self.write(
            dict(
                step=step,
                tokens=step * self.tokens_per_step,
                loss=loss,
                lr=lr,
                ms_per_step=dt * 1000,
                tokens_per_s=tokens_per_s,
                mfu=mfu,
                # to the millisecond: a tenth of a second would write a tiny run's time left as none
                eta_cell_s=round(eta_cell, 3),
                eta_grid_s=round(eta_grid, 3),
            )
        )
        self.t_last = time.monotonic()

    def wall_time_s(self):
        return self.wall_before + time.monotonic() - self.t_start

    def close(self, result):
        if self.file:
            self.file.close()
        if self.run:
            self.run.summary.update({k: v for k, v in result.items() if k != "config"})
            self.run.finish()


class TimeLeft:
    """Time left in the cell and the grid, from the step time measured after this process's first
    logged interval (which compiles) and from the fastest evaluation (the first compiles too).
    Cells not started yet are estimated at this cell's rates, or at their arm's when this process
    has run one of its cells."""

    def __init__(self, cell, todo, rates):
        self.cell, self.todo, self.rates = cell, todo, rates  # rates: arm -> (s/step, s/evaluation), shared by cells
        self.intervals, self.train_s, self.train_steps, self.eval_s = 0, 0.0, 0, []

    def evaluated(self, seconds):
        self.eval_s.append(seconds)

    def after(self, step, steps, seconds):
        """(cell, grid) seconds left at step, after a log interval of `steps` steps that took `seconds`."""
        self.intervals += 1
        if self.intervals > 1:
            self.train_s, self.train_steps = self.train_s + seconds, self.train_steps + steps
        step_s = self.train_s / self.train_steps if self.train_steps else seconds / steps
        arm, n, k = self.cell.arm, self.cell.max_iters, self.cell.eval_interval
        eval_s = min(self.eval_s, default=0.0)  # a resumed cell may log before its first evaluation
        self.rates[arm] = (step_s, eval_s)
        cell = (n - step) * step_s + evals_after(step, n, k) * eval_s
        here = (arm, self.cell.seed)
        later = self.todo[self.todo.index(here) + 1 :] if here in self.todo else []
        grid = cell + sum(
            self.rates.get(a, self.rates[arm])[0] * n + self.rates.get(a, self.rates[arm])[1] * evals_after(-1, n, k)
            for a, _ in later
        )
        return cell, grid


def evals_after(step, max_iters, eval_interval):
    """Evaluations still to come after step."""
    n, k = max_iters, eval_interval
    return n // k - step // k + (n % k != 0 and step < n)
