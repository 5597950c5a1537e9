"""Round-to-nearest-even onto every format against ml_dtypes, numpy and torch casts.

Each format gets >= 100k float32 inputs (see ``_oracle.rounding_probe``): every grid value, every
tie between neighbours and one float32 ulp either side of both, the values around the largest
finite, and log-uniform random values through the subnormals and past the top of the range.
ml_dtypes' casts to FP8 and bf16/fp16 overflow instead of saturating, so they are compared with
``saturate=False`` directly and with ``saturate=True`` after clipping the input to the range.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

from lowprec import formats as F
from tests.formats._oracle import code_values, finite_grid, ml_codes, ml_round, rounding_probe, same_bits, tf32_round

N_RANDOM = 100_000
SPECIALS = np.array([0.0, -0.0, np.inf, -np.inf, np.nan], np.float32)


def _probe(name: str, n_random: int = N_RANDOM) -> np.ndarray:
    return rounding_probe(finite_grid(name), np.random.default_rng(len(name) * 7 + n_random), n_random)


def _round(x: np.ndarray, name: str, saturate: bool) -> np.ndarray:
    return F.round_to(torch.from_numpy(x), name, saturate=saturate).numpy()


def _clip_finite(x: np.ndarray, name: str) -> np.ndarray:
    f = F.get(name)
    return np.where(np.isfinite(x), np.clip(x, f.lowest, f.max), x).astype(np.float32)


def _assert_same(got: np.ndarray, ref: np.ndarray, x: np.ndarray) -> None:
    bad = ~same_bits(got, ref)
    assert not bad.any(), f"{bad.sum()} mismatches, e.g. x={x[bad][:5]} got={got[bad][:5]} ref={ref[bad][:5]}"


@pytest.mark.parametrize("name", ["e4m3", "e5m2"])
def test_fp8_matches_ml_dtypes(name):
    x = np.concatenate([_probe(name), SPECIALS])
    assert x.size > 100_000
    _assert_same(_round(x, name, saturate=False), ml_round(x, name), x)
    _assert_same(_round(x, name, saturate=True), ml_round(_clip_finite(x, name), name), x)
    got = F.encode(torch.from_numpy(x), name, saturate=False).numpy()
    ref = ml_codes(x, name)
    finite = ~np.isnan(code_values(name)[ref])
    assert np.array_equal(got[finite], ref[finite])  # every non-NaN code bit for bit, -0 included
    assert np.isnan(code_values(name)[got[~finite]]).all()


@pytest.mark.parametrize("name", ["e3m2", "e2m3", "e2m1"])
def test_fp6_fp4_match_ml_dtypes(name):
    f = F.get(name)
    x = _probe(name)
    assert x.size > 100_000
    ref = ml_round(x, name)  # ml_dtypes saturates FP6/FP4 itself: they have no inf or NaN
    _assert_same(_round(x, name, saturate=True), ref, x)
    _assert_same(_round(x, name, saturate=True), ml_round(_clip_finite(x, name), name), x)
    grid = finite_grid(name)
    # the largest finite has an odd mantissa in all three, so its upper tie rounds up and overflows
    tie_above = f.max + (grid[-1] - grid[-2]) / 2
    fits = np.abs(x) < tie_above
    _assert_same(_round(x[fits], name, saturate=False), ref[fits], x[fits])
    got = F.encode(torch.from_numpy(x), name).numpy()
    assert np.array_equal(got, ml_codes(x, name))
    with pytest.raises(ValueError, match="^x: expected values within"):
        F.round_to(torch.from_numpy(x), name, saturate=False)


def test_e8m0_matches_ml_dtypes():
    x = _probe("e8m0")
    # e8m0 has no sign and no zero. Below 2^-126 (float32's own subnormals) ml_dtypes reads the
    # float32 exponent field and rounds everything above 2^-127 up to 2^-126: checked by hand below.
    x = x[x >= 2.0**-126]
    assert x.size > 100_000 // 2
    x = np.concatenate([x, np.float32([np.inf, np.nan])])
    _assert_same(_round(x, "e8m0", saturate=False), ml_round(x, "e8m0"), x)
    _assert_same(_round(x, "e8m0", saturate=True), ml_round(_clip_finite(x, "e8m0"), "e8m0"), x)
    assert np.array_equal(F.encode(torch.from_numpy(x), "e8m0", saturate=False).numpy(), ml_codes(x, "e8m0"))


def test_e8m0_below_float32_normals():
    tiny, ulp = 2.0**-127, 2.0**-149
    x = torch.tensor([ulp, 2.0**-128, tiny, tiny + ulp, 1.5 * tiny - ulp, 1.5 * tiny, 2 * tiny - ulp])
    # nearest power of two, no zero to flush to; the tie 1.5 * 2^-127 goes up as at every binade
    assert F.round_to(x, "e8m0").tolist() == [tiny] * 5 + [2 * tiny] * 2
    assert F.encode(x, "e8m0").tolist() == [0] * 5 + [1] * 2


@pytest.mark.parametrize("name", ["int8", "int4"])
def test_integers_round_half_to_even_and_saturate(name):
    f = F.get(name)
    rng = np.random.default_rng(3)
    ints = np.arange(f.lowest - 3, f.max + 4, dtype=np.float32)
    x = np.concatenate([ints, ints + 0.5, np.nextafter(ints + 0.5, np.float32(np.inf)),
                        np.nextafter(ints + 0.5, np.float32(-np.inf)),
                        rng.uniform(2 * f.lowest, 2 * f.max, N_RANDOM).astype(np.float32)]).astype(np.float32)
    _assert_same(_round(x, name, saturate=True), ml_round(x, name), x)
    assert F.round_to(torch.tensor([2.5, 3.5, -2.5, -0.5]), name).tolist() == [2.0, 4.0, -2.0, -0.0]
    fits = (x >= f.lowest - 0.5) & (x < f.max + 0.5)  # -128.5 ties to -128 (even); 127.5 to 128
    _assert_same(_round(x[fits], name, saturate=False), ml_round(x[fits], name), x[fits])
    codes = F.encode(torch.from_numpy(x), name).numpy()
    two_complement = ml_round(x, name).astype(np.int64) & (2 ** f.bits - 1)
    assert np.array_equal(codes, two_complement)


@pytest.mark.parametrize("name, torch_dtype, np_dtype", [("bf16", torch.bfloat16, None),
                                                         ("fp16", torch.float16, np.float16)])
def test_16_bit_formats_match_torch_numpy_and_ml_dtypes(name, torch_dtype, np_dtype):
    x = np.concatenate([_probe(name, n_random=20_000), SPECIALS])
    got = _round(x, name, saturate=False)
    _assert_same(got, ml_round(x, name), x)
    _assert_same(got, torch.from_numpy(x).to(torch_dtype).float().numpy(), x)
    if np_dtype is not None:
        with np.errstate(over="ignore"):
            _assert_same(got, x.astype(np_dtype).astype(np.float32), x)
    _assert_same(_round(x, name, saturate=True), ml_round(_clip_finite(x, name), name), x)


def test_tf32_matches_integer_rounding_of_the_bit_pattern():
    rng = np.random.default_rng(5)
    top = rng.integers(0, 2**19, 40_000, dtype=np.uint64) << np.uint64(13)
    ties = (top | np.uint64(0x1000)).astype(np.uint32)  # exactly half a tf32 step above a tf32 value
    bits = np.concatenate([ties, ties + 1, ties - 1, rng.integers(0, 2**32, 40_000, dtype=np.uint64).astype(np.uint32)])
    x = np.concatenate([bits.view(np.float32), SPECIALS])
    x = x[~np.isnan(x) | np.isin(x.view(np.uint32), SPECIALS.view(np.uint32))]
    _assert_same(_round(x, "tf32", saturate=False), tf32_round(x), x)
    _assert_same(_round(x, "tf32", saturate=True), tf32_round(_clip_finite(x, "tf32")), x)


def test_fp32_is_the_identity_on_float32():
    rng = np.random.default_rng(6)
    x = rng.integers(0, 2**32, 100_000, dtype=np.uint64).astype(np.uint32).view(np.float32)
    x = np.concatenate([x, np.float32([2.0**-149, -(2.0**-149), 3.4028235e38])])
    _assert_same(_round(x, "fp32", saturate=False), x, x)


@pytest.mark.parametrize("name", ["e4m3", "e5m2", "e3m2", "e2m3", "e2m1", "bf16", "fp16"])
def test_half_precision_inputs_round_like_float32(name):
    x32 = np.random.default_rng(9).choice(_probe(name, n_random=2_000), 20_000)
    for dtype in (torch.bfloat16, torch.float16):
        xd = torch.from_numpy(x32).to(dtype)
        xd = xd[torch.isfinite(xd)]
        got = F.round_to(xd, name)
        assert same_bits(got.numpy(), F.round_to(xd.float(), name).numpy()).all()
