"""Hand-checked edges: the top of each range, saturation both ways, the inf/NaN rules of each
format, ties to even at chosen points, and float64 inputs (rounded once, never through float32)."""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from lowprec import formats as F

INF, NAN = math.inf, math.nan


def _r(values, name, **kw):
    return F.round_to(torch.tensor(values, dtype=kw.pop("dtype", torch.float32)), name, **kw).tolist()


def _same(got, expected):
    return all((math.isnan(g) and math.isnan(e)) or (g == e and math.copysign(1, g) == math.copysign(1, e))
               for g, e in zip(got, expected, strict=True))


def test_e4m3_top_of_range():
    # 448 = 1.110b * 2^8; the next step would be 480, so 464 is the tie: to even, i.e. down to 448
    x = [448.0, 463.99997, 464.0, 464.00003, 465.0, -464.0, -465.0]
    assert _r(x, "e4m3", saturate=True) == [448.0] * 5 + [-448.0, -448.0]
    assert _same(_r(x, "e4m3", saturate=False), [448.0] * 3 + [NAN, NAN, -448.0, NAN])
    assert F.encode(torch.tensor(x), "e4m3", saturate=False).tolist() == [0x7E] * 3 + [0x7F, 0x7F, 0xFE, 0xFF]


def test_e5m2_top_of_range():
    # 57344 = 1.11b * 2^15 has an odd mantissa: the tie 61440 rounds up, to inf without saturation
    x = [57344.0, 61439.996, 61440.0, -61440.0, 1e30]
    assert _r(x, "e5m2", saturate=False) == [57344.0, 57344.0, INF, -INF, INF]
    assert _r(x, "e5m2", saturate=True) == [57344.0, 57344.0, 57344.0, -57344.0, 57344.0]


@pytest.mark.parametrize("name, top, tie", [("e3m2", 28.0, 30.0), ("e2m3", 7.5, 7.75), ("e2m1", 6.0, 7.0)])
def test_fp6_fp4_top_of_range(name, top, tie):
    below = float(np.nextafter(np.float32(tie), np.float32(0)))
    assert _r([below, -below, tie, -tie, 1e6], name, saturate=True) == [top, -top, top, -top, top]
    assert _r([below, -below], name, saturate=False) == [top, -top]
    for x in (tie, -tie, 1e6):
        with pytest.raises(ValueError, match=f"^x: expected values within .*{name} has no inf or NaN"):
            F.round_to(torch.tensor([x]), name, saturate=False)


def test_ties_go_to_even_codes():
    # each tie lies between an even code and an odd one, and goes to the even one
    assert _r([1.0625, 1.1875, 0.5 * 2**-9, 1.5 * 2**-9], "e4m3") == [1.0, 1.25, 0.0, 2**-8]
    assert _r([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0], "e2m1") == [0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0]
    assert _r([1.125, 1.375, 3.5 * 2**-16], "e5m2") == [1.0, 1.5, 4 * 2**-16]
    assert _r([1 + 2**-8, 1 + 3 * 2**-8], "bf16") == [1.0, 1 + 2**-6]


@pytest.mark.parametrize("name", ["e4m3", "e5m2", "e3m2", "e2m3", "e2m1", "bf16", "fp16", "tf32"])
def test_signed_zero_and_tiny_values_keep_their_sign(name):
    tiny = F.get(name).min_subnormal / 4  # rounds to zero
    assert _same(_r([0.0, -0.0, tiny, -tiny], name), [0.0, -0.0, 0.0, -0.0])


@pytest.mark.parametrize("name", ["fp32", "tf32", "bf16", "fp16", "e5m2"])
def test_ieee_formats_keep_inf(name):
    for saturate in (True, False):
        assert _same(_r([INF, -INF, NAN], name, saturate=saturate), [INF, -INF, NAN])


def test_e4m3_turns_inf_into_nan_with_its_sign():
    for saturate in (True, False):
        got = F.round_to(torch.tensor([INF, -INF, NAN, -NAN]), "e4m3", saturate=saturate)
        assert torch.isnan(got).all()
        assert torch.signbit(got).tolist() == [False, True, False, True]


def test_e8m0_rules():
    assert _same(_r([INF, NAN, 2.0**128], "e8m0", saturate=False), [NAN, NAN, NAN])
    assert _same(_r([INF, 3.0 * 2**126, 1.4 * 2**127], "e8m0", saturate=True), [NAN, 2.0**127, 2.0**127])
    assert _same(_r([1.5 * 2**127, 1.9 * 2**127], "e8m0", saturate=True), [2.0**127, 2.0**127])
    for bad in (0.0, -0.0, -1.0):
        with pytest.raises(ValueError, match=r"^x: expected positive values \(e8m0"):
            F.round_to(torch.tensor([1.0, bad]), "e8m0")


@pytest.mark.parametrize("name", ["e3m2", "e2m3", "e2m1", "int8", "int4"])
@pytest.mark.parametrize("bad", [INF, -INF, NAN])
def test_formats_without_nan_refuse_non_finite(name, bad):
    for saturate in (True, False):
        with pytest.raises(ValueError, match=f"^x: expected finite values \\({name} has no inf or NaN"):
            F.round_to(torch.tensor([1.0, bad]), name, saturate=saturate)
        with pytest.raises(ValueError, match="^x: expected finite values"):
            F.encode(torch.tensor([bad]), name, saturate=saturate)


@pytest.mark.parametrize("name, top, beyond", [
    ("e4m3", 448.0, 1e30), ("e5m2", 57344.0, 1e30), ("fp16", 65504.0, 1e30), ("int8", 127.0, 1e30),
    ("int4", 7.0, 1e30), ("bf16", (2 - 2**-7) * 2**127, 3.4e38), ("tf32", (2 - 2**-10) * 2**127, 3.4028e38),
])
def test_saturation_both_ways(name, top, beyond):
    lowest = F.get(name).lowest
    assert _r([beyond, -beyond, top, lowest], name, saturate=True) == [top, lowest, top, lowest]


def test_float64_inputs_are_rounded_once():
    # through float32 first, 1.0625 + 2^-40 would become the tie 1.0625 and then go to even, 1.0
    x = [1.0625 + 2**-40, 1.0625 - 2**-40, -(1.0625 + 2**-40)]
    assert _r(x, "e4m3", dtype=torch.float64) == [1.125, 1.0, -1.125]
    assert _r([1 + 2**-8 + 2**-40], "bf16", dtype=torch.float64) == [1 + 2**-7]
    # finite values beyond float32's range saturate; they do not become inf on the way
    assert _r([1e300, -1e300], "bf16", dtype=torch.float64) == [(2 - 2**-7) * 2**127, -(2 - 2**-7) * 2**127]
    assert _r([1e300], "fp32", dtype=torch.float64) == [float(np.finfo(np.float32).max)]
    assert _r([1e300], "bf16", dtype=torch.float64, saturate=False) == [INF]
    assert _r([1e-300], "e8m0", dtype=torch.float64) == [2.0**-127]  # positive, though float32 says 0
    assert F.round_to(torch.tensor([1.0], dtype=torch.float64), "e4m3").dtype == torch.float32


def test_float64_inputs_against_numpy_half():
    # numpy converts float64 to float16 directly (one rounding): an independent reference
    rng = np.random.default_rng(8)
    grid = np.arange(2**15, dtype=np.uint16).view(np.float16).astype(np.float64)
    grid = grid[np.isfinite(grid)]
    mids = (grid[:-1] + grid[1:]) / 2
    offsets = np.exp2(rng.uniform(-60, -30, mids.size)) * mids.clip(2**-24)
    x = np.concatenate([mids, mids + offsets, mids - offsets, -mids - offsets])
    got = F.round_to(torch.from_numpy(x), "fp16", saturate=False).numpy()
    with np.errstate(over="ignore"):
        ref = x.astype(np.float16).astype(np.float32)
    assert np.array_equal(got.view(np.uint32), ref.view(np.uint32))
