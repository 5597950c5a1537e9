"""Degenerate blocks (zeros, NaN, inf, outliers, tiny values), ragged shapes, 0-d/1-d tensors,
half-precision inputs and given (delayed) scales."""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from lowprec.quant import blockwise, mx, nvfp4, quantize, rowwise, tensorwise
from tests.quant import _reference as R
from tests.quant._cases import BLOCK_CASES, BLOCK_IDS, CASE_IDS, CASES
from tests.quant._reference import Spec, codes_of, dequantize_ref, quantize_ref

# The finite scale each rule gives an all-zero block: FP32 1, E8M0 2^-127, NVFP4 E4M3 0 (times g = 1).
ZERO_BLOCK_SCALE = {"amax": 1.0, "floor": 2.0**-127, "ceil": 2.0**-127, "nvfp4": 0.0}


def randn(*shape: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize(("g", "spec", "fmt"), CASES, ids=CASE_IDS)
def test_all_zero_tensor_has_finite_scales_and_zero_output(g, spec, fmt):
    x = torch.zeros(20, 64)
    q = quantize(x, fmt, g)
    assert torch.all(q.scale == ZERO_BLOCK_SCALE[spec.rule])
    if spec.rule == "nvfp4":
        assert q.global_scale.item() == 1.0
    assert torch.equal(q.dequantize(), x)


@pytest.mark.parametrize(("g", "spec", "fmt"), BLOCK_CASES, ids=BLOCK_IDS)
@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_non_finite_value_poisons_only_its_own_block(g, spec, fmt, bad):
    x = randn(32, 256, seed=1)
    x[17, 40] = bad  # block row 17 (or 16 for 16x16, 0 for 128x128), block column 40 // bc
    q = quantize(x, fmt, g)
    br, bc = spec.br, spec.bc
    bi, bj = 17 // br, 40 // bc
    assert math.isnan(q.scale[bi, bj].item())
    assert torch.isfinite(q.scale).sum() == q.scale.numel() - 1
    deq = q.dequantize()
    rows, cols = slice(bi * br, (bi + 1) * br), slice(bj * bc, (bj + 1) * bc)
    assert torch.isnan(deq[rows, cols]).all()
    # Every other block is what it is with the poisoned block zeroed: the reference on that tensor.
    clean = x.clone()
    clean[rows, cols] = 0.0
    ref = dequantize_ref(quantize_ref(clean, fmt, spec), (32, 256))
    keep = torch.ones(32, 256, dtype=torch.bool)
    keep[rows, cols] = False
    np.testing.assert_array_equal(deq[keep].numpy(), ref[keep.numpy()])


@pytest.mark.parametrize(("g", "fmt"), [(tensorwise(), "e4m3"), (rowwise(), "e5m2")])
def test_non_finite_value_makes_its_whole_scaling_group_nan(g, fmt):
    x = randn(4, 64, seed=2)
    x[2, 7] = math.inf
    deq = quantize(x, fmt, g).dequantize()
    nan_rows = [0, 1, 2, 3] if g.block_rows is None else [2]
    assert torch.isnan(deq[nan_rows]).all()
    assert torch.isfinite(deq).sum() == (4 - len(nan_rows)) * 64


@pytest.mark.parametrize(("g", "spec", "fmt"), [c for c in BLOCK_CASES if c[1].rule != "nvfp4"],
                         ids=[i for c, i in zip(BLOCK_CASES, BLOCK_IDS) if c[1].rule != "nvfp4"])
def test_outlier_changes_only_its_own_block(g, spec, fmt):
    # NVFP4 is left out on purpose: its global scale follows the tensor amax, so an outlier moves
    # every block's E4M3 scale (see test_nvfp4_outlier_moves_the_global_scale).
    rows = max(2 * spec.br, 16)
    x = randn(rows, 256, seed=3)
    base = quantize(x, fmt, g)
    x[rows - 3, 100] = 1.0e4
    q = quantize(x, fmt, g)
    bi, bj = (rows - 3) // spec.br, 100 // spec.bc
    changed = (q.scale != base.scale).nonzero().tolist()
    assert changed == [[bi, bj]]
    deq, deq0 = q.dequantize(), base.dequantize()
    keep = torch.ones(rows, 256, dtype=torch.bool)
    keep[bi * spec.br:(bi + 1) * spec.br, bj * spec.bc:(bj + 1) * spec.bc] = False
    assert torch.equal(deq[keep], deq0[keep])


def test_nvfp4_outlier_moves_the_global_scale_and_still_matches_reference():
    x = randn(64, 64, seed=4)
    x[3, 3] = 1.0e4
    q = quantize(x, "e2m1", nvfp4(16))
    ref = quantize_ref(x, "e2m1", Spec("nvfp4", 1, 16, "nvfp4"))
    # TE's global decode scale: the reciprocal of the encode scale 2688 / amax, each rounded to FP32
    assert q.global_scale.item() == ref.global_scale == np.float32(1) / (np.float32(2688.0) / np.float32(1.0e4))
    np.testing.assert_array_equal(q.scale.numpy(), ref.scale)


@pytest.mark.parametrize(("g", "spec", "fmt"), CASES, ids=CASE_IDS)
def test_tiny_amax_blocks_divide_by_nothing_and_make_no_inf(g, spec, fmt):
    x = torch.zeros(16, 64)
    x[0, 0], x[1, 1], x[2, 33] = 1.0e-45, -3.0e-41, 2.0e-38  # subnormal and near FP32's smallest normal
    q = quantize(x, fmt, g)
    assert torch.isfinite(q.scale).all() and torch.isfinite(q.values()).all()
    deq = q.dequantize()
    assert torch.isfinite(deq).all()
    ref = quantize_ref(x, fmt, spec)
    np.testing.assert_array_equal(q.scale.numpy(), ref.scale)
    np.testing.assert_array_equal(codes_of(q.data), ref.codes)
    if spec.rule == "amax":  # amax / fmax is below FP32's normals here: clamped to 2^-126, never 0
        assert q.scale.min().item() == 2.0**-126


@pytest.mark.parametrize("shape", [(3, 5, 37), (1, 1, 1), (2, 129)])
@pytest.mark.parametrize(("g", "fmt"), [(mx(32), "e4m3"), (blockwise(128, 128), "e4m3"), (nvfp4(16, True), "e2m1")],
                         ids=["mx32", "block128x128", "nvfp4-16x16"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_ragged_shapes_are_padded_and_cropped(shape, g, fmt, dtype):
    x = (randn(*shape, seed=5) * 3).to(dtype)
    q = quantize(x, fmt, g)
    m, k = math.prod(shape[:-1]), shape[-1]
    br, bc = g.block_rows, g.block_cols
    assert q.data.shape == (math.ceil(m / br) * br, math.ceil(k / bc) * bc)
    deq = q.dequantize()
    assert deq.shape == x.shape and deq.dtype == dtype
    # Padding never changes a scale: each block's scale is the rule applied to the amax of its
    # real (unpadded) elements alone.
    x2 = x.double().reshape(m, k).numpy()
    amax = np.array([[np.abs(x2[i:i + br, j:j + bc]).max() for j in range(0, k, bc)] for i in range(0, m, br)])
    if g.rule.value == "nvfp4":
        want, global_scale, _ = R.nvfp4_rule(amax, fmt)
        assert q.global_scale.item() == global_scale == np.float32(1) / (np.float32(2688) / np.float32(amax.max()))
    else:
        want = (R.floor_rule if g.rule.value == "floor" else R.amax_rule)(amax, fmt)
    np.testing.assert_array_equal(q.scale.numpy(), np.asarray(want, np.float32))
    assert (q.values()[m:] == 0).all() and (q.values()[:, k:] == 0).all()
    ref = quantize_ref(x, fmt, Spec(str(g), br, bc, g.rule.value))
    np.testing.assert_array_equal(q.dequantize(torch.float32).numpy(), dequantize_ref(ref, shape))


@pytest.mark.parametrize(("g", "spec", "fmt"), CASES, ids=CASE_IDS)
def test_0d_and_1d_tensors(g, spec, fmt):
    for x in (torch.tensor(-2.75), torch.tensor([0.5, -3.0, 7.0])):
        q = quantize(x, fmt, g)
        ref = quantize_ref(x, fmt, spec)
        np.testing.assert_array_equal(q.scale.numpy(), ref.scale)
        deq = q.dequantize()
        assert deq.shape == x.shape and deq.dtype == x.dtype
        np.testing.assert_array_equal(deq.numpy(), dequantize_ref(ref, tuple(x.shape)))


@pytest.mark.parametrize(("g", "spec", "fmt"), CASES, ids=CASE_IDS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_inputs(g, spec, fmt, dtype):
    x = (randn(16, 96, seed=6) * 10).to(dtype)
    q = quantize(x, fmt, g)
    ref = quantize_ref(x, fmt, spec)  # the reference reads x exactly (every bf16/fp16 is an FP32)
    np.testing.assert_array_equal(q.scale.numpy(), ref.scale)
    np.testing.assert_array_equal(codes_of(q.data), ref.codes)
    assert q.dtype == dtype and q.dequantize().dtype == dtype
    exact = dequantize_ref(ref, (16, 96))
    np.testing.assert_array_equal(q.dequantize(torch.float32).numpy(), exact)
    np.testing.assert_array_equal(q.dequantize().float().numpy(), torch.from_numpy(exact).to(dtype).float().numpy())


@pytest.mark.parametrize(("g", "scale", "fmt"), [
    (tensorwise(), torch.tensor(0.5), "e4m3"),
    (rowwise(), torch.tensor([[0.5], [2.0], [1.0]]), "e5m2"),
    (blockwise(1, 32), torch.tensor([[1.0, 0.25]]), "e4m3"),  # broadcast over the three block rows
])
def test_given_scale_is_used_and_values_beyond_it_saturate(g, scale, fmt):
    fmax = {"e4m3": 448.0, "e5m2": 57344.0}[fmt]
    x = randn(3, 64, seed=7)
    x[0, 0], x[1, 40], x[2, 63] = 1.0e6, -1.0e6, 1.0e6  # far beyond fmax * any scale here
    q = quantize(x, fmt, g, scale=scale)
    grid = torch.broadcast_to(scale, q.scale.shape)
    assert torch.equal(q.scale, grid)
    eff = grid.repeat_interleave(q.block_shape[0], 0).repeat_interleave(q.block_shape[1], 1)
    v = q.values()
    assert v[0, 0].item() == fmax and v[1, 40].item() == -fmax and v[2, 63].item() == fmax
    want = R.cast((x / eff).numpy(), fmt).astype(np.float32)  # ml_dtypes, clipped at fmax first
    np.testing.assert_array_equal(v.numpy(), want)


def test_given_scale_is_copied_not_aliased():
    scale = torch.tensor(2.0)
    q = quantize(torch.ones(4, 4), "e4m3", tensorwise(), scale=scale)
    scale.mul_(10)  # delayed scaling updates its scale buffer in place after each step
    assert torch.equal(q.dequantize(), torch.ones(4, 4))


@pytest.mark.parametrize("shape", [(0, 64), (4, 0), (0,), (2, 0, 3)])
@pytest.mark.parametrize(("g", "spec", "fmt"), CASES[::2], ids=CASE_IDS[::2])
def test_empty_tensors_round_trip(shape, g, spec, fmt):
    # an MoE expert that receives no tokens still quantizes its (0, K) input
    q = quantize(torch.empty(shape), fmt, g)
    assert q.data.numel() == 0
    deq = q.dequantize()
    assert deq.shape == shape and deq.dtype == torch.float32


def test_non_contiguous_input_quantizes_as_its_values():
    x = randn(64, 96, seed=8)
    for g in (mx(32), blockwise(128, 128), rowwise()):
        assert torch.equal(quantize(x.T, "e4m3", g).data.view(torch.uint8),
                           quantize(x.T.contiguous(), "e4m3", g).data.view(torch.uint8))
