"""Blackwell's block-scaled GEMMs (``kernels.blackwell``): no GPU here runs them, so the tests hold the operands
lowprec hands to ``torch._scaled_mm`` to the layout cuBLAS documents, through an independent reading of it: a
stand-in ``torch._scaled_mm`` that finds each scale by the documented offset formula, unpacks FP4 nibbles by
hand and multiplies in float64. Through it, every GEMM of mxfp8, mxfp4 and nvfp4 equals the emulation; and the
first-use check passes it and refuses a stand-in that reads the scales unswizzled.
"""
from __future__ import annotations

import sys

import pytest
import torch

from lowprec import recipes as R
from lowprec.kernels import blackwell as BW
from lowprec.kernels.first_use import integer_operands
from lowprec.kernels.gemm import GemmPath, _cublas, _emulated, gemm_path, scaled_mm
from lowprec.quant import mx, nvfp4, quantize

E2M1_VALUES = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]


def _offset(r: torch.Tensor, c: torch.Tensor, cols: int) -> torch.Tensor:
    """Where scale ``(r, c)`` of a ``(rows, cols)`` matrix lies: tiles of 128 x 4, row tiles outer, each tile
    512 bytes with ``(r, c)`` at ``(r % 32) * 16 + (r // 32 % 4) * 4 + c % 4``."""
    col_tiles = -(-cols // 4)
    tile = (r // 128) * col_tiles + c // 4
    return tile * 512 + (r % 32) * 16 + (r // 32 % 4) * 4 + c % 4


def _unswizzle(flat: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    r = torch.arange(rows)[:, None].expand(rows, cols)
    c = torch.arange(cols)[None, :].expand(rows, cols)
    return flat.view(torch.uint8)[_offset(r, c, cols)]


def _values(data: torch.Tensor) -> torch.Tensor:
    """float64 element values: FP8 by torch's exact widening, FP4 nibbles (low first) by the E2M1 table."""
    if data.dtype == torch.float4_e2m1fn_x2:
        b = data.view(torch.uint8).to(torch.int64)
        nib = torch.stack([b & 0xF, b >> 4], dim=-1).flatten(-2)
        mag = torch.tensor(E2M1_VALUES, dtype=torch.float64)[nib & 7]
        return torch.where(nib >= 8, -mag, mag)
    return data.double()


def _scales(flat: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    codes = _unswizzle(flat, rows, cols)
    if flat.dtype == torch.float8_e8m0fnu:
        return torch.pow(2.0, codes.double() - 127)
    return codes.view(torch.float8_e4m3fn).double()


def fake_scaled_mm(a, b, scale_a, scale_b, out_dtype, swizzled=True, **_):
    """``torch._scaled_mm`` for block-scaled operands as cuBLAS documents it (``b``: the (K, N) transpose)."""
    va, vb = _values(a), _values(b.t())  # (M, K), (N, K)
    block = 32 if scale_a.dtype == torch.float8_e8m0fnu else 16
    kb = va.shape[1] // block
    if swizzled:
        sa, sb = _scales(scale_a, va.shape[0], kb), _scales(scale_b, vb.shape[0], kb)
    else:  # a wrong reading: row-major, as if never swizzled
        sa = torch.pow(2.0, scale_a.view(torch.uint8)[: va.shape[0] * kb].double().view(-1, kb) - 127)
        sb = torch.pow(2.0, scale_b.view(torch.uint8)[: vb.shape[0] * kb].double().view(-1, kb) - 127)
    va = va * sa.repeat_interleave(block, dim=1)
    vb = vb * sb.repeat_interleave(block, dim=1)
    return (va @ vb.t()).to(out_dtype)


@pytest.mark.parametrize("rows,cols", [(1, 1), (128, 4), (130, 7), (300, 9), (64, 40)])
def test_the_swizzle_is_the_documented_layout(rows, cols):
    codes = torch.randint(0, 255, (rows, cols), dtype=torch.uint8, generator=torch.Generator().manual_seed(rows))
    flat = BW.swizzle(codes, 127)
    rp, cp = -(-rows // 128) * 128, -(-cols // 4) * 4
    assert flat.shape == (rp * cp,)
    assert torch.equal(_unswizzle(flat, rows, cols), codes)
    # padding holds the given value, nothing else
    mask = torch.ones(rp * cp, dtype=torch.bool)
    r = torch.arange(rows)[:, None].expand(rows, cols)
    mask[_offset(r, torch.arange(cols)[None, :].expand(rows, cols), cols).flatten()] = False
    assert (flat[mask] == 127).all()


def test_the_swizzle_refuses_what_is_not_one_byte_codes():
    with pytest.raises(ValueError, match=r"^scales: expected a 2-D tensor of one-byte scale codes"):
        BW.swizzle(torch.ones(4, 4), 127)


def test_operands_as_the_tensor_cores_take_them():
    x = torch.randn(48, 96)
    data, scale = BW.operands(quantize(x, "e2m1", mx(32)))
    assert data.dtype == torch.float4_e2m1fn_x2 and data.shape == (48, 48)
    assert scale.dtype == torch.float8_e8m0fnu and scale.shape == (128 * 4,)
    data, scale = BW.operands(quantize(x, "e4m3", mx(32)))
    assert data.dtype == torch.float8_e4m3fn and data.shape == (48, 96)
    q = quantize(x, "e2m1", nvfp4(16, two_d=True))
    data, scale = BW.operands(q)
    assert scale.dtype == torch.float8_e4m3fn
    per_row = _unswizzle(scale, 48, 6).view(torch.float8_e4m3fn).float()
    assert torch.equal(per_row, q.scale.repeat_interleave(16, dim=0))  # 16x16 blocks: each row its block's


@pytest.mark.parametrize("gemm", R.GEMMS)
@pytest.mark.parametrize("recipe", ["mxfp8", "mxfp4", "nvfp4"])
def test_every_gemm_of_the_block_scaled_recipes_equals_the_emulation_through_the_documented_layout(
        recipe, gemm, monkeypatch):
    monkeypatch.setattr(torch, "_scaled_mm", fake_scaled_mm)
    g: R.Gemm = getattr(R.get(recipe), gemm)
    assert BW.native_pair(g.lhs.fmt, g.lhs.granularity, g.rhs.fmt, g.rhs.granularity)
    gen = torch.Generator().manual_seed(5)
    a = quantize(torch.randn(40, 200, generator=gen), g.lhs.fmt, g.lhs.granularity)
    b = quantize(torch.randn(56, 200, generator=gen), g.rhs.fmt, g.rhs.granularity)
    want = scaled_mm(a, b, torch.float32, backend=GemmPath.EMULATED)
    got = scaled_mm(a, b, torch.float32, backend=GemmPath.CUBLAS)
    tol = 2 * 201 * 2.0 ** -24 * (a.dequantize(torch.float64).abs() @ b.dequantize(torch.float64).abs().t())
    assert ((got.double() - want.double()).abs() <= tol).all()


def test_the_first_use_check_passes_the_layout_and_refuses_a_misread_one(monkeypatch):
    cpu = torch.device("cpu")
    monkeypatch.setattr(torch, "_scaled_mm", fake_scaled_mm)
    assert BW.CHECK.run(cpu, _cublas, _emulated) is True
    monkeypatch.setattr(torch, "_scaled_mm", lambda *a, **k: fake_scaled_mm(*a, swizzled=False, **k))
    with pytest.warns(UserWarning, match=r"native block-scaled GEMMs \(torch._scaled_mm\) differ from the "
                                         r"emulation on cpu \(mxfp8: .*MX GEMMs run folded there and NVFP4 GEMMs"):
        assert BW.CHECK.run(cpu, _cublas, _emulated) is False


def test_blackwell_takes_the_recipes_pairs_natively_and_no_others():
    C = sys.modules["lowprec.kernels.capability"]
    sm100, sm90 = C.cuda_capability((10, 0)), C.cuda_capability((9, 0))
    assert gemm_path("e4m3", mx(32), "e4m3", mx(32), sm100) is GemmPath.CUBLAS
    assert gemm_path("e2m1", nvfp4(16), "e2m1", nvfp4(16, two_d=True), sm100) is GemmPath.CUBLAS
    assert gemm_path("e2m1", mx(32), "e4m3", mx(32), sm100) is GemmPath.FOLDED  # mixed: folded on FP8
    assert gemm_path("e5m2", mx(32), "e5m2", mx(32), sm100) is GemmPath.EMULATED
    assert gemm_path("e4m3", mx(32), "e4m3", mx(32), sm90) is GemmPath.FOLDED
    assert gemm_path("e2m1", nvfp4(16), "e2m1", nvfp4(16), sm90) is GemmPath.EMULATED


def test_the_checks_problems_are_representable_and_each_format_is_covered():
    names = [name for name, _, _ in BW.CHECK.problems(torch.device("cpu"))]
    assert names == ["mxfp8", "mxfp4", "nvfp4"]
    a, b = integer_operands(torch.device("cpu"), "e4m3", mx(32))
    exact = a.dequantize(torch.float64) @ b.dequantize(torch.float64).t()
    assert torch.equal(scaled_mm(a, b, backend="emulated").double(), exact)
