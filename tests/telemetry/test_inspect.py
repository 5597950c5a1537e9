"""``lowprec inspect``: the trouble ranking against hand-worked scores, an injected fault found, the
report's files, and one-line errors naming RUN_DIR."""
from __future__ import annotations

import base64
import math
from dataclasses import replace

import pytest
import torch.nn as nn
from click.testing import CliRunner

from lowprec import formats as F
from lowprec import telemetry as T
from lowprec.cli import main
from lowprec.policy_file import load_policy
from lowprec.telemetry import OperandStats
from lowprec.telemetry.records import TelemetryWriter, read_records
from lowprec.telemetry.trouble import (
    SATURATION_FLOOR,
    SQNR_ALLOWANCE_DB,
    TROUBLE_THRESHOLD,
    UNDERFLOW_SCALE,
    floors,
    rank_layers,
    reach,
    suggest_policy,
)
from tests.nn.common import make_linear, randn

E4M3, E2M1 = F.get("e4m3"), F.get("e2m1")


def _rec(layer, step, sqnr, saturation=0.0, underflow=0.0, amax=1.0, fmt=E4M3):
    return OperandStats(layer, "fprop", "input", amax, 0.01, underflow, saturation, sqnr, step, fmt)


RECORDS = [_rec("a", 1, 30.0), _rec("b", 1, 28.0, underflow=0.2), _rec("c", 1, 31.0),
           _rec("a", 2, 30.0), _rec("b", 2, 20.0, saturation=0.1), _rec("c", 2, math.inf)]


def test_the_floors_follow_the_format_table():
    # binades reached below a block's largest value: log2(max / (min_subnormal / 2)), one past the table's range
    assert reach(E2M1) == pytest.approx(math.log2(6 / 0.25)) and reach(E4M3) == pytest.approx(math.log2(448 * 1024))
    assert reach(E4M3) == pytest.approx(E4M3.binades + 1)
    e2m1, e4m3 = floors(E2M1), floors(E4M3)
    assert e2m1.underflow == pytest.approx(UNDERFLOW_SCALE / math.sqrt(math.log2(24)))  # 0.93
    assert e4m3.underflow == pytest.approx(UNDERFLOW_SCALE / math.sqrt(math.log2(448 * 1024)))  # 0.46
    assert e2m1.saturation == e4m3.saturation == SATURATION_FLOOR
    # ideal SQNR 6.02 * man_bits + 14.5 dB, less the allowance
    assert e4m3.sqnr_db == pytest.approx(20 * math.log10(2) * 3 + 10 * math.log10(28) - SQNR_ALLOWANCE_DB)
    assert floors(None) == replace(e2m1, fmt=None)  # unknown: the most lenient


def test_the_ranking_scores_as_the_note_says():
    ranked = rank_layers(RECORDS)
    # b: saturation 0.1 over a floor of 0.05 at step 2 (2.0) beats underflow 0.2 of E4M3's 0.46 at step 1
    assert [t.layer for t in ranked] == ["b", "a", "c"]
    assert ranked[0].score == pytest.approx(0.1 / SATURATION_FLOOR) and ranked[0].worst == "fprop.input @ step 2"
    assert str(ranked[0].flag) == "saturation 0.1 (flag above 0.05)"
    ideal = floors(E4M3).sqnr_db + SQNR_ALLOWANCE_DB  # a's SQNR shortfall, as a fraction of the allowance
    assert ranked[1].score == pytest.approx((ideal - 30.0) / SQNR_ALLOWANCE_DB)
    assert ranked[2].score == pytest.approx((ideal - 31.0) / SQNR_ALLOWANCE_DB)  # its inf (exact) scores 0
    assert str(ranked[1].flag) == "SQNR 30.0 dB (flag below 2.5)"
    # the same underflow is a flag in E4M3 and healthy in E2M1, whose floor is wider
    assert rank_layers([_rec("a", 1, 30.0, underflow=0.5)])[0].score > 1
    assert rank_layers([_rec("a", 1, 16.0, underflow=0.5, fmt=E2M1)])[0].score < 1
    assert rank_layers([_rec("a", 1, math.nan), _rec("b", 1, 30.0)])[0].score == math.inf
    assert suggest_policy(ranked).exclude == ("b",)
    assert suggest_policy(ranked, threshold=2.5).exclude is None


def test_an_input_scaled_by_1e4_mid_run_is_named_with_its_operand():
    model = nn.Sequential(make_linear("fp8-delayed", 64, 64), make_linear("fp8-delayed", 64, 32, seed=3))
    records = []
    for step, fault in ((1, 1.0), (2, 1.0), (3, 1e4)):
        x = randn(16, 64, seed=step)
        with T.sample(model, step=step) as t:
            h = model[0](x.requires_grad_())
            model[1](h * fault).sum().backward()  # the fault: layer 1's input scaled up
        records += t.records
    ranked = {t.layer: t for t in rank_layers(records)}
    # the fault clips layer 1's input, and the gradient layer 0 gets back through it (1e4 times larger)
    assert (ranked["1"].worst, ranked["0"].worst) == ("fprop.input @ step 3", "dgrad.grad_output @ step 3")
    assert all(t.score >= TROUBLE_THRESHOLD and t.flag.figure == "saturation" for t in ranked.values())
    assert ranked["1"].max_saturation > 0.5
    before = rank_layers([r for r in records if r.step < 3])  # the steps before the fault: nothing flagged
    assert max(t.score for t in before) < TROUBLE_THRESHOLD


def _write(run_dir, records):
    run_dir.mkdir(parents=True, exist_ok=True)
    w = TelemetryWriter(run_dir / "telemetry.csv", None)
    w.write(records)
    w.close()


def test_inspect_writes_the_report_heatmaps_and_policy(tmp_path):
    _write(tmp_path, RECORDS)
    result = CliRunner().invoke(main, ["inspect", str(tmp_path)])
    assert result.exit_code == 0, result.output
    assert result.output.splitlines()[:2] == [f"{tmp_path / 'inspect.html'}: 3 layers, 1 flagged",
                                              "  b: fprop.input @ step 2: saturation 0.1 (flag above 0.05)"]
    page = (tmp_path / "inspect.html").read_text()
    for png in ("inspect_sqnr.png", "inspect_underflow.png", "inspect_saturation.png"):
        data = (tmp_path / png).read_bytes()
        # the page holds each image itself (it linked the files, so a page moved alone showed none)
        inlined = f'src="data:image/png;base64,{base64.b64encode(data).decode()}"'
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and inlined in page
    assert 'src="inspect_' not in page and page.count("<img ") == 3
    assert load_policy(tmp_path / "suggested_policy.json").exclude == ("b",)
    out = tmp_path / "elsewhere" / "r.html"
    assert CliRunner().invoke(main, ["inspect", str(tmp_path), "--out", str(out)]).exit_code == 0
    assert (out.parent / "r_sqnr.png").exists() and (out.parent / "suggested_policy.json").exists()


@pytest.mark.parametrize("content, expected", [
    (None, "RUN_DIR: expected a file telemetry.csv"),
    ("step,layer\n1,a\n", "RUN_DIR: expected telemetry.csv with the columns"),
    ("step,layer,gemm,operand,amax,scale,underflow,saturation,sqnr_db\n1,a,fprop,input,1.0,x,0,0,30\n",
     "RUN_DIR: expected rows of 9 fields"),
    ("step,layer,gemm,operand,amax,scale,underflow,saturation,sqnr_db\n1,a,fprop,input,1.0,1,2,0,30\n",
     "RUN_DIR: expected rows of 9 fields"),
    ("step,layer,gemm,operand,amax,scale,underflow,saturation,sqnr_db\n", "RUN_DIR: expected a telemetry.csv holding"),
    (b"step,layer\xff\xfe\n", "RUN_DIR: expected telemetry.csv as UTF-8 text (a CSV lowprec train wrote), got "),
])
def test_a_missing_or_corrupt_csv_is_one_line_naming_run_dir(tmp_path, content, expected):
    if isinstance(content, bytes):  # it was "UnicodeDecodeError: 'utf-8' codec can't decode byte 0xff ..."
        (tmp_path / "telemetry.csv").write_bytes(content)
    elif content is not None:
        (tmp_path / "telemetry.csv").write_text(content)
    result = CliRunner().invoke(main, ["inspect", str(tmp_path)])
    assert result.exit_code == 1 and result.output.startswith(f"Error: {expected}"), result.output
    assert len(result.output.strip().splitlines()) == 1


def test_the_format_travels_in_the_csv_and_older_files_read_without_it(tmp_path):
    _write(tmp_path, RECORDS)
    assert read_records(tmp_path / "telemetry.csv") == RECORDS
    old = tmp_path / "old" / "telemetry.csv"
    old.parent.mkdir()
    old.write_text("step,layer,gemm,operand,amax,scale,underflow,saturation,sqnr_db\n1,a,fprop,input,1.0,1,0.5,0,16\n")
    (record,) = read_records(old)
    assert record.fmt is None and rank_layers([record])[0].flag.floor == floors(E2M1).underflow


@pytest.mark.parametrize("settings, last_step, expected", [
    ({"telemetry_every": 0, "recipe": "nvfp4"}, 5, "the run had telemetry off (--telemetry-every 0)"),
    ({"telemetry_every": 500, "recipe": "nvfp4"}, 300, "the run ended at step 300, before its first sampled step "
                                                       "(500: --telemetry-every 500)"),
    ({"telemetry_every": 2, "recipe": "bf16"}, 5, "recipe bf16 casts nothing to low precision"),
    ({"telemetry_every": 2, "recipe": "fp8-current"}, 5, "no layer of the run was converted to fp8-current"),
    (None, 5, "the run sampled no operand, and it left no checkpoint to say why"),
])
def test_inspect_explains_a_run_without_telemetry(settings, last_step, expected, tmp_path, monkeypatch):
    import lowprec.train.run_state

    monkeypatch.setattr(lowprec.train.run_state, "saved_train_config", lambda directory: settings)
    (tmp_path / "log.csv").write_text(f"step,loss\n1,5.0\n{last_step},4.0\n")
    result = CliRunner().invoke(main, ["inspect", str(tmp_path)])
    assert result.exit_code == 0, result.output
    assert result.output == f"{tmp_path}: no telemetry.csv, nothing to inspect: {expected}" + \
        result.output[len(f"{tmp_path}: no telemetry.csv, nothing to inspect: {expected}"):]
    assert len(result.output.splitlines()) == 1 and not (tmp_path / "inspect.html").exists()


def test_sqnr_heatmap_marks_exact_casts_blank():
    from lowprec.telemetry.report import grid

    layers, steps, rows = grid(RECORDS, "sqnr_db", min)
    assert layers == ["a", "b", "c"] and steps == [1, 2]
    assert rows[1] == [28.0, 20.0] and rows[2][0] == 31.0 and math.isnan(rows[2][1])
    assert rows[0] == [30.0, 30.0]


def test_compare_links_the_inspect_report_of_each_recipe_with_telemetry(tmp_path):
    from lowprec.telemetry.report import inspect_links

    _write(tmp_path / "runs" / "fp8", RECORDS)
    (tmp_path / "runs" / "bf16").mkdir()
    runs = [(name, str(tmp_path / "runs" / name)) for name in ("bf16", "fp8")]
    links = inspect_links(tmp_path, runs)
    assert links.count("<li>") == 1 and 'href="runs/fp8/inspect.html"' in links
    assert (tmp_path / "runs" / "fp8" / "inspect.html").is_file()
    assert inspect_links(tmp_path, [("bf16", None)]) == ""
