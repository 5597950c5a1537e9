"""MX and NVFP4 GEMMs on Blackwell's block-scaled tensor cores, through ``torch._scaled_mm``.

[Note: block-scaled GEMMs on Blackwell]
On sm100 and sm120 ``torch._scaled_mm`` multiplies block-scaled operands natively: E4M3 or E5M2 codes, or FP4
codes packed two per byte (``torch.float4_e2m1fn_x2``, element ``2i`` in the low nibble, as
``lowprec.formats.pack`` packs them), with one scale per 32 elements along K in E8M0
(``torch.float8_e8m0fnu``: MXFP8, MXFP4) or per 16 in E4M3 (NVFP4). The scales are passed in the layout the
tensor cores read (cuBLAS's "1D block scaling factors layout"): the ``(rows, K / block)`` matrix padded to
multiples of ``(128, 4)``, cut into tiles of 128 rows x 4 columns stored one after another along the
columns first, each tile of 512 bytes holding entry ``(r, c)`` at ``(r % 32) * 16 + (r // 32) * 4 + c``
(:func:`swizzle`; padding entries are scales of one, multiplying no element). NVFP4's 16x16 weight blocks are
given as 1x16 blocks (each block's scale repeated over its rows), and its FP32 global scales multiply the
FP32 output afterwards, ``a``'s then ``b``'s, as the emulation does.

None of this has run on a Blackwell GPU in this project: the layout is tested on the CPU against an
independent construction (``tests/kernels/test_blackwell.py``), and the path checks itself on a device's
first use (:data:`CHECK`, [Note: GEMM paths that check themselves]) against the emulation on E4M3, E2M1 and
NVFP4 problems; a device where it fails or differs warns once, and its MX GEMMs run folded
(``kernels.fold``), its NVFP4 GEMMs emulated. ``lowprec info --check`` says which.
"""
from __future__ import annotations

import torch

from lowprec import formats as F
from lowprec._checks import fail
from lowprec.kernels.first_use import FirstUseCheck, integer_operands
from lowprec.quant import GranularityKind, QuantizedTensor, mx, nvfp4

E4M3, E5M2, E2M1 = F.get("e4m3"), F.get("e5m2"), F.get("e2m1")
TILE_ROWS, TILE_COLS = 128, 4


def native_pair(lhs_fmt, lhs_gran, rhs_fmt, rhs_gran) -> bool:
    """Whether Blackwell's tensor cores take this pair through ``torch._scaled_mm``: two MX operands with
    blocks of 32 along K, both FP8 (not both E5M2) or both E2M1; or two NVFP4 operands (E2M1, blocks of 16)."""
    a, b = F.get(lhs_fmt), F.get(rhs_fmt)
    kinds = {lhs_gran.kind, rhs_gran.kind}
    if kinds == {GranularityKind.MX}:
        if lhs_gran.block_rows != 1 or rhs_gran.block_rows != 1 or {lhs_gran.block_cols, rhs_gran.block_cols} != {32}:
            return False
        fp8 = a in (E4M3, E5M2) and b in (E4M3, E5M2) and not (a is E5M2 and b is E5M2)
        return fp8 or (a is E2M1 and b is E2M1)
    if kinds == {GranularityKind.NVFP4}:
        return a is E2M1 and b is E2M1 and {lhs_gran.block_cols, rhs_gran.block_cols} == {16}
    return False


def swizzle(scales: torch.Tensor, pad_value: int) -> torch.Tensor:
    """``scales`` (rows, cols), one byte each, in the tensor cores' tiled layout: 1-D, padded to whole tiles
    of 128 x 4 with ``pad_value`` (see [Note: block-scaled GEMMs on Blackwell])."""
    if scales.dim() != 2 or scales.element_size() != 1:
        fail("scales", "a 2-D tensor of one-byte scale codes", f"{scales.dtype}{tuple(scales.shape)}")
    r, c = scales.shape
    rp, cp = -r % TILE_ROWS, -c % TILE_COLS
    padded = torch.nn.functional.pad(scales.view(torch.uint8), (0, cp, 0, rp), value=pad_value)
    rows, cols = padded.shape
    # (row tile, r // 32, r % 32, col tile, c) -> (row tile, col tile, r % 32, r // 32, c)
    tiles = padded.view(rows // TILE_ROWS, 4, 32, cols // TILE_COLS, TILE_COLS)
    return tiles.permute(0, 3, 2, 1, 4).reshape(-1)


def _scale_codes(q: QuantizedTensor) -> torch.Tensor:
    """One scale code per row and block along K: NVFP4's 2-D blocks repeated over their rows."""
    codes = q.scale_codes()
    if q.granularity.block_rows > 1:
        codes = codes.repeat_interleave(q.granularity.block_rows, dim=0)
    return codes


def operands(q: QuantizedTensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(codes, scales)`` of ``q`` as ``torch._scaled_mm`` takes them on Blackwell: rows padded with zero
    codes to a multiple of 16 (its dimensions must be; the caller crops the output), the scales' rows to
    whole tiles of 128."""
    codes = torch.nn.functional.pad(q.data.view(torch.uint8), (0, 0, 0, -q.data.shape[0] % 16))
    if q.fmt is E2M1:
        data = F.pack(codes, E2M1).view(torch.float4_e2m1fn_x2)
    else:
        data = codes.view(q.data.dtype)
    mx_scales = q.granularity.kind is GranularityKind.MX
    one = 127 if mx_scales else 0x38  # 2^0 in E8M0, 1.0 in E4M3
    scale = swizzle(_scale_codes(q), one)
    return data, scale.view(torch.float8_e8m0fnu if mx_scales else torch.float8_e4m3fn)


def block_scaled_mm(a: QuantizedTensor, b: QuantizedTensor, out_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``a (M, K) @ b (N, K).T`` on block-scaled tensor cores (the caller checks :func:`native_pair`)."""
    a_data, sa = operands(a)
    b_data, sb = operands(b)
    nvfp4_pair = a.global_scale is not None or b.global_scale is not None
    out = torch._scaled_mm(a_data, b_data.t(), scale_a=sa, scale_b=sb,
                           out_dtype=torch.float32 if nvfp4_pair else out_dtype)
    if nvfp4_pair:
        for g in (a.global_scale, b.global_scale):
            if g is not None:
                out = out * g
        out = out.to(out_dtype)
    return out


def _problems(device: torch.device) -> list[tuple[str, QuantizedTensor, QuantizedTensor]]:
    """MXFP8, MXFP4 and NVFP4 (16x16 weight blocks) operands of small integers: sums representable."""
    return [("mxfp8", *integer_operands(device, "e4m3", mx(32))),
            ("mxfp4", *integer_operands(device, "e2m1", mx(32))),
            ("nvfp4", *integer_operands(device, "e2m1", (nvfp4(16), nvfp4(16, two_d=True)), k=160, block=16))]


CHECK = FirstUseCheck("native block-scaled GEMMs (torch._scaled_mm)",
                      "MX GEMMs run folded there and NVFP4 GEMMs emulated", _problems)
"""The native path's first-use check (see [Note: GEMM paths that check themselves])."""


__all__ = ["CHECK", "block_scaled_mm", "native_pair", "operands", "swizzle"]
