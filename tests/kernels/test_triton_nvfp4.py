"""The Triton NVFP4 cast follows TransformerEngine's order of operations like the reference: on the
tie-heavy vector sets of ``tests/quant/_nvfp4_sets.py`` its codes and scales equal both
``lowprec.quant.quantize`` and the independent numpy reference, on either side of a fused pair."""
from __future__ import annotations

import numpy as np
import pytest
import torch

pytest.importorskip("triton")

from lowprec.kernels import triton_quant as TQ
from lowprec.quant import nvfp4, quantize
from tests.kernels.test_triton_quant import assert_same
from tests.quant._nvfp4_sets import tie_heavy
from tests.quant._reference import Spec, codes_of, quantize_ref

# Blocks whose E4M3 scale underflows multiply by FP32's max, as TE does, and may overflow to inf
# before saturating: the interpreter's numpy says so.
pytestmark = pytest.mark.filterwarnings("ignore:overflow encountered")


def assert_equals_reference(q, x: torch.Tensor, br: int) -> None:
    ref = quantize_ref(x, "e2m1", Spec(f"nvfp4-{br}x16", br, 16, "nvfp4"))
    np.testing.assert_array_equal(q.scale.numpy(), ref.scale)
    assert q.global_scale.item() == ref.global_scale
    np.testing.assert_array_equal(codes_of(q.data), ref.codes)


@pytest.mark.parametrize(("br", "mb"), [(1, 64), (16, 4)], ids=["1x16", "16x16"])
def test_cast_on_tie_heavy_set_equals_reference_and_te_order(br, mb):
    x = tie_heavy(mb, 20, br, 16, seed=21)  # 64 x 320
    g = nvfp4(16, two_d=br > 1)
    q = TQ.quantize(x, "e2m1", g)
    assert_same(q, quantize(x, "e2m1", g))
    assert_equals_reference(q, x, br)


@pytest.mark.parametrize("side", ["A", "B"])
def test_pair_on_tie_heavy_sets_both_sides(side):
    # side A quantizes x along K, side B x.T along M: each is given a set tie-heavy in its own blocks
    ties = tie_heavy(32, 20, 1, 16, seed=22 if side == "A" else 23)  # (32, 320)
    x = ties if side == "A" else ties.t()
    q, qt, _ = TQ.quantize_pair(x, "e2m1", nvfp4(16), "e2m1", nvfp4(16))
    assert_equals_reference(q, x, 1)
    assert_equals_reference(qt, x.t(), 1)
    xb = x.bfloat16()  # and from bf16, with 16x16 blocks on the other side
    q, qt, _ = TQ.quantize_pair(xb, "e2m1", nvfp4(16), "e2m1", nvfp4(16, two_d=True))
    assert_same(q, quantize(xb, "e2m1", nvfp4(16)))
    assert_same(qt, quantize(xb.t(), "e2m1", nvfp4(16, two_d=True)))


def test_stochastic_rounding_on_tie_heavy_set_equals_reference_given_the_uniforms():
    x = tie_heavy(32, 20, 1, 16, seed=24)
    rand = torch.rand(x.shape, generator=torch.Generator().manual_seed(25))
    q = TQ.quantize(x, "e2m1", nvfp4(16), rounding="stochastic", rand=rand)
    assert_same(q, quantize(x, "e2m1", nvfp4(16), rounding="stochastic", rand=rand))
