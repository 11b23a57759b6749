"""report.py on grids written by hand: pairing and what stops it, the tables, power, tuning and
downstream sections, mixed versions, escaping, plots, and strict JSON."""

import json
import os
import re
import socket
import subprocess
import sys
import tarfile

import numpy as np
import pytest

import common
import grid_files
import paired_stats
import report
from reporting import grid, paired, plots
import tune
from helpers import write_tuning_cell

SETTINGS = dict(learning_rate=1e-3, weight_decay=0.1, dropout=0.0, max_iters=20, eval_interval=10, n_layer=2)
WEIGHTS = {
    "attn.0": [1.0],
    "attn_v.0": [1.0],
    "mlp.0": [0.4, 0.6],
    "attn.1": [0.2, 0.3, 0.5],
    "attn_v.1": [0.6, 0.1, 0.3],
    "mlp.1": [0.1, 0.2, 0.3, 0.4],
    "out": [0.1, 0.1, 0.2, 0.2, 0.4],
}


def write_cell(out, arm, seed, val_loss, curve=None, **changes):
    """One cell folder as train.py writes it: config.json, log.jsonl (train and eval records), result.json."""
    cell = out / arm / f"seed{seed}"
    cell.mkdir(parents=True)
    code = dict(fingerprint="c0de" * 16, git_commit=None, git_dirty=None)
    (cell / "config.json").write_text(json.dumps(dict(SETTINGS, arm=arm, seed=seed, model=dict(n_layer=2), code=code)))
    curve = curve or {0: 10.8, 1000: 6.0, 2000: val_loss}
    records = []
    for i, (tokens, loss) in enumerate(sorted(curve.items())):
        if i:
            records.append(
                dict(
                    step=10 * i,
                    tokens=tokens,
                    loss=loss + 0.1,
                    lr=1e-3,
                    ms_per_step=5.0,
                    tokens_per_s=2e5,
                    mfu=None,
                    eta_cell_s=1.0,
                    eta_grid_s=3.0,
                )
            )
        routing = dict(weights=WEIGHTS, entropy={}, qk_v_jsd={"0": 0.01 * i, "1": 0.02 * i} if arm == "rd" else {})
        records.append(dict(step=10 * i, tokens=tokens, val_loss=loss, routing=routing))
    (cell / "log.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    # each seed its own init and data order (two cells of one arm with the same hashes are one training)
    pairing = dict(
        init_hash="1a" * 31 + f"{seed:02x}",
        data_hash="d4" * 31 + f"{seed:02x}",
        eval_tokens=992,
        code=code["fingerprint"],
        init_from=None,
        settings=dict(SETTINGS),
    )
    result = dict(
        arm=arm,
        seed=seed,
        status="finished",
        val_loss=val_loss,
        diverged_at=None,
        reason=None,
        tokens=2000,
        steps=20,
        params=1000,
        non_embedding_params=500,
        wall_time_s=100.0 + seed,
        routing=dict(weights=WEIGHTS),
        pairing=pairing,
    )
    result.update(changes)
    (cell / "result.json").write_text(json.dumps(result))
    return cell


def make_grid(tmp_path, losses, arms=("parent", "rd")):
    """A grid of finished, paired cells: losses = {(arm, seed): final validation loss}."""
    out = tmp_path / "grid"
    out.mkdir()
    seeds = sorted({s for _, s in losses})
    (out / "config.json").write_text(json.dumps(dict(SETTINGS, arms={a: {} for a in arms}, seeds=seeds)))
    for (arm, seed), loss in losses.items():
        write_cell(out, arm, seed, loss)
    return out


def edit(out, arm, seed, change):
    """Apply change(result) to a cell's result.json."""
    path = out / arm / f"seed{seed}" / "result.json"
    result = json.loads(path.read_text())
    change(result)
    path.write_text(json.dumps(result))


def in_markdown(note):
    """A note as report.md writes it: the brackets of JSON values in it escaped (markup in text from files)."""
    return note.replace("[", "\\[").replace("]", "\\]")


def run(out, *args):
    report.main([str(out), *args])
    return json.load(open(out / "paired.json")), (out / "report.md").read_text()


@pytest.fixture
def no_matplotlib(monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import fails as if not installed; tables only


LOSSES = {
    ("parent", 0): 3.00,
    ("rd", 0): 2.97,
    ("parent", 1): 3.10,
    ("rd", 1): 3.08,
    ("parent", 2): 3.05,
    ("rd", 2): 3.01,
    ("parent", 3): 3.20,
    ("rd", 3): 3.16,
}


def test_report_pairs_and_leaves_out_changed_init_and_data(tmp_path, no_matplotlib):
    out = make_grid(tmp_path, LOSSES)
    paired, _ = run(out)
    assert paired["arms"]["rd"]["seeds"] == [0, 1, 2, 3] and paired["arms"]["rd"]["left_out"] == [], (
        "every seed pairs while the pairing records agree"
    )
    assert paired["arms"]["rd"]["deltas"] == pytest.approx([-0.03, -0.02, -0.04, -0.04])
    edit(out, "rd", 1, lambda r: r["pairing"].update(init_hash="ff" * 32))
    edit(out, "parent", 2, lambda r: r["pairing"].pop("data_hash"))
    paired, text = run(out)
    rd = paired["arms"]["rd"]
    assert rd["seeds"] == [0, 3] and rd["n"] == 2, "seeds 1 and 2 left out of rd's n: another init, no data hash"
    assert rd["deltas"] == pytest.approx([-0.03, -0.04]) and rd["wins"] == 2
    (s1, r1), (s2, r2) = [(d["seed"], d["reason"]) for d in rd["left_out"]]
    assert s1 == 1 and "init_hash" in r1 and "1a1a" in r1 and "ffff" in r1 and len(r1) < 100, (
        "the reason names the key and both values, shortened"
    )
    assert s2 == 2 and "data_hash" in r2 and "missing" in r2, "a key one record lacks is 'missing'"
    assert "| rd | 2 | 2/2 |" in text and f"- rd, seed 1: {r1}" in text and f"- rd, seed 2: {r2}" in text
    paired, _ = run(out, "--reference=rd")
    assert paired["arms"]["parent"]["deltas"] == pytest.approx([0.03, 0.04]), (
        "another --reference pairs the other way round"
    )


def recorded(arm, seed, residual, **model):
    """What train.py records beside a result: the cell's record (its model, rates, data and code) and its counts."""
    shape = dict(n_layer=2, n_head=2, n_embd=32, block_size=16, vocab_size=64, n_experts=1, residual=residual) | model
    code = dict(fingerprint="c0de" * 16, git_commit="ab12cd34ef56" + "0" * 28, git_dirty=False)
    return dict(
        config=dict(
            arm=arm,
            seed=seed,
            model=shape,
            learning_rate=1e-3,
            min_lr=1e-4,
            data_dir="data/tiny",
            train_data_sha256="5ha" * 20,
            tokenizer="gpt2",
            code=code,
        ),
        params=26784 + 320 * (residual != "standard"),
        non_embedding_params=25056,
        active_params=26784 + 320 * (residual != "standard"),
    )


def test_the_report_opens_with_what_it_compared_and_a_verdict_per_pair(tmp_path, no_matplotlib):
    # issue #50: settings that differ from the reference, sizes and FLOPs, data, code, and one verdict per pair
    losses = (
        {("standard", s): 3.0 + s / 10 for s in range(4)}
        | {("attnres", s): 2.95 + s / 10 - s / 100 for s in range(4)}
        | {("dar", s): 3.0 + s / 10 + (-0.01) ** s for s in range(4)}
    )
    out = make_grid(tmp_path, losses, arms=("standard", "attnres", "dar"))
    for arm, seed in losses:
        edit(
            out,
            arm,
            seed,
            lambda r: r.update(recorded(arm, seed, arm, **(dict(attnres_block_size=2) if arm == "attnres" else {}))),
        )
    paired, text = run(out)
    opening = text[: text.index("Final validation loss")]
    assert "No baseline arm" not in opening, "standard is a baseline"
    assert "| standard | (the reference) | 26,784 | 25,056 | 172,992 |" in opening, (
        "6 x 26,784 active + 12 x 2 x 32 x 16 for attention: model.flops_per_token's count"
    )
    assert (
        '| attnres | residual "attnres" ("standard"), attnres_block_size 2 (null) | 27,104 | 25,056 | 174,912 |'
        in opening
    ), "Block AttnRes's own block size named beside its scheme"
    assert (
        "Data: corpus data/tiny (train shards sha256 5ha5ha5ha5ha...), tokenizer gpt2; tokens trained per cell: "
        "2,000; validation text: 992 tokens of the validation shard evaluated"
    ) in opening
    assert "Code: git commit ab12cd34ef56." in opening
    assert "- attnres against standard: **ahead**: mean delta -0.0650 nats, 95% CI [" in opening
    assert "(t over seeds), 4/4 seeds in favour" in opening, "no per-sequence losses: the seeds' t interval"
    assert "- dar against standard: **not detectable at this size**: mean delta" in opening
    assert paired["arms"]["attnres"]["ci95"][1] < 0, "ahead: the quoted interval below 0"
    (tmp_path / "b").mkdir()
    losses = {(arm, s): loss + 0.2 * (arm == "attnres") for (arm, s), loss in losses.items()}
    _, text = run(make_grid(tmp_path / "b", losses, arms=("standard", "attnres", "dar")))
    assert "- attnres against standard: **behind**: mean delta +0.1350 nats" in text


def test_a_grid_without_a_baseline_arm_says_so_at_the_top(tmp_path, no_matplotlib):
    _, text = run(make_grid(tmp_path, LOSSES))
    assert text.index(
        "**No baseline arm**: none of the arms is a baseline scheme (standard, scaled_residual); every "
        "delta below is against parent, not against a baseline."
    ) < text.index("Final validation loss")
    assert "| rd | none | 1,000 | 500 | not recorded (no n_layer, n_embd, block_size) |" in text, (
        "an older cell without its shape: what is missing is said"
    )


def test_one_interval_is_quoted_and_the_bootstrap_only_where_calibrated(tmp_path, no_matplotlib):
    seeds = range(paired_stats.BOOTSTRAP_CALIBRATED_SEEDS)
    rng = np.random.default_rng(3)
    losses = {(arm, s): 3.0 + rng.normal(0, 0.05) - 0.02 * (arm == "rd") for arm in ("parent", "rd") for s in seeds}
    out = make_grid(tmp_path, losses)
    with_sequences(out, ("parent", "rd"), seeds, 40, rng)
    paired, text = run(out)
    ci = paired["arms"]["rd"]["text"]["ci95"]
    assert (
        f"95% CI [{ci[0]:+.4f}, {ci[1]:+.4f}] (two-way bootstrap over seeds and text, calibrated from 20 seeds)" in text
    ), "from 20 seeds the bootstrap is the interval quoted"
    (tmp_path / "s").mkdir()
    small = make_grid(tmp_path / "s", {k: v for k, v in losses.items() if k[1] < 3})
    with_sequences(small, ("parent", "rd"), range(3), 40, rng)
    paired, text = run(small)
    ci = paired["arms"]["rd"]["text"]["ci95_t"]
    assert f"95% CI [{ci[0]:+.4f}, {ci[1]:+.4f}] (t over seeds and text)" in text, "below 20 seeds: the t interval"


def test_intervals_that_disagree_on_zero_say_why():
    st = dict(n=3, identical=False, ci95=[-0.05, 0.01], mean=-0.02)
    text = dict(n=3, ci95_t=[-0.04, 0.005], ci95=[-0.03, -0.01])
    why = paired.disagreement(st, text)
    assert why == (
        "the bootstrap excludes 0, the seeds' t interval and the t interval over seeds and text do not: "
        "the bootstrap draws only from the 3 seeds seen and is too narrow below 20 seeds; the verdict "
        "quotes t over seeds and text"
    ), why
    assert paired.disagreement(st, dict(text, ci95=[-0.03, 0.001])) is None, "all three include 0: they agree"
    why = paired.disagreement(dict(st, ci95=[-0.05, -0.01]), dict(text, ci95=[-0.03, 0.001]))
    assert "counts the text's variance" in why and why.startswith("the seeds' t interval excludes 0"), why


def test_differing_settings_are_named_and_an_arms_own_settings_are_not(tmp_path, no_matplotlib):
    losses = {(arm, s): 3.0 for arm in ("parent", "rd") for s in range(5)}
    out = make_grid(tmp_path, losses)
    edit(out, "rd", 0, lambda r: r["pairing"]["settings"].update(learning_rate=1e-4))
    edit(out, "rd", 1, lambda r: r["pairing"]["settings"].update(weight_decay=0.0))
    edit(out, "parent", 2, lambda r: r["pairing"]["settings"].update(dropout=0.2))
    edit(out, "rd", 3, lambda r: r["pairing"].update(eval_tokens=192))
    for seed in range(5):  # rd sets its own n_layer (absent from its settings) and records a key of its own
        edit(out, "rd", seed, lambda r: r["pairing"]["settings"].pop("n_layer"))
        edit(out, "rd", seed, lambda r: r["pairing"]["settings"].update(rd_control="dup"))
    paired, _ = run(out)
    reasons = {d["seed"]: d["reason"] for d in paired["arms"]["rd"]["left_out"]}
    assert paired["arms"]["rd"]["seeds"] == [4] and paired["arms"]["rd"]["n"] == 1, (
        "only seed 4 agrees on every setting both cells record"
    )
    assert reasons[0] == "parent and rd differ in settings.learning_rate (0.001 vs 0.0001)", (
        "a differing shared setting stops the pairing (an arm's own would not)"
    )
    assert reasons[1] == "parent and rd differ in settings.weight_decay (0.1 vs 0.0)"
    assert reasons[2] == "parent and rd differ in settings.dropout (0.2 vs 0.0)"
    assert reasons[3] == "parent and rd differ in eval_tokens (992 vs 192)", (
        "a top-level pairing key, not only settings"
    )


def test_diverged_cells_are_listed_apart(tmp_path, no_matplotlib):
    out = make_grid(tmp_path, LOSSES)
    edit(
        out,
        "rd",
        1,
        lambda r: r.update(
            status="diverged", val_loss=None, diverged_at=40, reason="non-finite training loss at step 40"
        ),
    )
    edit(out, "parent", 2, lambda r: r.update(val_loss=float("nan")))  # written before the status field existed
    paired, text = run(out)
    assert paired["arms"]["rd"]["seeds"] == [0, 3] and paired["arms"]["rd"]["deltas"] == pytest.approx([-0.03, -0.04])
    assert paired["diverged"] == [
        dict(arm="rd", seed=1, step=40, reason="non-finite training loss at step 40"),
        dict(arm="parent", seed=2, step=20, reason="val_loss is nan"),
    ]
    assert [d["reason"] for d in paired["arms"]["rd"]["left_out"]] == ["rd/seed1 diverged", "parent/seed2 diverged"], (
        "the reference's diverged seed is out too"
    )
    assert "| rd | 1 | 40 | non-finite training loss at step 40 |" in text and "| rd | 2 | 2/2 |" in text, (
        "diverged cells get their own table, with step and reason"
    )


def test_old_and_unfinished_cells_are_not_paired(tmp_path, no_matplotlib):
    out = make_grid(tmp_path, LOSSES)
    for arm, seed in LOSSES:  # result.json as written before cells recorded their pairing
        edit(out, arm, seed, lambda r: [r.pop(k) for k in ("pairing", "status", "wall_time_s")])
    (out / "rd" / "seed3" / "result.json").unlink()  # unfinished: log only
    paired, text = run(out)
    assert paired["arms"]["rd"]["seeds"] == [] and paired["arms"]["rd"]["n"] == 0 and "| rd | 0 | 0/0 |" in text, (
        "cells of an earlier version, without pairing records, never pair"
    )
    reasons = [d["reason"] for d in paired["arms"]["rd"]["left_out"]]
    assert reasons[0] == "parent/seed0 no pairing record; rd/seed0 no pairing record"
    assert reasons[3] == "parent/seed3 no pairing record; rd/seed3 missing"
    assert "Wall time" not in text, "no wall time recorded: no wall-time table"


def test_each_arms_step_time_is_beside_the_references_seed_by_seed(tmp_path, no_matplotlib):
    out = make_grid(tmp_path, LOSSES)

    def timed(arm, seed, first, later):  # the logged intervals: the first (warm-up) at `first`, the rest at `later`
        log = out / arm / f"seed{seed}" / "log.jsonl"
        records = [json.loads(line) for line in log.read_text().splitlines()]
        timings = iter([first] + [later] * len(records))
        for r in records:
            if "ms_per_step" in r:
                r["ms_per_step"] = next(timings)
        log.write_text("".join(json.dumps(r) + "\n" for r in records))

    for seed in (0, 1, 2, 3):  # two training records each: the first is left out
        timed("parent", seed, 900.0, 10.0 * (seed + 1))
        timed("rd", seed, 5.0, 15.0 * (seed + 1) if seed % 2 == 0 else 60.0 * (seed + 1) / 2)
    _, text = run(out)
    # ratios 1.5, 3.0, 1.5, 3.0: their mean 2.25, not the ratio of the means
    assert "| parent | 10.0 | 20.0 | 30.0 | 40.0 | 1.00 |" in text, text
    assert "| rd | 15.0 | 60.0 | 45.0 | 120.0 | 2.25 |" in text, text


def test_a_seed_whose_two_cells_trained_on_different_machines_is_left_out_of_the_ratio(tmp_path, no_matplotlib):
    out = make_grid(tmp_path, LOSSES)
    for arm in ("parent", "rd"):
        for seed in (0, 1, 2, 3):
            host = "AVX512" if (arm, seed) == ("rd", 1) else "AVX2"  # one cell of the grid ran on another host
            edit(out, arm, seed, lambda r: r.setdefault("config", {}).update(machine=dict(cpu_capability=host)))
            log = out / arm / f"seed{seed}" / "log.jsonl"
            records = [json.loads(line) for line in log.read_text().splitlines()]
            for r in records:
                if "ms_per_step" in r:
                    r["ms_per_step"] = 10.0 * (2 if arm == "rd" else 1) * (4 if (arm, seed) == ("rd", 1) else 1)
            log.write_text("".join(json.dumps(r) + "\n" for r in records))
    _, text = run(out)
    assert "| rd | 20.0 | 80.0 | 20.0 | 20.0 | 2.00 |" in text, "the other host's 4x slower cell priced rd at 3.50"
    assert "rd: seed(s) 1 left out of its ratio" in text, text
    assert "machines" not in text.split("left out of its ratio")[0].split("Training step time")[-1]


def test_stray_folders_and_damaged_files_are_skipped_with_a_note(tmp_path, no_matplotlib):
    out = make_grid(tmp_path, LOSSES)
    (out / "rd" / "seed_old").mkdir()
    (out / "notes").mkdir()
    with open(out / "rd" / "seed0" / "log.jsonl", "a") as f:
        f.write('{"step": 30, "tokens": 3000, "val_lo')  # torn by a full disk
    (out / "parent" / "seed3" / "result.json").write_text('{"arm": "parent", "val_')  # half-written
    paired, text = run(out)
    assert paired["arms"]["rd"]["seeds"] == [0, 1, 2], "a stray folder or damaged file costs only its own seed"
    assert paired["arms"]["rd"]["left_out"] == [dict(seed=3, reason="parent/seed3 unreadable result.json")]
    notes = "\n".join(paired["skipped"])
    for part in (
        "rd/seed_old/",
        "notes/",
        "rd/seed0/log.jsonl: skipped line 6 (not JSON)",
        "parent/seed3/result.json: unreadable",
    ):
        assert part in notes and part in text
    assert paired["arms"]["rd"]["delta_curve"]["tokens"] == [0, 1000, 2000]


def test_each_arm_is_paired_with_the_reference_seed_by_seed(tmp_path, no_matplotlib):
    # a problem in one arm's cell (or between two non-reference arms) leaves that seed out of that arm only
    losses = {(arm, s): 3.0 + s / 10 - i / 100 for i, arm in enumerate(("parent", "rd", "extra")) for s in range(4)}
    out = make_grid(tmp_path, losses, arms=("parent", "rd", "extra"))
    (out / "extra" / "seed0" / "result.json").unlink()  # unfinished
    edit(out, "extra", 1, lambda r: r.update(status="diverged", val_loss=None, diverged_at=10, reason="nan"))
    edit(out, "rd", 2, lambda r: r["pairing"].update(init_hash="ff" * 32))  # differs from parent and extra
    edit(out, "parent", 3, lambda r: r["pairing"].update(code="0ther"))  # the reference: out for every arm
    (out / "new" / "seed0").mkdir(parents=True)  # an arm that has not finished a cell
    (out / "new" / "seed0" / "log.jsonl").write_text("")
    paired, text = run(out)
    rd, extra, new = (paired["arms"][arm] for arm in ("rd", "extra", "new"))
    assert rd["seeds"] == [0, 1] and rd["deltas"] == pytest.approx([-0.01, -0.01]), (
        "rd keeps its seeds: extra's problems are extra's"
    )
    assert extra["seeds"] == [2] and extra["deltas"] == pytest.approx([-0.02]), (
        "extra: only the seed where both of its cells and the reference's are usable"
    )
    assert [(d["seed"], d["reason"].split(" (")[0]) for d in rd["left_out"]] == [
        (2, "parent and rd differ in init_hash"),
        (3, "parent and rd differ in code"),
    ]
    assert [(d["seed"], d["reason"].split(" (")[0]) for d in extra["left_out"]] == [
        (0, "extra/seed0 missing"),
        (1, "extra/seed1 diverged"),
        (3, "parent and extra differ in code"),
    ]
    assert new["seeds"] == [] and [d["reason"] for d in new["left_out"]] == [f"new/seed{s} missing" for s in range(4)]
    assert (
        "| rd | 2 | 2/2 |" in text and "| extra | 1 | 1/1 |" in text and "- extra, seed 0: extra/seed0 missing" in text
    )
    assert "| new | 0 | 0/0 | undefined | undefined | undefined | undefined | undefined | undefined |" in text
    assert "- new: no paired seed: its mean, s.d., interval and p-values are undefined" in text
    assert "- extra: 1 paired seed: no s.d., so the t-test's p and interval are undefined" in text
    assert "nan" not in text.replace("| extra | 1 | 10 | nan |", ""), (
        "undefined statistics are words (the diverged cell's reason is its own)"
    )
    assert "Per-seed deltas, extra: seed 2: -0.0200" in text, "per-seed deltas name their seeds"


def test_fields_of_the_wrong_type_are_skipped_with_a_note(tmp_path, no_matplotlib):
    losses = {(arm, s): 3.0 - i / 100 for i, arm in enumerate(("parent", "rd")) for s in range(5)}
    out = make_grid(tmp_path, losses)
    (out / "config.json").write_text(json.dumps(dict(arms=dict(parent={}, rd={}), seeds=["a", 0, True, 1.5, 1])))
    edit(out, "rd", 0, lambda r: r.update(val_loss=True))  # would count as 1.0
    edit(out, "parent", 1, lambda r: r.update(wall_time_s="100"))
    edit(out, "rd", 2, lambda r: r.update(pairing=[r["pairing"]]))
    edit(out, "rd", 3, lambda r: r["pairing"].update(settings=[["learning_rate", 0.1]]))  # would compare nothing
    log = out / "rd" / "seed4" / "log.jsonl"
    log.write_text(
        log.read_text().replace('"val_loss": 2.99', '"val_loss": "2.99"')  # the last evaluation
        + json.dumps(dict(step=30, tokens=10**400, val_loss=2.9))
        + "\n"
    )  # no float holds the int
    paired, text = run(out)
    rd = paired["arms"]["rd"]
    assert rd["seeds"] == [4] and rd["deltas"] == pytest.approx([-0.01]), (
        "fields of the wrong type make a cell unreadable, not a crash"
    )
    assert [d["reason"] for d in rd["left_out"]] == [
        "rd/seed0 unreadable result.json",
        "parent/seed1 unreadable result.json",
        "rd/seed2 unreadable result.json",
        "rd/seed3 unreadable result.json",
    ]
    assert rd["delta_curve"]["tokens"] == [0, 1000], "the evaluation at 2000 tokens skipped"
    notes = paired["skipped"]
    for note in (
        'config.json: seeds "a", true, 1.5 ignored (not non-negative integers)',
        "rd/seed0/result.json: unreadable (val_loss is true, not a number)",
        'parent/seed1/result.json: unreadable (wall_time_s is "100", not a finite number)',
        "rd/seed2/result.json: unreadable (pairing is [{\"init_hash\": \"..., not a dict)",
        "rd/seed3/result.json: unreadable (pairing.settings is not a dict)",
        'rd/seed4/log.jsonl: skipped line 5 (val_loss is "2.99", not a number), line 6 (tokens is '
        '1000000000000000..., not a finite number)',
    ):
        assert note in notes and f"- {in_markdown(note)}" in text
    assert "parent/seed1" not in paired["wall_time_s"] and "| parent | 100 | - | 102 | 103 | 104 | 409 |" in text, (
        "a wall time of the wrong type is left out of the wall-time table only"
    )


def test_a_killed_reports_temporaries_are_removed_by_the_next_report(tmp_path, no_matplotlib):
    # a report killed before its renames (SIGKILL: nothing runs) leaves temporaries, some of files the next
    # report may not write again (another --cell's plot): the next report removes every one a dead writer left
    out = make_grid(tmp_path, LOSSES)
    ended = subprocess.Popen([sys.executable, "-c", ""])
    ended.wait()
    host = socket.gethostname()
    stale = [f"report.md.{ended.pid}.{host}.tmp", f"routing_rd_seed7.png.{ended.pid}.{host}.tmp"]
    kept = [
        f"paired.json.{os.getppid()}.{host}.tmp",  # a live writer's
        f"report.md.{ended.pid}.another-host.tmp",
        f".{ended.pid}.{host}.tmp",
    ]  # another host's; no file's
    for name in stale + kept:
        (out / name).write_text("partial")
    report.main([str(out)])
    assert sorted(p.name for p in out.iterdir() if p.name.endswith(".tmp")) == sorted(kept), (
        "a killed report's temporaries go; files that are not ours stay"
    )
    assert (out / "report.md").exists()


def test_read_only_out_dir_is_one_line_before_any_work(tmp_path, monkeypatch):
    out = make_grid(tmp_path, {("parent", 0): 3.0, ("rd", 0): 2.9})
    access = os.access  # as root a chmod does not stop writes, so the permission check is what is tested
    monkeypatch.setattr(os, "access", lambda path, mode: False if path == str(out) else access(path, mode))
    with pytest.raises(SystemExit) as e:
        report.main([str(out)])
    assert e.value.code.startswith(f"error: cannot write to {out} (") and "\n" not in e.value.code
    assert "copy the grid somewhere writable" in e.value.code
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "parent", "rd"], (
        "nothing written before the refusal"
    )


def test_bad_cell_argument_is_one_line(tmp_path, no_matplotlib):
    out = make_grid(tmp_path, LOSSES)
    for cell, message in (
        ("rd", "give arm/seedK, e.g. --cell=rd/seed0"),
        ("rd/seed9", "no such cell"),
        ("lstm/seed0", "no such cell"),
    ):
        with pytest.raises(SystemExit) as e:
            report.main([str(out), f"--cell={cell}"])
        assert str(e.value.code).startswith("error: ") and message in e.value.code and "\n" not in e.value.code
    assert not (out / "report.md").exists(), "a refused --cell writes no report"


def test_bad_out_dir(tmp_path):
    with pytest.raises(SystemExit, match="not a directory"):
        report.main([str(tmp_path / "nope")])


def log_of(curve):
    return [dict(step=i, tokens=t, val_loss=v) for i, (t, v) in enumerate(curve.items())]


def test_delta_curve_against_scipy():
    from scipy import stats

    ref = {0: [10.0, 10.1, 9.9], 100: [6.0, 6.2, 6.1], 200: [5.0, 5.1, 5.3], 300: [4.0, 4.1, 4.2]}
    arm = {0: [10.0, 10.2, 9.8], 100: [5.9, 6.0, 6.2], 200: [4.9, 5.0, 5.1], 300: [3.9, 4.0, 4.3]}
    logs = {
        (name, s): log_of({t: v[s] for t, v in curve.items() if not (name == "ref" and s == 2 and t == 100)})
        for name, curve in (("ref", ref), ("rd", arm))
        for s in range(3)
    }
    logs["rd", 1].append(dict(step=9, tokens=250, val_loss=4.5))  # evaluated by one seed only
    c = paired.delta_curve(logs, "rd", "ref", [0, 1, 2])
    assert c["n"] == 3 and c["tokens"].tolist() == [0, 200, 300], "only the tokens every seed has"
    d = np.array([[arm[t][s] - ref[t][s] for t in (0, 200, 300)] for s in range(3)])
    low, high = stats.t.interval(0.95, 2, loc=d.mean(0), scale=stats.sem(d, axis=0))
    assert c["mean"] == pytest.approx(d.mean(0)) and c["ci95_low"] == pytest.approx(low), (
        "the curve's mean and interval are scipy's t interval"
    )
    assert c["ci95_high"] == pytest.approx(high)
    c = paired.delta_curve(logs, "rd", "ref", [0, 1])  # only the seeds given (the paired ones)
    assert c["tokens"].tolist() == [0, 100, 200, 300] and c["mean"][1] == pytest.approx(-0.15), (
        "with seeds 0 and 1 only, the evaluation at 100 tokens that seed 2 lacks is back"
    )
    single = paired.delta_curve(logs, "rd", "ref", [0])
    assert single["mean"] == pytest.approx([0.0, -0.1, -0.1, -0.1]) and np.isnan(single["ci95_low"]).all(), (
        "one seed: a mean, no interval"
    )
    assert len(paired.delta_curve(logs, "rd", "ref", [])["tokens"]) == 0, "no seeds: an empty curve, no error"


def test_delta_curve_and_wall_time_in_the_report(tmp_path, no_matplotlib):
    out = tmp_path / "grid"
    out.mkdir()
    curves = {("parent", s): {0: 10.8, 1000: 6.0 + s / 10, 2000: 5.0 + s / 10} for s in range(3)}
    curves.update({("rd", s): {0: 10.8, 1000: 5.9 + s / 20, 2000: 4.95 + s / 10} for s in range(3)})
    curves["rd", 2] = {0: 0.0, 1000: 0.0, 2000: 4.9}
    for (arm, seed), curve in curves.items():
        write_cell(out, arm, seed, curve[2000], curve=curve)
    edit(out, "rd", 2, lambda r: r["pairing"].update(code="0ther"))  # seed 2 left out: its curve must not count
    paired, text = run(out)
    c = paired["arms"]["rd"]["delta_curve"]
    assert c["tokens"] == [0, 1000, 2000] and c["n"] == 2, "the curve covers the evaluations both paired seeds have"
    assert c["mean"] == pytest.approx([0.0, -0.125, -0.05])
    assert paired["wall_time_s"] == {
        "parent/seed0": 100.0,
        "parent/seed1": 101.0,
        "parent/seed2": 102.0,
        "rd/seed0": 100.0,
        "rd/seed1": 101.0,
        "rd/seed2": 102.0,
    }
    assert "| rd | 100 | 101 | 102 | 303 |" in text, "wall time per cell with the arm's total"


def test_plots(tmp_path):
    pytest.importorskip("matplotlib")
    out = make_grid(tmp_path, {("parent", 0): 3.0, ("rd", 0): 2.9, ("parent", 1): 3.1, ("rd", 1): 3.05})
    _, text = run(out, "--cell=rd/seed1")
    for name in ("val_loss.png", "delta_curve.png", "jsd_rd.png", "routing_rd_seed1.png"):
        assert (out / name).stat().st_size > 1000 and f"]({name})" in text, (
            "each plot written and linked from report.md"
        )


def test_tables_without_matplotlib(tmp_path, no_matplotlib):
    out = make_grid(tmp_path, {("parent", 0): 3.0, ("rd", 0): 2.9})
    _, text = run(out)
    assert "| rd | 1 | 1/1 |" in text and not list(out.glob("*.png")), "without matplotlib: the tables, no PNG"


def test_command_line_error_is_one_line_without_traceback(tmp_path):
    out = make_grid(tmp_path, {("parent", 0): 3.0, ("rd", 0): 2.9})
    cli = subprocess.run(
        [sys.executable, "report.py", str(out), "--cell=rd_attnres"],
        capture_output=True,
        text=True,
        cwd=os.path.dirname(os.path.abspath(report.__file__)),
    )
    assert cli.returncode == 1 and cli.stderr == "error: --cell=rd_attnres: give arm/seedK, e.g. --cell=rd/seed0\n"


@pytest.mark.parametrize("arms", [None, 5, "rd", ["parent", "rd"], {"../x": {}, "parent": {}}])
def test_config_arms_of_the_wrong_type_are_taken_from_the_folders(tmp_path, no_matplotlib, arms):
    out = make_grid(tmp_path, LOSSES)
    (out / "config.json").write_text(json.dumps(dict(arms=arms, seeds=[0, 1, 2, 3])))
    paired, text = run(out)
    assert paired["reference"] == "parent" and paired["arms"]["rd"]["deltas"] == pytest.approx(
        [-0.03, -0.02, -0.04, -0.04]
    )
    note = (
        f"config.json: arms is {json.dumps(arms)}, not a dict of arm settings; arms taken from the folders"
        if not isinstance(arms, dict)
        else 'config.json: arms "../x" ignored (not folder names)'
    )
    assert paired["skipped"] == [note] and f"- {in_markdown(note)}" in text and "| x |" not in text


def test_log_records_of_the_wrong_type_are_skipped_and_plots_still_drawn(tmp_path):
    pytest.importorskip("matplotlib")
    out = make_grid(tmp_path, {("parent", 0): 3.0, ("rd", 0): 2.9})
    log = out / "rd" / "seed0" / "log.jsonl"
    records = [json.loads(line) for line in log.read_text().splitlines()]
    evaluation = records[-1]
    bad = [
        dict(evaluation, routing=5),
        dict(evaluation, routing=dict(weights=[[1.0]])),
        dict(evaluation, routing=dict(weights={"attn.0": "1.0"})),
        dict(evaluation, routing=dict(weights={"out": []})),
        dict(evaluation, routing=dict(qk_v_jsd={"0": None})),
        dict(evaluation, tokens="2000"),
        dict(evaluation, tokens=float("inf")),
        [evaluation],
    ]
    partial = dict(evaluation, tokens=3000, routing=dict(qk_v_jsd={"0": 0.5}))  # layer 1 missing: a gap in its line
    log.write_text("".join(json.dumps(r) + "\n" for r in records + bad + [partial]))
    paired, text = run(out, "--cell=rd/seed0")
    note = next(n for n in paired["skipped"] if n.startswith("rd/seed0/log.jsonl: "))
    assert note == (
        "rd/seed0/log.jsonl: skipped line 6 (routing is 5, not a dict), line 7 (routing.weights is "
        '[[1.0]], not a dict), line 8 (routing.weights.attn.0 is "1.0", not a list of numbers) and 5 more lines'
    )
    for name in ("val_loss.png", "delta_curve.png", "jsd_rd.png", "routing_rd_seed0.png"):
        assert (out / name).stat().st_size > 1000 and f"]({name})" in text
    assert paired["arms"]["rd"]["delta_curve"]["tokens"] == [0, 1000, 2000], "the partial record is not parent's"


def copy_cell(out, source, target, symlink=False, **record):
    """cp -a (or ln -s) of one cell folder, then record changes written into the copy's result.json."""
    import shutil

    if symlink:
        os.symlink(os.path.relpath(out / source, (out / target).parent), out / target)
    else:
        shutil.copytree(out / source, out / target, symlinks=True)
    path = out / target / "result.json"
    path.write_text(json.dumps(dict(json.loads(path.read_text()), **record)))


def test_copied_and_linked_cells_are_never_counted_as_seeds(tmp_path, no_matplotlib):
    # the issue's case: cp -a attnres/seed0 attnres/seed7 (and ln -s for the other arm) must not make n=3 of 2 seeds
    losses = {(arm, s): 3.0 + s / 10 - i / 100 for i, arm in enumerate(("parent", "rd")) for s in range(3)}
    out = make_grid(tmp_path, losses)
    (out / "config.json").unlink()  # arms and seeds from the folders alone
    copy_cell(out, "parent/seed0", "parent/seed7")
    copy_cell(out, "rd/seed0", "rd/seed7", symlink=True)
    os.symlink("rd", out / "rd_link")  # a linked arm folder: every record in it is rd's
    copy_cell(out, "rd/seed1", "rd/seed8", seed=8)  # a copy whose recorded seed was edited to match its folder
    (out / "parent" / "seed0").rename(out / "parent" / "seed5")  # a moved cell: its record still says seed0
    paired, text = run(out)
    rd = paired["arms"]["rd"]
    assert rd["seeds"] == [2] and rd["deltas"] == pytest.approx([-0.01]) and "| rd | 1 | 1/1 |" in text, (
        "copies and links are never counted: rd keeps one seed"
    )
    assert [(d["seed"], d["reason"]) for d in rd["left_out"]] == [
        (0, "parent/seed0 missing"),
        (1, "rd/seed1 same training as rd/seed8"),
        (8, "parent/seed8 missing; rd/seed8 same training as rd/seed1"),
    ]
    assert "seed 7" not in text and "rd_link |" not in text and list(paired["arms"]) == ["rd"], (
        "a copied cell's recorded seed adds no seed, a linked arm no arm"
    )
    notes = paired["skipped"]
    for note in (
        "folder parent/seed5/: its result.json is parent/seed0's, not counted; rename it to parent/seed0/ or delete it",
        "folder parent/seed7/: its result.json is parent/seed0's, not counted; rename it to parent/seed0/ or delete it",
        "folder rd/seed7/: its result.json is rd/seed0's, not counted; a copy of rd/seed0/: delete it",
        "rd/seed1, rd/seed8: one training (the same init_hash and data_hash), none counted; delete the "
        "copies, keeping the cell trained with that seed",
    ):
        assert note in notes and f"- {in_markdown(note)}" in text
    assert "folder rd_link/: a link to rd/, not counted; delete the link" in notes and len(notes) == 5


def test_result_json_without_its_cell_is_unreadable(tmp_path, no_matplotlib):
    out = make_grid(tmp_path, LOSSES)
    edit(out, "rd", 0, lambda r: r.pop("seed"))
    edit(out, "rd", 1, lambda r: r.update(seed="1"))
    edit(out, "rd", 2, lambda r: r.update(arm=None))  # null is no arm either
    paired, _ = run(out)
    assert paired["arms"]["rd"]["seeds"] == [3], (
        "a result.json without its arm or seed, or with one of the wrong type, is not counted"
    )
    for note in (
        "rd/seed0/result.json: unreadable (no seed recorded)",
        'rd/seed1/result.json: unreadable (seed is "1", not a seed)',
        "rd/seed2/result.json: unreadable (no arm recorded)",
    ):
        assert note in paired["skipped"]


@pytest.mark.parametrize("name", ["report.md", "paired.json", "val_loss.png", "jsd_parent.png", "routing_rd_seed0.png"])
def test_an_output_name_that_is_a_folder_is_one_line_before_anything_is_written(tmp_path, name):
    out = make_grid(tmp_path, {("parent", 0): 3.0, ("rd", 0): 2.9})
    (out / name).mkdir()
    with pytest.raises(common.DataError) as e:
        report.main([str(out)])
    assert str(e.value) == f"{out / name} is a folder, where report.py writes its {name}; move or delete it"
    assert sorted(p.name for p in out.iterdir()) == sorted(["config.json", "parent", "rd", name]), (
        "nothing written beside the folder in the way"
    )


def test_folders_where_files_belong_and_empty_cells_make_no_arm_or_seed(tmp_path, no_matplotlib):
    out = make_grid(tmp_path, LOSSES)
    (out / "phantom" / "seed0").mkdir(parents=True)
    (out / "rd" / "seed9").mkdir()
    (out / "rd" / "seed3" / "log.jsonl").unlink()
    (out / "rd" / "seed3" / "log.jsonl").mkdir()
    (out / "parent" / "seed2" / "result.json").unlink()
    (out / "parent" / "seed2" / "result.json").mkdir()
    os.mkfifo(out / "parent" / "seed1" / "result.json.fifo")
    (out / "parent" / "seed1" / "result.json").unlink()
    (out / "parent" / "seed1" / "result.json.fifo").rename(
        out / "parent" / "seed1" / "result.json"
    )  # would block a read
    paired, text = run(out)
    assert list(paired["arms"]) == ["rd"] and paired["arms"]["rd"]["seeds"] == [0, 3] and "seed 9" not in text, (
        "folders where files belong make no arm or seed"
    )
    assert paired["arms"]["rd"]["delta_curve"]["tokens"] == [], "rd/seed3 has no log to read"
    for note in (
        "folder phantom/: not an arm (no seed<k> cell of its own with a result.json or log.jsonl)",
        "folder rd/seed9/: no result.json or log.jsonl (not started)",
        "rd/seed3/log.jsonl: unreadable (a folder, not a file)",
        "parent/seed2/result.json: unreadable (a folder, not a file)",
        "parent/seed1/result.json: unreadable (not a regular file)",
    ):
        assert note in paired["skipped"]


def test_temporary_names_are_the_processs_own_and_never_left_behind(tmp_path, monkeypatch):
    pytest.importorskip("matplotlib")
    out = make_grid(tmp_path, {("parent", 0): 3.0, ("rd", 0): 2.9})
    others = [out / f"{name}.{os.getpid() + 1}.tmp" for name in ("report.md", "paired.json", "jsd_rd.png")]
    for other in others:  # another report's temporaries, mid-write: folders, so touching one would fail
        other.mkdir()
    run(out)
    assert sorted(p.name for p in out.glob("*.tmp")) == sorted(p.name for p in others)
    before = {p.name: p.read_bytes() for p in out.iterdir() if p.is_file()}
    replace = os.replace

    def full_disk(src, dst):
        if dst.endswith(".png"):
            raise OSError(28, "No space left on device")
        replace(src, dst)

    monkeypatch.setattr(os, "replace", full_disk)
    with pytest.raises(common.DataError, match=r"^cannot write .*val_loss.png \(No space left on device\); free disk"):
        report.main([str(out)])
    assert {p.name: p.read_bytes() for p in out.iterdir() if p.is_file()} == before, (
        "a failed write leaves every file as it was"
    )
    assert sorted(p.name for p in out.glob("*.tmp")) == sorted(p.name for p in others)


def raise_on_constant(name):
    raise ValueError(f"{name} is not JSON")


def test_every_file_written_for_a_one_seed_grid_is_strict_json(tmp_path, no_matplotlib):
    out = make_grid(tmp_path, {("parent", 0): 3.0, ("rd", 0): 2.9, ("parent", 1): 3.1})
    edit(out, "parent", 1, lambda r: r.update(val_loss=float("nan"), diverged_at=float("inf")))
    paired, _ = run(out)
    written = sorted(p.name for p in out.iterdir() if p.name not in ("config.json", "parent", "rd"))
    assert written == ["paired.json", "report.md"], "without matplotlib; the plots are PNGs"
    json.loads((out / "paired.json").read_text(), parse_constant=raise_on_constant)
    rd = paired["arms"]["rd"]
    assert rd["n"] == 1 and rd["std"] is None and rd["ci95"] == [None, None] and rd["p_ttest"] is None, (
        "one seed: null, not NaN, for what is undefined"
    )
    assert rd["delta_curve"]["ci95_low"] == [None] * 3 and rd["mean"] == pytest.approx(-0.1), (
        "the curve's band is null for one seed"
    )
    assert paired["diverged"] == [dict(arm="parent", seed=1, step=None, reason="val_loss is nan")]


def test_hostile_files_and_folders_are_skipped_with_a_note(tmp_path, monkeypatch, no_matplotlib):
    out = make_grid(tmp_path, {(arm, s): 3.0 - i / 100 for i, arm in enumerate(("parent", "rd")) for s in range(6)})
    (out / "rd" / "seed0" / "result.json").write_text("[1, 2]")
    edit(out, "rd", 1, lambda r: r.update(val_loss=float("inf")))
    (out / "rd" / "seed2" / "result.json").write_text("[" * 100_000 + "]" * 100_000)  # past Python's recursion limit
    (out / "rd" / "seed3" / "result.json").write_bytes(b'{"arm": "rd", "seed": 3, "val_loss": \xff}')
    (out / "other" / "seed0").mkdir(parents=True)
    locked = [
        str(out / "rd" / "seed4" / "result.json"),
        str(out / "other"),
    ]  # root ignores chmod: refuse in open/listdir
    real_open, real_listdir = open, os.listdir

    def refusing(call):
        def refuse(path, *args, **kwargs):
            if str(path) in locked:
                raise PermissionError(13, "Permission denied", str(path))
            return call(path, *args, **kwargs)

        return refuse

    monkeypatch.setattr(common, "open", refusing(real_open), raising=False)  # report reads JSON through common
    monkeypatch.setattr(grid_files, "open", refusing(real_open), raising=False)
    monkeypatch.setattr(os, "listdir", refusing(real_listdir))
    paired, text = run(out)
    rd = paired["arms"]["rd"]
    assert rd["seeds"] == [5] and [d["reason"] for d in rd["left_out"]][:5] == [
        "rd/seed0 unreadable result.json",
        "rd/seed1 diverged",
        "rd/seed2 unreadable result.json",
        "rd/seed3 unreadable result.json",
        "rd/seed4 unreadable result.json",
    ]
    assert paired["diverged"] == [dict(arm="rd", seed=1, step=20, reason="val_loss is inf")]
    for note in (
        "rd/seed0/result.json: unreadable ([1, 2], not a JSON object)",
        "rd/seed2/result.json: unreadable (not JSON)",
        "rd/seed3/result.json: unreadable (not JSON)",
        "rd/seed4/result.json: unreadable (permission denied)",
        "folder other/: unreadable (permission denied)",
    ):
        assert note in paired["skipped"] and f"- {in_markdown(note)}" in text
    locked.append(str(out))
    with pytest.raises(common.DataError, match=f"^cannot list {out} \\(permission denied\\); check its permissions$"):
        report.main([str(out)])
    (tmp_path / "file").write_text("")
    with pytest.raises(SystemExit, match="is not a directory; give the out_dir of a train.py grid"):
        report.main([str(tmp_path / "file")])


def test_seeds_trained_under_other_code_are_named_as_mixed(tmp_path, no_matplotlib):
    # each seed paired fairly (both arms under the same code), but seed 2 under other code: said so
    out = make_grid(tmp_path, {(a, s): 3.0 - 0.1 * (a == "rd") + 0.01 * s for a in ("parent", "rd") for s in (0, 1, 2)})
    paired, text = run(out)
    assert "Mixed versions" not in text and paired["arms"]["rd"]["mixed_versions"] == [], (
        "one version of code: no mixed versions"
    )
    for arm in ("parent", "rd"):
        edit(out, arm, 2, lambda r: r["pairing"].update(code="b" * 64))
    paired, text = run(out)
    assert paired["arms"]["rd"]["n"] == 3, "every seed is paired"
    assert paired["arms"]["rd"]["mixed_versions"] == [
        'code: seeds 0, 1: "c0dec0dec0dec0dec; seed 2: "bbbbbbbbbbbbbbbbb'
    ]
    assert (
        "**Mixed versions**" in text
        and '- rd: code: seeds 0, 1: "c0dec0dec0dec0dec; seed 2: "bbbbbbbbbbbbbbbbb' in text
    )


def test_power_in_the_report(tmp_path, no_matplotlib):
    out = make_grid(tmp_path, LOSSES)
    paired, text = run(out)
    rd = paired["arms"]["rd"]
    std = np.std([-0.03, -0.02, -0.04, -0.04], ddof=1)
    assert rd["power"]["std"] == pytest.approx(std) and rd["power"]["effect"] == 0.03, (
        "power sized from the s.d. of the per-seed deltas"
    )
    assert rd["power"]["detectable_effect"] == pytest.approx(paired_stats.detectable_effect_in_sd(4) * std)
    assert rd["power"]["seeds_needed"] == paired_stats.seeds_needed(0.03 / std)
    assert rd["power"]["sign_test_min_p"] == pytest.approx(0.125), "4 seeds: the sign test's floor is 2 x 0.5^4"
    assert rd["power"]["notes"] == [
        "the sign test cannot reach p < 0.05 at 4 seeds: its smallest p is 0.125; it needs 6"
    ]
    row = f"| rd | 4 | {std:.4f} | {rd['power']['detectable_effect']:.4f} | {rd['power']['seeds_needed']} | 0.125 |"
    assert "seeds to detect 0.03 nats" in text and row in text and f"- rd: {rd['power']['notes'][0]}" in text
    paired, text = run(out, "--effect=0.1")
    assert paired["arms"]["rd"]["power"]["seeds_needed"] == paired_stats.seeds_needed(0.1 / std) == 3, "not 2: df 1"
    assert "seeds to detect 0.1 nats" in text
    for bad in ("0", "-0.03", "nan", "inf"):
        with pytest.raises(SystemExit, match=f"^error: --effect={float(bad)}: give a positive number of nats"):
            report.main([str(out), f"--effect={bad}"])


def test_power_says_why_without_two_seeds_or_spread(tmp_path, no_matplotlib):
    # seeds 0-5 with one exact delta each (binary fractions): no spread; seed 0 alone: no s.d. at all
    out = make_grid(tmp_path, {(arm, s): s + 1.0 - 0.5 * (arm == "rd") for arm in ("parent", "rd") for s in range(6)})
    paired, text = run(out)
    power = paired["arms"]["rd"]["power"]
    assert power["detectable_effect"] is None and power["seeds_needed"] is None and power["std"] == 0, (
        "identical deltas: no power estimate"
    )
    assert power["notes"] == ["every seed has the same delta (s.d. 0): power cannot be estimated from it"]
    assert power["sign_test_min_p"] == pytest.approx(1 / 32) and "| rd | 6 | 0.0000 | - | - | 0.0312 |" in text
    for seed in range(1, 6):
        edit(out, "rd", seed, lambda r: r.update(status="diverged", val_loss=None))
    paired, text = run(out)
    json.loads((out / "paired.json").read_text(), parse_constant=raise_on_constant)
    power = paired["arms"]["rd"]["power"]
    assert power["std"] is None and power["detectable_effect"] is None and power["seeds_needed"] is None, (
        "one seed: no s.d. to size the test from"
    )
    assert power["notes"] == [
        "n = 1: no s.d. of the deltas to size the t-test from",
        "the sign test cannot reach p < 0.05 at 1 seed: its smallest p is 1; it needs 6",
    ]
    assert "| rd | 1 | undefined | - | - | 1 |" in text and "- rd: n = 1: no s.d. of the deltas" in text


def test_a_diverging_but_finite_arm_still_gets_its_report(tmp_path, no_matplotlib):
    # 800 nats worse: exp(mean delta) is past a float, and that alone once stopped the whole report
    out = make_grid(
        tmp_path, {(arm, s): 3.0 + s / 10 + 800 * (arm == "rd") for arm in ("parent", "rd") for s in range(3)}
    )
    paired, text = run(out)
    json.loads((out / "paired.json").read_text(), parse_constant=raise_on_constant)
    rd = paired["arms"]["rd"]
    # every seed 800 nats worse: identical deltas, so no t-test (not p = 0)
    assert rd["mean"] == pytest.approx(800) and rd["ppl_change"] is None and rd["p_ttest"] is None and rd["identical"]
    assert "| rd | 3 | 0/3 | +800.0000 |" in text and "| off scale |" in text and "ppl change off scale" in text


def test_huge_losses_are_a_report_in_strict_json(tmp_path, no_matplotlib):
    out = make_grid(tmp_path, {("parent", 0): 1.0, ("rd", 0): 1.7e308, ("parent", 1): 2.0, ("rd", 1): 1.6e308})
    paired, text = run(out)
    json.loads((out / "paired.json").read_text(), parse_constant=raise_on_constant)
    assert paired["arms"]["rd"]["mean"] == pytest.approx(1.65e308) and "| rd | 1.7000e+308 | 1.6000e+308 |" in text, (
        "deltas near the float limit still give a mean"
    )


def table_blocks(text):
    """The markdown tables of a text: lists of consecutive lines that start with '|'."""
    blocks, block = [], []
    for line in text.split("\n") + [""]:
        if line.startswith("|"):
            block.append(line)
        elif block:
            blocks, block = blocks + [block], []
    return blocks


def test_text_from_files_cannot_forge_lines_tables_or_links(tmp_path, no_matplotlib):
    out = make_grid(tmp_path, LOSSES)
    forged = "nan\n| forged | row |\n# Heading <img src=x> [link](http://x) \u2028- item"
    edit(out, "rd", 1, lambda r: r.update(status="diverged", val_loss=None, diverged_at=40, reason=forged))
    (out / "notes|x\n- forged item").mkdir()  # a stray folder: its name goes into a note
    write_cell(out, "a|b", 0, 2.5)  # an arm whose name holds a table's separator
    os.mkdir(os.path.join(os.fsencode(out), b"latin\xe9"))  # a folder name that is not UTF-8
    paired, text = run(out)
    assert paired["diverged"][0]["reason"] == forged and "a|b" in paired["arms"], "paired.json keeps them whole"
    lines = text.split("\n")
    assert not [line for line in lines if line.startswith(("| forged", "# Heading", "- forged", "- item"))], (
        "no forged line starts a markdown block"
    )
    assert not re.search(r"(?<!\\)<img|(?<!\\)\[link", text) and "\u2028" not in text, "no live HTML or link"
    assert (
        "| rd | 1 | 40 | nan\\n\\| forged \\| row \\|\\n\\# Heading \\<img src=x\\> \\[link\\](http://x) \\u2028- item |"  # noqa: E501
        in lines
    )
    for block in table_blocks(text):  # every row of a table has its header's cells
        assert len({len(re.findall(r"(?<!\\)\|", row)) for row in block}) == 1, block
    assert "| a\\|b | 1 | 1/1 |" in text and "- folder latin\\udce9/: not an arm" in text, (
        "odd folder names escaped, never markup"
    )


TASKS = {
    "hellaswag": ("multiple_choice", 0.25),
    "arc_easy": ("multiple_choice", 0.25),
    "lambada": ("language_modeling", 0.0),
}


def write_downstream(
    out,
    arm,
    seed,
    correct,
    bundle="b" * 64,
    max_per_task=100,
    step=20,
    items=100,
    scoring="d" * 64,
    dtype="float32",
    bits=None,
):
    """downstream.json as downstream.py writes it into a cell: correct = {task: items answered right}, bits =
    {task: bits per byte} (default: 1 + correct / 1000)."""
    tasks = {}
    for label, right in correct.items():
        kind, baseline = TASKS[label]
        accuracy = right / items
        tasks[label] = dict(
            icl_task_type=kind,
            items=items,
            correct=right,
            accuracy=accuracy,
            random_baseline=baseline,
            centered=(accuracy - baseline) / (1 - baseline),
            bits_per_byte=(bits or {}).get(label, 1 + right / 1000),
        )
    record = dict(
        bundle_sha256=bundle,
        max_per_task=max_per_task,
        scoring_code=scoring,
        dtype=dtype,
        step=step,
        core=sum(t["centered"] for t in tasks.values()) / len(tasks),
        bits_per_byte=sum(t["bits_per_byte"] for t in tasks.values()) / len(tasks),
        tasks=tasks,
    )
    (out / arm / f"seed{seed}" / "downstream.json").write_text(json.dumps(record))
    return record


CORRECT = {
    "parent": [
        dict(hellaswag=30, lambada=20),
        dict(hellaswag=32, lambada=21),
        dict(hellaswag=31, lambada=19),
        dict(hellaswag=29, lambada=22),
    ],
    "rd": [
        dict(hellaswag=33, lambada=22),
        dict(hellaswag=35, lambada=21),
        dict(hellaswag=31, lambada=23),
        dict(hellaswag=34, lambada=20),
    ],
}


def test_downstream_deltas_tables_and_statistics(tmp_path, no_matplotlib):
    out = make_grid(tmp_path, LOSSES)
    for arm, per_seed in CORRECT.items():
        for seed, correct in enumerate(per_seed):
            write_downstream(out, arm, seed, correct)
    paired, text = run(out)
    rd = paired["downstream"]["arms"]["rd"]
    # by hand: hellaswag's centered accuracy is (c/100 - 1/4) / (3/4), lambada's c/100; CORE their mean
    hella = [(r - p) / 75 for r, p in zip([33, 35, 31, 34], [30, 32, 31, 29])]
    lambada = [(r - p) / 100 for r, p in zip([22, 21, 23, 20], [20, 21, 19, 22])]
    assert rd["seeds"] == [0, 1, 2, 3] and rd["left_out"] == [] and rd["mixed_evaluations"] == [], (
        "every seed's downstream results pair"
    )
    assert rd["core"]["deltas"] == pytest.approx([(h + l) / 2 for h, l in zip(hella, lambada)]), (
        "CORE's delta is the mean of the tasks' centered deltas"
    )
    assert rd["core"]["wins"] == 4 and rd["core"]["p_sign"] == pytest.approx(0.125), "CORE higher is a win"
    assert rd["tasks"]["hellaswag"]["deltas"] == pytest.approx([0.03, 0.03, 0.0, 0.05]), "accuracy, not centered"
    assert rd["tasks"]["hellaswag"]["wins"] == 3 and rd["tasks"]["hellaswag"]["p_sign"] == pytest.approx(0.25), "a tie"
    lam = rd["tasks"]["lambada"]
    assert lam["deltas"] == pytest.approx(lambada) and lam["wins"] == 2 and lam["items"] == [100], (
        "a task's accuracy deltas and statistics"
    )
    assert lam["mean"] == pytest.approx(0.01) and lam["p_ttest"] == pytest.approx(
        paired_stats.paired_statistics(lambada)["p_ttest"]
    )
    assert lam["icl_task_type"] == "language_modeling" and lam["seeds"] == [0, 1, 2, 3]
    assert paired["downstream"]["core"]["parent/seed1"] == pytest.approx((7 / 75 + 0.21) / 2), (
        "CORE per cell as each downstream.json records it"
    )
    assert "## Downstream tasks" in text and f"| parent | {(5 / 75 + 0.2) / 2:.4f} |" in text
    assert f"| rd | 4 | 4/4 | {rd['core']['mean']:+.4f} |" in text
    assert (
        f"| hellaswag | multiple_choice | 100 | 4 | 3/4 | +0.0275 | {np.std([0.03, 0.03, 0, 0.05], ddof=1):.4f} |"
        in text
    )
    assert "| lambada | language_modeling | 100 | 4 | 2/4 | +0.0100 |" in text
    assert paired["arms"]["rd"]["deltas"] == pytest.approx([-0.03, -0.02, -0.04, -0.04]), "the loss untouched"
    # bits per byte (written as 1 + correct / 1000 a task): the mean over tasks, lower is better
    bits = rd["bits_per_byte"]
    assert bits["deltas"] == pytest.approx([0.0025, 0.0015, 0.002, 0.0015]) and bits["wins"] == 0, (
        "bits per byte higher here: no win for rd"
    )
    assert rd["tasks"]["hellaswag"]["bits_per_byte"]["deltas"] == pytest.approx([0.003, 0.003, 0.0, 0.005])
    assert "| rd | 4 | 0/4 | +0.0019 |" in text and "Task bits per byte, rd - parent (lower is better):" in text
    assert f"| hellaswag | 4 | 0/4 | {rd['tasks']['hellaswag']['bits_per_byte']['mean']:+.4f} | 0.0021 |" in text


def test_downstream_scored_by_other_code_never_pairs(tmp_path, no_matplotlib):
    out = make_grid(tmp_path, {(arm, s): 3.0 - 0.01 * (arm == "rd") for arm in ("parent", "rd") for s in range(3)})
    for arm in ("parent", "rd"):
        for seed in range(3):
            write_downstream(out, arm, seed, dict(hellaswag=30 + seed + 2 * (arm == "rd"), lambada=20))
    write_downstream(out, "rd", 1, dict(hellaswag=33, lambada=20), scoring="e" * 64)  # downstream.py edited since
    paired, text = run(out)
    rd = paired["downstream"]["arms"]["rd"]
    assert rd["seeds"] == [0, 2], "downstream results of other scoring code never pair"
    assert [d["reason"] for d in rd["left_out"]] == [
        "parent and rd differ in scoring_code (dddddddddddddddd... vs eeeeeeeeeeeeeeee...)"
    ]


def test_downstream_pairs_the_items_scored_and_the_precision(tmp_path, no_matplotlib):
    out = make_grid(tmp_path, {(arm, s): 3.0 - 0.01 * (arm == "rd") for arm in ("parent", "rd") for s in range(3)})
    for arm in ("parent", "rd"):
        for seed in range(3):
            write_downstream(
                out, arm, seed, dict(hellaswag=30 + seed + 2 * (arm == "rd"), lambada=20), max_per_task=500
            )
    # every item of tasks of 100 (downstream.py) against the first 500 (in training): the same items, paired
    write_downstream(out, "rd", 1, dict(hellaswag=33, lambada=20), max_per_task=None)
    write_downstream(out, "rd", 2, dict(hellaswag=34, lambada=20), dtype="bfloat16")  # another precision: never
    paired, text = run(out)
    rd = paired["downstream"]["arms"]["rd"]
    assert rd["seeds"] == [0, 1] and rd["mixed_evaluations"] == [], "another precision never pairs"
    assert [d["reason"] for d in rd["left_out"]] == ["parent and rd differ in dtype (float32 vs bfloat16)"]
    assert "- rd, seed 2: parent and rd differ in dtype (float32 vs bfloat16)" in text


def test_downstream_json_of_an_earlier_version_pairs_without_bits_per_byte(tmp_path, no_matplotlib):
    out = make_grid(tmp_path, {(arm, s): 3.0 - 0.01 * (arm == "rd") for arm in ("parent", "rd") for s in range(3)})
    for arm in ("parent", "rd"):
        for seed in range(3):
            record = write_downstream(out, arm, seed, dict(hellaswag=30 + seed + 2 * (arm == "rd"), lambada=20))
            if (arm, seed) != ("rd", 2):  # written before bits per byte and dtype were: neither field
                for d in (record, *record["tasks"].values()):
                    d.pop("bits_per_byte")
                record.pop("dtype")
                (out / arm / f"seed{seed}" / "downstream.json").write_text(json.dumps(record))
    paired, text = run(out)
    rd = paired["downstream"]["arms"]["rd"]
    assert rd["seeds"] == [0, 1] and rd["core"]["n"] == 2 and rd["bits_per_byte"]["n"] == 0, (
        "an earlier downstream.json pairs its CORE, without bits per byte"
    )
    assert [d["reason"] for d in rd["left_out"]] == ["parent and rd differ in dtype (null vs float32)"]
    assert "bits-per-byte delta" not in text and "Task bits per byte" not in text, (
        "no bits-per-byte tables when no pair has them"
    )


def test_downstream_pairs_only_one_evaluation_and_says_why_not(tmp_path, no_matplotlib):
    out = make_grid(tmp_path, {(arm, s): 3.0 - 0.01 * (arm == "rd") for arm in ("parent", "rd") for s in range(7)})
    for arm in ("parent", "rd"):
        for seed in range(7):
            write_downstream(out, arm, seed, dict(hellaswag=30 + seed + 2 * (arm == "rd"), lambada=20))
    write_downstream(out, "rd", 0, dict(hellaswag=40, lambada=20), bundle="c" * 64)  # another task bundle
    write_downstream(out, "rd", 1, dict(hellaswag=20, lambada=10), max_per_task=50, items=50)
    (out / "parent" / "seed2" / "downstream.json").unlink()
    write_downstream(out, "rd", 3, dict(hellaswag=40, lambada=20), step=10)  # of a checkpoint before the end
    (out / "rd" / "seed4" / "downstream.json").write_text('{"bundle_sha256": "b')  # torn
    write_downstream(out, "rd", 5, dict(hellaswag=40))  # a task fewer
    edit(out, "rd", 6, lambda r: r["pairing"].update(init_hash="ff" * 32))  # out of the loss: not listed again
    paired, text = run(out)
    assert paired["arms"]["rd"]["seeds"] == [0, 1, 2, 3, 4, 5], "the loss pairs every seed but 6"
    rd = paired["downstream"]["arms"]["rd"]
    assert rd["seeds"] == [] and rd["core"]["n"] == 0 and rd["tasks"] == {}, (
        "no seed whose two downstream results are of one evaluation"
    )
    reasons = {d["seed"]: d["reason"] for d in rd["left_out"]}
    assert reasons == {
        0: "parent and rd differ in bundle_sha256 (bbbbbbbbbbbbbbbb... vs cccccccccccccccc...)",
        1: "parent and rd differ in tasks.hellaswag.items (100 vs 50)",
        2: "parent/seed2 has no downstream.json",
        3: "rd/seed3 downstream.json is of step 10, its result.json of step 20",
        4: "rd/seed4 unreadable downstream.json",
        5: "parent and rd differ in tasks.lambada.items (100 vs missing)",
    }
    assert "rd/seed4/downstream.json: unreadable (not JSON)" in paired["skipped"], (
        "an unreadable downstream.json is named under Skipped"
    )
    for seed, reason in reasons.items():
        assert f"- rd, seed {seed}: {reason}" in text
    assert "| rd | 0 | 0/0 | undefined |" in text and "Task accuracy" not in text
    assert "| parent | 0.1333 | 0.1400 | - | 0.1533 | 0.1600 | 0.1667 | 0.1733 |" in text, "CORE per cell"
    assert "| rd | 0.2000 | 0.2000 | 0.1600 | 0.2000 | unreadable | 0.2000 | 0.1867 |" in text
    write_downstream(out, "rd", 0, dict(hellaswag=32, lambada=20), bundle="b" * 64)
    write_downstream(out, "parent", 1, dict(hellaswag=20, lambada=10), max_per_task=50, items=50)
    paired, text = run(out)  # now seeds 0 and 1 pair, each within one evaluation, but the two differ
    rd = paired["downstream"]["arms"]["rd"]
    assert rd["seeds"] == [0, 1] and rd["core"]["deltas"] == pytest.approx([(2 / 75) / 2, 0.0]), (
        "seeds scored on other items pair, each within itself (the mean mixes them: said below)"
    )
    assert rd["mixed_evaluations"] == [
        "seed 0: bundle bbbbbbbbbbbb, 200 items, scoring code dddddddddddd, float32; "
        "seed 1: bundle bbbbbbbbbbbb, 100 items, scoring code dddddddddddd, float32"
    ]
    assert "**Mixed evaluations**" in text and "| hellaswag | multiple_choice | 50, 100 | 2 |" in text, (
        "the items of each seed are shown"
    )


@pytest.mark.parametrize(
    "change, problem",
    [
        (lambda d: d.pop("bundle_sha256"), "no bundle_sha256"),
        (lambda d: d.update(step="20"), 'step is "20", not a step'),
        (lambda d: d.update(max_per_task=0), "max_per_task is 0, not null or a positive integer"),
        (lambda d: d.update(core=float("nan")), "core is NaN, not a finite number"),
        (lambda d: d.update(tasks={}), "tasks is {}, not a dict of tasks"),
        (lambda d: d["tasks"].update(lambada=[0.2]), "tasks.lambada is [0.2], not a dict"),
        (lambda d: d["tasks"]["lambada"].update(correct=101), "tasks.lambada.correct is 101, more than its 100 items"),
        (
            lambda d: d["tasks"]["lambada"].update(accuracy=0.3),
            "tasks.lambada.accuracy is 0.3, not correct / items (0.2)",
        ),
        (
            lambda d: d["tasks"]["hellaswag"].update(
                random_baseline=25.0, centered=0.3 - 25.0
            ),  # percent, not a fraction
            "tasks.hellaswag.random_baseline is 25.0, not a fraction in [0, 1)",
        ),
        (
            lambda d: d["tasks"]["hellaswag"].update(centered=0.3),
            "tasks.hellaswag.centered is 0.3, not (accuracy - random_baseline) / (1 - random_baseline)",
        ),
        (lambda d: d.update(core=0.5), "core is 0.5, not the mean of its tasks' centered accuracies"),
        (
            lambda d: d["tasks"]["lambada"].update(bits_per_byte=-1.0),
            "tasks.lambada.bits_per_byte is -1.0, not a finite number >= 0",
        ),
        (lambda d: d.update(bits_per_byte=0.5), "bits_per_byte is 0.5, not the mean of every task's bits_per_byte"),
        (
            lambda d: d["tasks"]["lambada"].pop("bits_per_byte"),
            "bits_per_byte is 1.025, not the mean of every task's bits_per_byte",
        ),
        (lambda d: d.clear() or d.update(tasks=5), "no bundle_sha256"),
    ],
)
def test_a_malformed_downstream_json_is_a_named_problem(tmp_path, no_matplotlib, change, problem):
    out = make_grid(tmp_path, {(arm, s): 3.0 for arm in ("parent", "rd") for s in range(2)})
    for arm in ("parent", "rd"):
        for seed in range(2):
            record = write_downstream(out, arm, seed, dict(hellaswag=30, lambada=20))
    change(record)
    (out / "rd" / "seed1" / "downstream.json").write_text(json.dumps(record))
    paired, text = run(out)
    assert f"rd/seed1/downstream.json: unreadable ({problem})" in paired["skipped"], "the problem named in Skipped"
    assert paired["downstream"]["arms"]["rd"]["left_out"] == [
        dict(seed=1, reason="rd/seed1 unreadable downstream.json")
    ]
    assert paired["downstream"]["arms"]["rd"]["seeds"] == [0] and paired["arms"]["rd"]["seeds"] == [0, 1], (
        "a damaged downstream.json costs its downstream seed, never the loss's"
    )
    json.loads((out / "paired.json").read_text(), parse_constant=raise_on_constant)


def test_no_downstream_section_without_downstream_results(tmp_path, no_matplotlib):
    out = make_grid(tmp_path, LOSSES)
    (out / "rd" / "seed9").mkdir()
    (out / "rd" / "seed9" / "downstream.json").write_text("{}")  # a cell that never trained: not read
    paired, text = run(out)
    assert paired["downstream"] is None and "## Downstream" not in text and "downstream.json" not in text, (
        "no downstream.json: no section"
    )


def test_plots_take_any_folder_name(tmp_path):
    pytest.importorskip("matplotlib")
    out = make_grid(tmp_path, {("parent", 0): 3.0, ("parent", 1): 3.1})
    long = "rd_" + "x" * 245  # the folder fits the file system's 255 bytes; jsd_<arm>.png.<pid>.tmp would not
    odd = os.fsdecode(b"lat\xe9n $x$")  # not UTF-8 (a lone surrogate in Python), and $...$ is math to matplotlib
    for arm in (long, odd):
        for seed, loss in ((0, 2.9), (1, 3.05)):
            write_cell(out, arm, seed, loss)
            log = out / arm / f"seed{seed}" / "log.jsonl"  # with QK/V divergences, one of a layer named like math
            log.write_text(log.read_text().replace('"qk_v_jsd": {}', '"qk_v_jsd": {"0": 0.1, "$\\\\frac{": 0.2}'))
    paired, text = run(out, f"--cell={long}/seed1")
    assert paired["arms"][long]["deltas"] == pytest.approx([-0.1, -0.05]) and f"| {long} | 2 | 2/2 |" in text
    assert paired["arms"][odd]["deltas"] == pytest.approx([-0.1, -0.05]) and "| lat\\udce9n \\$x\\$ | 2 | 2/2 |" in text
    figures = re.findall(r"!\[.*\]\((.*)\)", text)
    assert len(figures) == 5 and all((out / name).stat().st_size > 1000 for name in figures), (
        "every plot of long and odd names written"
    )
    assert all(len(p.name) < 80 for p in out.iterdir() if p.is_file()), "file names shortened with a hash"
    assert f"### {long}: QK/V Jensen-Shannon divergence per layer over training" in text


def rated(out, arm, rate, seeds):
    """An arm's cells as train.py records an arm that sets its own learning rate: in arm_settings, not in settings."""
    for seed in seeds:
        edit(
            out,
            arm,
            seed,
            lambda r: (
                r["pairing"]["settings"].pop("learning_rate", None),
                r["pairing"].update(arm_settings=dict(learning_rate=rate)),
            ),
        )


def test_each_arms_learning_rate_is_shown_and_a_change_across_seeds_is_mixed(tmp_path, no_matplotlib):
    out = make_grid(tmp_path, LOSSES)
    paired, text = run(out)
    assert "| arm | seed 0 | seed 1 | seed 2 | seed 3 | learning rate |" in text, (
        "the learning rate is a column of the final-loss table"
    )
    assert "| parent | 3.0000 | 3.1000 | 3.0500 | 3.2000 | 0.001 |" in text, "the grid's rate"
    assert paired["learning_rates"] == {"parent": [0.001], "rd": [0.001]}, "each arm's rates as its cells trained at"
    rated(out, "rd", 0.002, range(4))
    paired, text = run(out)
    assert "| rd | 2.9700 | 3.0800 | 3.0100 | 3.1600 | 0.002 |" in text and paired["learning_rates"]["rd"] == [0.002], (
        "an arm's own rate shown where it sets one"
    )
    assert paired["arms"]["rd"]["n"] == 4 and paired["arms"]["rd"]["mixed_versions"] == [], "an arm's own rate pairs"
    rated(out, "rd", 0.003, [3])  # one seed trained at another rate (--allow_changes)
    paired, text = run(out)
    assert paired["arms"]["rd"]["n"] == 4 and "| rd | 2.9700 | 3.0800 | 3.0100 | 3.1600 | 0.002, 0.003 |" in text
    note = "arm_settings.learning_rate: seeds 0, 1, 2: null / 0.002; seed 3: null / 0.003"
    assert paired["arms"]["rd"]["mixed_versions"] == [note] and f"- rd: {note}" in text
    edit(out, "rd", 2, lambda r: r["pairing"].update(arm_settings=[0.002]))
    paired, text = run(out)
    assert "rd/seed2/result.json: unreadable (pairing.arm_settings is not a dict)" in paired["skipped"], (
        "an arm_settings of the wrong type makes the cell unreadable"
    )


# the tuning cells' final losses on seeds 1000-1002 (steps 10 of 20): parent: 3e-3 beats 1e-3 on every seed by 0.15,
# beyond its s.d. 0.05 (1e-2 diverged on a seed); rd: 1e-3, the lowest mean and the smallest rate tried
TUNE_SEEDS, TUNE_RATES = [1000, 1001, 1002], [1e-3, 3e-3, 1e-2]
TUNING = {
    ("parent", 1e-3): (3.3, 3.5, 3.4),
    ("parent", 3e-3): (3.2, 3.3, 3.25),
    ("parent", 1e-2): (None, 3.0, 3.0),
    ("rd", 1e-3): (3.1, 3.3, 3.2),
    ("rd", 3e-3): (3.2, 3.4, 3.3),
    ("rd", 1e-2): (3.3, 3.5, 3.4),
}


def tuned_grid(tmp_path, change=None):
    """A grid of the tuned protocol: each arm trained at its chosen rate, tune/ holding the tuning cells and the
    choice.json tune.py makes of them, then change(record) (or a string: the file's text)."""
    out = make_grid(tmp_path, LOSSES)
    rated(out, "parent", 3e-3, range(4))
    rated(out, "rd", 1e-3, range(4))
    tune_dir = str(out / "tune")
    for (arm, rate), losses in TUNING.items():
        for seed, loss in zip(TUNE_SEEDS, losses):
            write_tuning_cell(tune_dir, arm, rate, seed, loss, 10)
    table = {
        arm: {tune.rate_name(r): tune.tuning_row(tune_dir, arm, r, TUNE_SEEDS, 10) for r in TUNE_RATES}
        for arm in ("parent", "rd")
    }
    chosen = {arm: tune.stable_choice(list(rows.values())) for arm, rows in table.items()}
    record = dict(
        tune_seeds=TUNE_SEEDS,
        seeds=[0, 1, 2, 3],
        tune_iters=10,
        max_iters=20,
        learning_rates=TUNE_RATES,
        min_lr_ratio=0.1,
        tuning_text=dict(first_token=1000, tokens=1000),
        test_tokens=1000,
        table=table,
        choice={arm: rate for arm, (rate, _) in chosen.items()},
        reason={arm: reason for arm, (_, reason) in chosen.items()},
    )
    if callable(change):
        record = json.loads(json.dumps(record))
        change(record)
    (out / "tune" / "choice.json").write_text(change if isinstance(change, str) else json.dumps(record))
    return out


def test_report_runs_where_torch_cannot_be_imported(tmp_path):
    """A copied grid on a machine with numpy, scipy and matplotlib only: report.py writes its report (a stub torch
    package first on the path raises ImportError, as an absent one would)."""
    out = tuned_grid(tmp_path)
    stub = tmp_path / "no_torch" / "torch"
    stub.mkdir(parents=True)
    (stub / "__init__.py").write_text("raise ImportError('No module named torch (a test stub)')\n")
    env = dict(os.environ, PYTHONPATH=str(stub.parent), OMP_NUM_THREADS="1")
    cli = subprocess.run(
        [sys.executable, "report.py", str(out)],
        capture_output=True,
        text=True,
        env=env,
        cwd=os.path.dirname(os.path.abspath(report.__file__)),
    )
    assert cli.returncode == 0, cli.stderr[-2000:]
    text = (out / "report.md").read_text()
    assert "## Learning-rate tuning" in text and "## Paired against parent" in text, "the tuning read without torch"
    probe = subprocess.run([sys.executable, "-c", "import torch"], capture_output=True, text=True, env=env)
    assert probe.returncode != 0 and "a test stub" in probe.stderr, "the stub must make torch unimportable"


def test_the_tuning_section_shows_each_arms_rates_its_choice_and_cost(tmp_path, no_matplotlib):
    paired, text = run(make_grid(tmp_path, LOSSES))
    assert paired["tuning"] is None and "Learning-rate tuning" not in text, "no choice.json: no tuning section"
    (tmp_path / "t").mkdir()
    out = tuned_grid(tmp_path / "t")
    paired, text = run(out)
    assert set(paired["arms"]) == {"rd"} and not [n for n in paired["skipped"] if "tune" in n], "tune/ is no arm"
    assert text.index("## Learning-rate tuning") < text.index("Final validation loss"), (
        "the tuning section comes before the results"
    )
    assert "| rd | learning_rate 0.001 (0.003) |" in text, "each arm's tuned rate beside its reference's, at the top"
    assert (
        "on tuning seeds 1000, 1001, 1002 (never a compared seed) for 10 of the 20 steps (the whole schedule in "
        "them, min_lr 0.1 x the rate), evaluated on the validation shard's 1,000 tokens from token 1,000 (the "
        "reported validation set is its first 1,000)"
    ) in text
    assert "The paired result below compares each arm at its own chosen rate." in text
    assert "| arm | lr 0.001 | lr 0.003 | lr 0.01 |" in text, "a column per rate tried"
    assert "| parent | 3.4000 (0.1000) | **3.2500 (0.0500)** | not finished |" in text
    assert "| rd | **3.2000 (0.1000)** | 3.3000 (0.1000) | 3.4000 (0.1000) |" in text
    parent = "the lowest mean, 0.1500 below 0.001 on every seed, beyond its seeds' s.d. 0.0500"
    assert f"- parent: 0.003, {parent}" in text and "- rd: 0.001, the lowest mean" in text
    assert "- parent at 0.01: seed 1000 diverged" in text, "the rates never chosen are listed with why"
    # 17 tuning cells of 10 steps and one diverged at 5 (10 s each); the grid: 8 cells of 20 steps, 100-103 s
    assert (
        "Cost: the tuning 18 cells, 175 steps, 180 s wall; the paired grid 8 cells, 160 steps, 812 s wall (the "
        "tuning 109% of the grid's steps)."
    ) in text
    edge = "rd: the chosen rate 0.001 is the smallest tried; the best may lie beyond it (widen tune_learning_rates)"
    assert f"- {edge}" in text
    assert paired["tuning"] == dict(
        choice=dict(parent=0.003, rd=0.001),
        reason=dict(parent=parent, rd="the lowest mean"),
        tune_seeds=TUNE_SEEDS,
        tune_iters=10,
        max_iters=20,
        min_lr_ratio=0.1,
        notes=[edge],
        tuning_text=dict(first_token=1000, tokens=1000),
        test_tokens=1000,
        mean=dict(
            parent={"0.001": pytest.approx(3.4), "0.003": pytest.approx(3.25), "0.01": None},
            rd={"0.001": pytest.approx(3.2), "0.003": pytest.approx(3.3), "0.01": pytest.approx(3.4)},
        ),
        sd=dict(
            parent={"0.001": pytest.approx(0.1), "0.003": pytest.approx(0.05), "0.01": None},
            rd={"0.001": pytest.approx(0.1), "0.003": pytest.approx(0.1), "0.01": pytest.approx(0.1)},
        ),
        cost=dict(
            tuning=dict(cells=18, steps=175, wall_time_s=180.0), grid=dict(cells=8, steps=160, wall_time_s=812.0)
        ),
    )
    assert paired["learning_rates"] == {"parent": [0.003], "rd": [0.001]}, "every arm trained at its chosen rate"
    rated(out, "rd", 2e-3, [1])  # a seed not at the arm's choice
    paired, text = run(out)
    assert "rd: trained at 0.001, 0.002, tune/choice.json chose 0.001" in paired["tuning"]["notes"]
    assert "- rd: trained at 0.001, 0.002, tune/choice.json chose 0.001" in text


def edited(path, change):
    record = json.loads(path.read_text())
    change(record)
    path.write_text(json.dumps(record))


@pytest.mark.parametrize(
    "choice, problem",
    [
        ('{"tune_seeds": [1000', "not JSON"),
        ("[]", "[], not a JSON object"),
        (
            lambda c: c.pop("tuning_text"),
            "no tuning_text: a choice.json made before the tuning split, whose rates were "
            "chosen on the reported validation text itself; tune again in a new out_dir",
        ),
        (
            lambda c: c.update(tuning_text=dict(first_token=0, tokens=1000)),
            "tuning_text begins at token 0, inside the reported validation text (its first 1000 tokens)",
        ),
        (lambda c: c.pop("tune_iters"), "no tune_iters"),
        (lambda c: c.update(tune_seeds=[True]), "tune_seeds is [true], not a list of 2 or more distinct seeds"),
        (lambda c: c.update(tune_seeds=[1000]), "tune_seeds is [1000], not a list of 2 or more distinct seeds"),
        (lambda c: c.update(table=[]), "table is [], not a dict of arms"),
        (
            lambda c: c.update(tune_seeds=[1000, 1], seeds=[0, 1]),
            "tune_seeds and seeds share 1: rates chosen on compared seeds",
        ),
        (lambda c: c["table"]["rd"].update({"0.001": []}), "table.rd.0.001 is [], not a dict"),
        (
            lambda c: c["table"]["rd"].pop("0.01"),
            "table.rd holds rates 0.001, 0.003, not learning_rates 0.001, 0.003, 0.01",
        ),
        # an edited loss, mean, s.d. or field: not what the tuning cells hold
        (
            lambda c: c["table"]["rd"]["0.003"]["val_loss"].update({"1001": 3.0}),
            "table.rd.0.003.val_loss.1001 is 3.0, but its tuning cells in tune/ give 3.4 (an edited or copied choice.json)",  # noqa: E501
        ),
        (
            lambda c: c["table"]["parent"]["0.01"]["val_loss"].update({"1000": 2.0}),
            "table.parent.0.01.val_loss.1000 is 2.0, but its tuning cells in tune/ give null (an edited or copied choice.json)",  # noqa: E501
        ),
        (
            lambda c: c["table"]["rd"]["0.003"].update(mean=3.0),
            "table.rd.0.003.mean is 3.0, but its tuning cells in tune/ give 3.3000000000000003 (an edited or copied "
            "choice.json)",
        ),
        (
            lambda c: c["table"]["rd"]["0.001"].pop("learning_rate"),
            "table.rd.0.001.learning_rate is null, but its tuning cells in tune/ give 0.001 (an edited or copied choice.json)",  # noqa: E501
        ),
        (lambda c: c["choice"].update(rd=0.003), "choice.rd is 0.003, not the tuning rule's 0.001 (the lowest mean)"),
        (lambda c: c["reason"].update(rd="a hunch"), 'reason.rd is "a hunch", not the tuning rule\'s: the lowest mean'),
        (lambda c: c["choice"].update(extra=0.003), "choice.extra has no row in table"),
    ],
)
def test_a_malformed_or_edited_choice_json_is_a_named_problem(tmp_path, no_matplotlib, choice, problem):
    paired, text = run(tuned_grid(tmp_path, choice))
    assert paired["tuning"] == dict(problem=problem), "an unusable choice.json is named in paired.json"
    assert f"tune/choice.json: unreadable ({in_markdown(problem)}); the arms' rates cannot be traced" in text
    assert paired["arms"]["rd"]["n"] == 4 and "| rd | 2.9700 | 3.0800 | 3.0100 | 3.1600 | 0.001 |" in text, (
        "the paired result stands without the tuning"
    )


def test_a_choice_json_is_checked_against_its_tuning_cells(tmp_path, no_matplotlib):
    out = tuned_grid(tmp_path)
    result = out / "tune" / "rd-lr0.001" / "seed1002" / "result.json"
    edited(result, lambda r: r.update(val_loss=3.0))  # a tuning cell's loss changed after the choice
    assert run(out)[0]["tuning"] == dict(
        problem="table.rd.0.001.val_loss.1002 is 3.2, but its tuning cells in tune/ "
        "give 3.0 (an edited or copied choice.json)"
    )
    result.unlink()
    problem = run(out)[0]["tuning"]["problem"]
    assert (
        problem.startswith(
            "table.rd.0.001 cannot be checked against its tuning cells: tuning cell rd-lr0.001/seed1002 has no result ("
        )
        and "\n" not in problem
    )
    write_tuning_cell(str(out / "tune"), "rd", 1e-3, 1002, 3.2, 10, initial=3.1)  # ended above its step-0 loss
    assert run(out)[0]["tuning"]["problem"] == (
        "table.rd.0.001.initial_loss.1002 is 5.8, but its tuning cells in tune/ "
        "give 3.1 (an edited or copied choice.json)"
    )


def test_the_report_says_the_model_every_cell_shares_dense_or_moe(tmp_path, no_matplotlib):
    out = make_grid(tmp_path, LOSSES)
    paired, text = run(out)
    assert "Model shared by every cell: n_layer 2; dense MLP." in text and paired["model"] == dict(
        n_layer=2, differing=[]
    )
    moe = dict(n_experts=8, moe_top_k=2, moe_shared_experts=1, moe_expert_hidden=0, moe_bias_rate=0.01)
    for arm, seed in LOSSES:
        edit(out, arm, seed, lambda r: r["pairing"]["settings"].update(moe))
    paired, text = run(out)
    assert "MoE MLP: 8 experts, top-2, 1 shared, expert width auto, balancing bias rate 0.01." in text
    assert paired["model"] == dict(n_layer=2, **moe, differing=[])
    edit(out, "rd", 0, lambda r: r["pairing"]["settings"].update(n_experts=4))  # a cell of another MLP: named
    paired, text = run(out)
    assert "differing between cells: n_experts" in text and paired["model"]["differing"] == ["n_experts"], (
        "a setting that differs between cells is named"
    )


# --- references: every arm against each baseline, in one report ---------------------------------------

BASELINE_LOSSES = {
    (arm, s): loss + s / 10
    for s in range(3)
    for arm, loss in (("standard", 3.00), ("scaled_residual", 2.99), ("gated", 2.97), ("wide", 3.02))
}
BASELINE_ARMS = ("standard", "scaled_residual", "gated", "wide")


def test_every_arm_is_paired_against_each_baseline_present_in_one_report(tmp_path, no_matplotlib):
    out = make_grid(tmp_path, BASELINE_LOSSES, arms=BASELINE_ARMS)
    paired, text = run(out)
    assert paired["references"] == ["standard", "scaled_residual"] and paired["reference"] == "standard", (
        "both baselines are references; paired.json's reference the first"
    )
    against_standard, against_scaled = (paired["by_reference"][r]["arms"] for r in paired["references"])
    assert list(against_standard) == ["scaled_residual", "gated", "wide"], "against standard, every other arm"
    assert against_standard["gated"]["deltas"] == pytest.approx([-0.03] * 3)
    assert against_standard["scaled_residual"]["deltas"] == pytest.approx([-0.01] * 3)
    # standard - scaled_residual is the section above with its sign turned: each pair compared once
    assert list(against_scaled) == ["gated", "wide"], "against scaled_residual, every arm but standard (paired above)"
    assert against_scaled["gated"]["deltas"] == pytest.approx([-0.02] * 3)
    assert against_scaled["wide"]["deltas"] == pytest.approx([0.03] * 3) and against_scaled["wide"]["wins"] == 0
    assert paired["arms"] == against_standard, "the first reference's, where a report of one reference has them"
    assert "Reference arms: standard, scaled_residual." in text, "the references named at the top"
    first, second = text.index("## Paired against standard"), text.index("## Paired against scaled_residual")
    assert first < text.index("| gated | 3 | 3/3 | -0.0300 |") < second < text.index("| gated | 3 | 3/3 | -0.0200 |")
    assert "(standard: paired with scaled_residual above; each pair once.)" in text[second:]
    assert text.count("Power of the paired t-test") == 2 and text.count("Final validation loss") == 1, (
        "a power table per reference, one final-loss table"
    )


def test_the_references_named_are_the_ones_paired_in_their_order(tmp_path, no_matplotlib):
    out = make_grid(tmp_path, BASELINE_LOSSES, arms=BASELINE_ARMS)
    paired, text = run(out, "--reference=gated,standard")
    assert paired["references"] == ["gated", "standard"] and list(paired["by_reference"]) == ["gated", "standard"], (
        "the references in the order --reference names them"
    )
    assert list(paired["by_reference"]["gated"]["arms"]) == ["standard", "scaled_residual", "wide"]
    assert list(paired["by_reference"]["standard"]["arms"]) == ["scaled_residual", "wide"], (
        "each pair once: standard is not paired with gated again"
    )
    assert paired["by_reference"]["gated"]["arms"]["standard"]["deltas"] == pytest.approx([0.03] * 3)
    paired, text = run(out, "--reference=wide")  # one reference: the report of one, as before
    assert paired["references"] == ["wide"] and list(paired["arms"]) == ["standard", "scaled_residual", "gated"]
    assert "Reference arm: wide." in text and text.count("## Paired against") == 1
    for given, message in (
        ("--reference=gated,nope", "reference arm 'nope' not found; arms: standard, scaled_residual"),
        ("--reference=gated,gated", "--reference=gated,gated names an arm twice"),
    ):
        with pytest.raises(SystemExit, match=re.escape(message)):
            report.main([str(out), given])


def test_without_a_baseline_arm_the_first_arm_is_the_reference(tmp_path, no_matplotlib):
    paired, text = run(make_grid(tmp_path, LOSSES))
    assert paired["references"] == ["parent"] and list(paired["by_reference"]) == ["parent"], (
        "no baseline arm: the first arm is the reference"
    )
    assert paired["by_reference"]["parent"]["arms"] == paired["arms"] and "Reference arm: parent." in text


def test_downstream_is_paired_against_each_reference(tmp_path, no_matplotlib):
    out = make_grid(tmp_path, BASELINE_LOSSES, arms=BASELINE_ARMS)
    right = dict(standard=30, scaled_residual=31, gated=34, wide=29)
    for arm, seed in BASELINE_LOSSES:
        write_downstream(out, arm, seed, dict(hellaswag=right[arm] + seed, lambada=20))
    paired, text = run(out)
    for reference, arm in (("standard", "gated"), ("scaled_residual", "gated"), ("standard", "scaled_residual")):
        core = paired["by_reference"][reference]["downstream"][arm]["core"]
        assert core["deltas"] == pytest.approx([(right[arm] - right[reference]) / 75 / 2] * 3)
    assert "standard" not in paired["by_reference"]["scaled_residual"]["downstream"], (
        "each pair once in the downstream section too"
    )
    assert paired["downstream"]["arms"] == paired["by_reference"]["standard"]["downstream"], (
        "paired.json's downstream is the first reference's"
    )
    assert text.index("**Against standard**") < text.index("**Against scaled_residual**")
    assert text.count("CORE per cell") == 1, "one CORE table per report"


def test_the_delta_curves_of_every_reference_are_one_figure(tmp_path):
    pytest.importorskip("matplotlib")
    from matplotlib.image import imread

    out = make_grid(tmp_path, BASELINE_LOSSES, arms=BASELINE_ARMS)
    arms, seeds, results, unusable, logs, _ = grid_files.load_grid(str(out))
    comparisons = {
        ref: paired.compare(ref, ["standard"][:i], arms, seeds, results, unusable, logs, 0.03)
        for i, ref in enumerate(["standard", "scaled_residual"])
    }
    assert comparisons["scaled_residual"]["curves"]["gated"]["mean"] == pytest.approx([0, 0, -0.02])
    figures = plots.plots(str(out), arms, comparisons, {}, ("standard", 0))  # no logs: the delta curves alone
    assert figures == [
        (
            "Paired delta NLL(arm) - NLL(reference), a row per reference (standard, scaled_residual) "
            "during training (mean, 95% t-interval)",
            "delta_curve.png",
        )
    ]
    assert imread(out / "delta_curve.png").shape[:2] == (2 * 3.5 * 110, 3 * 5 * 110), "2 references x 3 arms"


# --- seeds and validation text; machines ------------------------------------------------------------


def with_sequences(out, arms, seeds, sequences, rng):
    """Per-sequence losses in each cell's result.json around its val_loss (their mean, as train.py records);
    returns {(arm, seed): losses}."""
    recorded = {}
    for arm in arms:
        for seed in seeds:

            def add(r):
                wiggle = rng.normal(0, 0.3, sequences)
                r["val_sequence_losses"] = (r["val_loss"] + wiggle - wiggle.mean()).tolist()
                recorded[arm, seed] = r["val_sequence_losses"]

            edit(out, arm, seed, add)
    return recorded


def test_identical_deltas_draw_no_zero_width_interval_in_the_report(tmp_path, no_matplotlib):
    # rd computes what parent does (every seed and sequence the same delta): no interval anywhere, in words
    out = make_grid(tmp_path, {(arm, s): 3.0 + s / 8 for arm in ("parent", "rd") for s in range(3)})
    for arm in ("parent", "rd"):
        for seed in range(3):
            edit(out, arm, seed, lambda r: r.update(val_sequence_losses=[r["val_loss"] - 0.25, r["val_loss"] + 0.25]))
    paired, text = run(out)
    rd = paired["arms"]["rd"]
    assert rd["text"]["identical"] and rd["text"]["ci95_t"] == [None, None] and rd["text"]["ci95"] == [None, None]
    assert "| rd | 3 | 2 | +0.0000 | undefined | undefined | undefined | - | - | - |" in text
    assert (
        "- rd: every seed and sequence has the same delta: no variance, so the intervals over seeds and text "
        "are undefined (not zero wide)" in text
    )
    assert "[+0.0000, +0.0000]" not in text, "an interval of zero width drawn from identical deltas"
    curve = rd["delta_curve"]
    assert all(low is None and high is None for low, high in zip(curve["ci95_low"], curve["ci95_high"])), (
        "every evaluation's deltas are identical: the curve's band is undefined, not zero wide"
    )


def test_the_text_interval_and_shares_are_paired_stats_on_the_sequence_deltas(tmp_path, no_matplotlib):
    out = make_grid(tmp_path, LOSSES)
    losses = with_sequences(out, ("parent", "rd"), range(4), 50, np.random.default_rng(0))
    paired, text = run(out)
    deltas = np.array([np.subtract(losses["rd", s], losses["parent", s]) for s in range(4)])
    expected = paired_stats.text_uncertainty(deltas)
    got = paired["arms"]["rd"]["text"]
    assert got["ci95"] == pytest.approx(expected["ci95"]) and got["share"] == pytest.approx(expected["share"]), (
        "the report's text interval and shares are paired_stats' on the sequence deltas"
    )
    assert got["ci95_t"] == pytest.approx(expected["ci95_t"])
    assert got["n"] == 4 and got["sequences"] == 50 and got["mean"] == pytest.approx(paired["arms"]["rd"]["mean"]), (
        "over every paired seed and sequence"
    )
    assert got["ci95_t"][1] - got["ci95_t"][0] > paired["arms"]["rd"]["ci95"][1] - paired["arms"]["rd"]["ci95"][0], (
        "the text's variance widens the interval beyond the seeds-only one"
    )
    row = next(line for line in text.splitlines() if line.startswith("| rd | 4 | 50 |"))
    assert f"[{got['ci95_t'][0]:+.4f}, {got['ci95_t'][1]:+.4f}] | [{got['ci95'][0]:+.4f}, {got['ci95'][1]:+.4f}]" in row
    assert "only 50 sequences (fewer than 100)" in text, "few sequences are said"


def test_the_text_interval_is_never_computed_on_part_of_the_seeds(tmp_path, no_matplotlib):
    out = make_grid(tmp_path, LOSSES)
    with_sequences(out, ("parent", "rd"), range(4), 120, np.random.default_rng(0))
    edit(out, "parent", 2, lambda r: r.pop("val_sequence_losses"))  # a cell of an earlier version
    edit(out, "rd", 3, lambda r: r.update(val_sequence_losses=[x + 0.01 for x in r["val_sequence_losses"]]))
    paired, text = run(out)
    why = paired["arms"]["rd"]["text"]["unavailable"]
    assert why == (
        "parent/seed2: no per-sequence validation losses (a cell of an earlier version); rd/seed3: "
        "val_sequence_losses do not average to its val_loss (an edited result?)"
    )
    assert "| rd | 4 | - | -0.0325 | " in text and "unavailable" in text and "fewer than 100" not in text, (
        "unavailable, never computed on part of the seeds"
    )


def test_identical_deltas_are_said_not_given_p_0(tmp_path, no_matplotlib):
    out = make_grid(tmp_path, {(arm, s): 3.0 + s - 0.5 * (arm == "rd") for arm in ("parent", "rd") for s in range(2)})
    paired, text = run(out)
    rd = paired["arms"]["rd"]
    assert rd["identical"] and rd["p_ttest"] is None and rd["ci95"] == [None, None], (
        "identical deltas: no p and no interval, null in paired.json"
    )
    assert "| rd | 2 | 2/2 | -0.5000 | 0.0000 | undefined | undefined | 0.5 |" in text
    assert "every seed has the same delta (-0.5000): the t-test's p and interval are undefined" in text


# a cell's record of its validation text before the per-document part (records.ValidationText.described)
OLD_TEXT = dict(layout="spread", part="test", sequences=3, tokens=48, documents=2, held_out_documents=3, bytes=40)
OLD_WORDS = "3 sequences spread evenly over the validation shard, in 2 of its 3 documents, 40 bytes of text"
READ = [dict(name="hamlet.txt", bytes=30, sequences=2), dict(name=None, bytes=10, sequences=1)]


def with_text(out, validation, arms=("parent", "rd")):
    for arm, seed in LOSSES:
        if arm in arms:
            edit(out, arm, seed, lambda r: r.update(validation=validation))


def with_data_dir(out, data_dir):
    config = json.loads((out / "config.json").read_text())
    (out / "config.json").write_text(json.dumps(dict(config, data_dir=str(data_dir))))


def test_the_validation_text_names_each_document_read_with_its_bytes_and_sequences(tmp_path, no_matplotlib):
    out = make_grid(tmp_path, LOSSES)
    with_text(out, dict(OLD_TEXT, documents_read=READ))
    _, text = run(out)
    assert f"{OLD_WORDS}: hamlet.txt (30 bytes, 2 sequences), unnamed (10 bytes, 1 sequence)." in text
    many = [dict(name=f"t{i}", bytes=1, sequences=1) for i in range(25)]
    words = grid.validation_words(dict(OLD_TEXT, documents_read=many))
    assert words.endswith(
        ": t0 (1 byte, 1 sequence), " + ", ".join(f"t{i} (1 byte, 1 sequence)" for i in range(1, 20)) + " and 5 more"
    ), "20 named, the rest counted"


def test_an_older_and_a_newer_cell_of_one_text_still_pair_and_the_text_is_said_once(tmp_path, no_matplotlib):
    out = make_grid(tmp_path, LOSSES)
    with_text(out, OLD_TEXT)
    before, _ = run(out)
    with_text(out, dict(OLD_TEXT, documents_read=READ), arms=("rd",))  # rd's cells made after the record
    paired, text = run(out)
    assert paired["arms"]["rd"]["seeds"] == [0, 1, 2, 3] and paired["arms"] == before["arms"], "every seed pairs"
    assert text.count("3 sequences spread evenly") == 1 and f"{OLD_WORDS}: hamlet.txt (30 bytes" in text, (
        "one text: the newer record's words"
    )


def test_seeds_trained_on_different_machines_are_named_and_still_pair(tmp_path, no_matplotlib):
    out = make_grid(tmp_path, LOSSES)
    machine = dict(
        cpu="Intel(R) Xeon(R) Processor",
        cpu_flags=["avx2", "fma"],
        cpu_capability="AVX512",
        gpu=None,
        torch="2.13.0+cpu",
        torch_git="x",
        cuda=None,
    )
    for arm in ("parent", "rd"):
        for seed in range(4):
            edit(out, arm, seed, lambda r: r.update(config=dict(machine=machine)))
    paired, text = run(out)
    assert paired["machines"] == dict(machines=[machine], seeds_on_several={}), "one machine: said once"
    assert "Every cell that records its machine ran on: Intel(R) Xeon(R) Processor (AVX512 kernels)" in text
    epyc = dict(machine, cpu="AMD EPYC 7B13", cpu_capability="AVX2")
    edit(out, "rd", 1, lambda r: r.update(config=dict(machine=epyc)))
    paired, text = run(out)
    assert paired["arms"]["rd"]["n"] == 4, "it pairs: rounding, not a change"
    assert paired["machines"] == dict(machines=[machine, epyc], seeds_on_several={"1": {"parent": 0, "rd": 1}}), (
        "a seed trained on two machines is named, and still pairs"
    )
    assert (
        "- seed 1: parent on machine 0, rd on machine 1" in text and "- machine 1: AMD EPYC 7B13 (AVX2 kernels)" in text
    )


def test_the_shared_model_names_every_moe_option_that_differs():
    # every MoE option of model.py, the router's learning-rate scale included
    results = {
        ("a", s): {"pairing": {"settings": dict(n_experts=8, moe_router_lr_scale=scale)}}
        for s, scale in ((0, 1.0), (1, 2.0))
    }
    assert grid.shared_model(results) == ({"n_experts": 8}, ["moe_router_lr_scale"])


def test_a_grid_beside_the_same_grid_on_another_corpus(tmp_path, no_matplotlib):
    (tmp_path / "a").mkdir(), (tmp_path / "b").mkdir()
    here = make_grid(tmp_path / "a", LOSSES)
    there = make_grid(
        tmp_path / "b", {(arm, s): loss + 0.5 + 0.02 * s * (arm == "rd") for (arm, s), loss in LOSSES.items()}
    )
    for out, data in ((here, "data/shakespeare_bytes"), (there, "data/pydoc_bytes")):
        config = json.loads((out / "config.json").read_text())
        (out / "config.json").write_text(json.dumps(dict(config, data_dir=data, train_data_sha256=data[5:])))
    with_sequences(here, ("parent", "rd"), range(4), 120, np.random.default_rng(0))
    with pytest.raises(common.DataError, match="paired.json cannot be read .*; run python report.py .* first"):
        run(here, f"--beside={there}")
    theirs, _ = run(there)
    paired, text = run(here, f"--beside={there}")
    side = paired["beside"]
    assert side["differ"] == ["data_dir", "train_data_sha256"] and side["out_dir"] == str(there), (
        "the grids differ in their data only"
    )
    assert side["rows"][0]["here"] == paired["arms"]["rd"] and side["rows"][0]["there"] == theirs["arms"]["rd"], (
        "each row here and there from the two paired.json"
    )
    here_rd, there_rd = paired["arms"]["rd"], theirs["arms"]["rd"]
    ci = here_rd["text"]["ci95_t"]
    assert (
        f"| rd | parent | {here_rd['mean']:+.4f} | 4/4 | {here_rd['p_ttest']:.3g} | [{ci[0]:+.4f}, {ci[1]:+.4f}] | "
        f"{there_rd['mean']:+.4f} | {there_rd['wins']}/4 | {there_rd['p_ttest']:.3g} | unavailable |"
    ) in text
    assert "settings differ in: data_dir, train_data_sha256; every compared arm's own settings are alike." in text
    for by_reference in ([theirs["by_reference"]], {"parent": {"arms": [1]}}):  # not what a report writes
        (there / "paired.json").write_text(json.dumps(dict(theirs, by_reference=by_reference)))
        with pytest.raises(
            common.DataError, match=r"paired.json's by_reference is not a report's .*; run python report.py"
        ):
            run(here, f"--beside={there}")


def test_beside_with_two_references_and_an_arm_of_other_settings_there(tmp_path, no_matplotlib):
    # two references (the baselines by name), and arm x Block AttnRes here but Full AttnRes there: each reference's
    # rows show that reference's numbers from the other grid, and x's other settings are named, never "nothing"
    arms = ("standard", "scaled_residual", "x")
    losses = {(arm, s): 3.0 + s / 10 - i / 50 for i, arm in enumerate(arms) for s in range(3)}
    (tmp_path / "a").mkdir(), (tmp_path / "b").mkdir()
    here = make_grid(tmp_path / "a", losses, arms=arms)
    there = make_grid(
        tmp_path / "b", {(arm, s): loss + 0.3 * (arm == "x") + 0.01 * s for (arm, s), loss in losses.items()}, arms=arms
    )
    for out, block in ((here, 2), (there, 1)):
        config = json.loads((out / "config.json").read_text())
        config["arms"]["x"] = dict(residual="attnres", attnres_block_size=block)
        (out / "config.json").write_text(json.dumps(config))
    theirs, _ = run(there)
    paired, text = run(here, f"--beside={there}")
    rows = {(row["arm"], row["reference"]): row for row in paired["beside"]["rows"]}
    assert set(rows) == {("scaled_residual", "standard"), ("x", "standard"), ("x", "scaled_residual")}, (
        "each pair once, under its reference"
    )
    for (arm, reference), row in rows.items():
        assert row["there"] == theirs["by_reference"][reference]["arms"][arm], (
            f"{arm} against {reference}: the other grid's numbers against that reference, not the first one's"
        )
    x = theirs["by_reference"]["scaled_residual"]["arms"]["x"]
    assert (
        f"| x | scaled_residual | {paired['by_reference']['scaled_residual']['arms']['x']['mean']:+.4f} | 3/3 |" in text
    )
    assert f"| {x['mean']:+.4f} | 0/3 |" in text, "the second reference's row holds its own numbers there"
    assert paired["beside"]["arm_differ"] == {"x": ["attnres_block_size (2 vs 1)"]}, (
        "the arm's differing setting with both values"
    )
    assert "differ in: nothing" not in text and "The grids' settings are alike; **arms of one name" in text
    assert (
        "**arms of one name with other settings** (their rows compare different methods or rates): x: "
        "attnres_block_size (2 vs 1)."
    ) in text
    (there / "config.json").unlink()
    _, text = run(here, f"--beside={there}")
    assert f"The grids' settings cannot be compared: {there} holds no readable config.json." in text, (
        "an unreadable config.json: the settings cannot be compared, said"
    )


def test_a_grid_of_one_arm_says_so_instead_of_an_empty_table(tmp_path, no_matplotlib):
    paired, text = run(make_grid(tmp_path, {("parent", s): 3.0 + s for s in range(2)}, arms=("parent",)))
    assert paired["references"] == ["parent"] and paired["arms"] == {}, "one arm: nothing to pair"
    assert "## Paired against parent\n\nNo other arm to pair with." in text
    assert "| arm | n | wins |" not in text and "Power of the paired t-test" not in text, "no empty tables"
    assert "| parent | 3.0000 | 4.0000 |" in text, "its losses are still shown"


ROOT = os.path.dirname(os.path.abspath(report.__file__))
ARCHIVES = sorted(
    name
    for name in os.listdir(os.path.join(ROOT, "results"))
    if os.path.isfile(os.path.join(ROOT, "results", name, "grids.tar.xz"))
)


@pytest.mark.parametrize("name", ARCHIVES)
def test_each_results_archive_regenerates_its_report_byte_for_byte(tmp_path, name):
    """results/<name>/report.md is what `python report.py out/<grid>` writes from the grids in its grids.tar.xz,
    extracted into out/ as docs/leaderboard.md says (the title names that path): a change to the report's code that
    moves a byte of a committed report must regenerate it."""
    committed = os.path.join(ROOT, "results", name, "report.md")
    with open(committed, "rb") as f:
        expected = f.read()
    grid = re.match(rb"# Paired report: (out/[^\n/]+)\n", expected)
    assert grid, f"{committed}'s title names out/<grid>: regenerate it from the archive extracted into out/"
    with tarfile.open(os.path.join(ROOT, "results", name, "grids.tar.xz")) as archive:
        archive.extractall(tmp_path / "out", filter="data")
    cli = subprocess.run(
        [sys.executable, os.path.join(ROOT, "report.py"), grid[1].decode()],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env=dict(os.environ, OMP_NUM_THREADS="1"),
    )
    assert cli.returncode == 0, cli.stderr[-2000:]
    with open(tmp_path / grid[1].decode() / "report.md", "rb") as f:
        assert f.read() == expected, f"regenerate {committed}: cd into the extracted folder's parent and run the report"


def test_importing_the_report_imports_no_torch():
    """report.py and every part of reporting/ import where torch cannot: a finder refuses torch (sys.modules['torch']
    = None would block it too, but scipy reads that entry and fails on it), and torch is not imported after."""
    parts = sorted(name[:-3] for name in os.listdir(os.path.join(ROOT, "reporting")) if name.endswith(".py"))
    code = (
        "import sys\n"
        "class Block:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name.split('.')[0] == 'torch': raise ImportError('torch blocked')\n"
        "sys.meta_path.insert(0, Block())\n"
        "import report, " + ", ".join(f"reporting.{p}" for p in parts) + "\n"
        "assert 'torch' not in sys.modules\n"
    )
    cli = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    assert cli.returncode == 0 and "cost" in parts and "paired" in parts, cli.stderr[-2000:]


def test_the_interval_decides_the_verdict_and_what_it_detects(tmp_path, no_matplotlib):
    """The verdict line's 'detects' is the smallest delta its own interval (over seeds and text) tells from 0, not the
    seeds-only t-test's; an arm with no paired seed reads 'no paired seed', never 'not detectable'."""
    out = make_grid(tmp_path, LOSSES)
    for arm, s in LOSSES:  # per-sequence losses: the text carries variance of its own
        bumps = [0.05 * ((s + i) % 3) * (arm == "rd") for i in range(4)]
        edit(out, arm, s, lambda r: r.update(val_sequence_losses=[r["val_loss"] + b - np.mean(bumps) for b in bumps]))
    paired, text = run(out)
    st = paired["arms"]["rd"]
    low, high = st["text"]["ci95_t"]
    se = (high - low) / 2 / paired_stats.stats.t.ppf(0.975, st["n"] - 1)
    expected = paired_stats.detectable_effect_in_sd(st["n"]) * np.sqrt(st["n"]) * se
    assert f"this interval detects {expected:.4f} nats" in text, text
    assert f"{expected:.4f}" != f"{st['power']['detectable_effect']:.4f}", "the text's variance widens what it detects"
    assert "That interval alone decides the verdict, not the seeds' t-test p" in text
    for s in range(4):
        (out / "rd" / f"seed{s}" / "result.json").unlink()
    _, text = run(out)
    assert "- rd against parent: **no paired seed**: 0 paired seeds: no interval" in text, text


def test_beside_labels_rows_whose_arm_differs_by_the_grids_setting(tmp_path, no_matplotlib):
    """Block AttnRes here (the grid's attnres_block_size 4), Full AttnRes there (1): each row of the arm says so."""
    arms = ("standard", "x")
    losses = {(arm, s): 3.0 + s / 10 - i / 50 for i, arm in enumerate(arms) for s in range(3)}
    (tmp_path / "a").mkdir(), (tmp_path / "b").mkdir()
    grids = [make_grid(tmp_path / d, losses, arms=arms) for d in "ab"]
    for out, block in zip(grids, (4, 1)):
        config = json.loads((out / "config.json").read_text())
        config.update(attnres_block_size=block, arms=dict(standard={}, x=dict(residual="attnres")))
        (out / "config.json").write_text(json.dumps(config))
    run(grids[1])
    paired, text = run(grids[0], f"--beside={grids[1]}")
    row = next(line for line in text.splitlines() if line.startswith("| x | standard |"))
    assert row.split(" | ")[-1].startswith("**other: x: attnres_block_size (4 vs 1)"), row  # a grid setting: both named
    assert paired["beside"]["arm_differ"]["x"] == ["attnres_block_size (4 vs 1)"]


def test_a_tuned_grid_without_its_choice_says_so_and_how_to_write_it(tmp_path, no_matplotlib):
    out = tuned_grid(tmp_path)
    config = json.loads((out / "config.json").read_text())
    (out / "config.json").write_text(json.dumps(dict(config, tune_learning_rates=[1e-3, 3e-3], tune_iters=10)))
    (out / "tune" / "choice.json").unlink()
    paired, text = run(out)
    assert "This grid was tuned (config.json: tune_learning_rates \\[0.001, 0.003\\]), but tune/choice.json is" in text
    assert "Rerun the train.py command that made the grid" in text and paired["tuning"]["problem"].startswith("missing")


def test_a_cell_without_depth_weights_says_what_cell_draws(tmp_path, no_matplotlib):
    out = make_grid(tmp_path, LOSSES)
    for s in range(4):
        path = out / "parent" / f"seed{s}" / "log.jsonl"
        records = [json.loads(line) for line in path.read_text().splitlines()]
        path.write_text("".join(json.dumps({k: v for k, v in r.items() if k != "routing"}) + "\n" for r in records))
    _, text = run(out, "--cell=parent/seed0")
    assert "--cell=parent/seed0: no depth-weight plot: it draws a cell's depth weights" in text
    assert "only the AttnRes family's schemes log; here the arms rd." in text
    _, text = run(out, "--cell=rd/seed0")
    assert "no depth-weight plot" not in text


@pytest.mark.parametrize(
    "tuning, past",
    [
        (dict(tune_learning_rates=[1e-3], tune_iters=15), " (past the tuning's budget)"),
        (dict(tune_learning_rates=[1e-3], tune_iters=0, max_iters=60), " (past the tuning's budget)"),  # 15 steps
        (dict(tune_learning_rates=[1e-3], tune_iters=0, max_iters=80), ""),  # its default budget: 20 steps
        (dict(tune_learning_rates=[], tune_iters=200), ""),  # untuned (the longer grids of `standard`)
    ],
)
def test_a_loss_spike_after_warmup_is_flagged_with_arm_seed_and_step(tmp_path, no_matplotlib, tuning, past):
    out = make_grid(tmp_path, {})
    config = json.loads((out / "config.json").read_text())
    (out / "config.json").write_text(json.dumps(dict(config, warmup_iters=10, **tuning)))
    for arm, curve in (("parent", {0: 10.8, 1000: 6.0, 2000: 5.0}), ("rd", {0: 10.8, 1000: 5.0, 2000: 5.5})):
        for s in range(2):
            write_cell(out, arm, s, curve[2000] + s / 100, curve={t: v + s / 100 for t, v in curve.items()})
    paired, text = run(out)
    assert f"- rd, seed 0: validation loss +0.500 nats between steps 10 and 20{past}\n" in text
    assert "- rd, seed 1: training loss +0.500 nats between steps 10 and 20" in text
    assert "parent, seed" not in text.split("**Loss spikes**")[1], "a falling loss is no spike"
    assert {(d["arm"], d["seed"], tuple(d["steps"])) for d in paired["spikes"]} == {
        ("rd", 0, (10, 20)),
        ("rd", 1, (10, 20)),
    }


def test_the_code_a_seed_pairs_on_is_recomputed_from_the_code_each_cell_records(tmp_path, no_matplotlib):
    """A cell recorded under an earlier NOT_COMPUTING (its stored fingerprint counted a definition since declared to
    compute nothing) pairs; a cell whose code differs in a definition that computes does not, whatever it stored."""
    out = make_grid(tmp_path, {(a, s): 3.0 - 0.1 * (a == "rd") + 0.01 * s for a in ("parent", "rd") for s in range(3)})
    code = dict(definitions={"learning_rate_at": "1" * 16, "write_report": "2" * 16, "Block": "3" * 16}, schemes={})
    for arm in ("parent", "rd"):
        for s in range(3):
            edit(out, arm, s, lambda r: r.update(code=json.loads(json.dumps(code))))
    edit(out, "parent", 1, lambda r: r["code"]["definitions"].update(write_report="0" * 16))  # as an earlier
    edit(out, "parent", 1, lambda r: r["pairing"].update(code="0"))  # NOT_COMPUTING would have recorded it
    edit(out, "parent", 2, lambda r: r["code"]["definitions"].update(learning_rate_at="0" * 16))
    paired, text = run(out)
    assert paired["arms"]["rd"]["seeds"] == [0, 1], "the earlier record pairs: only what computes counts"
    assert [d["reason"].split(" (")[0] for d in paired["arms"]["rd"]["left_out"]] == ["parent and rd differ in code"]
