import json
import math
import os
import sys

import pytest

import report

DELTAS = [-0.03, -0.02, -0.04, 0.01, -0.025]


def t_cdf_df4(t):
    # closed form of Student's t CDF for 4 degrees of freedom (independent of scipy)
    x2 = t * t / (1 + t * t / 4)
    return 0.5 + 3 / 8 * (t / math.sqrt(1 + t * t / 4)) * (1 - x2 / 12)


def test_paired_statistics_against_textbook_values():
    st = report.paired_statistics(DELTAS)
    mean = -0.021
    std = math.sqrt((0.009 ** 2 + 0.001 ** 2 + 0.019 ** 2 + 0.031 ** 2 + 0.004 ** 2) / 4)
    se = std / math.sqrt(5)
    assert st["n"] == 5 and st["wins"] == 4
    assert st["mean"] == pytest.approx(mean) and st["std"] == pytest.approx(std)
    t = mean / se
    assert st["p_ttest"] == pytest.approx(2 * t_cdf_df4(t), rel=1e-9)
    assert st["ci95"][1] == pytest.approx(mean + 2.776445 * se, rel=1e-6)  # t(0.975, 4) from the tables
    assert st["ci95"][0] == pytest.approx(mean - 2.776445 * se, rel=1e-6)
    assert st["p_sign"] == pytest.approx(2 * (5 + 1) / 32)  # two-sided: P(X >= 4) + P(X <= 1), n = 5
    assert st["ppl_change"] == pytest.approx(math.exp(mean) - 1)


def test_sign_test_like_the_paper_and_ties():
    assert report.paired_statistics([-0.03] * 10)["p_sign"] == pytest.approx(2 / 1024)  # 10/10 wins
    st = report.paired_statistics([-0.01, 0.0, -0.02])  # a tie counts for neither side
    assert st["wins"] == 2 and st["p_sign"] == pytest.approx(0.5)
    single = report.paired_statistics([-0.01])
    assert single["n"] == 1 and math.isnan(single["std"]) and math.isnan(single["p_ttest"])


def make_grid(tmp_path, cells, arms=("parent", "rd")):
    out = tmp_path / "grid"
    out.mkdir()
    (out / "config.json").write_text(json.dumps({"arms": {a: {} for a in arms}, "seeds": [0, 1, 2]}))
    for (arm, seed), (loss, init_hash) in cells.items():
        cell = out / arm / f"seed{seed}"
        cell.mkdir(parents=True)
        log = [dict(step=s, tokens=s * 100, val_loss=(loss or 3.0) + 1 / (s + 1),
                    routing=dict(weights={"attn.0": [1.0], "attn_v.0": [1.0], "mlp.0": [0.4, 0.6], "out": [0.3, 0.7]},
                                 qk_v_jsd={"0": 0.01 * s} if arm == "rd" else {})) for s in (0, 10)]
        (cell / "log.jsonl").write_text("".join(json.dumps(r) + "\n" for r in log))
        if loss is not None:
            (cell / "result.json").write_text(json.dumps(dict(val_loss=loss, init_hash=init_hash, data_hash="d")))
    return out


def test_report_pairs_only_complete_seeds(tmp_path, capsys):
    cells = {("parent", 0): (3.00, "a"), ("rd", 0): (2.97, "a"),
             ("parent", 1): (3.10, "a"), ("rd", 1): (None, "a"),  # unfinished
             ("parent", 2): (3.05, "a"), ("rd", 2): (3.01, "b")}  # unpaired init
    out = make_grid(tmp_path, cells)
    report.main([str(out)])
    paired = json.load(open(out / "paired.json"))
    assert paired["reference"] == "parent" and paired["missing"] == ["rd/seed1"]
    rd = paired["arms"]["rd"]
    assert rd["seeds"] == [0, 2] and rd["deltas"] == pytest.approx([-0.03, -0.04]) and rd["wins"] == 2
    assert paired["pairing_problems"] == ["seed 2: arms differ in init - not paired"]
    text = (out / "report.md").read_text()
    assert "rd/seed1" in text and "| rd | 2 | 2/2 |" in text
    report.main([str(out), "--reference=rd"])
    assert json.load(open(out / "paired.json"))["arms"]["parent"]["deltas"] == pytest.approx([0.03, 0.04])


def test_plots_written_when_matplotlib_is_installed(tmp_path):
    pytest.importorskip("matplotlib")
    out = make_grid(tmp_path, {("parent", 0): (3.0, "a"), ("rd", 0): (2.9, "a")})
    report.main([str(out), "--cell=rd/seed0"])
    for name in ("val_loss.png", "jsd_rd.png", "routing_rd_seed0.png"):
        assert (out / name).stat().st_size > 1000
        assert f"]({name})" in (out / "report.md").read_text()


def test_tables_without_matplotlib(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import fails as if not installed
    out = make_grid(tmp_path, {("parent", 0): (3.0, "a"), ("rd", 0): (2.9, "a")})
    report.main([str(out)])
    assert "| rd | 1 | 1/1 |" in (out / "report.md").read_text()
    assert not list(out.glob("*.png"))


def test_bad_out_dir(tmp_path):
    with pytest.raises(SystemExit, match="not a directory"):
        report.main([str(tmp_path / "nope")])
