"""
tune.py: the tuned protocol. The tuning grid's config (arms, seeds, budget, min_lr at the run's
ratio), its refusals (one line each, tuning seeds among the compared ones first), the choice from
hand-written tuning results (lowest mean over the tuning seeds, a diverged rate never, ties to the
smaller rate), choice.json, the tuned arms; and the one command end to end through train.py.

$ OMP_NUM_THREADS=1 .venv/bin/python -m pytest tests/test_tune.py -q -p no:cacheprovider
"""

import glob
import json
import os
import re
import shutil
import subprocess
import sys

import numpy as np
import pytest

import grid_files
import records
import report
import train
import tune
from common import ConfigError, read_json, write_json
from helpers import result, tiny, write_tuning_cell

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RATES = [1e-3, 3e-3, 1e-2]
TUNE = dict(tune_learning_rates=RATES, tune_seeds=[1000, 1001, 1002], tune_iters=125)


def rates(chosen):
    """{arm: learning rate} of what tune.choose chose."""
    return {arm: settings["learning_rate"] for arm, settings in chosen.items()}


def config(tmp_path=None, **changes):
    """A checked run of the default shape with two arms and the tuned protocol's keys."""
    cfg = dict(
        train.DEFAULTS,
        vocab_size=320,
        seeds=[0, 1, 2],
        max_iters=250,
        learning_rate=3e-3,
        min_lr=3e-4,
        out_dir=str(tmp_path / "out") if tmp_path else "out",
        arms={"standard": {"residual": "standard"}, "attnres": {"residual": "attnres", "attnres_block_size": 2}},
        **TUNE,
    )
    cfg.update(changes)
    records.check_config(cfg, 1)
    return cfg


def test_tuning_config_arms_seeds_budget_and_min_lr():
    cfg = dict(config(reference_arm="attnres"), downstream_bundle="data/eval_bundle")  # as if one were there
    before = json.dumps(cfg, sort_keys=True)
    tuning = tune.tuning_config(cfg)
    assert json.dumps(cfg, sort_keys=True) == before  # the run's config is not touched
    assert list(tuning["arms"]) == [
        "standard-lr0.001",
        "standard-lr0.003",
        "standard-lr0.01",
        "attnres-lr0.001",
        "attnres-lr0.003",
        "attnres-lr0.01",
    ]
    assert tuning["arms"]["attnres-lr0.01"] == dict(
        residual="attnres", attnres_block_size=2, learning_rate=0.01, min_lr=pytest.approx(0.001, rel=1e-12)
    )
    for name, settings in tuning["arms"].items():  # min_lr / learning_rate stays the run's 0.1
        assert settings["min_lr"] / settings["learning_rate"] == pytest.approx(0.1, rel=1e-12), name
    assert tuning["out_dir"] == os.path.join("out", "tune") and tuning["seeds"] == [1000, 1001, 1002]
    assert tuning["max_iters"] == 125 and tuning["reference_arm"] == "" and tuning["downstream_bundle"] == ""
    changed = ("arms", "seeds", "max_iters", "out_dir", "reference_arm", "downstream_bundle")
    assert {k: v for k, v in tuning.items() if k not in changed} == {
        k: v for k, v in cfg.items() if k not in changed
    }  # every other key the run's, tune_* too (its record)
    records.check_config(tuning, 1)  # a grid train.py runs: its arm names and rates pass the run's checks
    cell = records.cell_config(tuning, "attnres-lr0.001", 1001)
    assert (cell["learning_rate"], cell["min_lr"], cell["max_iters"]) == (0.001, pytest.approx(1e-4), 125)
    assert tune.tuning_config(config(tune_iters=0))["max_iters"] == 63  # the default: a quarter of max_iters, up


@pytest.mark.parametrize(
    "changes, message",
    [
        (dict(tune_seeds=[1000, 2]), "tune_seeds and seeds share 2: a rate chosen on a compared seed favours its arm"),
        (dict(tune_seeds=[]), "tune_seeds=[]: give distinct non-negative integers"),
        (
            dict(tune_seeds=[1000]),
            "tune_seeds=[1000]: one tuning seed cannot show the seeds' noise a rate must beat; give "
            "at least 2, e.g. --tune_seeds=1000,1001,1002",
        ),
        (dict(tune_learning_rates=[1e-3, 0.0]), "tune_learning_rates=[0.001, 0.0]: give positive numbers"),
        (dict(tune_learning_rates=["fast"]), "tune_learning_rates=['fast']: give positive numbers"),
        (dict(tune_learning_rates=[True, float("nan"), 10**400]), "tune_learning_rates=[True, nan, 1000"),
        (dict(tune_learning_rates=[1e-3, 0.0010000001]), "repeats a rate (to 6 significant digits"),
        (dict(tune_iters=20), "tune_iters is 20: the tuning budget must be above warmup_iters=20"),
        (
            dict(tune_iters=251),
            "tune_iters is 251: the tuning budget must be above warmup_iters=20 (a rate is judged "
            "after its warmup) and at most max_iters=250; set --tune_iters",
        ),
        (
            dict(arms={"standard": {"learning_rate": 1e-3}}),
            "arm 'standard' sets learning_rate, which tune_learning_rates",
        ),
        (dict(arms={"tune": {}}), "arm 'tune' would share out_dir/tune with the tuning grid"),
        (dict(arms={"a" * 60: {}}), f"tuning arm {'a' * 60}-lr0.001 is 68 characters, at most 64"),
    ],
)
def test_tuning_settings_that_cannot_run_are_one_line(changes, message):
    with pytest.raises(ConfigError) as e:
        tune.tuning_config(config(**changes))
    assert str(e.value).startswith(message) if "share" in message else message in str(e.value)
    assert "\n" not in str(e.value)


# per arm and rate, the final loss on tuning seeds 1000, 1001 and 1002. standard: 1e-2 has the lowest mean (2.29)
# and is lower than 3e-3 (2.32) on every seed, but by 0.03, inside 1e-2's own s.d. (0.044); and 3e-3 beats 1e-3 (2.50)
# on every seed by far
# more than its s.d.: 3e-3. attnres: 1e-2 diverged on one seed (its other seeds would win), 1e-3 and 3e-3 tie
# exactly (2.40): the smaller. dar: 1e-2 is lower on average but worse on seed 1002 (a stall): 3e-3.
LOSSES = {
    ("standard", 1e-3): (2.50, 2.48, 2.52),
    ("standard", 3e-3): (2.31, 2.33, 2.32),
    ("standard", 1e-2): (2.24, 2.32, 2.31),
    ("attnres", 1e-3): (2.5, 2.25, 2.45),
    ("attnres", 3e-3): (2.25, 2.5, 2.45),
    ("attnres", 1e-2): (None, 1.0, 1.0),
    ("dar", 1e-3): (2.6, 2.6, 2.6),
    ("dar", 3e-3): (2.40, 2.41, 2.42),
    ("dar", 1e-2): (2.20, 2.21, 2.60),
}
ARMS3 = dict(
    arms={
        "standard": {"residual": "standard"},
        "attnres": {"residual": "attnres", "attnres_block_size": 2},
        "dar": {"residual": "dar"},
    }
)


def tuned(tmp_path, losses=LOSSES):
    tune_dir = str(tmp_path / "out" / "tune")
    for (arm, rate), ends in losses.items():
        for seed, loss in zip((1000, 1001, 1002), ends):
            write_tuning_cell(tune_dir, arm, rate, seed, loss, 125)
    return tune_dir


def test_an_arm_added_to_a_tuned_grid_extends_its_choice_and_a_rerun_of_some_arms_keeps_the_others(tmp_path, capsys):
    two = dict(arms={k: v for k, v in ARMS3["arms"].items() if k != "dar"})
    tune_dir = tuned(tmp_path)
    assert rates(tune.choose(config(tmp_path, **two), tune_dir)) == {"standard": 0.003, "attnres": 0.001}
    path = os.path.join(tune_dir, "choice.json")
    first = read_json(path)
    assert rates(tune.choose(config(tmp_path, **ARMS3), tune_dir))["dar"] == 0.003  # dar added: not an edited file
    assert "arms dar added, the recorded arms' choices as they were" in capsys.readouterr().out
    grown = read_json(path)
    assert {k: grown[k] for k in first if k not in ("table", "choice", "reason")} == {
        k: v for k, v in first.items() if k not in ("table", "choice", "reason")
    }
    assert all(grown[k][arm] == first[k][arm] for k in ("table", "choice", "reason") for arm in first["choice"])
    assert rates(tune.choose(config(tmp_path, arms={"dar": ARMS3["arms"]["dar"]}), tune_dir)) == {"dar": 0.003}
    assert read_json(path) == grown  # a rerun of one arm keeps the other arms' choices
    grown["choice"]["standard"] = 0.01  # but a recorded arm's choice that its cells do not give: refused
    write_json(path, grown)
    with pytest.raises(ConfigError, match="differs from the choice its tuning cells give"):
        tune.choose(config(tmp_path, **ARMS3), tune_dir)


def test_choose_beyond_the_seeds_noise_never_a_diverged_rate_ties_to_the_smaller(tmp_path, capsys):
    cfg, tune_dir = config(tmp_path, **ARMS3), tuned(tmp_path)
    choice = rates(tune.choose(cfg, tune_dir))
    assert choice == {"standard": 0.003, "attnres": 0.001, "dar": 0.003}
    record = read_json(os.path.join(tune_dir, "choice.json"))
    assert record["choice"] == choice and record["tune_seeds"] == [1000, 1001, 1002] and record["tune_iters"] == 125
    assert record["seeds"] == [0, 1, 2] and record["max_iters"] == 250 and record["learning_rates"] == RATES
    assert record["min_lr_ratio"] == pytest.approx(0.1)
    assert record["tuning_text"] == dict(layout="spread", sequences="odd", tokens=8192)
    assert record["test_tokens"] == 8192
    row = record["table"]["standard"]["0.01"]
    assert row["val_loss"] == {"1000": 2.24, "1001": 2.32, "1002": 2.31} and row["problem"] is None
    assert row["mean"] == pytest.approx(2.29, abs=1e-12) and row["sd"] == pytest.approx(0.0019**0.5, abs=1e-12)
    assert row["initial_loss"] == {"1000": 5.8, "1001": 5.8, "1002": 5.8}
    assert record["table"]["attnres"]["0.01"]["mean"] is None
    assert record["table"]["attnres"]["0.01"]["problem"] == "seed 1000 diverged"
    for arm in ("standard", "attnres"):  # every mean is its seeds' mean
        for row in record["table"][arm].values():
            if row["mean"] is not None:
                assert row["mean"] == pytest.approx(sum(row["val_loss"].values()) / 3, abs=1e-12)
    assert record["reason"] == {
        "standard": "the safer rate: 0.01 has the lowest mean but is not better beyond the seeds' noise (0.0300 "
        "lower, within its seeds' s.d. 0.0436)",
        "attnres": "the lowest mean",
        "dar": "the safer rate: 0.01 has the lowest mean but is not better beyond the seeds' noise (worse on seed 1002)",  # noqa: E501
    }
    printed = capsys.readouterr().out
    assert "tuned: standard at learning_rate 0.003 (the safer rate: 0.01 has the lowest mean" in printed
    assert "tuned: attnres at learning_rate 0.001 (the lowest mean)" in printed
    assert grid_files.tuning_problem(record, os.path.dirname(tune_dir)) is None  # what tune writes, the report reads
    before = open(os.path.join(tune_dir, "choice.json"), "rb").read()
    written = os.stat(os.path.join(tune_dir, "choice.json")).st_mtime_ns
    assert rates(tune.choose(cfg, tune_dir)) == choice  # rerun: the same choice, the same file
    assert open(os.path.join(tune_dir, "choice.json"), "rb").read() == before
    assert os.stat(os.path.join(tune_dir, "choice.json")).st_mtime_ns == written, (
        "an unchanged choice rewritten: its newer choice.json makes every rerun write the report again"
    )
    assert [n for n in os.listdir(tune_dir) if n.startswith("choice.json.")] == []  # no temporary left


def rows(*losses, initial=5.8):
    """stable_choice's rows for rates 1e-3, 3e-3, 1e-2, ... from each rate's per-seed final losses."""
    made = []
    for rate, ends in zip((1e-3, 3e-3, 1e-2, 3e-2), losses):
        starts = {str(s): initial for s in range(len(ends))}
        ends = dict(zip(starts, ends))
        usable = all(e is not None and e < initial for e in ends.values())
        made.append(
            dict(
                learning_rate=rate,
                val_loss=ends,
                initial_loss=starts,
                problem=None if usable else "x",
                mean=sum(ends.values()) / len(ends) if usable else None,
                sd=float(np.std(list(ends.values()), ddof=1)) if usable else None,
            )
        )
    return made


@pytest.mark.parametrize(
    "losses, chosen, reason",
    [
        # a larger rate better on every seed by more than its own seeds' s.d. wins
        (
            ((2.5, 2.6, 2.7), (2.3, 2.4, 2.5)),
            3e-3,
            "the lowest mean, 0.2000 below 0.001 on every seed, beyond its seeds' s.d. 0.1000",
        ),
        # the same mean gain with a spread past it: the safer rate
        (((2.5, 2.6, 2.7), (2.05, 2.5, 2.65)), 1e-3, "within its seeds' s.d. 0.3122"),
        # better on average by far, beyond its seeds' s.d. (0.37 against 0.26), but a seed stalls (worse than at the
        # safer rate): the safer rate
        (((2.5, 2.5, 2.5, 2.5), (2.0, 2.0, 2.0, 2.52)), 1e-3, "(worse on seed 3)"),
        # an exact tie: the smaller
        (((2.5, 2.4), (2.4, 2.5)), 1e-3, "the lowest mean"),
        # the lowest mean beyond noise is chosen over every smaller rate; a larger, worse rate never
        (((2.9, 2.8), (2.6, 2.5), (2.3, 2.2), (2.31, 2.21)), 1e-2, "the lowest mean, 0.3000 below 0.003"),
        # 1e-2 cannot beat 1e-3 (a seed worse) but 3e-3 can; 1e-2 does not beat 3e-3: 3e-3
        (((2.6, 2.6, 2.6), (2.4, 2.41, 2.42), (2.1, 2.2, 2.65)), 3e-3, "worse on seed 2"),
        # a finite loss at or above the step-0 loss is not finished: never chosen, whatever its mean
        (((2.5, 2.5), (2.0, 5.8)), 1e-3, "the lowest mean"),
        (((2.5, 2.5), (2.0, float("nan"))), 1e-3, "the lowest mean"),
    ],
)
def test_a_larger_rate_wins_only_beyond_the_seeds_noise(losses, chosen, reason):
    rate, why = tune.stable_choice(rows(*losses))
    assert rate == chosen and reason in why, why


def test_a_larger_rate_that_beats_a_worse_middle_one_is_chosen_non_monotone():
    # non-monotone: 3e-3 is worse than 1e-3 on every seed, 1e-2 beats both by far more than its s.d.; a rule that
    # compares each rate with the next larger one only would keep 1e-3
    rate, why = tune.stable_choice(rows((2.5, 2.6), (2.55, 2.65), (2.0, 2.1)))
    assert rate == 1e-2, f"the largest rate beats every smaller one and must be chosen ({why})"
    assert why == "the lowest mean, 0.5500 below 0.003 on every seed, beyond its seeds' s.d. 0.0707"
    # the lowest mean does not beat the next smaller rate, a larger one does: the reason names that one
    rate, why = tune.stable_choice(rows((2.5, 2.6), (2.2, 2.65), (2.4, 2.5)))
    assert (
        rate == 3e-3
        and why
        == "the lowest mean, and 0.01 beats 0.001 (0.1000 below 0.001 on every seed, beyond its seeds' s.d. 0.0707)"
    ), why


def test_every_choice_and_its_reason_agree_with_the_rule_non_monotone():
    # random losses, most of them not ordered like the rates: the choice is never beaten by a larger rate, every
    # smaller usable rate is, and a reason saying "within its seeds' s.d." quotes a gain within it
    rng = np.random.default_rng(0)
    for _ in range(300):
        made = rows(*(tuple(np.round(rng.uniform(2.0, 2.6) + rng.normal(0, 0.05, 3), 3)) for _ in range(4)))
        rate, why = tune.stable_choice(made)
        chosen = next(r for r in made if r["learning_rate"] == rate)
        assert not any(grid_files.beats(r, chosen) for r in made if r["learning_rate"] > rate), why
        for smaller in (r for r in made if r["learning_rate"] < rate):
            assert any(grid_files.beats(r, smaller) for r in made if r["learning_rate"] > smaller["learning_rate"]), (
                f"{smaller['learning_rate']} is smaller than the choice yet beaten by no larger rate ({why})"
            )
        if match := re.search(r"\(([0-9.]+) lower, within its seeds' s.d. ([0-9.]+)\)", why):
            assert float(match[1]) <= float(match[2]), why


def test_a_hand_edited_choice_is_refused_not_rewritten(tmp_path, capsys):
    cfg, tune_dir = config(tmp_path, **ARMS3), tuned(tmp_path)
    tune.choose(cfg, tune_dir)
    path = os.path.join(tune_dir, "choice.json")
    record = read_json(path)
    record["choice"]["dar"] = 0.01
    with open(path, "w") as f:
        json.dump(record, f)
    edited = open(path, "rb").read()
    with pytest.raises(
        ConfigError,
        match=r"choice.json differs from the choice its tuning cells give \(in choice\): "
        r"edited by hand or copied from another tuning; delete it and rerun",
    ) as e:
        tune.choose(cfg, tune_dir)
    assert "\n" not in str(e.value) and open(path, "rb").read() == edited, "the edited file is left as it was"
    os.remove(path)
    tune.choose(cfg, tune_dir)
    record = read_json(path)
    capsys.readouterr()
    # reasons worded by another version, the same choice from the same losses: rewritten, and said
    with open(path, "w") as f:
        json.dump(dict(record, reason=dict(record["reason"], dar="the safer rate")), f)
    tune.choose(cfg, tune_dir)
    assert read_json(path) == record and "rewritten: its reasons in this version's words" in capsys.readouterr().out
    # another tuning's record (a rate dropped, --allow_changes): rewritten, and said
    with open(path, "w") as f:
        json.dump(dict(record, learning_rates=[1e-3, 3e-3]), f)
    tune.choose(cfg, tune_dir)
    assert read_json(path) == record
    assert (
        "choice.json rewritten: this tuning's learning_rates differ from the recorded one's" in capsys.readouterr().out
    )


def test_the_same_rates_in_another_order_are_the_same_tuning(tmp_path):
    cfg = config(tmp_path, **ARMS3)
    shuffled = dict(cfg, tune_learning_rates=[1e-2, 1e-3, 3e-3])
    assert records.differences(cfg, shuffled) == {}, "the order of the rates tried is no other setting"
    assert "tune_learning_rates" in records.differences(cfg, dict(cfg, tune_learning_rates=[1e-3, 3e-3])), (
        "another set of rates still is"
    )
    tune_dir = tuned(tmp_path)
    tune.choose(cfg, tune_dir)
    before = open(os.path.join(tune_dir, "choice.json"), "rb").read()
    assert tune.choose(shuffled, tune_dir) == tune.choose(cfg, tune_dir)
    assert open(os.path.join(tune_dir, "choice.json"), "rb").read() == before, "the same choice.json, rates sorted"


def test_every_rate_exploded_is_one_line_never_a_choice(tmp_path):
    # a finite loss of 2e17 (or above the step-0 loss) is no result: the run stops before the paired grid
    losses = LOSSES | {
        ("attnres", 1e-3): (2e17, 2e17, 3e17),
        ("attnres", 3e-3): (6.0, 2.0, 2.0),
        ("attnres", 1e-2): (None, 2.0, 2.0),
    }
    with pytest.raises(
        ConfigError,
        match=r"^arm 'attnres': no rate finished on every tuning seed \(0.001: seed 1000 "
        r"ended at 2e\+17, not below its step-0 loss 5.8; 0.003: seed 1000 ended at 6, "
        r"not below its step-0 loss 5.8; 0.01: seed 1000 diverged\); add smaller "
        r"rates to tune_learning_rates$",
    ):
        tune.choose(config(tmp_path, **ARMS3), tuned(tmp_path, losses))
    assert not os.path.exists(tmp_path / "out" / "tune" / "choice.json")


def test_a_tuning_cell_without_its_step0_loss_is_one_line(tmp_path):
    cfg, tune_dir = config(tmp_path, **ARMS3), tuned(tmp_path)
    log = os.path.join(tune_dir, "dar-lr0.003", "seed1002", "log.jsonl")
    for damage in ('{"step": 25, "val_loss": 3.1}\n', '{"step": 0, "val_loss": true}\n', "{not json\n", None):
        if damage is None:
            os.remove(log)
        else:
            open(log, "w").write(damage)
        with pytest.raises(
            ConfigError,
            match=r"dar-lr0.003/seed1002/log.jsonl (does not start with the step-0 "
            r"validation loss|is unreadable or damaged).*; delete .*seed1002 to "
            r"retrain it$",
        ) as e:
            tune.choose(cfg, tune_dir)
        assert "\n" not in str(e.value)


def test_the_tie_goes_to_the_smaller_rate_whatever_the_order(tmp_path):
    cfg, tune_dir = config(tmp_path, **ARMS3, tune_learning_rates=[3e-3, 1e-3, 1e-2]), tuned(tmp_path)
    assert rates(tune.choose(cfg, tune_dir))["attnres"] == 0.001


def test_a_missing_or_foreign_tuning_cell_is_one_line(tmp_path):
    cfg, tune_dir = config(tmp_path), tuned(tmp_path)
    os.remove(os.path.join(tune_dir, "attnres-lr0.003", "seed1001", "result.json"))
    with pytest.raises(
        ConfigError,
        match=r"^tuning cell attnres-lr0.003/seed1001 has no result \(.*result.json "
        r"missing\); run the same command to train it$",
    ):
        tune.choose(cfg, tune_dir)
    write_tuning_cell(tune_dir, "attnres", 3e-3, 1001, 2.5, 250)  # trained for another budget
    with pytest.raises(
        ConfigError,
        match=r"attnres-lr0.003/seed1001/result.json is not of this tuning \(learning_rate "
        r"0.003, 250 steps; this tuning: 0.003, 125 steps\)",
    ) as e:
        tune.choose(cfg, tune_dir)
    assert "\n" not in str(e.value) and not os.path.exists(os.path.join(tune_dir, "choice.json"))
    write_tuning_cell(tune_dir, "attnres", 3e-3, 1001, 2.5, 125)
    shutil.rmtree(os.path.join(tune_dir, "standard-lr0.001", "seed1000"))
    os.rename(
        os.path.join(tune_dir, "standard-lr0.01", "seed1000"), os.path.join(tune_dir, "standard-lr0.001", "seed1000")
    )
    with pytest.raises(ConfigError, match="is the record of arm 'standard-lr0.01' seed 1000 \\(a copied file"):
        tune.choose(cfg, tune_dir)


@pytest.mark.parametrize("pairing", [None, [1], dict(arm_settings="lr 0.003"), dict(arm_settings=None)])
def test_a_tuning_result_with_a_damaged_pairing_is_one_line(tmp_path, pairing):
    cfg, tune_dir = config(tmp_path), tuned(tmp_path)
    path = os.path.join(tune_dir, "attnres-lr0.003", "seed1001", "result.json")
    result = read_json(path)
    result["pairing"] = pairing
    with open(path, "w") as f:
        json.dump(result, f)
    with pytest.raises(ConfigError, match=r"seed1001/result.json is not of this tuning \(learning_rate None"):
        tune.choose(cfg, tune_dir)


def test_only_the_master_process_writes_the_choice(tmp_path, capsys):
    cfg, tune_dir = config(tmp_path), tuned(tmp_path)
    assert rates(tune.choose(cfg, tune_dir, master=False)) == {"standard": 0.003, "attnres": 0.001}
    assert not os.path.exists(os.path.join(tune_dir, "choice.json")) and capsys.readouterr().out == ""


def test_an_arm_that_diverged_at_every_rate_is_one_line(tmp_path):
    losses = LOSSES | {("attnres", r): (None, 2.0, 2.0) for r in RATES}
    with pytest.raises(
        ConfigError,
        match=r"^arm 'attnres': no rate finished on every tuning seed \(0.001: seed 1000 "
        r"diverged; 0.003: seed 1000 diverged; 0.01: seed 1000 diverged\); add "
        r"smaller rates to tune_learning_rates$",
    ):
        tune.choose(config(tmp_path), tuned(tmp_path, losses))


def test_the_compared_seeds_never_choose(tmp_path):
    cfg, tune_dir = config(tmp_path), tuned(tmp_path)
    cfg["seeds"] = [0, 1001]
    with pytest.raises(ConfigError, match="^tune_seeds and seeds share 1001"):
        tune.choose(cfg, tune_dir)
    assert not os.path.exists(os.path.join(tune_dir, "choice.json"))


def test_tuned_arms_are_the_arms_at_their_chosen_rates(tmp_path):
    cfg = config(tmp_path, min_lr=1e-4)
    arms = tune.tuned_arms(cfg, tune.choose(cfg, tuned(tmp_path)))
    assert arms == {
        "standard": dict(residual="standard", learning_rate=0.003, min_lr=pytest.approx(3e-3 / 30)),
        "attnres": dict(residual="attnres", attnres_block_size=2, learning_rate=0.001, min_lr=pytest.approx(1e-3 / 30)),
    }
    assert cfg["arms"]["standard"] == {"residual": "standard"}  # the run's arms untouched
    tuned_cfg = dict(cfg, arms=arms)
    records.check_config(tuned_cfg, 1)  # and a grid that passes the run's checks
    assert records.cell_config(tuned_cfg, "standard", 0)["learning_rate"] == 0.003


# -----------------------------------------------------------------------------
# the routing rate (tune_routing_lr_scales): each routed arm's routing_lr_scale at its chosen rate

# at each arm's chosen rate (LOSSES: attnres 1e-3, dar 3e-3), per routing scale. attnres: 0.1 beats 1 on every seed by
# far more than the noise: 0.1. dar (non-monotone): 0.3 is the worst, 1 beats 0.3 but not 0.1 (worse on seed 1001):
# 0.1, the safer (smaller) routing rate, which 1 (the lowest mean) does not beat
SCALED = {  # each routed arm's cells at every rate, as the tuning grid trains them
    **{("attnres-rs0.1", r): ends for r, ends in zip(RATES, [(2.10, 2.11, 2.12), (2.3,) * 3, (2.4,) * 3])},
    **{("dar-rs0.1", r): ends for r, ends in zip(RATES, [(2.7,) * 3, (2.45, 2.35, 2.45), (2.6,) * 3])},
    **{("dar-rs0.3", r): ends for r, ends in zip(RATES, [(2.8,) * 3, (2.60, 2.61, 2.62), (2.9,) * 3])},
}


def test_routing_scales_add_cells_for_routed_arms_only_and_refuse_what_cannot_run():
    cfg = config(**ARMS3, tune_routing_lr_scales=[1, 0.1])
    arms = tune.tuning_config(cfg)["arms"]
    assert [a for a in arms if "-rs" in a] == [f"{arm}-rs0.1-lr{r:g}" for arm in ("attnres", "dar") for r in RATES]
    assert arms["dar-rs0.1-lr0.003"] == dict(
        residual="dar", learning_rate=0.003, min_lr=pytest.approx(3e-4), routing_lr_scale=0.1
    )
    assert tune.tuning_config(config(**ARMS3))["arms"] == {a: v for a, v in arms.items() if "-rs" not in a}  # as before
    assert tune.tuning_config(dict(cfg, vocab_size=None))["arms"] == arms  # launch.py's: before the data is read
    for bad in ([0], [0.1, 0.1], ["x"]):
        with pytest.raises(ConfigError, match="^tune_routing_lr_scales=.*give distinct positive numbers"):
            tune.tuning_config(config(tune_routing_lr_scales=bad))
    own = dict(arms={"attnres": {"residual": "attnres", "routing_lr_scale": 0.5}})
    with pytest.raises(ConfigError, match="^arm 'attnres' sets routing_lr_scale, which tune_routing_lr_scales chooses"):
        tune.tuning_config(config(**own, tune_routing_lr_scales=[0.1]))


def test_the_routing_scale_is_chosen_each_at_its_own_rate_by_the_same_rule_non_monotone(tmp_path, capsys):
    cfg = config(tmp_path, **ARMS3, tune_routing_lr_scales=[0.1, 0.3, 1])
    tune_dir = tuned(tmp_path, LOSSES | SCALED)
    with pytest.raises(ConfigError, match="tuning cell attnres-rs0.3-lr0.001/seed1000 has no result"):
        tune.choose(cfg, tune_dir)  # every scale's cells at every rate are needed
    attnres_03 = {("attnres-rs0.3", r): ends for r, ends in zip(RATES, [(2.5,) * 3, (2.6,) * 3, (2.7,) * 3])}
    tune_dir = tuned(tmp_path, LOSSES | SCALED | attnres_03)
    chosen = tune.choose(cfg, tune_dir)
    assert rates(chosen) == {"standard": 0.003, "attnres": 0.001, "dar": 0.003}  # the rates as before
    record = read_json(os.path.join(tune_dir, "choice.json"))
    assert record["routing_scales"] == [0.1, 0.3] and record["routing_choice"] == {"attnres": 0.1, "dar": 0.1}
    assert set(record["routing_table"]["dar"]) == {"0.1", "0.3", "1"}
    assert record["routing_table"]["dar"]["1"]["val_loss"] == record["table"]["dar"]["0.003"]["val_loss"]  # its rate's
    assert record["routing_table"]["dar"]["0.1"]["learning_rate"] == pytest.approx(3e-4)  # the routing rate
    assert record["routing_reason"]["dar"].startswith("routing rate 0.0003: the safer rate: ")
    assert "tuned: attnres at learning_rate 0.001 (the lowest mean), routing_lr_scale 0.1 (routing rate" in (
        capsys.readouterr().out
    )
    assert chosen["dar"] == dict(learning_rate=0.003, routing_lr_scale=0.1) and chosen["standard"] == dict(
        learning_rate=0.003
    )
    arms = tune.tuned_arms(cfg, chosen)
    assert arms["attnres"]["routing_lr_scale"] == 0.1 and arms["dar"]["routing_lr_scale"] == 0.1
    assert "routing_lr_scale" not in arms["standard"]  # no routing parameters: never a scale
    records.check_config(dict(cfg, arms=arms), 1)


def test_an_arm_unstable_at_a_rate_with_its_routing_at_1x_takes_that_rate_where_a_slower_routing_is_best(
    tmp_path, capsys
):
    """MUDDFormer on the Python docs: at 1e-2 with its routing at 1x one tuning seed blew up, so the rule took 3e-3
    there; at 1e-2 with its routing at 0.1x it had the lowest loss of all. Each scale at its own rate finds it; the
    rate chosen at 1x first, then the scale at that rate, did not."""
    losses = LOSSES | {
        ("dar", 1e-2): (2.20, 2.90, 2.21),  # unstable: 3e-3 at x1
        **{("dar-rs0.1", r): ends for r, ends in zip(RATES, [(2.7,) * 3, (2.45, 2.44, 2.46), (2.10, 2.11, 2.12)])},
        **{("attnres-rs0.1", r): (2.9, 2.9, 2.9) for r in RATES},
    }
    cfg = config(tmp_path, **ARMS3, tune_routing_lr_scales=[0.1, 1])
    chosen = tune.choose(cfg, tuned(tmp_path, losses))
    assert rates(chosen)["dar"] == 0.01
    assert "tuned: dar at learning_rate 0.01 (at routing x1 0.003: the lowest mean" in capsys.readouterr().out
    record = read_json(str(tmp_path / "out" / "tune" / "choice.json"))
    assert record["routing_choice"]["dar"] == 0.1 and record["choice"]["dar"] == 0.01
    assert record["table"]["dar"]["0.01"]["mean"] > record["table"]["dar"]["0.003"]["mean"] - 0.1  # x1's own rows kept
    assert grid_files.tuning_problem(record, str(tmp_path / "out")) is None, "the report's check agrees"
    arms = tune.tuned_arms(cfg, chosen)
    assert arms["dar"] | {"min_lr": 0} == dict(residual="dar", learning_rate=0.01, min_lr=0, routing_lr_scale=0.1)
    edited = dict(record, choice=dict(record["choice"], dar=0.003))  # the rate chosen at x1, the scale at that rate
    assert "choice.dar is 0.003, not the tuning rule's 0.01 (its rate at routing x0.1)" in grid_files.tuning_problem(
        edited, str(tmp_path / "out")
    )
    without = {k: {a: v for a, v in record[k].items() if a != "dar"} for k in ("table", "choice")}
    assert grid_files.tuning_problem(dict(record, **without), str(tmp_path / "out")) == (
        "routing_table.dar has no row in table"
    )


def test_a_listed_scale_of_1_is_the_same_tuning_as_none():
    assert grid_files.as_compared("tune_routing_lr_scales", [1.0, 0.1]) == grid_files.as_compared(
        "tune_routing_lr_scales", [0.1]
    )
    assert grid_files.as_compared("tune_routing_lr_scales", [0.3]) != grid_files.as_compared(
        "tune_routing_lr_scales", [0.1]
    )
    assert not records.differences(dict(tune_routing_lr_scales=[0.1, 1]), dict(tune_routing_lr_scales=[0.1]))


def test_a_scale_of_1_chosen_leaves_the_arm_as_without_routing_tuning(tmp_path):
    losses = LOSSES | {(f"{arm}-rs0.1", r): (2.9, 2.9, 2.9) for arm in ("attnres", "dar") for r in RATES}
    cfg = config(tmp_path, **ARMS3, tune_routing_lr_scales=[0.1, 1])
    arms = tune.tuned_arms(cfg, tune.choose(cfg, tuned(tmp_path, losses)))
    assert arms == tune.tuned_arms(config(tmp_path, **ARMS3), tune.choose(config(tmp_path, **ARMS3), tuned(tmp_path)))


def test_a_rerun_of_fewer_compared_seeds_keeps_every_recorded_arm(tmp_path, capsys):
    # a partial rerun (--arms=standard --seeds=0,1) once rewrote choice.json without the other arms
    tune_dir = tuned(tmp_path)
    tune.choose(config(tmp_path, **ARMS3), tune_dir)
    full = read_json(os.path.join(tune_dir, "choice.json"))
    tune.choose(config(tmp_path, arms={"standard": {"residual": "standard"}}, seeds=[0, 1]), tune_dir)
    assert read_json(os.path.join(tune_dir, "choice.json")) == full
    tune.choose(config(tmp_path, arms={"standard": {"residual": "standard"}}, seeds=[0, 7]), tune_dir)
    grown = read_json(os.path.join(tune_dir, "choice.json"))
    assert grown["seeds"] == [0, 1, 2, 7] and {k: v for k, v in grown.items() if k != "seeds"} == {
        k: v for k, v in full.items() if k != "seeds"
    }
    assert "seeds 7 added, the recorded arms' choices as they were" in capsys.readouterr().out


# -----------------------------------------------------------------------------
# the one command, end to end

needs_snippet = pytest.mark.skipif(
    "tune_learning_rates" not in train.DEFAULTS,
    reason="needs the train.py snippet: the tune_* keys and the tuned protocol in main",
)


def run_train(args):
    return subprocess.run(
        [sys.executable, "train.py", *args],
        cwd=ROOT,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
        capture_output=True,
        text=True,
        timeout=300,
    )


@needs_snippet
def test_one_command_tunes_on_tuning_seeds_then_pairs_at_each_arms_rate(shards, tmp_path, capsys):
    out = str(tmp_path / "out")
    args = tiny(
        shards,
        out,
        "--arms=standard,attnres",
        "--tune_learning_rates=1e-3,3e-2",
        "--tune_seeds=1000,1001",
        "--tune_iters=4",
    )
    proc = run_train(args)  # the one command, as a user types it
    assert proc.returncode == 0, proc.stderr[-3000:]
    tune_dir = os.path.join(out, "tune")
    rows = {}
    for arm in ("standard", "attnres"):
        for rate in (1e-3, 3e-2):
            for seed in (1000, 1001):
                r = result(tune_dir, tune.tuning_arm(arm, rate), seed)
                assert r["steps"] == 4 and r["pairing"]["arm_settings"]["learning_rate"] == rate
                assert r["config"]["min_lr"] == pytest.approx(rate / 10)  # tiny's min_lr / learning_rate = 1e-3 / 1e-2
            rows[arm, rate] = tune.tuning_row(tune_dir, arm, rate, [1000, 1001], 4)
        assert not os.path.exists(os.path.join(tune_dir, tune.tuning_arm(arm, 1e-3), "seed0"))  # no compared seed
    record = read_json(os.path.join(tune_dir, "choice.json"))
    choice = record["choice"]
    for arm in ("standard", "attnres"):  # the choice from the tuning cells alone, said; the compared cell at it
        assert (choice[arm], record["reason"][arm]) == tune.stable_choice([rows[arm, 1e-3], rows[arm, 3e-2]])
        assert f"tuned: {arm} at learning_rate {tune.rate_name(choice[arm])} ({record['reason'][arm]})" in proc.stdout
        r = result(out, arm, 0)
        assert r["steps"] == 8 and r["pairing"]["arm_settings"]["learning_rate"] == choice[arm]
        assert r["config"]["min_lr"] == pytest.approx(choice[arm] / 10)
    paired = json.load(open(os.path.join(out, "paired.json")))
    assert paired["tuning"]["choice"] == choice and paired["arms"]["attnres"]["n"] == 1  # paired across rates
    assert "## Learning-rate tuning" in open(os.path.join(out, "report.md")).read()
    before = open(os.path.join(tune_dir, "choice.json"), "rb").read()
    train.main(args)  # the same command again: every cell done already, the same choice
    assert capsys.readouterr().out.count("done already") == 10  # 8 tuning cells, 2 compared
    assert open(os.path.join(tune_dir, "choice.json"), "rb").read() == before
    with pytest.raises(ConfigError, match=r"config.json was made with other settings: tune_learning_rates \("):
        train.main(args + ["--tune_learning_rates=1e-3,3e-2,0.1"])  # refused before the tuning trains a new rate
    assert not os.path.exists(os.path.join(tune_dir, "standard-lr0.1"))
    with pytest.raises(ConfigError, match="^tune_seeds and seeds share 0: "):
        train.main(
            tiny(
                shards,
                str(tmp_path / "o2"),
                "--arms=standard",
                "--tune_learning_rates=1e-3",
                "--tune_seeds=0,1000",
                "--tune_iters=4",
            )
        )
    assert not os.path.exists(tmp_path / "o2" / "tune")


@needs_snippet
def test_one_command_tunes_the_routing_rate_too_and_trains_each_arm_at_its_scale(shards, tmp_path, monkeypatch):
    import report

    write_report = report.main
    monkeypatch.setattr(report, "main", lambda argv: None)
    out = str(tmp_path / "out")
    routing = ["--tune_learning_rates=1e-3,3e-2", "--tune_seeds=1000,1001", "--tune_iters=4"]
    train.main(tiny(shards, out, "--arms=standard,attnres", *routing, "--tune_routing_lr_scales=0.1,1"))
    tune_dir = os.path.join(out, "tune")
    for rate in (1e-3, 3e-2):  # a cell per scale other than 1 for the routed arm, at every rate; none for standard
        r = result(tune_dir, tune.tuning_arm("attnres-rs0.1", rate), 1000)
        assert r["pairing"]["arm_settings"]["routing_lr_scale"] == 0.1 and r["steps"] == 4
    assert not [name for name in os.listdir(tune_dir) if name.startswith("standard-rs")]
    record = read_json(os.path.join(tune_dir, "choice.json"))
    rate, scale = record["choice"]["attnres"], record["routing_choice"]["attnres"]
    rows = [
        tune.tuning_row(tune_dir, "attnres-rs0.1", rate, [1000, 1001], 4),
        record["table"]["attnres"][tune.rate_name(rate)],
    ]
    assert record["routing_table"]["attnres"]["0.1"]["val_loss"] == rows[0]["val_loss"]
    assert record["routing_table"]["attnres"]["1"]["val_loss"] == rows[1]["val_loss"]
    arm = result(out, "attnres", 0)["pairing"]["arm_settings"]
    assert arm.get("routing_lr_scale", 1.0) == scale and arm["learning_rate"] == rate  # the paired cell at its choice
    assert "routing_lr_scale" not in result(out, "standard", 0)["pairing"]["arm_settings"]
    # the report shows the routing rows and choice, checked against the tuning cells, and counts their cost
    write_report([out])
    with open(os.path.join(out, "report.md")) as f:
        text = f.read()
    means = {
        n: f"{row['mean']:.4f} ({row['sd']:.4f}) at {row['learning_rate'] / float(n):g}"  # each scale at its own rate
        for n, row in record["routing_table"]["attnres"].items()
    }
    cells = [f"**{m}**" if float(n) == scale else m for n, m in sorted(means.items(), key=lambda i: float(i[0]))]
    assert f"| attnres | {cells[0]} | {cells[1]} |" in text, text
    assert f"- attnres: x{scale:g}, {record['routing_reason']['attnres']}" in text
    assert "Cost: the tuning 12 cells, 48 steps" in text  # 2 arms x 2 rates x 2 seeds, and attnres-rs0.1's 4
    edit = dict(record, routing_table={"attnres": {**record["routing_table"]["attnres"], "1": rows[0]}})
    with open(os.path.join(tune_dir, "choice.json"), "w") as f:
        json.dump(edit, f)
    write_report([out])
    with open(os.path.join(out, "report.md")) as f:
        assert "routing_table.attnres is not what its tuning cells in tune/ give" in f.read()


def test_the_choice_reads_no_test_token_and_a_killed_tuning_goes_on_only_with_its_rates(shards, tmp_path, monkeypatch):
    # every validation token each cell reads, counted where it is read (validation_batch), as positions in the shard
    out, E, T = str(tmp_path / "out"), 1000, 16
    args = tiny(
        shards, out, "--arms=standard", "--tune_learning_rates=1e-3,3e-2", "--tune_seeds=1000,1001", "--tune_iters=4"
    )
    where, read, cell = {}, {}, []  # where: id of a cell's validation rows -> their starts in the shard
    real_rows, real_batch, real_cell, real_choose = (
        records.ValidationText.rows,
        train.validation_batch,
        train.train_cell,
        tune.choose,
    )

    def rows(self, *a):
        val_rows = real_rows(self, *a)
        where[id(val_rows)] = (val_rows, self.starts(*a))  # the array kept alive, so its id stays its own
        return val_rows

    def validation_batch(val_rows, seq_ids, device):
        starts = where[id(val_rows)][1]
        read.setdefault(cell[-1], set()).update(starts[j] + t for j in seq_ids for t in range(T + 1))
        return real_batch(val_rows, seq_ids, device)

    def killed(*a, **k):
        raise KeyboardInterrupt

    monkeypatch.setattr(records.ValidationText, "rows", rows)
    monkeypatch.setattr(train, "validation_batch", validation_batch)
    monkeypatch.setattr(train, "train_cell", lambda arm, *a: (cell.append(arm), real_cell(arm, *a)))
    monkeypatch.setattr(report, "main", lambda argv: None)
    monkeypatch.setattr(tune, "choose", killed)  # killed after the tuning cells, before the choice
    with pytest.raises(KeyboardInterrupt):
        train.main(args)
    n_seq, slots = (E - 1) // T, 3000 // (T + 1)  # the validation shard: 3,000 tokens (the error below)
    picks = [(2 * k + 1) * slots // (4 * n_seq) * (T + 1) for k in range(2 * n_seq)]  # spread: even test, odd tune
    tuning_text, test_text = ({p + t for p in picks[i::2] for t in range(T + 1)} for i in (1, 0))
    assert len(tuning_text) == len(test_text) == n_seq * (T + 1) and min(tuning_text) < max(test_text)
    assert sorted(read) == ["standard-lr0.001", "standard-lr0.03"]
    for arm, positions in read.items():  # every tuning cell read the tuning text whole, and no test token
        assert positions == tuning_text and not positions & test_text, arm
    with pytest.raises(
        ConfigError,
        match=r"tune/config.json was made with other settings: tune_learning_rates "
        r"\(\[0.001, 0.03\] -> \[0.001, 0.03, 0.1\]\); .*--allow_changes=True",
    ):
        train.main(args + ["--tune_learning_rates=1e-3,3e-2,0.1"])  # the killed tuning, with another rate list
    assert not os.path.exists(os.path.join(out, "tune", "standard-lr0.1"))
    monkeypatch.setattr(tune, "choose", real_choose)
    read.clear()
    train.main(args)  # the same command: the tuning done, the choice made, the compared cell trained
    assert sorted(read) == ["standard"] and read["standard"] == test_text  # the reported text, as before the split
    assert read_json(os.path.join(out, "tune", "choice.json"))["tuning_text"] == dict(
        layout="spread", sequences="odd", tokens=E
    )
    with pytest.raises(
        ConfigError,
        match=r"^the tuned protocol chooses rates on the 1,600 validation tokens after the "
        r"1,600 it reports \(eval_tokens\), but the validation shard holds 3,000, fewer "
        r"than 3,200; set --eval_tokens=1500 or less, or give a longer validation "
        r"shard$",
    ):
        train.main(
            tiny(
                shards,
                str(tmp_path / "o2"),
                "--arms=standard",
                "--tune_learning_rates=1e-3",
                "--tune_seeds=1000,1001",
                "--tune_iters=4",
                "--eval_tokens=1600",
                "--eval_layout=first",
            )
        )
    assert not os.path.exists(tmp_path / "o2" / "tune")
    with pytest.raises(  # spread: the reported and the tuning sequences need 2 x 99 slots of 17; 176 fit
        ConfigError,
        match=r"^eval_layout='spread' reads 2 x 99 sequences of 17 tokens \(the reported ones and the tuning ones "
        r"between them\) but the validation shard holds 176 \(3,000 tokens\); set --eval_tokens=1409 or less",
    ):  # a frozen grid reads its 99 alone (tests/test_records.py)
        tuned = ["--tune_learning_rates=1e-3", "--tune_seeds=1000,1001", "--tune_iters=4"]
        train.main(tiny(shards, str(tmp_path / "o2"), "--arms=standard", *tuned, "--eval_tokens=1600"))
    assert not os.path.exists(tmp_path / "o2" / "tune")  # refused before any tuning cell
    assert not [p for p in glob.glob(str(tmp_path / "o2" / "**"), recursive=True) if os.path.isfile(p)]  # no file
