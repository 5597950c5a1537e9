"""quantize against the independent reference: every scale and every element code, bit for bit,
for each granularity with each element format it applies to; plus small hand-computed cases."""
from __future__ import annotations

import zlib

import numpy as np
import pytest
import torch

from lowprec.quant import blockwise, mx, nvfp4, quantize, tensorwise
from tests.quant._cases import CASE_IDS, CASES
from tests.quant._reference import EMAX, FMAX, ML_DTYPES, codes_of, dequantize_ref, quantize_ref, wide_range


def assert_matches_reference(x: torch.Tensor, g, spec, fmt: str) -> None:
    q = quantize(x, fmt, g)
    ref = quantize_ref(x, fmt, spec)
    np.testing.assert_array_equal(q.scale.numpy(), ref.scale, err_msg="block scales")
    if ref.global_scale is None:
        assert q.global_scale is None
    else:
        assert q.global_scale.dim() == 0 and q.global_scale.item() == ref.global_scale
    np.testing.assert_array_equal(codes_of(q.data), ref.codes, err_msg="element codes")
    np.testing.assert_array_equal(q.values().numpy(), ref.values, err_msg="decoded values")
    deq = q.dequantize(torch.float32).numpy()
    np.testing.assert_array_equal(deq, dequantize_ref(ref, tuple(x.shape)), err_msg="dequantized")


@pytest.mark.parametrize(("g", "spec", "fmt"), CASES, ids=CASE_IDS)
def test_wide_range_data_matches_reference(g, spec, fmt):
    # (4, 3, 288): M = 12 rows; K = 288 is 9 MX blocks, 18 NVFP4 blocks, 2.25 blocks of 128 (padded).
    # Values span 2^-12..2^12 so blocks differ by many binades and NVFP4 scales also underflow.
    x = wide_range((4, 3, 288), seed=zlib.crc32((spec.name + fmt).encode()))
    assert_matches_reference(x, g, spec, fmt)


@pytest.mark.parametrize(("g", "spec", "fmt"), CASES, ids=CASE_IDS)
def test_randn_data_matches_reference(g, spec, fmt):
    x = torch.randn(40, 96, generator=torch.Generator().manual_seed(7))
    assert_matches_reference(x, g, spec, fmt)


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2", "e3m2", "e2m3", "e2m1"])
def test_every_code_of_the_format_round_trips_through_an_mx_block(fmt):
    # Codes laid out with a block maximum that makes the MX floor scale exactly 1: each block must
    # reproduce the format's own grid. ml_dtypes gives the grid (every code, both signs).
    bits = {"e4m3": 8, "e5m2": 8, "e3m2": 6, "e2m3": 6, "e2m1": 4}[fmt]
    grid = np.arange(2**bits, dtype=np.uint8).view(ML_DTYPES[fmt]).astype(np.float32)
    grid = grid[np.isfinite(grid)]
    pad = (-len(grid)) % 31
    grid = np.concatenate([grid, np.zeros(pad, np.float32)]).reshape(-1, 31)
    anchor = np.full((grid.shape[0], 1), 2.0**EMAX[fmt], np.float32)  # amax in [2^emax, fmax]: scale 1
    x = torch.from_numpy(np.concatenate([anchor, grid], axis=1))  # (rows, 32)
    assert np.abs(x.numpy()).max() <= FMAX[fmt]
    q = quantize(x, fmt, mx(32, "floor"))
    assert torch.all(q.scale == 1.0)
    assert torch.equal(q.dequantize(), x)


def test_tensorwise_e4m3_by_hand():
    x = torch.tensor([3.0, -1.5, 0.1])
    q = quantize(x, "e4m3", tensorwise())
    s = np.float32(3.0) / np.float32(448.0)
    assert q.scale.item() == s
    # 3 / s = 448; -1.5 / s = -224; 0.1 / s = 14.93 rounds to 15 (spacing 1 in [8, 16)).
    assert q.values().flatten().tolist() == [448.0, -224.0, 15.0]
    assert q.dequantize()[2].item() == np.float32(15 * s)


def test_blockwise_1x128_scales_each_row_block_by_hand():
    x = torch.zeros(2, 256)
    x[0, 5], x[0, 200], x[1, 130] = 448.0, -4.0 * 448, 0.5 * 448
    q = quantize(x, "e4m3", blockwise(1, 128))
    assert q.scale.tolist() == [[1.0, 4.0], [1.0, 0.5]]  # the all-zero block gets scale 1
    assert q.values()[0, 200].item() == -448.0 and q.values()[1, 130].item() == 448.0


def test_nvfp4_two_levels_by_hand():
    x = torch.zeros(1, 32)
    x[0, 0] = 6 * 448.0  # block 0 holds the tensor amax: G = 2688 / 2688 = 1 = g, s0 = 2688 / 6 = 448
    x[0, 16], x[0, 17] = 3.0, -1.0  # block 1: s1 = 3 * fp32(1/6) = 0.5 in E4M3; elements times 1 / 0.5
    q = quantize(x, "e2m1", nvfp4(16))
    assert q.global_scale.item() == 1.0
    assert q.scale.tolist() == [[448.0, 0.5]]
    assert q.values()[0, :2].tolist() == [6.0, 0.0]
    assert q.values()[0, 16:18].tolist() == [6.0, -2.0]
    assert torch.equal(q.dequantize(), x)


def test_nvfp4_global_scale_and_e4m3_rounding_of_block_scale_by_hand():
    x = torch.zeros(1, 32)
    x[0, 0] = 1.0  # tensor amax 1: encode G = 2688, decode g = 1 / 2688
    x[0, 16] = 0.35  # 0.35 * (2688 * fp32(1/6)) = 156.8 -> E4M3 spacing 16 in [128, 256): 160
    q = quantize(x, "e2m1", nvfp4(16))
    g = np.float32(1.0) / np.float32(2688.0)
    assert q.global_scale.item() == g
    s1 = np.float32(0.35) * (np.float32(2688.0) * (np.float32(1.0) / np.float32(6.0)))
    assert 152 < s1 < 160
    assert q.scale[0, 1].item() == 160.0
