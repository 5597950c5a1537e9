"""The scale rules' invariants, and the two MX rules on hand-built blocks where they part."""
from __future__ import annotations

import math

import ml_dtypes
import numpy as np
import pytest
import torch

from lowprec import formats as F
from lowprec.quant import mx, nvfp4, quantize
from tests.quant._cases import MX_FORMATS
from tests.quant._reference import EMAX, FMAX, expand, wide_range


def scaled_magnitudes(x: torch.Tensor, q) -> np.ndarray:
    """float64 |x / effective scale| per element of the 2-D view (exact: the scales are powers of two)."""
    m, k = q.shape.numel() // q.shape[-1], q.shape[-1]
    br, bc = q.block_shape
    eff = expand(q.effective_scale().double().numpy(), br, bc)[:m, :k]
    return np.abs(x.reshape(m, k).double().numpy()) / eff


@pytest.mark.parametrize("fmt", MX_FORMATS)
def test_mx_ceil_never_saturates(fmt):
    x = wide_range((64, 256), seed=11, lo=-30, hi=30)
    q = quantize(x, fmt, mx(32, "ceil"))
    assert scaled_magnitudes(x, q).max() <= FMAX[fmt]


@pytest.mark.parametrize("fmt", MX_FORMATS)
def test_mx_ceil_never_saturates_at_the_edge_of_each_binade(fmt):
    # Block maxima just above fmax * 2^k, where an exact ceil(log2) and FP32's rounding could part.
    k = torch.arange(-20, 20, dtype=torch.float64)
    edge = torch.tensor(FMAX[fmt], dtype=torch.float64) * torch.exp2(k)
    amax = torch.nextafter(edge.float(), torch.tensor(math.inf))  # (40,)
    x = torch.zeros(40, 32)
    x[:, 3] = amax
    q = quantize(x, fmt, mx(32, "ceil"))
    assert scaled_magnitudes(x, q).max() <= FMAX[fmt]
    assert torch.equal(q.scale[:, 0], torch.exp2(k + 1).float())


@pytest.mark.parametrize("fmt", MX_FORMATS)
def test_mx_floor_puts_each_block_max_in_the_top_binade(fmt):
    x = wide_range((64, 256), seed=12, lo=-30, hi=30)
    q = quantize(x, fmt, mx(32, "floor"))
    block_max = scaled_magnitudes(x, q).reshape(64, 8, 32).max(axis=2)
    lo, hi = 2.0 ** EMAX[fmt], 2.0 ** (EMAX[fmt] + 1)
    assert np.all((block_max >= lo) & (block_max < hi))


@pytest.mark.parametrize("fmt", MX_FORMATS)
@pytest.mark.parametrize("rule", ["floor", "ceil"])
def test_every_mx_scale_is_an_e8m0_value(fmt, rule):
    x = wide_range((16, 512), seed=13, lo=-100, hi=100)
    x[0, :32] = 0.0  # a zero block: scale 2^-127
    q = quantize(x, fmt, mx(32, rule))
    s = q.scale.numpy()
    assert np.all(s > 0) and s.min() == np.float32(2.0**-127)
    np.testing.assert_array_equal(s.astype(ml_dtypes.float8_e8m0fnu).astype(np.float32), s)
    codes = q.scale_codes()
    assert codes.dtype == torch.uint8
    np.testing.assert_array_equal(F.decode(codes, "e8m0").numpy(), s)
    # E8M0 code = biased exponent: an independent reading of the same bits
    np.testing.assert_array_equal(codes.numpy().astype(np.float64) - 127, np.log2(s.astype(np.float64)))


@pytest.mark.parametrize("two_d", [False, True])
def test_every_nvfp4_scale_is_an_e4m3_value(two_d):
    x = wide_range((64, 256), seed=14, lo=-8, hi=8)
    q = quantize(x, "e2m1", nvfp4(16, two_d=two_d))
    s = q.scale.numpy()
    assert s.max() == 448.0  # the block holding the tensor amax maps onto E4M3's max
    np.testing.assert_array_equal(s.astype(ml_dtypes.float8_e4m3fn).astype(np.float32), s)
    np.testing.assert_array_equal(F.decode(q.scale_codes(), "e4m3").numpy(), s)


# Where floor and ceil part: a block maximum a = m * 2^e with fmax's own mantissa < m < 2 (fmax is
# 1.75 * 2^8 for e4m3, 1.5 * 2^2 for e2m1). Floor gives 2^(e - emax) and a saturates to fmax; ceil
# gives twice that and nothing saturates.
# (format, block max, floor exponent, ceil exponent, floor element, ceil element), all by hand.
HAND = [
    ("e4m3", 672.0, 1, 1, 320.0, 320.0),  # 672 = 1.3125 * 2^9 = 448 * 1.5: agree; 336 ties to even 320
    ("e4m3", 448.0, 0, 0, 448.0, 448.0),  # exactly fmax
    ("e4m3", 480.0, 0, 1, 448.0, 240.0),  # 1.875 * 2^8: floor saturates
    ("e2m1", 7.0, 0, 1, 6.0, 4.0),  # 1.75 * 2^2: floor saturates; 3.5 ties to even 4
    ("e2m1", 7.5, 0, 1, 6.0, 4.0),  # 1.875 * 2^2: floor saturates; 3.75 rounds to 4
    ("e2m1", 6.0, 0, 0, 6.0, 6.0),
    ("e2m1", 4.5, 0, 0, 4.0, 4.0),  # 4.5 / 6 = 0.75: ceil exponent 0; 4.5 rounds to 4
]


@pytest.mark.parametrize("k", [-20, 0, 7])
@pytest.mark.parametrize(("fmt", "amax", "floor_exp", "ceil_exp", "floor_lp", "ceil_lp"), HAND)
def test_mx_rules_by_hand(k, fmt, amax, floor_exp, ceil_exp, floor_lp, ceil_lp):
    x = torch.zeros(1, 32)
    x[0, 5] = -amax * 2.0**k
    qf, qc = quantize(x, fmt, mx(32, "floor")), quantize(x, fmt, mx(32, "ceil"))
    assert qf.scale.item() == 2.0 ** (floor_exp + k) and qc.scale.item() == 2.0 ** (ceil_exp + k)
    assert qf.values()[0, 5].item() == -floor_lp and qc.values()[0, 5].item() == -ceil_lp


def test_mx_scale_exponent_clamps_to_e8m0_range():
    x = torch.zeros(3, 32)
    x[0, 0] = 2.0**-140  # floor exponent -148 clamps to -127
    x[1, 0] = 3.0e38  # floor: 2^(127 - 8) = 2^119, in range
    x[2, 0] = 1.0e-45  # FP32's smallest subnormal: amax / fmax underflows to 0 under the ceil rule
    qf, qc = quantize(x, "e4m3", mx(32, "floor")), quantize(x, "e4m3", mx(32, "ceil"))
    assert qf.scale[:, 0].tolist() == [2.0**-127, 2.0**119, 2.0**-127]
    assert qc.scale[:, 0].tolist() == [2.0**-127, 2.0**120, 2.0**-127]


@pytest.mark.parametrize("two_d", [False, True])
def test_nvfp4_global_amax_per_group_casts_each_group_as_its_own_tensor(two_d):
    """``quantize(..., global_amax=)``: one cast of several tensors stacked (a mixture's experts), each group's
    global scale from its own finite amax, gives each group's codes, block scales and global scale bit for bit
    as a cast of that group alone; the tensor's own amax given gives the plain cast's bits."""
    g = nvfp4(16, two_d=two_d)
    parts = [torch.randn(32, 48, generator=torch.Generator().manual_seed(i)) * 10.0 ** (i - 1) for i in range(3)]
    parts[1][3, 5] = float("inf")  # a non-finite block: its group's amax is over the finite ones
    x = torch.cat(parts)
    alone = [quantize(p, "e2m1", g) for p in parts]
    amax = torch.stack([p[torch.isfinite(p)].abs().amax() for p in parts])
    rows = 16 if two_d else 1
    per_block_row = amax.repeat_interleave(32 // rows).unsqueeze(1)
    both = quantize(x, "e2m1", g, global_amax=per_block_row)
    for i, q in enumerate(alone):
        assert torch.equal(both.data[32 * i:32 * (i + 1)], q.data)
        torch.testing.assert_close(both.scale[32 // rows * i:32 // rows * (i + 1)], q.scale, rtol=0, atol=0,
                                   equal_nan=True)  # NaN: the block holding inf
        assert torch.equal(both.global_scale[32 // rows * i, 0], q.global_scale)
    own = quantize(parts[0], "e2m1", g, global_amax=amax[0])
    assert torch.equal(own.data, alone[0].data) and torch.equal(own.global_scale, alone[0].global_scale)


def test_nvfp4_global_amax_is_refused_where_it_does_not_fit():
    with pytest.raises(ValueError, match=r"^global_amax: expected a tensor broadcastable to the block grid \(4, 3\)"):
        quantize(torch.randn(4, 48), "e2m1", nvfp4(16), global_amax=torch.ones(5, 1))
    with pytest.raises(ValueError, match=r"^global_amax: expected None for mx"):
        quantize(torch.randn(4, 64), "e2m1", mx(32), global_amax=torch.ones(4, 1))
