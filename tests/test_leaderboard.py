"""
dev/leaderboard.py, docs/leaderboard.md's tables: read off real tiny grids (two "corpora" and a longer `standard`
grid beside one), the cross-corpus verdict, the equal-time interpolation, and the refusal to put grids of two
settings in one table.
"""

import json
import math
import os
import re
import shutil
import sys

import pytest

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
