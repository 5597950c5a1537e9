"""Every bit code of every small format (and of bf16/fp16/tf32) decoded and re-encoded, against
ml_dtypes' reading of the same bit pattern."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from lowprec import formats as F
from tests.formats._oracle import BITS, SMALL, code_values, ml_codes, same_bits, tf32_round


@pytest.mark.parametrize("name", SMALL)
def test_decode_every_code_matches_ml_dtypes(name):
    n = 2 ** BITS[name]
    ref = code_values(name)
    got = F.decode(torch.arange(n, dtype=torch.uint8), name).numpy()
    assert got.dtype == np.float32
    assert same_bits(got, ref).all(), np.flatnonzero(~same_bits(got, ref))
    assert np.array_equal(F.decode_table(name).numpy().view(np.uint32), got.view(np.uint32))


@pytest.mark.parametrize("name", SMALL)
def test_encode_every_value_gives_its_code_back(name):
    codes = np.arange(2 ** BITS[name], dtype=np.uint8)
    values = code_values(name)
    keep = ~np.isnan(values)
    got = F.encode(torch.from_numpy(values[keep]), name).numpy()
    assert got.dtype == np.uint8
    assert np.array_equal(got, codes[keep]), np.flatnonzero(got != codes[keep])  # -0 included


@pytest.mark.parametrize("name", ["e4m3", "e5m2", "e8m0"])
def test_nan_codes_decode_to_nan(name):
    values = code_values(name)
    nan_codes = np.flatnonzero(np.isnan(values))
    expected = {"e4m3": [0x7F, 0xFF], "e8m0": [0xFF],  # FN: only the all-ones body
                "e5m2": [0x7D, 0x7E, 0x7F, 0xFD, 0xFE, 0xFF]}[name]  # IEEE: exponent 11111, mantissa != 0
    assert nan_codes.tolist() == expected
    got = F.decode(torch.tensor(expected, dtype=torch.uint8), name)
    assert torch.isnan(got).all()


@pytest.mark.parametrize("name", ["e3m2", "e2m3", "e2m1", "int8", "int4"])
def test_formats_without_nan_have_only_finite_codes(name):
    assert torch.isfinite(F.decode_table(name)).all()


def test_hand_decoded_codes():
    # one by one from the bit fields: S EEEE MMM etc.
    cases = [("e4m3", 0x7E, 448.0), ("e4m3", 0x01, 2**-9), ("e4m3", 0x08, 2**-6), ("e4m3", 0xB8, -1.0),
             ("e5m2", 0x7B, 57344.0), ("e5m2", 0x7C, np.inf), ("e5m2", 0xFC, -np.inf), ("e5m2", 0x01, 2**-16),
             ("e3m2", 0x1F, 28.0), ("e3m2", 0x01, 0.0625), ("e2m3", 0x1F, 7.5), ("e2m3", 0x01, 0.125),
             ("e2m1", 0x7, 6.0), ("e2m1", 0x1, 0.5), ("e2m1", 0xF, -6.0), ("e2m1", 0x8, -0.0),
             ("e8m0", 0x00, 2.0**-127), ("e8m0", 0x7F, 1.0), ("e8m0", 0xFE, 2.0**127),
             ("int4", 0x8, -8.0), ("int4", 0xF, -1.0), ("int8", 0x80, -128.0), ("int8", 0x7F, 127.0)]
    for name, code, value in cases:
        got = F.decode(torch.tensor([code], dtype=torch.uint8), name)
        assert same_bits(got.numpy(), np.float32(value)).all(), (name, code, got)


@pytest.mark.parametrize("name", ["e4m3", "e5m2", "int8"])
def test_decode_accepts_the_formats_own_dtype(name):
    codes = torch.arange(256, dtype=torch.uint8)
    typed = codes.view(F.get(name).storage_dtype)
    assert same_bits(F.decode(typed, name).numpy(), F.decode(codes, name).numpy()).all()


@pytest.mark.parametrize("name", ["e4m3", "e5m2"])
def test_nan_and_inf_encode_with_their_sign(name):
    x = np.array([np.nan, -np.nan, np.inf, -np.inf, 1e30, -1e30, 1.0], np.float32)
    got = F.encode(torch.from_numpy(x), name, saturate=False).numpy()  # ml_dtypes does not saturate
    ref = ml_codes(x, name)
    nan = np.isnan(code_values(name)[ref])
    assert np.array_equal(got[~nan], ref[~nan])  # inf codes, overflow to inf, finite values
    # NaN: the sign of x is kept; the body is all ones (ml_dtypes picks another NaN payload for e5m2)
    assert np.array_equal(got[nan] & 0x80, ref[nan] & 0x80)
    assert ((got[nan] & 0x7F) == 0x7F).all()


def test_e8m0_nan_code():
    x = torch.tensor([float("nan"), float("inf"), 2.0**128])
    assert F.encode(x, "e8m0", saturate=False).tolist() == [0xFF] * 3
    assert ml_codes(x.numpy(), "e8m0").tolist() == [0xFF] * 3


@pytest.mark.parametrize("name, dtype", [("bf16", torch.bfloat16), ("fp16", torch.float16)])
def test_16_bit_codes_exhaustively(name, dtype):
    codes = torch.arange(2**16, dtype=torch.int32)
    got = F.decode(codes, name).numpy()
    ref = code_values(name)
    assert same_bits(got, ref).all()
    by_torch = codes.to(torch.int16).view(dtype).float().numpy()
    assert same_bits(got, by_torch).all()
    keep = ~np.isnan(ref)
    back = F.encode(torch.from_numpy(ref[keep]), name)
    assert back.dtype == torch.int64
    assert np.array_equal(back.numpy(), codes.numpy()[keep])


def test_tf32_codes_exhaustively():
    codes = np.arange(2**19, dtype=np.int64)
    ref = (codes << 13).astype(np.uint32).view(np.float32)  # tf32 is the top 19 bits of a float32
    got = F.decode(torch.from_numpy(codes), "tf32").numpy()
    assert same_bits(got, ref).all()
    keep = ~np.isnan(ref)
    assert np.array_equal(F.encode(torch.from_numpy(ref[keep]), "tf32").numpy(), codes[keep])
    assert same_bits(tf32_round(ref[keep]), ref[keep]).all()  # the reference's own fixed points


def test_fp32_codes_on_a_sample():
    rng = np.random.default_rng(0)
    special = np.array([0, 1, 0x007FFFFF, 0x00800000, 0x7F7FFFFF, 0x7F800000, 0x80000000, 0xFF800000], np.uint32)
    bits = np.concatenate([special, rng.integers(0, 2**32, 100_000, dtype=np.uint32)])
    ref = bits.view(np.float32)
    got = F.decode(torch.from_numpy(bits.astype(np.int64)), "fp32").numpy()
    assert same_bits(got, ref).all()
    as_int32 = torch.from_numpy(bits.view(np.int32))  # x.view(torch.int32) is a natural source of codes
    assert same_bits(F.decode(as_int32, "fp32").numpy(), ref).all()
    keep = ~np.isnan(ref)
    assert np.array_equal(F.encode(torch.from_numpy(ref[keep]), "fp32").numpy(), bits[keep].astype(np.int64))
