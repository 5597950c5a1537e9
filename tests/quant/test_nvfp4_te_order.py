"""NVFP4 codes and scales equal TransformerEngine's, operation for operation: the reference
(``tests/quant/_reference.py``, numpy float32 in TE's order) against ``quantize`` on vector sets full
of exact rounding ties (``tests/quant/_nvfp4_sets.py``) and on random vectors."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from lowprec.quant import nvfp4, quantize
from tests.quant._nvfp4_sets import E2M1_TIES, e4m3_midpoints, tie_heavy
from tests.quant._reference import Spec, block_amax, cast, codes_of, padded_blocks, quantize_ref, view_2d, wide_range

LAYOUTS = [(1, 128), (16, 8)]  # (block rows, block grid rows): 1x16 and 16x16 blocks, 128 rows either way


def assert_equals_te(x: torch.Tensor, br: int):
    """Every E4M3 scale, the global scale and every element code equal the reference's."""
    q = quantize(x, "e2m1", nvfp4(16, two_d=br > 1))
    ref = quantize_ref(x, "e2m1", Spec(f"nvfp4-{br}x16", br, 16, "nvfp4"))
    np.testing.assert_array_equal(q.scale.numpy(), ref.scale, err_msg="E4M3 block scales")
    assert q.global_scale.item() == ref.global_scale
    np.testing.assert_array_equal(codes_of(q.data), ref.codes, err_msg="element codes")
    return ref


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize(("br", "mb"), LAYOUTS, ids=["1x16", "16x16"])
def test_tie_heavy_sets_match_te_bit_for_bit(br, mb, seed):
    x = tie_heavy(mb, 40, br, 16, seed=seed)  # 128 x 640: 82k codes
    ref = assert_equals_te(x, br)
    assert np.isin(ref.scaled, E2M1_TIES).mean() > 0.1  # a tenth of the codes decided by a tie


def test_tie_heavy_set_parts_te_order_from_the_obvious_ones():
    # The set would catch the orders lowprec and TE's kernels once used: elements divided by
    # fp32(s * g) rather than multiplied by fp32(1 / (s * g)), and a block scale (amax / 6) * G
    # rather than amax * (G * fp32(1 / 6)).
    x = tie_heavy(128, 40, 1, 16, seed=0)
    spec = Spec("nvfp4-16", 1, 16, "nvfp4")
    ref = quantize_ref(x, "e2m1", spec)
    blocks = padded_blocks(view_2d(x), spec)  # (128, 1, 40, 16)
    eff = ref.eff[:, None, :, None]
    with np.errstate(divide="ignore", invalid="ignore"):
        divided = np.where(eff == 0, np.float32(0), blocks / eff).astype(np.float32).reshape(ref.codes.shape)
    assert (cast(divided, "e2m1").view(np.uint8) != ref.codes).sum() > 1000
    amax = block_amax(blocks).astype(np.float32)  # (128, 40)
    big = np.float32(2688) / amax.max()
    assert np.isin(amax * (big * (np.float32(1) / np.float32(6))), e4m3_midpoints()).mean() > 0.05
    assert (cast((amax / np.float32(6)) * big, "e4m3").astype(np.float32) != ref.scale).sum() > 0


@pytest.mark.parametrize(("br", "mb"), LAYOUTS, ids=["1x16", "16x16"])
def test_random_vectors_match_te_bit_for_bit(br, mb):
    gen = torch.Generator().manual_seed(11)
    sets = [
        torch.randn(128, 640, generator=gen).bfloat16().float(),  # TE's usual input: bf16 values
        wide_range((128, 640), seed=12),  # blocks many binades apart; some E4M3 scales underflow
        torch.randn(128, 640, generator=gen) / torch.rand(128, 640, generator=gen).clamp_min(1e-3),  # heavy tails
    ]
    for x in sets:
        assert_equals_te(x, br)


def test_underflowed_block_stores_te_codes_and_dequantizes_to_zeros():
    x = torch.zeros(1, 32)
    x[0, 0] = 2688.0  # G = 1: block 1's scale 1e-4 * (1/6) is below E4M3's smallest, 2^-9, so 0
    x[0, 16:20] = torch.tensor([1e-4, -1e-4, 1e-38, 0.0])
    q = quantize(x, "e2m1", nvfp4(16))
    assert q.scale[0, 1].item() == 0.0
    # encode scale min(1 / 0, FP32 max) = 3.4e38: +-1e-4 saturate at +-6 (codes 7, 15) and 1e-38
    # becomes 3.4, stored as 3 (code 5): TE's codes, though the zero scale makes them all zeros
    assert codes_of(q.data)[0, 16:20].tolist() == [7, 15, 5, 0]
    assert torch.equal(q.dequantize()[0, 16:], torch.zeros(16))
