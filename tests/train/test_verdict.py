"""Noise-aware verdicts against hand-computed cases: the pooled spread, the noise of a gap, and the
PASS / WARN / FAIL boundaries with and without a known noise."""
import math
from dataclasses import replace

import pytest

from lowprec import recipes as R
from lowprec.convert import Coverage, Kept
from lowprec.train.verdict import (
    Family,
    Level,
    SeedBand,
    Thresholds,
    Verdict,
    gap_and_noise,
    judge,
    paired_gap,
    pct,
    pooled_std,
    untested,
    worst,
)

T = Thresholds()
NAN = math.nan


def test_a_seed_band_s_mean_spread_and_extremes():
    b = SeedBand((0, 1, 2), (2.0, 2.1, 2.3))
    assert b.mean == pytest.approx(6.4 / 3)
    # sample variance: ((2 - m)^2 + (2.1 - m)^2 + (2.3 - m)^2) / 2 with m = 6.4 / 3
    m = 6.4 / 3
    assert b.std == pytest.approx(math.sqrt(((2 - m) ** 2 + (2.1 - m) ** 2 + (2.3 - m) ** 2) / 2))
    assert (b.lo, b.hi) == (2.0, 2.3)
    assert b.relative()["hi"] == pytest.approx((2.3 - m) / m)
    one = SeedBand((5,), (2.0,))
    assert one.mean == 2.0 and math.isnan(one.std)  # one seed: no spread
    broken = SeedBand((0, 1), (2.0, math.inf))
    assert not broken.finite and math.isnan(broken.mean) and math.isnan(broken.std)
    with pytest.raises(ValueError, match=r"values: expected one value per seed of \[0, 1\], got \[2.0\]"):
        SeedBand((0, 1), (2.0,))


def test_the_spread_is_pooled_about_each_band_s_own_mean():
    base = SeedBand((0, 1, 2), (1.0, 1.2, 1.1))       # squares about 1.1: 0.01 + 0.01 + 0 = 0.02, 2 dof
    rec = SeedBand((0, 1), (1.5, 1.3))                # squares about 1.4: 0.01 + 0.01 = 0.02, 1 dof
    assert pooled_std(base, rec) == pytest.approx(math.sqrt(0.04 / 3))
    assert pooled_std(base, SeedBand((0,), (9.0,))) == pytest.approx(math.sqrt(0.02 / 2))  # one seed adds no dof
    assert math.isnan(pooled_std(SeedBand((0,), (1.0,)), SeedBand((0,), (1.2,))))


def test_the_gap_and_its_noise():
    base = SeedBand((0, 1, 2), (1.0, 1.2, 1.1))
    gap, noise = gap_and_noise(SeedBand((0,), (1.21,)), base, z=2.0)
    assert gap == pytest.approx(0.11 / 1.1)
    # two standard errors of a difference of means over 1 and 3 seeds, s = sqrt(0.02 / 2) = 0.1
    assert noise == pytest.approx(2 * 0.1 * math.sqrt(1 + 1 / 3) / 1.1)
    gap, noise = gap_and_noise(SeedBand((0, 1), (1.5, 1.3)), base, z=1.0)
    assert gap == pytest.approx(0.3 / 1.1) and noise == pytest.approx(math.sqrt(0.04 / 3) * math.sqrt(5 / 6) / 1.1)
    # one seed of each: the gap is known, its noise is not
    gap, noise = gap_and_noise(SeedBand((0,), (2.1,)), SeedBand((0,), (2.0,)), z=2.0)
    assert gap == pytest.approx(0.05) and math.isnan(noise)
    # a baseline without a finite loss: no gap
    assert all(math.isnan(x) for x in gap_and_noise(SeedBand((0,), (2.0,)), SeedBand((0,), (NAN,)), 2.0))


@pytest.mark.parametrize("gap, noise, level, within, reason", [
    # noise unknown (one seed of each): the tolerance (2%) and the warn margin (2 x 2%) alone
    (0.0, NAN, "PASS", None, "within tolerance 2%; noise unknown (one seed)"),
    (0.02, NAN, "PASS", None, "within tolerance 2%; noise unknown (one seed)"),
    (0.0201, NAN, "WARN", None, "beyond tolerance 2%, within the warn margin 4%; noise unknown (one seed)"),
    (0.04, NAN, "WARN", None, "beyond tolerance 2%, within the warn margin 4%; noise unknown (one seed)"),
    (0.0401, NAN, "FAIL", None, "beyond the warn margin 4% (tolerance 2%); noise unknown (one seed)"),
    # within the noise: the runs tell the recipe from BF16 no better than two BF16 seeds apart
    (0.01, 0.015, "PASS", True, "within noise ±1.5%"),
    (-0.015, 0.015, "PASS", True, "within noise ±1.5%"),
    (-0.03, 0.01, "PASS", False, "better than the baseline by more than the noise ±1%"),
    (0.015, 0.005, "PASS", False, "within tolerance 2%, beyond the noise ±0.5%"),
    (0.025, 0.03, "WARN", True, "beyond tolerance 2% but within noise ±3%"),
    # a noise wider than the warn margin widens the WARN band to tolerance + noise (2% + 3% = 5%)
    (0.045, 0.03, "WARN", False, "beyond tolerance 2% by less than the noise ±3%"),
    (0.0499, 0.03, "WARN", False, "beyond tolerance 2% by less than the noise ±3%"),
    (0.0501, 0.03, "FAIL", False, "beyond tolerance 2% by more than the noise ±3% and beyond the warn margin 4%"),
    # a small noise leaves the warn margin in charge (4%)
    (0.03, 0.005, "WARN", False, "beyond tolerance 2% by more than the noise ±0.5%, within the warn margin 4%"),
    (0.0401, 0.005, "FAIL", False, "beyond tolerance 2% by more than the noise ±0.5% and beyond the warn margin 4%"),
])
def test_verdict_boundaries(gap, noise, level, within, reason):
    v = judge(gap, noise, 0.02, T)
    assert (v.level.value, v.within_noise, v.reason) == (level, within, reason)
    assert v.label == (f"{level} (within noise)" if within else level)


def test_a_failed_run_or_a_missing_gap_fails_whatever_the_numbers():
    assert judge(0.0, 0.01, 0.02, T, failure="diverged (seed 1)").reason == "diverged (seed 1)"
    for gap in (NAN, math.inf):
        v = judge(gap, 0.01, 0.02, T)
        assert v.level is Level.FAIL and v.reason == "no finite gap" and v.within_noise is None
    assert judge(-math.inf, NAN, 0.02, T).level is Level.FAIL


def test_the_other_knobs_move_the_boundaries():
    wide = replace(T, warn_factor=3.0)
    assert judge(0.059, NAN, 0.02, wide).level is Level.WARN and judge(0.061, NAN, 0.02, wide).level is Level.FAIL
    # noise_z scales the noise: z=1 halves the band of z=2
    base, rec = SeedBand((0, 1, 2), (1.0, 1.2, 1.1)), SeedBand((0,), (1.1,))
    assert gap_and_noise(rec, base, 1.0)[1] == pytest.approx(gap_and_noise(rec, base, 2.0)[1] / 2)


@pytest.mark.parametrize("recipe, family", [
    ("bf16", Family.FP8), ("fp16", Family.FP8), ("fp8-delayed", Family.FP8), ("fp8-current", Family.FP8),
    ("fp8-rowwise", Family.FP8), ("fp8-blockwise", Family.FP8), ("mxfp8", Family.MX8), ("mxfp4", Family.FP4),
    ("nvfp4", Family.FP4),
])
def test_every_preset_has_its_family(recipe, family):
    assert Family.of(recipe) is family and Family.of(R.get(recipe)) is family


def test_a_user_recipe_s_family_comes_from_its_narrowest_operand():
    assert Family.of(replace(R.mxfp8(), name="mine")) is Family.MX8
    assert Family.of(replace(R.fp8_current(), name="mine")) is Family.FP8


def test_tolerances_per_family_and_their_sources():
    assert [T.tolerance(f) for f in Family] == [0.02, 0.02, 0.05]
    scale = Thresholds.at_scale()
    assert [scale.tolerance(f) for f in Family] == [0.005, 0.005, 0.02]
    for family, arxiv in ((Family.FP8, "2412.19437"), (Family.MX8, "2506.08027"), (Family.FP4, "2509.25149")):
        assert f"arXiv {arxiv}" in family.source


@pytest.mark.parametrize("kwargs, message", [
    ({"fp8": 0}, r"fp8: expected a relative gap in \(0, 1\), got 0 \(int\)"),
    ({"mx8": 1.5}, r"mx8: expected a relative gap in \(0, 1\), got 1.5 \(float\)"),
    ({"fp4": True}, r"fp4: expected a relative gap in \(0, 1\), got True \(bool\)"),
    ({"warn_factor": 0.5}, r"warn_factor: expected a number >= 1, got 0.5"),
    ({"noise_z": 0}, r"noise_z: expected a positive finite number, got 0"),
    ({"noise_z": math.inf}, r"noise_z: expected a positive finite number, got inf"),
])
def test_thresholds_are_validated(kwargs, message):
    with pytest.raises(ValueError, match=message):
        Thresholds(**kwargs)


def test_the_worst_verdict_and_percentages():
    assert worst(["PASS", Level.WARN, "PASS"]) is Level.WARN and worst(["FAIL", "WARN"]) is Level.FAIL
    # not tested is never a pass: worse than a warning, short of a failure
    assert worst(["PASS", "NOT TESTED", "WARN"]) is Level.NOT_TESTED and worst(["NOT TESTED", "FAIL"]) is Level.FAIL
    assert worst(["PASS"]) is Level.PASS
    assert [pct(x) for x in (0.02, 0.046, 0.0025, 0.12345)] == ["2%", "4.6%", "0.25%", "12.35%"]


def test_the_paired_gap_compares_each_seed_with_the_baseline_s_run_of_that_seed():
    base = SeedBand((0, 1, 2), (2.0, 2.2, 2.1))
    assert paired_gap(SeedBand((0, 1), (2.02, 2.244)), base) == pytest.approx((0.01 + 0.02) / 2)
    assert math.isnan(paired_gap(SeedBand((3,), (2.0,)), base))  # the baseline has no run of seed 3
    assert math.isnan(paired_gap(SeedBand((0,), (math.nan,)), base))
    assert math.isnan(paired_gap(SeedBand((1,), (2.0,)), SeedBand((0, 1), (2.0, math.inf))))


def test_a_recipe_that_ran_on_under_half_of_the_linear_parameters_is_not_tested():
    assert untested(None) is None  # unknown: judged on the losses alone
    assert untested(Coverage(2, 4, 50, 100)) is None
    assert untested(Coverage(1, 4, 10, 1000, ((Kept.SHAPE, 3),))) == (
        "1 of 4 linears converted (1% of linear parameters): under 50% of the linear parameters, so the gap "
        "mostly measures the baseline; 3 kept: shapes the recipe's GEMMs cannot take (a --model whose widths are "
        "multiples of what the conversion report names)")
    assert untested(Coverage(0, 0, 0, 0)).startswith("0 of 0 linears converted (n/a of linear parameters): no linear")
    for kind in Kept:  # every reason a layer is kept has its hint
        assert "1 kept: " in untested(Coverage(0, 1, 0, 10, ((kind, 1),)))
    assert untested(Coverage(1, 2, 1, 10_000)).startswith("1 of 2 linears converted (<1% of linear parameters)")
    assert Verdict(Level.NOT_TESTED, 0.0, 0.1, 0.02, "").label == "NOT TESTED"  # never "(within noise)"
