"""Independent references for the format tests: ml_dtypes (and numpy) casts and bit patterns.

Nothing here calls ``lowprec.formats``; everything a test compares against comes from this file,
numpy, ml_dtypes or hand-written numbers.

[Note: ml_dtypes sub-byte types]
ml_dtypes stores float4/float6/int4 values one per byte, right-aligned: the code sits in the low
``bits`` bits. Only codes below ``2**bits`` are canonical (a stray high bit is read as the sign), so
codes are built as ``np.arange(2**bits, dtype=np.uint8).view(dtype)``. Its casts from float32 round
half to even; the ones to FP6/FP4 saturate (those formats have no inf or NaN), the others overflow
to inf or NaN.
"""
from __future__ import annotations

import ml_dtypes
import numpy as np

ML_DTYPES = {
    "e4m3": ml_dtypes.float8_e4m3fn,
    "e5m2": ml_dtypes.float8_e5m2,
    "e3m2": ml_dtypes.float6_e3m2fn,
    "e2m3": ml_dtypes.float6_e2m3fn,
    "e2m1": ml_dtypes.float4_e2m1fn,
    "e8m0": ml_dtypes.float8_e8m0fnu,
    "int8": np.int8,
    "int4": ml_dtypes.int4,
    "bf16": ml_dtypes.bfloat16,
    "fp16": np.float16,
}
SMALL = ("e4m3", "e5m2", "e3m2", "e2m3", "e2m1", "e8m0", "int8", "int4")
"""Formats of 8 bits or fewer: every code is enumerated."""
SMALL_FLOATS = ("e4m3", "e5m2", "e3m2", "e2m3", "e2m1")
BITS = {"e4m3": 8, "e5m2": 8, "e3m2": 6, "e2m3": 6, "e2m1": 4, "e8m0": 8, "int8": 8, "int4": 4,
        "bf16": 16, "fp16": 16}


def code_values(name: str) -> np.ndarray:
    """float32 value of every code of a format (bf16/fp16 too), indexed by code, per ml_dtypes."""
    codes = np.arange(2 ** BITS[name], dtype=np.uint16 if BITS[name] == 16 else np.uint8)
    with np.errstate(invalid="ignore"):  # NaN codes
        return codes.view(ML_DTYPES[name]).astype(np.float32)


def ml_round(x: np.ndarray, name: str) -> np.ndarray:
    """float32 ``x`` cast onto the format by ml_dtypes (numpy for ints: half to even, then clip)."""
    if name in ("int8", "int4"):
        lo, hi = (-128, 127) if name == "int8" else (-8, 7)
        return np.clip(np.rint(x.astype(np.float64)), lo, hi).astype(np.float32)
    with np.errstate(over="ignore"):  # overflow to inf is the behaviour under test
        return x.astype(ML_DTYPES[name]).astype(np.float32)


def ml_codes(x: np.ndarray, name: str) -> np.ndarray:
    """Bit codes of ml_dtypes' cast of float32 ``x`` (uint8, one code per byte)."""
    with np.errstate(over="ignore"):
        return x.astype(ML_DTYPES[name]).view(np.uint8)


def finite_grid(name: str) -> np.ndarray:
    """Sorted, distinct, non-negative finite values of a format, float64."""
    v = code_values(name)
    v = np.abs(v[np.isfinite(v)]).astype(np.float64)
    return np.unique(v)


def same_bits(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Elementwise: equal float32 bit patterns (so -0 != +0), or both NaN (any payload, any sign)."""
    a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
    return (a.view(np.uint32) == b.view(np.uint32)) | (np.isnan(a) & np.isnan(b))


def tf32_round(x: np.ndarray) -> np.ndarray:
    """float32 -> tf32 (10 mantissa bits) by integer round half to even on the bit pattern.

    Adding ``0xFFF + lsb`` to the 13 dropped bits carries into the kept part exactly when the dropped
    part is above half, or equal to half with an odd kept part. Overflow carries into the exponent
    and gives inf, as an IEEE format should. NaN is left as it is.
    """
    b = np.asarray(x, np.float32).view(np.uint32).astype(np.uint64)
    lsb = (b >> 13) & 1
    r = ((b + 0xFFF + lsb) & ~np.uint64(0x1FFF)).astype(np.uint32).view(np.float32)
    return np.where(np.isnan(x), x, r)


def rounding_probe(grid: np.ndarray, rng: np.random.Generator, n_random: int) -> np.ndarray:
    """float32 values that test rounding onto ``grid`` (non-negative, sorted), both signs.

    Every grid value and every midpoint between neighbours (ties), each with its float32 neighbours
    one ulp either side; the midpoint above the largest value and points beyond it; then
    log-uniform random values from below the smallest step to twice the largest value.
    """
    top, cap = grid[-1], float(np.finfo(np.float32).max)  # bf16's range is float32's: stay finite
    step_top = top - grid[-2]
    mids = (grid[:-1] + grid[1:]) / 2
    beyond = np.array([top + step_top / 2, top + step_top, top * 1.5, top * 2])
    core = np.minimum(np.concatenate([grid, mids, beyond]), cap).astype(np.float32)
    with np.errstate(over="ignore"):  # float32's largest goes up to inf: also a case to test
        up = np.nextafter(core, np.float32(np.inf))
    down = np.nextafter(core, np.float32(0))
    smallest = grid[grid > 0][0]
    lo, hi = np.log2(smallest) - 3, np.log2(top) + 1
    rand = np.minimum(np.exp2(rng.uniform(lo, hi, n_random)), cap).astype(np.float32)
    pos = np.concatenate([core, up, down, rand])
    return np.concatenate([pos, -pos]).astype(np.float32)
