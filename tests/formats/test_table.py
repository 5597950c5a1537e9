"""The format table against hand-written spec values (OCP MX v1.0, the FP8 paper arXiv 2209.05433,
IEEE 754 for fp16/fp32) and, as a second source, ml_dtypes' and torch's finfo."""
from __future__ import annotations

import math

import ml_dtypes
import pytest
import torch

from lowprec import formats as F
from tests.formats._oracle import ML_DTYPES

# name: (bits, exp_bits, man_bits, bias, max, min_normal, min_subnormal, emax, inf, nan), by hand
SPEC = {
    "fp32": (32, 8, 23, 127, (2 - 2**-23) * 2**127, 2**-126, 2**-149, 127, True, True),
    "tf32": (19, 8, 10, 127, (2 - 2**-10) * 2**127, 2**-126, 2**-136, 127, True, True),
    "bf16": (16, 8, 7, 127, (2 - 2**-7) * 2**127, 2**-126, 2**-133, 127, True, True),
    "fp16": (16, 5, 10, 15, 65504.0, 2**-14, 2**-24, 15, True, True),
    "e4m3": (8, 4, 3, 7, 448.0, 2**-6, 2**-9, 8, False, True),
    "e5m2": (8, 5, 2, 15, 57344.0, 2**-14, 2**-16, 15, True, True),
    "e3m2": (6, 3, 2, 3, 28.0, 0.25, 0.0625, 4, False, False),
    "e2m3": (6, 2, 3, 1, 7.5, 1.0, 0.125, 2, False, False),
    "e2m1": (4, 2, 1, 1, 6.0, 1.0, 0.5, 2, False, False),
    "e8m0": (8, 8, 0, 127, 2.0**127, 2.0**-127, 2.0**-127, 127, False, True),
}


def test_table_lists_every_format():
    assert set(F.FORMATS) == set(SPEC) | {"int8", "int4"}


@pytest.mark.parametrize("name", sorted(SPEC))
def test_constants_match_the_spec(name):
    bits, eb, mb, bias, mx, mn, ms, emax, inf, nan = SPEC[name]
    f = F.get(name)
    assert (f.bits, f.exp_bits, f.man_bits, f.bias) == (bits, eb, mb, bias)
    assert (f.max, f.min_normal, f.min_subnormal, f.emax) == (mx, mn, ms, emax)
    assert (f.has_inf, f.has_nan) == (inf, nan)
    assert f.lowest == (ms if name == "e8m0" else -mx)  # e8m0 is unsigned: its least value is 2^-127
    assert f.binades == pytest.approx(math.log2(mx / ms))


@pytest.mark.parametrize("name", ["e4m3", "e5m2", "e3m2", "e2m3", "e2m1", "e8m0", "bf16", "fp16"])
def test_constants_match_ml_dtypes_finfo(name):
    fi = ml_dtypes.finfo(ML_DTYPES[name])
    f = F.get(name)
    assert f.max == float(fi.max)
    assert f.min_normal == float(fi.smallest_normal)
    assert f.min_subnormal == float(fi.smallest_subnormal)


@pytest.mark.parametrize("name", ["fp32", "bf16", "fp16", "e4m3", "e5m2"])
def test_torch_dtype_matches_torch_finfo(name):
    f = F.get(name)
    fi = torch.finfo(f.torch_dtype)
    assert (f.max, f.min_normal, f.min_subnormal) == (fi.max, fi.tiny, fi.tiny * fi.eps)
    assert f.storage_dtype == f.torch_dtype


@pytest.mark.parametrize("name, lo, hi", [("int8", -128, 127), ("int4", -8, 7)])
def test_integer_formats(name, lo, hi):
    f = F.get(name)
    assert (f.lowest, f.max, f.has_inf, f.has_nan) == (lo, hi, False, False)
    assert f.storage_dtype == (torch.int8 if name == "int8" else torch.uint8)
    table = F.decode_table(name)
    assert (table.min().item(), table.max().item()) == (lo, hi)


@pytest.mark.parametrize("alias, name", [
    ("float8_e4m3fn", "e4m3"), ("FP8_E5M2", "e5m2"), ("fp4", "e2m1"), ("float8_e8m0fnu", "e8m0"),
    ("bfloat16", "bf16"), ("half", "fp16"), ("fp6_e3m2", "e3m2"), ("E2M3", "e2m3"),
])
def test_aliases(alias, name):
    assert F.get(alias) is F.FORMATS[name]
    assert F.get(F.FORMATS[name]) is F.FORMATS[name]


def test_sub_byte_formats_store_in_uint8():
    for name in ("e3m2", "e2m3", "e2m1", "e8m0", "int4"):
        assert F.get(name).storage_dtype == torch.uint8


def test_tf32_is_stored_as_float32():
    # 19 bits do not fit a byte; tf32 values are float32 values with 13 mantissa bits zero
    assert F.get("tf32").storage_dtype == torch.float32
