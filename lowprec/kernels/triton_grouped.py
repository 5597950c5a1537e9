"""The cast of token rows grouped by expert with a scale per (expert, feature): the weight gradient's
transposed operands of experts under a row-wise recipe, in one Triton pass.

Each element ``x[t, k]`` is divided by the scale of ``amax[group[t], k]`` (its expert's amax of that
feature over the expert's tokens, reduced beforehand) and rounded to the format. The tile, the scale
from an amax, the correctly rounded division and the rounding to codes are the row-wise cast kernel's own
helpers (``triton_tiles``, ``triton_numerics``), so the codes equal the reference's given the same scales
(``lowprec.quant.quantize`` with a scale per element), bit for bit; see [Note: batched per-expert
casts] in ``lowprec.nn.grouped_casts``.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from lowprec import formats as F
from lowprec.kernels import triton_launch as launch
from lowprec.kernels.triton_numerics import RULE_AMAX, scale_from_amax, to_codes
from lowprec.kernels.triton_plan import SPECIALS
from lowprec.kernels.triton_tiles import divide, divisor_of, hw_fp8, load_tile, to_f32

BM, BK = 64, 64


@triton.jit
def columns_kernel(x_ptr, sxm, sxk, M, K, group_ptr, amax_ptr, out_ptr,
                   BM: tl.constexpr, BK: tl.constexpr, EVEN: tl.constexpr, EXP: tl.constexpr, MAN: tl.constexpr,
                   SPECIAL: tl.constexpr, FMAX: tl.constexpr, EMAX: tl.constexpr, RULE: tl.constexpr,
                   HW: tl.constexpr):
    x, pid_m, pid_k, offs_m, offs_k = load_tile(x_ptr, sxm, sxk, M, K, BM, BK, EVEN)
    v = to_f32(x)
    in_view = (offs_m[:, None] < M) & (offs_k[None, :] < K)
    grp = tl.load(group_ptr + offs_m, mask=offs_m < M, other=0)
    a = tl.load(amax_ptr + grp[:, None] * K + offs_k[None, :], mask=in_view, other=0)  # amax bits
    s = scale_from_amax(a, 1.0, RULE, FMAX, EMAX)
    d, r, dead, ok = divisor_of(s)
    scaled = divide(v, d, r, ok, 1)
    nan_sign = (v.to(tl.int32, bitcast=True) >> 31) & 1  # a NaN keeps the input's sign
    if HW and (MAN + EXP == 7):
        codes = hw_fp8(scaled, nan_sign, EXP, False)
    else:
        codes = to_codes(scaled, nan_sign, scaled, EXP, MAN, SPECIAL, True, False)
    codes = tl.where(dead, 0, codes).to(tl.uint8)
    tl.store(out_ptr + offs_m[:, None] * K + offs_k[None, :], codes, mask=in_view)


def columns_by_group(x2: torch.Tensor, group: torch.Tensor, amax: torch.Tensor, fmt: F.Format) -> torch.Tensor:
    """Codes ``(M, K)`` in ``fmt``'s storage dtype: ``x2[t, k]`` (float32, bfloat16 or float16) scaled by
    ``amax_scale(amax[group[t], k])``; ``group`` ``(M,)`` int64, ``amax`` ``(G, K)`` float32 (NaN for a
    group whose feature holds one)."""
    m, k = x2.shape
    x2 = x2 if x2.dtype in (torch.float32, torch.bfloat16, torch.float16) else x2.float()
    out = torch.empty((m, k), dtype=torch.uint8, device=x2.device)
    if not x2.numel():
        return out.view(fmt.storage_dtype)
    bits = amax.detach().float().contiguous().view(torch.int32) & 0x7FFFFFFF  # as the amax kernel's
    grid = (triton.cdiv(m, BM), triton.cdiv(k, BK))
    meta = dict(BM=BM, BK=BK, EVEN=int(m % BM == 0 and k % BK == 0), EXP=fmt.exp_bits, MAN=fmt.man_bits,
                SPECIAL=SPECIALS[fmt.special], FMAX=fmt.max, EMAX=fmt.emax, RULE=RULE_AMAX,
                HW=int(x2.is_cuda), num_warps=4)
    args = (x2, x2.stride(0), x2.stride(1), m, k, group.contiguous(), bits, out)
    if x2.is_cuda:
        launch.run(columns_kernel, grid, args, meta, ("columns", fmt.name))
    else:
        columns_kernel[grid](*args, **meta)
    return out.view(fmt.storage_dtype)


__all__ = ["columns_by_group"]
