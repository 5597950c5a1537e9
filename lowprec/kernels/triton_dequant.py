"""Fused dequantization: codes x block scales -> BF16, in one pass.

It decodes each code by bit operations, multiplies by its block's scale in float32 and rounds the
product to BF16 as torch does, so it equals ``QuantizedTensor.dequantize(torch.bfloat16)`` bit for bit
(without NVFP4's global scale). Two uses:

* emulated GEMMs: a device without MX/NVFP4 tensor cores (Hopper) runs them on the exact quantized
  values in BF16 with FP32 accumulation. Element times block scale is exact in BF16 whenever the
  element's and the scale's significands fit its 8 bits together (FP8/FP6/FP4 elements with E8M0 or
  E4M3 scales; see ``gemm.exact_in_bf16``), so nothing is lost there. NVFP4's global FP32 scale
  multiplies the GEMM's output instead (it would not be exact here);
* FP8 saved activations (``lowprec.nn.saved``) in an eager backward: 3 bytes moved per value where the
  reference's float32 temporaries move about 19.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from lowprec.kernels.ops import define
from lowprec.kernels.triton_numerics import bf16_bits, decode_codes
from lowprec.kernels.triton_tiles import _expand
from lowprec.quant import QuantizedTensor


@triton.jit
def dequant_kernel(data_ptr, scale_ptr, out_ptr, R, C, s_rows, s_cols, EXP: tl.constexpr, MAN: tl.constexpr,
                   NATIVE: tl.constexpr, BR: tl.constexpr, BC: tl.constexpr, BM: tl.constexpr, BK: tl.constexpr,
                   EVEN: tl.constexpr):
    """One ``BM x BK`` tile (whole blocks) of ``decode(codes) * block scale`` in BF16."""
    pid_m = tl.program_id(0)
    pid_k = tl.program_id(1)
    offs_m = pid_m * BM + tl.arange(0, BM)
    offs_k = pid_k * BK + tl.arange(0, BK)
    ptrs = offs_m[:, None] * C + offs_k[None, :]
    if EVEN:
        c = tl.load(data_ptr + ptrs)
    else:
        c = tl.load(data_ptr + ptrs, mask=(offs_m[:, None] < R) & (offs_k[None, :] < C), other=0)
    if NATIVE:  # float8 storage: the hardware's upcast is exact
        if EXP == 4:
            v = c.to(tl.float8e4nv, bitcast=True).to(tl.float32)
        else:
            v = c.to(tl.float8e5, bitcast=True).to(tl.float32)
    else:
        v = decode_codes(c.to(tl.int32), EXP, MAN)
    bi = pid_m * (BM // BR) + tl.arange(0, BM // BR)
    bj = pid_k * (BK // BC) + tl.arange(0, BK // BC)
    s = tl.load(scale_ptr + bi[:, None] * s_cols + bj[None, :], mask=(bi[:, None] < s_rows) & (bj[None, :] < s_cols),
                other=1.0)  # (BM / BR, BK / BC): one scale per block, broadcast below
    out = bf16_bits(v * _expand(s, BM, BK, BR, BC))  # the float32 product rounded as torch rounds it
    if EVEN:
        tl.store(out_ptr + ptrs, out)
    else:
        tl.store(out_ptr + ptrs, out, mask=(offs_m[:, None] < R) & (offs_k[None, :] < C))


def dequantize_blocks(data: torch.Tensor, scale: torch.Tensor, exp_bits: int, man_bits: int) -> torch.Tensor:
    """``decode(data) * scale`` per block, as BF16 (blocks from the shapes of data and scale; their
    edges must be powers of two up to 128)."""
    r, c = data.shape
    out = torch.empty(r, c, dtype=torch.bfloat16, device=data.device)
    br, bc = r // scale.shape[0], c // scale.shape[1]
    bm, bk = max(64, br), max(128, bc)
    native = data.dtype in (torch.float8_e4m3fn, torch.float8_e5m2) and data.is_cuda
    grid = (triton.cdiv(r, bm), triton.cdiv(c, bk))
    dequant_kernel[grid](data.view(torch.uint8), scale.contiguous(), out.view(torch.int16), r, c,
                         scale.shape[0], scale.shape[1],
                         EXP=exp_bits, MAN=man_bits, NATIVE=native, BR=br, BC=bc, BM=bm, BK=bk,
                         EVEN=r % bm == 0 and c % bk == 0, num_warps=8)
    return out


dequantize_bf16 = define(
    "dequantize_bf16(Tensor data, Tensor scale, int exp_bits, int man_bits) -> Tensor", dequantize_blocks,
    lambda data, scale, exp_bits, man_bits: data.new_empty(data.shape, dtype=torch.bfloat16))
""":func:`dequantize_blocks` as an operator (see [Note: how kernels become operators] in ``lowprec.kernels.ops``)."""


def block_values_bf16(q: QuantizedTensor) -> torch.Tensor:
    """The padded 2-D values ``decode(data) * scale`` of a block-scaled ``q`` in BF16 (NVFP4's global
    scale left out); the op in a compiled graph, a direct call in eager mode."""
    fn = dequantize_bf16 if torch.compiler.is_compiling() else dequantize_blocks
    return fn(q.data, q.scale, q.fmt.exp_bits, q.fmt.man_bits)
