"""
grid_files.py: what a grid's folder holds and how it is read. The paths, the strict readers (one
line naming the remedy, never a traceback) beside the lenient ones (a problem is a note), the tuning
folder and its choice; and that none of it needs torch. report.py's own use of the lenient readers
is tested in test_report.py, tune.py's of the tuning folder in test_tune.py.

$ OMP_NUM_THREADS=1 .venv/bin/python -m pytest tests/test_grid_files.py -q -p no:cacheprovider
"""

import json
import os
import subprocess
import sys

import pytest

import grid_files
from common import ConfigError
from helpers import write_tuning_cell

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULT = dict(arm="std", seed=0, status="finished", val_loss=3.0, diverged_at=None, steps=10)


def test_the_paths_of_a_grid():
    assert grid_files.cell_dir("out", "std", 3) == os.path.join("out", "std", "seed3")
    assert grid_files.choice_path("out") == os.path.join("out", "tune", "choice.json")
    assert grid_files.CELL_NAME.fullmatch("seed12") and not grid_files.CELL_NAME.fullmatch("seed01"), (
        "a cell folder is seed<k> with k as written by train.py (no leading zero)"
    )


def test_the_files_a_report_reads_include_the_tuning_choice(tmp_path):
    out = tmp_path / "grid"
    (out / "std" / "seed0").mkdir(parents=True)
    (out / "std" / "seed0" / "result.json").write_text("{}")
    assert grid_files.report_inputs(str(out), [("std", 0), ("std", 1)]) == [str(out / "std" / "seed0" / "result.json")]
    (out / "tune").mkdir()
    for name in ("config.json", "tune/choice.json", "std/seed0/downstream.json"):
        (out / name).write_text("{}")
    assert sorted(grid_files.report_inputs(str(out), [("std", 0)])) == sorted(
        str(out / name)
        for name in ("std/seed0/result.json", "std/seed0/downstream.json", "config.json", "tune/choice.json")
    ), "a changed choice or downstream result dates the report"
    assert not grid_files.report_is_current(str(out), [("std", 0)])  # no report yet
    (out / "report.md").write_text("")
    for name in ("config.json", "tune/choice.json", "std/seed0/downstream.json", "std/seed0/result.json"):
        os.utime(out / name, (0, 0))
    assert grid_files.report_is_current(str(out), [("std", 0)])
    for name in ("config.json", "tune/choice.json", "std/seed0/downstream.json"):
        os.utime(out / name, None)  # now: as new as the report at least
        os.utime(out / "report.md", (1, 1))
        assert not grid_files.report_is_current(str(out), [("std", 0)]), f"a report older than {name} is current"
        os.utime(out / name, (0, 0))


@pytest.mark.parametrize(
    "text, message",
    [
        ('{"arm": "std", "se', "is unreadable or damaged"),  # truncated
        ("[1, 2]", "holds list, not a train.py record"),  # the wrong shape
    ],
)
def test_the_strict_reader_refuses_a_damaged_record_in_one_line(tmp_path, text, message):
    path = tmp_path / "result.json"
    path.write_text(text)
    with pytest.raises(ConfigError, match=message) as e:
        grid_files.read_record(str(path), grid_files.RESULT_REMEDY)
    assert "\n" not in str(e.value) and grid_files.RESULT_REMEDY in str(e.value), "one line, naming the remedy"


@pytest.mark.parametrize("change", [dict(val_loss="3.0"), dict(seed="0"), dict(status="done"), dict(val_loss=True)])
def test_a_result_field_of_the_wrong_type_is_one_line(change):
    with pytest.raises(ConfigError, match="is not a result train.py wrote") as e:
        grid_files.check_result(dict(RESULT, **change), "result.json")
    assert "\n" not in str(e.value)


def test_a_copied_record_is_not_its_folders_cell():
    grid_files.check_owner("r.json", RESULT, "std", 0)
    with pytest.raises(ConfigError, match=r"is the record of arm 'std' seed 0 \(a copied file or folder\?\)"):
        grid_files.check_owner("out/std/seed1/r.json", RESULT, "std", 1)


def test_describe_done_reads_a_finished_and_a_diverged_result(tmp_path):
    path = tmp_path / "result.json"
    path.write_text(json.dumps(RESULT))
    assert grid_files.describe_done(str(path), []) == "val_loss 3.0000"
    path.write_text(json.dumps(dict(RESULT, status="diverged", val_loss=None, diverged_at=4)))
    assert (
        grid_files.describe_done(str(path), ["lr"])
        == "diverged at step 4 (recorded with other settings: lr; not retrained)"
    )


def test_the_lenient_readers_say_why_and_never_raise(tmp_path):
    (tmp_path / "half.json").write_text('{"arm": ')
    (tmp_path / "list.json").write_text("[1]")
    (tmp_path / "folder.json").mkdir()
    assert grid_files.json_object(str(tmp_path / "half.json")) == (None, "not JSON")
    assert grid_files.json_object(str(tmp_path / "list.json")) == (None, "[1], not a JSON object")
    assert grid_files.json_object(str(tmp_path / "folder.json")) == (None, "a folder, not a file")
    assert grid_files.json_object(str(tmp_path / "none.json")) == (None, "not a regular file")
    log = tmp_path / "log.jsonl"
    log.write_text('{"step": 0, "val_loss": 5.0, "tokens": 0}\n{"step": 1, "val_loss": "x"}\n{"step": 2, "va')
    records, why = grid_files.read_log(str(log))
    assert records == [{"step": 0, "val_loss": 5.0, "tokens": 0}], "the usable lines are kept"
    assert why == "skipped line 2 (val_loss is \"x\", not a number), line 3 (not JSON)"
    assert grid_files.result_problem(dict(RESULT, wall_time_s="12")) == 'wall_time_s is "12", not a finite number'


def test_the_fingerprint_a_cell_pairs_on_is_recomputed_from_a_readable_code_record_only():
    """The report pairs on the shared-code fingerprint recomputed from the code a cell records (a definition since
    declared non-computing counts no more); a code record it cannot read keeps the stored fingerprint, never a crash."""
    code = dict(definitions={"learning_rate_at": "1" * 16, "write_report": "2" * 16, "Gated": "3" * 16})
    code["schemes"] = {"gated": ["Gated"]}
    cell = dict(RESULT, pairing=dict(code="stored"), code=code)
    shared = grid_files.pairing_record(cell)["code"]
    assert shared == grid_files.code_fingerprints(code, "gated")[0] != "stored"
    edited = dict(code, definitions=dict(code["definitions"], write_report="0" * 16, Gated="0" * 16))
    assert grid_files.pairing_record(dict(cell, code=edited))["code"] == shared, "only shared computing code counts"
    edited = dict(code, definitions=dict(code["definitions"], learning_rate_at="0" * 16))
    assert grid_files.pairing_record(dict(cell, code=edited))["code"] != shared
    for odd in (None, {"fingerprint": "f"}, dict(code, schemes={"x": 5}), dict(code, schemes={"x": [[1]]})):
        assert grid_files.pairing_record(dict(cell, code=odd)) == {"code": "stored"}, odd
    assert grid_files.result_problem(dict(RESULT, code="x")) == 'code is "x", not a dict'


def test_a_cells_result_read_leniently_is_a_reason_never_a_traceback(tmp_path):
    cell = tmp_path / "std" / "seed0"
    cell.mkdir(parents=True)
    assert grid_files.cell_result(str(cell)) == (None, None), "no result yet: nothing to say"
    for text, why in (
        ('{"arm": "std", "se', "not JSON"),
        (json.dumps(dict(RESULT, wall_time_s="12")), 'wall_time_s is "12", not a finite number'),
    ):
        (cell / "result.json").write_text(text)
        assert grid_files.cell_result(str(cell)) == (None, why)
    (cell / "result.json").write_text(json.dumps(RESULT))
    assert grid_files.cell_result(str(cell)) == (RESULT, None)


def test_load_grid_reads_arms_and_seeds_from_the_record_and_the_folders(tmp_path):
    out = tmp_path / "grid"
    (out / "std" / "seed0").mkdir(parents=True)
    (out / "std" / "seed0" / "result.json").write_text(json.dumps(RESULT))
    (out / "std" / "seed1").mkdir()
    (out / "std" / "seed1" / "result.json").write_text("[")
    (out / "config.json").write_text(json.dumps(dict(arms={"std": {}, "wide": {}}, seeds=[0, 1, 2])))
    arms, seeds, results, unusable, logs, notes = grid_files.load_grid(str(out))
    assert arms == ["std", "wide"] and seeds == [0, 1, 2]
    assert list(results) == [("std", 0)] and unusable == {("std", 1): "unreadable result.json"}
    assert notes == ["std/seed1/result.json: unreadable (not JSON)"]


def test_the_tuning_folder_its_rows_and_its_choice(tmp_path):
    out = tmp_path / "grid"
    tune_dir = str(out / grid_files.TUNE_DIR)
    for rate, losses in ((1e-3, (3.0, 3.1)), (1e-2, (2.5, 2.6))):
        for seed, loss in zip((1000, 1001), losses):
            write_tuning_cell(tune_dir, "std", rate, seed, loss, 10)
    rows = [grid_files.tuning_row(tune_dir, "std", rate, [1000, 1001], 10) for rate in (1e-3, 1e-2)]
    assert rows[1]["val_loss"] == {"1000": 2.5, "1001": 2.6} and rows[1]["initial_loss"] == {"1000": 5.8, "1001": 5.8}
    rate, reason = grid_files.stable_choice(rows)
    assert rate == 1e-2 and reason.startswith("the lowest mean, 0.5000 below 0.001 on every seed"), reason
    record = dict(
        tune_seeds=[1000, 1001],
        seeds=[0],
        tune_iters=10,
        max_iters=40,
        learning_rates=[1e-3, 1e-2],
        min_lr_ratio=0.1,
        tuning_text=dict(first_token=100, tokens=100),
        test_tokens=100,
        table={"std": {"0.001": rows[0], "0.01": rows[1]}},
        choice={"std": rate},
        reason={"std": reason},
    )
    assert grid_files.read_tuning(str(out)) == (None, None), "no choice.json: no tuning"
    with open(grid_files.choice_path(str(out)), "w") as f:
        json.dump(record, f)
    assert grid_files.read_tuning(str(out)) == (record, None)
    assert set(grid_files.tuning_results(str(out), record)) == {
        (f"std-lr{r}", s) for r in ("0.001", "0.01") for s in (1000, 1001)
    }
    with open(grid_files.choice_path(str(out)), "w") as f:
        json.dump(dict(record, choice={"std": 1e-3}), f)
    assert grid_files.read_tuning(str(out))[1].startswith("choice.std is 0.001, not the tuning rule's 0.01")
    assert grid_files.recorded_choice(tune_dir)["choice"] == {"std": 1e-3}
    with open(grid_files.choice_path(str(out)), "w") as f:
        f.write("{")
    with pytest.raises(ConfigError, match=r"choice.json is unreadable or damaged .*; delete it to write the choice"):
        grid_files.recorded_choice(tune_dir)


def test_the_same_rates_in_another_order_are_the_same_setting():
    assert grid_files.as_compared("tune_learning_rates", [3e-3, 1e-3]) == grid_files.as_compared(
        "tune_learning_rates", [1e-3, 3e-3]
    )
    assert grid_files.as_compared("seeds", [1, 0]) != grid_files.as_compared("seeds", [0, 1]), (
        "only an unordered setting compares unordered"
    )


def test_grid_files_and_report_import_without_torch():
    code = (
        "import sys, grid_files, report, paired_stats; print(sorted(m for m in ('torch', 'model', 'records', "
        "'tune') if m in sys.modules))"
    )
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True)
    assert proc.returncode == 0 and proc.stdout.strip() == "[]", proc.stdout + proc.stderr
