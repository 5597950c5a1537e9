import base64
import json
import math
import re

import pytest

from lowprec.train.logs import RunLog, read_log
from lowprec.train.report import CompareReport, Thresholds, overall, verdict
from lowprec.train.result import RunResult


def _result(recipe, val, *, losses=(3.0, 2.5, 2.2), diverged=False, skipped=()):
    history = tuple({"step": i + 1, "loss": loss, "val_loss": val if i == len(losses) - 1 else None, "lr": 1e-3,
                     "skipped": i + 1 in skipped, "grad_norm": 1.0, "loss_scale": None, "spike": False,
                     "recipe": recipe, "tokens_per_s": 1000.0 + i, "elapsed_s": float(i)}
                    for i, loss in enumerate(losses))
    return RunResult(recipe=recipe, history=history, tokens_per_s=1234.0, peak_memory_bytes=3 << 29,
                     diverged=diverged, conversion=f"{recipe}: 28 linears converted")


@pytest.mark.parametrize("recipe, val, expected", [
    ("fp8-current", 2.0, "PASS"),        # equal
    ("fp8-current", 1.9, "PASS"),        # better than the baseline
    ("fp8-current", 2.039, "PASS"),      # +1.95% <= 2%
    ("mxfp8", 2.06, "WARN"),             # +3% <= 4%
    ("fp8-rowwise", 2.1, "FAIL"),        # +5% > 4%
    ("mxfp4", 2.09, "PASS"),             # +4.5% <= 5%
    ("nvfp4", 2.15, "WARN"),             # +7.5% <= 10%
    ("nvfp4", 2.25, "FAIL"),             # +12.5%
    ("fp8-current", float("nan"), "FAIL"),
])
def test_verdicts_follow_the_stated_thresholds(recipe, val, expected):
    v, gap, _ = verdict(_result(recipe, val), 2.0, Thresholds())
    assert v == expected
    if math.isfinite(val):
        assert gap == pytest.approx((val - 2.0) / 2.0)


def test_a_nan_anywhere_or_divergence_fails_whatever_the_gap():
    assert verdict(_result("mxfp4", 2.0, losses=(3.0, float("nan"), 2.0), skipped=(2,)), 2.0, Thresholds())[0] == "FAIL"
    assert verdict(_result("mxfp4", 2.0, diverged=True), 2.0, Thresholds())[:1] == ("FAIL",)
    assert verdict(_result("fp8-current", 2.0), float("nan"), Thresholds())[0] == "FAIL"


def test_final_train_loss_is_the_mean_of_the_last_ten_finite_steps():
    r = _result("bf16", 2.0, losses=tuple(float(i) for i in range(20)) + (float("nan"),), skipped=(21,))
    assert r.final_train_loss == pytest.approx(sum(range(10, 20)) / 10)
    assert r.skipped_steps == 1 and r.steps == 21 and r.has_nan


def test_thresholds_are_validated():
    with pytest.raises(ValueError, match="fp8: expected a relative gap in \\(0, 1\\)"):
        Thresholds(fp8=0)
    with pytest.raises(ValueError, match="warn_factor: expected a number >= 1"):
        Thresholds(warn_factor=0.5)


CONTEXT = {"model": {"name": "tiny", "params": 1_672_896, "config": {}},
           "data": {"source": "embedded corpus", "fingerprint": "ab" * 32},
           "train": {"steps": 3, "val_batches": 8, "batch_size": 16, "seq_len": 128, "grad_accum": 1, "lr": 2e-3,
                     "warmup_steps": 1, "min_lr_ratio": 0.1, "seed": 0, "hp_start_steps": 0, "dtype": "float32"},
           "device": "cpu", "lowprec_version": "0.1.0", "torch_version": "2.13.0", "python_version": "3.11.7"}


def test_report_files_are_consistent_and_self_contained(tmp_path):
    results = (_result("bf16", 2.0), _result("fp8-current", 2.02), _result("nvfp4", float("nan")))
    report = CompareReport(results=results, baseline="bf16", context=CONTEXT)
    paths = report.write(tmp_path)
    png = paths["png"].read_bytes()
    assert png.startswith(b"\x89PNG\r\n\x1a\n")
    page = paths["html"].read_text()
    assert base64.b64encode(png).decode() in page  # the same picture, inlined
    assert not re.search(r"(src|href)=\"(?!data:)", page)  # nothing fetched from elsewhere
    assert page.count("<tr>") == 4 and "class=\"FAIL\"" in page and "class=\"PASS\"" in page
    data = json.loads(paths["json"].read_text())
    assert data["data"]["fingerprint"] == "ab" * 32 and data["thresholds"] == {"fp8": 0.02, "fp4": 0.05,
                                                                               "warn_factor": 2.0}
    by_recipe = {r["recipe"]: r for r in data["results"]}
    assert by_recipe["fp8-current"]["gap_to_baseline"] == pytest.approx(0.01)
    assert by_recipe["nvfp4"]["final_val_loss"] is None and by_recipe["nvfp4"]["verdict"] == "FAIL"
    assert len(by_recipe["bf16"]["curve"]) == 3
    md = paths["markdown"].read_text()
    assert "| fp8-current" in md and "+1.00%" in md and "PASS: gap <= 2% for 8-bit" in md and "abab" in md
    assert overall(report.rows()) == "FAIL"
    # same inputs, same picture
    assert report.write(tmp_path / "again")["png"].read_bytes() == png


def test_the_baseline_must_be_among_the_results():
    with pytest.raises(ValueError, match="baseline: expected one of the compared recipes"):
        CompareReport(results=(_result("mxfp8", 2.0),), baseline="bf16", context=CONTEXT)


def test_csv_keeps_losses_exact_and_resume_rewrites_it(tmp_path):
    rows = [dict(_result("bf16", 2.0).history[i]) for i in range(3)]
    rows[1]["loss"] = 0.1 + 0.2  # not representable in short decimal: must still read back exactly
    log = RunLog(tmp_path, [], tensorboard=False)
    for r in rows:
        log.write(r)
    log.close()
    back = read_log(tmp_path / "log.csv")
    assert [float(r["loss"]) for r in back] == [r["loss"] for r in rows]
    assert back[0]["val_loss"] == "" and back[2]["val_loss"] == "2.0" and back[0]["skipped"] == "0"
    # a resumed run starts from the checkpoint's history: rows after it are gone
    RunLog(tmp_path, rows[:2], tensorboard=False).close()
    assert [r["step"] for r in read_log(tmp_path / "log.csv")] == ["1", "2"]


def test_tensorboard_gets_the_scalars(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    log = RunLog(tmp_path, [], tensorboard=True)
    for r in _result("bf16", 2.0).history:
        log.write(dict(r))
    log.close()
    acc = EventAccumulator(str(tmp_path / "tensorboard"))
    acc.Reload()
    assert [e.value for e in acc.Scalars("loss")] == pytest.approx([3.0, 2.5, 2.2])
    assert [e.step for e in acc.Scalars("val_loss")] == [3]
