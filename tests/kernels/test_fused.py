"""``kernels.quantize_pair`` and ``kernels.fused.cast_pair``: the Triton path (through the
interpreter) and the reference path give the same casts, the same Hadamard side and the same amax."""
from __future__ import annotations

import math

import pytest
import torch

pytest.importorskip("triton")

from lowprec.kernels import quantize_pair
from lowprec.kernels.fused import cast_pair
from lowprec.quant import blockwise, hadamard, mx, nvfp4, quantize, tensorwise
from tests.kernels.test_triton_quant import assert_same


@pytest.mark.parametrize("fmt,g", [("e4m3", tensorwise()), ("e4m3", blockwise(1, 128)), ("e4m3", mx(32, "ceil"))],
                         ids=str)
def test_quantize_pair_on_triton_equals_the_reference_on_tile_multiples(fmt, g):
    # 128 x 256: whole tiles, the kernels' unmasked path; per-tensor shares one cast for both sides
    x = (torch.randn(128, 256, generator=torch.Generator().manual_seed(0)) * 3).bfloat16()
    q, qt = quantize_pair(x, fmt, g, fmt, g, backend="triton")
    assert_same(q, quantize(x, fmt, g))
    assert_same(qt, quantize(x.t(), fmt, g))


def test_cast_pair_backends_agree_with_hadamard_and_amax():
    g = torch.Generator().manual_seed(1)
    x = (torch.randint(-40, 40, (96, 64), generator=g).float() / 4).bfloat16()  # exact Hadamard sums
    out = {b: cast_pair(x, "e2m1", nvfp4(16), "e2m1", nvfp4(16), hadamard_t=7, record_amax=True, backend=b)
           for b in ("torch", "triton")}
    for i in range(2):
        assert_same(out["triton"][i], out["torch"][i])
    assert out["triton"][2].item() == out["torch"][2].item() == x.float().abs().amax().item()
    ref_t = quantize(hadamard(x.t(), 16, seed=7), "e2m1", nvfp4(16))  # 96 tokens: no padding needed
    assert_same(out["torch"][1], ref_t)


def test_cast_pair_with_a_delayed_scale_records_the_amax_of_the_input():
    x = torch.randn(64, 128, generator=torch.Generator().manual_seed(2)).bfloat16()
    x[3, 3] = math.inf
    scale = torch.tensor(0.01)
    q, qt, amax = cast_pair(x, "e4m3", tensorwise(), "e4m3", tensorwise(), scale=scale, record_amax=True,
                            backend="triton")
    assert amax.item() == math.inf
    assert_same(q, quantize(x, "e4m3", tensorwise(), scale=scale))
    assert_same(qt, quantize(x.t(), "e4m3", tensorwise(), scale=scale))
