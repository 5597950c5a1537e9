"""Token rows grouped by expert: each (expert, feature)'s amax over the expert's rows, and the cast with a
scale per (expert, feature) (the weight gradient's transposed operands of experts under a row-wise
recipe), each in one Triton pass.

The amax (:func:`amax_by_group`) reads each tile of rows once and folds it into ``(E, K)`` by an atomic
integer maximum of the absolute values' bits: for non-negative floats the order of the bits is the order
of the values, and every NaN's bits (sign cleared) exceed infinity's, so a NaN anywhere in an expert's
feature makes that amax NaN. A maximum is exact in any order, so the result does not depend on the
schedule: it equals a reduction over each expert's rows, bit for bit (up to a NaN's payload).

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
from lowprec.kernels.triton_numerics import RULE_AMAX, abs_bits, scale_from_amax, to_codes
from lowprec.kernels.triton_plan import SPECIALS
from lowprec.kernels.triton_tiles import divide, divisor_of, hw_fp8, load_tile, to_f32

BM, BK = 64, 64
AM, AK = 64, 128


@triton.jit
def columns_kernel(x_ptr, sxm, sxk, M, K, group_ptr, amax_ptr, dest_ptr, P, out_ptr,
                   BM: tl.constexpr, MOVED: tl.constexpr, BK: tl.constexpr, EVEN: tl.constexpr,
                   EXP: tl.constexpr, MAN: tl.constexpr,
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
    if MOVED:  # each row's padded place
        place = tl.load(dest_ptr + offs_m, mask=offs_m < M, other=0)
    else:
        place = offs_m
    # features-major: (K, P), row t at column place[t]
    to = out_ptr + offs_k[:, None].to(tl.int64) * P + place[None, :]  # int64: past 2^31 codes
    tl.store(to, tl.trans(codes), mask=tl.trans(in_view))


@triton.jit
def group_amax_kernel(x_ptr, sxm, sxk, M, K, group_ptr, out_ptr, BM: tl.constexpr, BK: tl.constexpr,
                      EVEN: tl.constexpr):
    x, pid_m, pid_k, offs_m, offs_k = load_tile(x_ptr, sxm, sxk, M, K, BM, BK, EVEN)
    in_rows = offs_m < M
    bits = abs_bits(to_f32(x))  # ordered as the magnitudes, NaN above infinity
    bits = tl.where(in_rows[:, None] & (offs_k[None, :] < K), bits, 0)
    grp = tl.load(group_ptr + offs_m, mask=in_rows, other=0).to(tl.int32)
    first = tl.min(tl.where(in_rows, grp, 2147483647), axis=0)
    last = tl.max(tl.where(in_rows, grp, -1), axis=0)
    for g in range(first, last + 1):  # the experts of this tile's rows (one, or several small ones)
        m = tl.max(tl.where((grp == g)[:, None], bits, 0), axis=0)
        tl.atomic_max(out_ptr + g * K + offs_k, m, mask=offs_k < K)


def amax_by_group(x2: torch.Tensor, group: torch.Tensor, n_groups: int) -> torch.Tensor:
    """``(n_groups, K)`` float32: the maximum of ``|x2[t, k]|`` over the rows ``t`` of each group (0 for a
    group without rows, NaN where one of its values is NaN); ``x2`` ``(M, K)`` float32, bfloat16 or
    float16 with its rows grouped, ``group`` ``(M,)`` each row's group."""
    m, k = x2.shape
    out = torch.zeros((n_groups, k), dtype=torch.int32, device=x2.device)
    if not x2.numel():
        return out.view(torch.float32)
    x2 = x2 if x2.dtype in (torch.float32, torch.bfloat16, torch.float16) else x2.float()
    grid = (triton.cdiv(m, AM), triton.cdiv(k, AK))
    meta = dict(BM=AM, BK=AK, EVEN=int(m % AM == 0 and k % AK == 0), num_warps=4)
    args = (x2, x2.stride(0), x2.stride(1), m, k, group.contiguous(), out)
    if x2.is_cuda:
        launch.run(group_amax_kernel, grid, args, meta, ("group amax",))
    else:
        group_amax_kernel[grid](*args, **meta)
    return out.view(torch.float32)


def columns_by_group(x2: torch.Tensor, group: torch.Tensor, amax: torch.Tensor, fmt: F.Format,
                     dest: torch.Tensor | None, total: int) -> torch.Tensor:
    """Codes ``(K, total)`` in ``fmt``'s storage dtype, features-major: ``x2[t, k]`` (float32, bfloat16 or
    float16) scaled by ``amax_scale(amax[group[t], k])`` at ``[k, dest[t]]`` (``dest`` None: ``t``), zero
    codes elsewhere; ``group`` ``(M,)`` int64, ``amax`` ``(G, K)`` float32 (NaN for a group whose feature
    holds one)."""
    m, k = x2.shape
    out = (torch.zeros if total != m else torch.empty)((k, total), dtype=torch.uint8, device=x2.device)
    if not x2.numel():
        return out.view(fmt.storage_dtype)
    x2 = x2 if x2.dtype in (torch.float32, torch.bfloat16, torch.float16) else x2.float()
    bits = amax.detach().float().contiguous().view(torch.int32) & 0x7FFFFFFF  # as the amax kernel's
    grid = (triton.cdiv(m, BM), triton.cdiv(k, BK))
    moved = dest is not None
    meta = dict(BM=BM, BK=BK, MOVED=int(moved), EVEN=int(m % BM == 0 and k % BK == 0), EXP=fmt.exp_bits,
                MAN=fmt.man_bits, SPECIAL=SPECIALS[fmt.special], FMAX=fmt.max, EMAX=fmt.emax, RULE=RULE_AMAX,
                HW=int(x2.is_cuda), num_warps=4)
    args = (x2, x2.stride(0), x2.stride(1), m, k, group.contiguous(), bits, dest if moved else group, total, out)
    if x2.is_cuda:
        launch.run(columns_kernel, grid, args, meta, ("columns", fmt.name, moved))
    else:
        columns_kernel[grid](*args, **meta)
    return out.view(fmt.storage_dtype)


__all__ = ["amax_by_group", "columns_by_group"]
