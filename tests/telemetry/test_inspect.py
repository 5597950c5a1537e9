"""``lowprec inspect``: the trouble ranking against hand-worked scores, an injected fault found, the
report's files, and one-line errors naming RUN_DIR."""
from __future__ import annotations

import math

import pytest
import torch.nn as nn
from click.testing import CliRunner

from lowprec import telemetry as T
from lowprec.cli import main
from lowprec.policy_file import load_policy
from lowprec.telemetry import OperandStats
from lowprec.telemetry.records import TelemetryWriter
from lowprec.telemetry.trouble import rank_layers, suggest_policy
from tests.nn.common import make_linear, randn


def _rec(layer, step, sqnr, saturation=0.0, underflow=0.0, amax=1.0):
    return OperandStats(layer, "fprop", "input", amax, 0.01, underflow, saturation, sqnr, step)


RECORDS = [_rec("a", 1, 30.0), _rec("b", 1, 28.0, underflow=0.01), _rec("c", 1, 31.0),
           _rec("a", 2, 30.0), _rec("b", 2, 20.0, saturation=0.05), _rec("c", 2, math.inf)]


def test_the_ranking_scores_as_the_note_says():
    ranked = rank_layers(RECORDS)
    # step 2's peers: median SQNR of 30, 20 (inf left out) = 25; b loses 5 dB and clips 5%: 5 + 5
    # step 1's peers: median 30, median underflow 0; b loses 2 dB and flushes 1% more: 2 + 1
    assert [(t.layer, t.score) for t in ranked] == [("b", pytest.approx(10.0)), ("a", 0.0), ("c", 0.0)]
    assert ranked[0].worst == "fprop.input @ step 2" and ranked[0].max_saturation == 0.05
    assert rank_layers([_rec("a", 1, math.nan), _rec("b", 1, 30.0)])[0].score == math.inf
    assert suggest_policy(ranked).exclude == ("b",)
    assert suggest_policy(ranked, threshold=11).exclude is None


def test_an_input_scaled_by_1e4_mid_run_is_named_with_its_operand():
    model = nn.Sequential(make_linear("fp8-delayed", 64, 64), make_linear("fp8-delayed", 64, 32, seed=3))
    records = []
    for step, fault in ((1, 1.0), (2, 1.0), (3, 1e4)):
        x = randn(16, 64, seed=step)
        with T.sample(model, step=step) as t:
            h = model[0](x.requires_grad_())
            model[1](h * fault).sum().backward()  # the fault: layer 1's input scaled up
        records += t.records
    worst = rank_layers(records)[0]
    assert (worst.layer, worst.worst) == ("1", "fprop.input @ step 3") and worst.max_saturation > 0.5


def _write(run_dir, records):
    run_dir.mkdir(parents=True, exist_ok=True)
    w = TelemetryWriter(run_dir / "telemetry.csv", None)
    w.write(records)
    w.close()


def test_inspect_writes_the_report_heatmaps_and_policy(tmp_path):
    _write(tmp_path, RECORDS)
    result = CliRunner().invoke(main, ["inspect", str(tmp_path)])
    assert result.exit_code == 0, result.output
    assert "1 in trouble" in result.output
    page = (tmp_path / "inspect.html").read_text()
    for png in ("inspect_sqnr.png", "inspect_underflow.png", "inspect_saturation.png"):
        assert (tmp_path / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png in page
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
])
def test_a_missing_or_corrupt_csv_is_one_line_naming_run_dir(tmp_path, content, expected):
    if content is not None:
        (tmp_path / "telemetry.csv").write_text(content)
    result = CliRunner().invoke(main, ["inspect", str(tmp_path)])
    assert result.exit_code == 1 and result.output.startswith(f"Error: {expected}"), result.output
    assert len(result.output.strip().splitlines()) == 1


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
