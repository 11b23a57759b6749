"""
dev/leaderboard.py, docs/leaderboard.md's tables: read off real tiny grids (two "corpora" and a longer `standard`
grid beside one), the cross-corpus verdict, the equal-time interpolation, and the refusal to put grids of two
settings in one table; a row for an arm that diverged on every seed, one line for a grid it cannot read. --add, which
ranks a scheme (the README's `gated`) among a tiny tuned grid's rows: in a copy where the code and machine are the
grid's, afresh where they are not, the stored grid untouched either way.
"""

import hashlib
import json
import math
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time

import pytest

import cells
import train
from helpers import tiny

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "dev"))
import leaderboard  # noqa: E402

ARMS = "--arms=standard,scaled_residual,attnres"


def grid(shards, out, *extra):
    train.main(tiny(shards, out, ARMS, "--seeds=0,1", *extra))
    return str(out)


@pytest.fixture(scope="module")
def grids(shards, tmp_path_factory):
    d = tmp_path_factory.mktemp("leaderboard")
    one, two = grid(shards, d / "board_a"), grid(shards, d / "board_b")
    train.main(tiny(shards, d / "board_a_standard16", "--arms=standard", "--seeds=0,1", "--max_iters=16"))
    return one, two


def test_each_corpus_gets_a_row_per_arm_with_the_verdict_across_corpora(grids, capsys):
    leaderboard.main(*grids)
    out = capsys.readouterr().out
    assert out.count("| `attnres` |") == 2 and out.count("holds on both corpora") == 2, out
    corpora = []
    for g in grids:
        with open(os.path.join(g, "config.json")) as f:
            corpora.append(os.path.basename(os.path.normpath(json.load(f)["data_dir"])))
    assert f"holds on both corpora (verdicts on {corpora[0]} / {corpora[1]}; " in out, "the verdicts' order is named"
    assert "equal time from " + os.path.relpath(grids[0] + "_standard16") in out, "the longer grid is found by name"
    assert "equal time from no longer grid" in out, "the second grid has none beside it"
    row = next(line for line in out.splitlines() if line.startswith("| `standard` |"))
    assert row.split(" | ")[-2:] == ["1.00", "- |"], "standard against itself: ratio 1, no gain"


def test_the_gain_at_equal_time_reads_standard_off_the_longer_budgets(grids):
    def final(g, arm, s):
        with open(os.path.join(g, arm, f"seed{s}", "result.json")) as f:
            return json.load(f)["val_loss"]

    rows = leaderboard.rows(grids[0])
    gains = []
    for s in (0, 1):  # per seed: attnres's loss minus standard's at attnres's time, between the 8- and 16-step runs
        ratio = leaderboard.ms_per_step(os.path.join(grids[0], "attnres", f"seed{s}")) / leaderboard.ms_per_step(
            os.path.join(grids[0], "standard", f"seed{s}")
        )
        standard = {8: final(grids[0], "standard", s), 16: final(grids[0] + "_standard16", "standard", s)}
        gains.append(final(grids[0], "attnres", s) - leaderboard.at_steps(standard, ratio * 8)[0])
    assert rows["attnres"][3].startswith(f"{sum(gains) / 2:+.4f} ["), rows["attnres"][3]
    assert rows["standard"][2] == 1.0


def test_at_steps_is_linear_in_log_steps_and_says_when_beyond():
    points = {600: 2.0, 2400: 1.8}
    assert leaderboard.at_steps(points, 1200) == (pytest.approx(1.9), False)  # 1200 is the log midpoint
    assert leaderboard.at_steps(points, 600) == (pytest.approx(2.0), False)
    assert leaderboard.at_steps(points, 3000) == (1.8, True)
    assert leaderboard.at_steps(points, 2400) == (1.8, False)
    assert math.isclose(leaderboard.at_steps({1: 1.0, 100: 0.0}, 10)[0], 0.5)


def test_a_verdict_holds_across_corpora_only_when_it_is_the_same_ahead_or_behind():
    nd = "not detectable at this size"
    assert leaderboard.holds(["ahead", "ahead"]) == "yes (ahead)"
    assert leaderboard.holds(["behind", "behind"]) == "yes (behind)"
    assert leaderboard.holds(["ahead", nd]) == "no (ahead / n.d.)"
    assert leaderboard.holds(["ahead", "behind"]) == "no (ahead / behind)"
    assert leaderboard.holds([nd, nd]) == "no (n.d. / n.d.)"
    assert leaderboard.holds([None, "ahead"]) == "-"


def test_grids_of_two_settings_are_refused_with_the_keys_that_differ(grids, shards, tmp_path):
    other = grid(shards, tmp_path / "board_c", "--max_iters=12")
    with pytest.raises(SystemExit, match="differ in max_iters; a table across corpora compares one setting"):
        leaderboard.main(grids[0], other)


def test_a_seed_trained_on_another_host_than_standards_prices_nothing(grids, tmp_path):
    moved = str(tmp_path / "board")
    shutil.copytree(grids[0], moved)
    path = os.path.join(moved, "attnres", "seed1", "result.json")
    with open(path) as f:
        result = json.load(f)
    machine = result["config"]["machine"]  # continued on a host unlike this one, whatever this one is
    result["config"]["machine"] = dict(machine, cpu_capability=f"not {machine['cpu_capability']}")
    with open(path, "w") as f:
        json.dump(result, f)
    one = leaderboard.ms_per_step(os.path.join(moved, "attnres", "seed0")) / leaderboard.ms_per_step(
        os.path.join(moved, "standard", "seed0")
    )
    rows = leaderboard.rows(moved)
    assert rows["attnres"][2] == pytest.approx(one), "the ratio is seed 0's alone"
    assert re.search(r", [01]/1\b", rows["attnres"][3]), "the gain at equal time, seed 0 alone: " + rows["attnres"][3]


NO_GAIN = "-"  # no ratio, so no gain at equal time


def bench_file(path, grid_dir, ratios, **shape):
    with open(os.path.join(grid_dir, "config.json")) as f:
        config = json.load(f)
    keys = ("n_layer", "n_head", "n_embd", "block_size", "batch_size", "vocab_size", "dtype")
    made = dict({k: config[k] for k in keys}, compile=True, device="cpu", machine={}, code=None) | shape
    rows = [dict(variant=v, time_ratio=r, made=made) for v, r in ratios.items()]
    path.write_text(json.dumps(rows))
    return str(path)


def test_cost_takes_each_schemes_ratio_from_a_bench_at_the_grids_shape(grids, tmp_path, capsys):
    cost = bench_file(tmp_path / "compiled.json", grids[0], {"standard": 1.0, "attnres_block": 2.5})
    rows = leaderboard.rows(grids[0], cost=cost)
    assert rows["attnres"][2] == 2.5 and rows["scaled_residual"][2] is None, "the bench's ratio; no row, no cost"
    assert rows["scaled_residual"][3] == NO_GAIN, rows["scaled_residual"][3]
    gains = []
    for s in (0, 1):  # attnres against standard at 2.5 x its 8 steps: 20, past the 16-step grid's budget
        with open(os.path.join(grids[0], "attnres", f"seed{s}", "result.json")) as f:
            mine = json.load(f)["val_loss"]
        with open(os.path.join(grids[0] + "_standard16", "standard", f"seed{s}", "result.json")) as f:
            gains.append(mine - json.load(f)["val_loss"])
    assert rows["attnres"][3].startswith(f"{sum(gains) / 2:+.4f} [") and "beyond 16 steps" in rows["attnres"][3]
    leaderboard.main(grids[0], cost=cost)
    assert f"step times from {cost}" in capsys.readouterr().out
    other = bench_file(tmp_path / "wide.json", grids[0], {"standard": 1.0}, n_embd=768)
    with pytest.raises(SystemExit, match=r"measured at another shape than the grid's \(n_embd 768 there, "):
        leaderboard.rows(grids[0], cost=other)
    (tmp_path / "old.json").write_text(json.dumps([{"variant": "standard", "time_ratio": 1.0}]))
    with pytest.raises(SystemExit, match="is not a bench.py output that records what made it"):
        leaderboard.rows(grids[0], cost=str(tmp_path / "old.json"))


def test_an_arm_the_report_paired_but_no_run_recorded_gets_its_row_from_its_cells(grids, tmp_path, capsys):
    """Cells copied into a grid, found done by a run that trained none: config.json does not list their arm (a run
    records its arms when it trains a cell), the report pairs them; the table takes the arm's settings from them."""
    grid = str(tmp_path / "copied")
    shutil.copytree(grids[0], grid)
    edit_json(os.path.join(grid, "config.json"), lambda c: c["arms"].pop("attnres"))
    longer = [grids[0] + "_standard16"]  # beside the stored grid, not the copy
    assert leaderboard.rows(grid, longer=longer)["attnres"] == leaderboard.rows(grids[0])["attnres"]


def test_a_tuned_arm_is_priced_as_its_scheme_whatever_rates_tuning_chose():
    """Tuning sets rates and a routing rate's scale (MUDDFormer: 1e-2 at 0.1x), none of which changes a step's time;
    another model setting does."""
    tuned = dict(residual="muddformer", learning_rate=0.01, min_lr=0.001, routing_lr_scale=0.1)
    assert leaderboard.variant_of(tuned) == "muddformer"
    assert leaderboard.variant_of(dict(tuned, hc_streams=2)) is None


def test_the_plateau_table_reads_standards_curves_and_ranks_the_seeds(grids, tmp_path, capsys):
    leaderboard.main(grids[0])
    out = capsys.readouterr().out
    assert f"`standard`'s seeds through the budget ({grids[0]})" in out
    for s in (0, 1):  # the last column is the seed's final loss, as its result.json has it
        with open(os.path.join(grids[0], "standard", f"seed{s}", "result.json")) as f:
            final = json.load(f)["val_loss"]
        row = next(line for line in out.splitlines() if line.startswith(f"| {s} | "))
        assert row.endswith(f"| {final:.4f} |"), row
    # three seeds on a plateau until step 60, where the first to escape ends last: a ranking that reverses
    losses = {0: [3.3, 3.0, 2.5, 2.2, 2.00], 1: [3.4, 3.1, 2.6, 2.1, 1.95], 2: [3.5, 3.2, 2.7, 2.0, 1.90]}
    for seed, curve in losses.items():
        cell = tmp_path / "g" / "standard" / f"seed{seed}"
        cell.mkdir(parents=True)
        (cell / "result.json").write_text(json.dumps({"status": "finished", "val_loss": curve[-1], "steps": 100}))
        lines = [json.dumps({"step": step, "val_loss": v}) for step, v in zip((10, 20, 30, 50, 100), curve)]
        (cell / "log.jsonl").write_text("\n".join(lines) + "\n")
    table = leaderboard.plateau(str(tmp_path / "g"))
    assert table[0] == "| seed | step 10 | step 20 | step 30 | step 50 | step 100 |"
    assert table[-2] == "| spread (max - min) | 0.200 | 0.200 | 0.200 | 0.200 | 0.100 |"
    assert table[-1] == "| Spearman with step 100 | -1.00 | -1.00 | -1.00 | +1.00 | |"


def test_the_rates_each_corpus_tuned_may_differ_and_no_other_arm_setting(grids, tmp_path, capsys):
    def copy(g, name, **arm_settings):
        out = str(tmp_path / name)
        shutil.copytree(g, out)
        with open(os.path.join(out, "config.json")) as f:
            config = json.load(f)
        config["tune_learning_rates"] = [1e-3, 3e-3]  # as config/leaderboard.py: each corpus tunes its own rates
        config["arms"]["attnres"] |= arm_settings
        with open(os.path.join(out, "config.json"), "w") as f:
            json.dump(config, f)
        return out

    one = copy(grids[0], "a")
    leaderboard.main(one, copy(grids[1], "b", learning_rate=1e-3, min_lr=1e-4))
    assert capsys.readouterr().out.count("| `attnres` |") == 2, "the tuned rates are the corpus's, not a setting"
    with pytest.raises(SystemExit, match="differ in arms"):
        leaderboard.main(one, copy(grids[1], "c", attnres_block_size=1))
    fewer = copy(grids[1], "d")  # an arm one corpus did not run: its row there, "-" across
    edit_json(os.path.join(fewer, "config.json"), lambda c: c["arms"].pop("attnres"))
    shutil.rmtree(os.path.join(fewer, "attnres"))
    edit_json(os.path.join(fewer, "paired.json"), lambda p: p["arms"].pop("attnres"))
    leaderboard.main(one, fewer)
    assert re.search(r"\| `attnres` \|.*\| - ?; - \|", capsys.readouterr().out), "no verdict where it did not run"


def edit_json(path, change):
    with open(path) as f:
        record = json.load(f)
    change(record)
    with open(path, "w") as f:
        json.dump(record, f)


def test_an_arm_that_diverged_on_every_seed_gets_a_row_that_says_so(grids, tmp_path, capsys):
    moved = str(tmp_path / "board")
    shutil.copytree(grids[0], moved)
    for s in (0, 1):  # as finish_cell writes a diverged cell: no final loss, the step and the reason
        edit_json(
            os.path.join(moved, "attnres", f"seed{s}", "result.json"),
            lambda r: r.update(status="diverged", val_loss=None, diverged_at=4, reason="validation loss nan at step 4"),
        )
    leaderboard.main(moved)
    row = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("| `attnres` |"))
    assert row == "| `attnres` | **diverged on every seed (2/2)** | **diverged on every seed (2/2)** | - | - |", row


def test_a_grid_it_cannot_read_is_one_line_that_says_what_to_do(grids, tmp_path):
    moved = str(tmp_path / "board")
    shutil.copytree(grids[0], moved)
    shutil.rmtree(os.path.join(moved, "standard"))
    edit_json(os.path.join(moved, "config.json"), lambda c: c["arms"].pop("standard"))
    missing = r"has no arm `standard` \(its arms: scaled_residual, attnres\).*--arms=standard"
    with pytest.raises(SystemExit, match=missing):
        leaderboard.main(moved)
    with pytest.raises(SystemExit, match="does not exist; give a grid folder that train.py wrote"):
        leaderboard.main(str(tmp_path / "nowhere"))


def test_a_grid_results_stores_is_named_with_the_commands_that_extract_it(tmp_path, capsys):
    grid = str(tmp_path / "out" / "leaderboard_shakespeare")
    with pytest.raises(SystemExit) as stop:
        leaderboard.cli([grid])
    command = str(stop.value).split("results/ stores it: ")[1]
    assert command.startswith(f"mkdir -p {tmp_path / 'out'} && tar xJf "), command
    subprocess.run(command, shell=True, check=True)  # as a fresh clone would: out/ does not exist yet
    leaderboard.cli([grid])
    assert capsys.readouterr().out.count("| `standard` | - | - | 1.00 | - |") == 1, "the stored table, read off it"


# --- --add: a scheme ranked among a stored grid's rows -------------------------------------------------------


@pytest.fixture(scope="module")
def stored(shards, tmp_path_factory):
    """A tiny grid as the stored leaderboard grids are: tuned (two rates, two tuning seeds), the two baselines and a
    scheme, two seeds, trained by this code on this machine."""
    out = tmp_path_factory.mktemp("stored") / "board"
    tuned = ("--tune_learning_rates=[1e-3,1e-2]", "--tune_seeds=[1000,1001]", "--tune_iters=4")
    train.main(tiny(shards, out, ARMS, "--seeds=0,1", *tuned))
    return str(out)


def digest(folder):
    """{file: sha256} of everything under folder."""
    found = {}
    for parent, _, files in os.walk(folder):
        for name in files:
            with open(os.path.join(parent, name), "rb") as f:
                found[os.path.relpath(os.path.join(parent, name), folder)] = hashlib.sha256(f.read()).hexdigest()
    return found


def final(grid, arm, seed):
    with open(os.path.join(grid, arm, f"seed{seed}", "result.json")) as f:
        return json.load(f)


def table_rows(out):
    return [line for line in out.splitlines() if line.startswith("| ") and not line.startswith("| scheme")]


def test_add_trains_the_scheme_alone_in_a_copy_paired_with_the_stored_baselines(stored, tmp_path, capsys):
    grid, rank = str(tmp_path / "board"), str(tmp_path / "rank_gated_board")
    shutil.copytree(stored, grid)
    before = digest(grid)
    leaderboard.cli(["--add=gated", grid])
    out = capsys.readouterr().out
    assert digest(grid) == before, "the stored grid is never written"
    assert f"`gated` is added to a copy of it without checkpoints, {rank}" in out, out
    for arm in ("standard", "scaled_residual", "attnres"):  # the stored cells, copied and not trained again
        for s in (0, 1):
            assert final(rank, arm, s) == final(grid, arm, s)
            assert not os.path.exists(os.path.join(rank, arm, f"seed{s}", "ckpt.pt"))
    with open(os.path.join(rank, "tune", "choice.json")) as f:
        choice = json.load(f)
    with open(os.path.join(grid, "tune", "choice.json")) as f:
        assert choice["choice"] == json.load(f)["choice"] | {"gated": choice["choice"]["gated"]}, "gated tuned too"
    assert sorted(os.listdir(os.path.join(rank, "tune"))) == sorted(
        os.listdir(os.path.join(grid, "tune")) + ["gated-lr0.001", "gated-lr0.01"]
    )
    # its row: paired seed by seed with the stored `standard`, among the stored rows as the table prints them
    new = leaderboard.rows(rank)["gated"]
    deltas = [final(rank, "gated", s)["val_loss"] - final(grid, "standard", s)["val_loss"] for s in (0, 1)]
    assert new[4] == pytest.approx(sum(deltas) / 2)
    expected = {f"`{arm}`": row for arm, row in leaderboard.rows(grid).items()} | {"**`gated`** (new)": new}
    by_mean = sorted(expected.items(), key=lambda item: item[1][4])  # every arm finished: each has a mean
    assert table_rows(out) == [leaderboard.row_line(name, row) for name, row in by_mean], out
    assert f"`gated`: paired with the same cells (copied into {rank})" in out


def test_add_trains_the_baselines_afresh_where_the_grids_code_differs(stored, tmp_path, capsys):
    grid, rank = str(tmp_path / "board"), str(tmp_path / "rank_gated_board")
    shutil.copytree(stored, grid)
    edit_json(os.path.join(grid, "config.json"), lambda c: c["code"]["definitions"].update(StandardResidual="0" * 16))
    before = digest(grid)
    leaderboard.cli(["--add=gated", grid])
    out = capsys.readouterr().out
    assert digest(grid) == before
    assert out.startswith(f"this code computes otherwise than {grid}'s (StandardResidual): so `standard`, "), out
    with open(os.path.join(rank, "config.json")) as f:
        assert list(json.load(f)["arms"]) == ["standard", "scaled_residual", "gated"]
    with open(os.path.join(rank, "tune", "choice.json")) as f:
        assert list(json.load(f)["choice"]) == ["standard", "scaled_residual", "gated"], "each tuned afresh"
    assert final(rank, "standard", 0) != final(grid, "standard", 0), "trained, not copied"
    fresh = leaderboard.rows(rank)
    printed = table_rows(out)
    assert leaderboard.row_line("**`gated`** (new)", fresh["gated"]) in printed
    assert leaderboard.row_line(f"`scaled_residual` ({rank})", fresh["scaled_residual"]) in printed
    for arm, row in leaderboard.rows(grid).items():
        assert leaderboard.row_line(f"`{arm}`", row) in printed
    assert "trained anew in " + rank in out and "not paired with them" in out


def test_add_dry_run_says_what_it_would_train_and_trains_nothing(stored, tmp_path, capsys):
    grid, rank = str(tmp_path / "board"), str(tmp_path / "rank_gated_board")
    shutil.copytree(stored, grid)
    leaderboard.cli(["--add=gated", "--dry_run", grid])
    out = capsys.readouterr().out
    assert "--arms=gated " not in out and out.rstrip().count("--arms=gated") == 1
    assert re.search(r"4 tuning cells of 4 steps, then 2 cells of 8 steps: about \d+m\d\ds with \d worker", out), out
    leaderboard.cli(["--add=gated", "--dry_run", "--max_iters=12", grid])  # another budget: not the stored grid's
    out = capsys.readouterr().out
    assert out.startswith(f"max_iters differ from {grid}'s: so `standard`, `scaled_residual` and `gated` train"), out
    assert "--arms=standard,scaled_residual,gated --max_iters=12" in out
    assert "12 tuning cells of 4 steps, then 6 cells of 12 steps" in out
    assert not os.path.exists(rank) and digest(grid) == digest(stored)


def test_add_passes_a_stop_signal_on_to_its_workers_and_says_how_to_go_on(tmp_path, monkeypatch, capsys):
    """SIGTERM to --add's process (a scheduler's or kill's stop reaches it alone) reaches each worker, which stops
    as train.py's loop does (PREEMPTED), and the command says to run it again; without the forwarding the workers
    would train on, orphaned."""

    def worker(argv, threads):  # train_worker's signal handling, without the training
        with cells.stop_on_signals():
            signal.pthread_sigmask(signal.SIG_UNBLOCK, cells.STOP_SIGNALS)
            open(tmp_path / f"ready{os.getpid()}", "w").close()
            while not cells.stop_received:
                time.sleep(0.01)
            open(tmp_path / f"stopped{os.getpid()}", "w").close()
        sys.exit(cells.PREEMPTED)

    def stop_when_ready():
        while len(list(tmp_path.glob("ready*"))) < 2:
            time.sleep(0.01)
        os.kill(os.getpid(), signal.SIGTERM)

    monkeypatch.setattr(leaderboard, "train_worker", worker)
    before = signal.getsignal(signal.SIGTERM)
    threading.Thread(target=stop_when_ready, daemon=True).start()
    with pytest.raises(SystemExit) as stop:
        leaderboard.train_workers([], 1, 2)
    assert stop.value.code == cells.PREEMPTED, "stopped and checkpointed, as train.py and launch.py say it"
    assert "stopped by a signal: run the same command again" in capsys.readouterr().err
    assert len(list(tmp_path.glob("stopped*"))) == 2, "each worker got the signal"
    assert signal.getsignal(signal.SIGTERM) == before, "this process's own handler restored"


def test_add_pairs_on_the_code_each_stored_cell_records_not_its_recorded_digest(stored, tmp_path, capsys):
    """A baseline's cell recorded under an earlier NOT_COMPUTING (a definition since declared to compute nothing had
    another digest, and its stored fingerprint counted it) still pairs: the report and --add recompute the fingerprint
    from the cell's code. A cell whose code differs in a definition that computes is retrained with the baselines."""
    grid = str(tmp_path / "board")
    shutil.copytree(stored, grid)
    cell = os.path.join(grid, "standard", "seed1", "result.json")

    def earlier(r):  # write_report had another digest, and the fingerprint recorded then counted it
        r["code"]["definitions"]["write_report"] = "0" * 16
        r["pairing"]["code"] = "0" * 64

    edit_json(cell, earlier)
    leaderboard.cli(["--add=gated", "--dry_run", grid])
    out = capsys.readouterr().out
    assert "--arms=gated" in out and "record code that computes otherwise" not in out, out
    edit_json(cell, lambda r: r["code"]["definitions"].update(learning_rate_at="0" * 16))
    leaderboard.cli(["--add=gated", "--dry_run", grid])
    out = capsys.readouterr().out
    assert out.startswith("its baselines' cells record code that computes otherwise than this code"), out
    assert "--arms=standard,scaled_residual,gated" in out


def test_the_estimate_counts_what_a_cell_spends_before_it_steps_at_its_pace():
    """A compiled cell's first interval and first evaluation carry its compile (the leaderboard's compiled grid: about
    30 s a cell for `standard`, 50 s for Frac); step_time leaves them out, so the estimate adds them per cell."""
    log = [
        {"step": 0, "val_loss": 5.7, "eval_s": 13.7},
        {"step": 10, "ms_per_step": 1690.0},
        {"step": 20, "ms_per_step": 90.0},
        {"step": 60, "val_loss": 2.8, "eval_s": 1.2},
    ]
    assert leaderboard.start_s(log, 90.0, 1.2) == pytest.approx((1690 - 90) * 10 / 1000 + 12.5)
    assert leaderboard.start_s(log[2:], 90.0, 1.2) == 0.0, "an eager cell at its pace from the start costs nothing"


def test_add_refuses_a_scheme_not_registered_in_one_line(stored):
    with pytest.raises(SystemExit, match=r"--add=nope: no such scheme in model.RESIDUALS \(standard, attnres, "):
        leaderboard.cli(["--add=nope", stored])
    with pytest.raises(SystemExit, match="has an arm attnres already"):
        leaderboard.cli(["--add=attnres", stored])


def test_a_table_across_corpora_leaves_out_what_each_corpus_tuning_chose_and_the_run_flags():
    """Each corpus's tuning picks its own rates and routing scales for the same arms (MUDDFormer: 1e-2 at 0.1x on
    both, but not by rule), and --allow_changes is a run flag: none of them makes two grids' settings differ."""
    arm = dict(residual="muddformer", learning_rate=0.01, min_lr=0.001, routing_lr_scale=0.1)
    assert leaderboard.setting(dict(tune_learning_rates=[0.01], arms={"m": arm}))["arms"] == {
        "m": {"residual": "muddformer"}
    }
    assert "allow_changes" in leaderboard.PER_CORPUS
