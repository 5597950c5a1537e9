"""The fused dequantization behind emulated GEMMs equals the reference's decode x block scale in BF16
(exact: the products fit BF16), block for block, NaN blocks included."""
from __future__ import annotations

import math

import pytest
import torch

pytest.importorskip("triton")

from lowprec.kernels.triton_dequant import block_values_bf16
from lowprec.quant import mx, nvfp4, quantize


@pytest.mark.parametrize("fmt,g", [("e4m3", mx(32, "ceil")), ("e5m2", mx(32, "floor")), ("e2m1", mx(32, "ceil")),
                                   ("e3m2", mx(32, "floor")), ("e2m3", mx(32, "ceil")), ("e2m1", nvfp4(16)),
                                   ("e2m1", nvfp4(16, two_d=True))], ids=str)
@pytest.mark.parametrize("shape", [(64, 128), (50, 96)], ids=str)
def test_block_values_equal_the_reference_values_times_scales(fmt, g, shape):
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(*shape, generator=gen) * torch.logspace(-3, 3, shape[1])
    x[1, 1] = math.nan  # a NaN block dequantizes to NaN
    q = quantize(x, fmt, g)
    br, bc = q.block_shape
    mb, kb = q.scale.shape
    ref = (q.values().view(mb, br, kb, bc) * q.scale[:, None, :, None]).view(q.data.shape)  # (Mp, Kp) float32
    got = block_values_bf16(q)
    assert got.dtype == torch.bfloat16 and got.shape == q.data.shape
    assert torch.equal(torch.isnan(got), torch.isnan(ref))
    ok = ~torch.isnan(ref)
    assert torch.equal(got.float()[ok], ref[ok])  # exact, not merely close
