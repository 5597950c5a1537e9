import base64
import json
import math
import re

import pytest

from lowprec.convert import Coverage, Kept
from lowprec.train.logs import RunLog, read_log
from lowprec.train.report import CompareReport, RecipeRuns, overall
from lowprec.train.result import RunResult
from lowprec.train.verdict import Family


def _result(recipe, val, *, losses=(3.0, 2.5, 2.2), diverged=False, skipped=(), coverage=None):
    history = tuple({"step": i + 1, "loss": loss, "val_loss": val if i == len(losses) - 1 else None, "lr": 1e-3,
                     "skipped": i + 1 in skipped, "grad_norm": 1.0, "loss_scale": None, "spike": False,
                     "recipe": recipe, "tokens_per_s": 1000.0 + i, "elapsed_s": float(i)}
                    for i, loss in enumerate(losses))
    return RunResult(recipe=recipe, history=history, tokens_per_s=1234.0, peak_memory_bytes=3 << 29,
                     diverged=diverged, conversion=f"{recipe}: 28 linears converted", coverage=coverage)


def _one(recipe, val, base=2.0, **kw):
    """The verdict on one seed of ``recipe`` against one seed of bf16 at ``base``."""
    report = CompareReport(runs=(RecipeRuns.of(_result("bf16", base)), RecipeRuns.of(_result(recipe, val, **kw))),
                           baseline="bf16", context=CONTEXT)
    return report.rows()[1]


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
def test_one_seed_verdicts_follow_the_stated_thresholds(recipe, val, expected):
    row = _one(recipe, val)
    assert row["verdict"] == expected
    assert row["noise"] != row["noise"] and row["within_noise"] is None  # one seed: noise unknown
    if math.isfinite(val):
        assert row["gap_to_baseline"] == pytest.approx((val - 2.0) / 2.0)
        assert row["reason"].endswith("noise unknown (one seed)")


def test_a_nan_anywhere_or_divergence_fails_whatever_the_gap():
    assert _one("mxfp4", 2.0, losses=(3.0, float("nan"), 2.0), skipped=(2,))["reason"] == "non-finite loss (seed 0)"
    assert _one("mxfp4", 2.0, diverged=True)["reason"] == "diverged (seed 0)"
    row = _one("fp8-current", 2.0, base=float("nan"))
    assert (row["verdict"], row["reason"]) == ("FAIL", "the baseline has no finite validation loss")


def test_final_train_loss_is_the_mean_of_the_last_ten_finite_steps():
    r = _result("bf16", 2.0, losses=tuple(float(i) for i in range(20)) + (float("nan"),), skipped=(21,))
    assert r.final_train_loss == pytest.approx(sum(range(10, 20)) / 10)
    assert r.skipped_steps == 1 and r.steps == 21 and r.has_nan


CONTEXT = {"model": {"name": "tiny", "params": 1_672_896, "config": {}},
           "data": {"source": "embedded corpus", "fingerprint": "ab" * 32},
           "train": {"steps": 3, "val_batches": 8, "batch_size": 16, "seq_len": 128, "grad_accum": 1, "lr": 2e-3,
                     "warmup_steps": 1, "min_lr_ratio": 0.1, "seed": 0, "hp_start_steps": 0, "dtype": "float32"},
           "device": "cpu", "lowprec_version": "0.1.0", "torch_version": "2.13.0", "python_version": "3.11.7"}


def _seeds(recipe, vals, family=None):
    return RecipeRuns(recipe, family or Family.of(recipe), tuple(range(len(vals))),
                      tuple(_result(recipe, v) for v in vals))


def test_report_files_are_consistent_and_self_contained(tmp_path):
    runs = (_seeds("bf16", (2.0, 2.1, 2.2)), _seeds("fp8-current", (2.12,)), _seeds("mxfp8", (2.3,)),
            _seeds("nvfp4", (float("nan"),)))
    report = CompareReport(runs=runs, baseline="bf16", context=CONTEXT)
    paths = report.write(tmp_path)
    png = paths["png"].read_bytes()
    assert png.startswith(b"\x89PNG\r\n\x1a\n")
    page = paths["html"].read_text()
    assert base64.b64encode(png).decode() in page  # the same picture, inlined
    assert not re.search(r"(src|href)=\"(?!data:)", page)  # nothing fetched from elsewhere
    assert page.count("<tr>") == 5 and "class=\"FAIL\"" in page and "class=\"PASS\"" in page
    data = json.loads(paths["json"].read_text())
    assert data["data"]["fingerprint"] == "ab" * 32
    assert data["thresholds"] == {"fp8": 0.02, "mx8": 0.02, "fp4": 0.05, "warn_factor": 2.0, "noise_z": 2.0}
    band = data["baseline_band"]
    assert band["seeds"] == [0, 1, 2] and band["val_losses"] == [2.0, 2.1, 2.2]
    assert band["mean"] == pytest.approx(2.1) and band["std"] == pytest.approx(0.1)
    by_recipe = {r["recipe"]: r for r in data["results"]}
    # one seed against three: noise = 2 * 0.1 * sqrt(1 + 1/3) / 2.1 = 11.0%, the gap (2.12 - 2.1) / 2.1 within it
    fp8 = by_recipe["fp8-current"]
    assert fp8["gap_to_baseline"] == pytest.approx(0.02 / 2.1)
    assert fp8["noise"] == pytest.approx(0.2 * math.sqrt(4 / 3) / 2.1)
    assert (fp8["verdict"], fp8["label"], fp8["within_noise"]) == ("PASS", "PASS (within noise)", True)
    assert fp8["seeds"] == [0] and fp8["family"] == "fp8" and "arXiv 2412.19437" in fp8["tolerance_source"]
    # +9.5%: beyond MXFP8's 2% but inside the noise: WARN, and said to be within noise
    mx = by_recipe["mxfp8"]
    assert (mx["verdict"], mx["within_noise"], mx["tolerance"]) == ("WARN", True, 0.02)
    assert mx["reason"] == "beyond tolerance 2% but within noise ±11%"
    assert by_recipe["nvfp4"]["final_val_loss"] is None and by_recipe["nvfp4"]["verdict"] == "FAIL"
    # against bf16's seed 0 (2.0), the run of the same seed: +6% and +15%, far outside the gap to the mean
    assert fp8["gap_same_seeds"] == pytest.approx(0.06) and mx["gap_same_seeds"] == pytest.approx(0.15)
    assert by_recipe["bf16"]["gap_same_seeds"] is None and by_recipe["nvfp4"]["gap_same_seeds"] is None
    base_runs = by_recipe["bf16"]["runs"]
    assert [r["seed"] for r in base_runs] == [0, 1, 2] and len(base_runs[2]["curve"]) == 3
    md = paths["markdown"].read_text()
    assert "| fp8-current" in md and "+0.95%" in md and "+6.00%" in md and "abab" in md and "bf16 over 3 seeds" in md
    assert "`bf16` band over 3 seeds: 2.1000 ± 0.1000 (std, 4.76% of the mean): 2.0000 (seed 0), " in md
    assert "- mxfp8: WARN (within noise): beyond tolerance 2% but within noise ±11%; same-seed gap +15.00% " \
           "(shown, not judged); tolerance 2% for MXFP8 (MXFP8 recipe (arXiv 2506.08027)" in md
    assert "arXiv 2509.25149" in md and "PASS (within noise)" in page
    assert overall(report.rows()) == "FAIL"
    # same inputs, same picture
    assert report.write(tmp_path / "again")["png"].read_bytes() == png


def test_the_baseline_s_own_failure_fails_it_and_every_recipe():
    runs = (_seeds("bf16", (2.0, float("nan"))), _seeds("mxfp8", (2.0,)))
    rows = CompareReport(runs=runs, baseline="bf16", context=CONTEXT).rows()
    assert [(r["verdict"], r["reason"]) for r in rows] == [
        ("FAIL", "non-finite loss (seed 1)"), ("FAIL", "the baseline has no finite validation loss")]


def test_the_baseline_must_be_among_the_results_and_seeds_match_runs():
    with pytest.raises(ValueError, match="baseline: expected one of the compared recipes"):
        CompareReport(runs=(RecipeRuns.of(_result("mxfp8", 2.0)),), baseline="bf16", context=CONTEXT)
    with pytest.raises(ValueError, match=r"seeds: expected one distinct seed per run of 'bf16' \(2 runs\), got \[0\]"):
        RecipeRuns("bf16", Family.FP8, (0,), (_result("bf16", 2.0), _result("bf16", 2.1)))


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


def _covered(converted, linears, converted_params, params, kept=()):
    return Coverage(converted, linears, converted_params, params, kept)


def test_a_recipe_that_converted_nothing_is_not_tested_never_pass(tmp_path):
    # the GPU's small preset: every linear kept BF16, so the recipe's runs were BF16's and it said PASS
    none = _covered(0, 57, 0, 12_681_216, ((Kept.SMALL, 56), (Kept.POLICY, 1)))
    runs = (_seeds("bf16", (2.0, 2.1, 2.2)),
            RecipeRuns("fp8-current", Family.FP8, (0,), (_result("fp8-current", 2.0, coverage=none),)))
    report = CompareReport(runs=runs, baseline="bf16", context=CONTEXT)
    row = report.rows()[1]
    assert (row["verdict"], row["label"]) == ("NOT TESTED", "NOT TESTED")
    assert row["reason"].startswith("0 of 57 linears converted (0% of linear parameters): no linear ran it, so the "
                                    "gap compares the baseline with itself; 56 kept: too small to gain")
    assert '"skip_small": false' in row["reason"] and "1 kept: the policy keeps them (--policy" in row["reason"]
    assert overall(report.rows()) == "NOT TESTED"
    paths = report.write(tmp_path)
    assert re.search(r"\| fp8-current +\| 0/57 \(0%\) +\|", paths["markdown"].read_text())
    assert 'class="NOT_TESTED">NOT TESTED<' in paths["html"].read_text()
    assert json.loads(paths["json"].read_text())["results"][1]["coverage"]["converted"] == 0


@pytest.mark.parametrize("coverage, verdict", [
    (_covered(3, 10, 49, 100), "NOT TESTED"),  # under half of the parameters
    (_covered(3, 10, 50, 100), "PASS"),  # half: tested
    (_covered(10, 10, 100, 100), "PASS"),
    (None, "PASS"),  # unknown (a result from elsewhere): judged on its losses as before
])
def test_under_half_of_the_linear_parameters_is_not_tested(coverage, verdict):
    runs = (RecipeRuns.of(_result("bf16", 2.0)),
            RecipeRuns("mxfp8", Family.MX8, (0,), (_result("mxfp8", 2.0, coverage=coverage),)))
    row = CompareReport(runs=runs, baseline="bf16", context=CONTEXT).rows()[1]
    assert row["verdict"] == verdict
    if verdict == "NOT TESTED":
        assert row["reason"].startswith("3 of 10 linears converted (49% of linear parameters): under 50% of the "
                                        "linear parameters, so the gap mostly measures the baseline")


def test_every_linear_converted_is_not_tested_while_fused_experts_ran_in_high_precision(tmp_path):
    # a mixture of experts whose 3-D expert weights lowprec cannot see into: 83% of the matrices stayed BF16
    experts = Coverage(8, 8, 17_000, 100_000, unseen=2, unseen_params=83_000)
    runs = (RecipeRuns.of(_result("bf16", 2.0)),
            RecipeRuns("fp8-current", Family.FP8, (0,), (_result("fp8-current", 2.0, coverage=experts),)))
    report = CompareReport(runs=runs, baseline="bf16", context=CONTEXT)
    row = report.rows()[1]
    assert row["verdict"] == "NOT TESTED"
    assert row["reason"].startswith("8 of 8 linears converted (17% of matrix parameters; 83% in 2 weights lowprec "
                                    "cannot see into): under 50% of the matrix parameters")
    assert row["coverage"]["unseen_params"] == 83_000
    assert re.search(r"\| fp8-current +\| 8/8 \(17%, 2 unseen\) +\|", report.write(tmp_path)["markdown"].read_text())


def test_a_failed_run_fails_even_where_nothing_was_converted():
    none = _covered(0, 4, 0, 100, ((Kept.SHAPE, 4),))
    row = _one("fp8-current", 2.0, diverged=True, coverage=none)
    assert (row["verdict"], row["reason"]) == ("FAIL", "diverged (seed 0)")


def test_the_report_opens_with_what_each_verdict_means_and_why_similar_gaps_differ(tmp_path):
    # the README's job: fp8-current WARN (within noise) at +2.9%, mxfp4 PASS at +3.4%
    runs = (_seeds("bf16", (2.0, 2.1, 2.2)), _seeds("fp8-current", (2.161,)), _seeds("mxfp4", (2.171,)))
    report = CompareReport(runs=runs, baseline="bf16", context=CONTEXT)
    md = report.write(tmp_path)["markdown"].read_text().splitlines()
    assert md[0].startswith("# lowprec compare") and md[1] == ""
    legend = md[2:7]
    assert [line.split(":")[0] for line in legend] == ["- PASS", "- WARN", "- FAIL", "- NOT TESTED",
                                                       "- Why similar gaps can get different verdicts"]
    assert "FP8/FP16 2%, MXFP8 2%, FP4/FP6 5%" in legend[0] and "within noise" in legend[0]
    assert "same-seed gap" in legend[4] and "own tolerance" in legend[4]
    rows = {r["recipe"]: r for r in report.rows()}
    assert rows["fp8-current"]["label"] == "WARN (within noise)" and rows["mxfp4"]["label"] == "PASS (within noise)"
    text = "\n".join(md)
    assert "- fp8-current: WARN (within noise): beyond tolerance 2% but within noise" in text
    assert "same-seed gap +8.05% (shown, not judged); tolerance 2% for FP8/FP16" in text
    assert "tolerance 5% for FP4/FP6" in text
