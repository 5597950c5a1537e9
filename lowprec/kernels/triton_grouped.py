"""Token rows grouped by expert: each (expert, feature)'s amax over the expert's rows, the cast with a
scale per (expert, feature) (the weight gradient's transposed operands of experts under a row-wise
recipe), the tokens moved features-major into the padded layout, and each expert's weight codes transposed,
each in one Triton pass.

The amax (:func:`amax_by_group`) reads each tile of rows once and folds it into ``(E, K)`` by an atomic
integer maximum of the absolute values' bits: for non-negative floats the order of the bits is the order
of the values, and every NaN's bits (sign cleared) exceed infinity's, so a NaN anywhere in an expert's
feature makes that amax NaN. A maximum is exact in any order, so the result does not depend on the
schedule: it equals a reduction over each expert's rows, bit for bit (up to a NaN's payload).

Each element ``x[t, k]`` is divided by the scale of ``amax[group[t], k]`` (its expert's amax of that
feature over the expert's tokens, reduced beforehand) and rounded to the format. The scale from an amax,
the correctly rounded division and the rounding to codes are the row-wise cast kernel's own helpers
(``triton_numerics``, ``triton_tiles``), so the codes equal the reference's given the same scales
(``lowprec.quant.quantize`` with a scale per element), bit for bit; see [Note: batched per-expert
casts] in ``lowprec.nn.grouped_casts``.

Both that cast (:func:`columns_by_group`) and the plain move of codes or values (:func:`features_padded`)
write the features-major layout the weight gradient's grouped GEMM reads, each expert's tokens from a
16-aligned column on (``grouped_gemm.token_padding``). A program owns a tile of that output and gathers
the rows it holds through each padded column's source row (-1 for the zeros between experts), so its
stores run along the output's contiguous columns; scattering row tiles to their places instead (the
first version) left the stores strided by the output's width, at about a twentieth of the H200's
bandwidth (BENCHMARKS.md, run 56).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from lowprec import formats as F
from lowprec.kernels import triton_launch as launch
from lowprec.kernels.ops import as_operators, define
from lowprec.kernels.triton_numerics import RULE_AMAX, abs_bits, scale_from_amax, to_codes
from lowprec.kernels.triton_plan import SPECIALS
from lowprec.kernels.triton_tiles import divide, divisor_of, hw_fp8, load_tile, to_f32

CAST_TILE, MOVE_TILE = (32, 128), (128, 128)
"""Output tiles (padded columns x features) of the padded features-major kernel, casting and moving: the
fastest of seven shapes on one H200 for 65536 routed rows of 1024 features (0.16 ms and 0.04 ms; BENCHMARKS.md,
run 57)."""
TRANSPOSE_TILE = (64, 64)
"""Tiles (rows of the input x its columns) of the experts' transposed copy."""
AM, AK = 128, 128
"""Tiles of the per-(expert, feature) amax: 128 rows (each program's atomics fold twice the rows of 64)
took 65,536 routed rows of 1024 features from 67 to 51 us and of 512 from 55 to 51 on the H200 (run 72)."""


@triton.jit
def padded_kernel(x_ptr, sxm, sxk, M, K, src_ptr, group_ptr, amax_ptr, P, out_ptr,
                  BP: tl.constexpr, BK: tl.constexpr, MOVED: tl.constexpr, CAST: tl.constexpr,
                  EXP: tl.constexpr, MAN: tl.constexpr, SPECIAL: tl.constexpr, FMAX: tl.constexpr,
                  EMAX: tl.constexpr, RULE: tl.constexpr, HW: tl.constexpr):
    # one tile of the output (BK features x BP padded columns), gathered from the rows it holds
    offs_p = tl.program_id(0) * BP + tl.arange(0, BP)
    offs_k = tl.program_id(1) * BK + tl.arange(0, BK)
    if MOVED:  # each padded column's row, -1 for the zeros between experts
        src = tl.load(src_ptr + offs_p, mask=offs_p < P, other=-1)
    else:
        src = tl.where(offs_p < M, offs_p, -1)
    live = src >= 0
    take = live[:, None] & (offs_k[None, :] < K)
    x = tl.load(x_ptr + src[:, None].to(tl.int64) * sxm + offs_k[None, :] * sxk, mask=take, other=0)
    if CAST:
        v = to_f32(x)
        grp = tl.load(group_ptr + src, mask=live, other=0)
        a = tl.load(amax_ptr + grp[:, None] * K + offs_k[None, :], mask=take, other=0)  # amax bits
        s = scale_from_amax(a, 1.0, RULE, FMAX, EMAX)
        d, r, dead, ok = divisor_of(s)
        scaled = divide(v, d, r, ok, 1)
        nan_sign = (v.to(tl.int32, bitcast=True) >> 31) & 1  # a NaN keeps the input's sign
        if HW and (MAN + EXP == 7):
            codes = hw_fp8(scaled, nan_sign, EXP, False)
        else:
            codes = to_codes(scaled, nan_sign, scaled, EXP, MAN, SPECIAL, True, False)
        y = tl.where(dead | ~take, 0, codes).to(tl.uint8)
    else:  # the bits moved as they are
        y = x
    # features-major (K, P): contiguous along the padded columns (int64: past 2^31 elements)
    to = out_ptr + offs_k[None, :].to(tl.int64) * P + offs_p[:, None]
    tl.store(to, y, mask=(offs_p[:, None] < P) & (offs_k[None, :] < K))


@triton.jit
def transpose_kernel(x_ptr, R, K, out_ptr, BR: tl.constexpr, BK: tl.constexpr):
    # one tile of expert program_id(2)'s (K, R) output from its (R, K) input, the bits moved as they are;
    # loaded along K and stored along R (a transpose in registers), so both run along contiguous memory
    e = tl.program_id(2).to(tl.int64)
    offs_r = tl.program_id(0) * BR + tl.arange(0, BR)
    offs_k = tl.program_id(1) * BK + tl.arange(0, BK)
    base = e * R * K
    take = (offs_r[:, None] < R) & (offs_k[None, :] < K)
    x = tl.load(x_ptr + base + offs_r[:, None].to(tl.int64) * K + offs_k[None, :], mask=take, other=0)
    to = out_ptr + base + offs_k[:, None].to(tl.int64) * R + offs_r[None, :]
    tl.store(to, tl.trans(x), mask=(offs_k[:, None] < K) & (offs_r[None, :] < R))


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


def _amax_by_group(x2: torch.Tensor, group: torch.Tensor, n_groups: int) -> torch.Tensor:
    """The pass of :func:`amax_by_group`."""
    m, k = x2.shape
    out = torch.zeros((n_groups, k), dtype=torch.int32, device=x2.device)
    if not x2.numel():
        return out.view(torch.float32)
    x2 = x2 if x2.dtype in (torch.float32, torch.bfloat16, torch.float16) else x2.float()
    grid = (triton.cdiv(m, AM), triton.cdiv(k, AK))
    meta = dict(BM=AM, BK=AK, EVEN=int(m % AM == 0 and k % AK == 0), num_warps=4)
    args = (x2, x2.stride(0), x2.stride(1), m, k, group.contiguous(), out)
    launch.launch(group_amax_kernel, grid, args, meta, ("group amax",), x2.is_cuda)
    return out.view(torch.float32)


@triton.jit
def scales_kernel(amax_ptr, amax_out, scale_out, N, BLOCK: tl.constexpr, FMAX: tl.constexpr, EMAX: tl.constexpr,
                  RULE: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    live = offs < N
    bits = tl.load(amax_ptr + offs, mask=live, other=0)
    magnitude = bits & 0x7FFFFFFF
    nan = magnitude > 0x7F800000
    tl.store(amax_out + offs, tl.where(nan, 0x7FC00000, bits), mask=live)  # one NaN, as torch.nan
    # a finite amax keeps its sign (a negative one scales by 1, as the reference's), inf and NaN give NaN
    s = scale_from_amax(tl.where(magnitude < 0x7F800000, bits, magnitude), 1.0, RULE, FMAX, EMAX)
    tl.store(scale_out + offs, s, mask=live)


def _amax_scales(amax: torch.Tensor, fmt: F.Format) -> tuple[torch.Tensor, torch.Tensor]:
    """The pass of :func:`amax_scales`."""
    src = amax.detach().float().contiguous()
    out_amax, out_scale = torch.empty_like(src), torch.empty_like(src)
    n = src.numel()
    if not n:
        return out_amax, out_scale
    block = 1024
    grid = (triton.cdiv(n, block),)
    args = (src.view(torch.int32), out_amax.view(torch.int32), out_scale, n)
    meta = dict(BLOCK=block, FMAX=fmt.max, EMAX=fmt.emax, RULE=RULE_AMAX, num_warps=4)
    launch.launch(scales_kernel, grid, args, meta, ("amax scales", fmt.name), src.is_cuda)
    return out_amax, out_scale


def _bits(t: torch.Tensor) -> torch.Tensor:
    """``t`` viewed as integers of its width (its bits moved as they are: NaN payloads too)."""
    return t.view({1: torch.uint8, 2: torch.int16, 4: torch.int32}[t.element_size()])


def _padded(x2: torch.Tensor, sources: torch.Tensor | None, total: int, out: torch.Tensor, group, bits,
            cast: dict, key: tuple) -> None:
    m, k = x2.shape
    bp, bk = CAST_TILE if cast["CAST"] else MOVE_TILE
    grid = (triton.cdiv(total, bp), triton.cdiv(k, bk))
    moved = sources is not None
    meta = dict(BP=bp, BK=bk, MOVED=int(moved), num_warps=4, **cast)
    args = (x2, x2.stride(0), x2.stride(1), m, k, sources if moved else out, group, bits, total, out)
    launch.launch(padded_kernel, grid, args, meta, key + (moved,), x2.is_cuda)


_COPY = dict(CAST=0, EXP=0, MAN=0, SPECIAL=0, FMAX=0.0, EMAX=0, RULE=0, HW=0)


def _columns_by_group(x2: torch.Tensor, group: torch.Tensor, amax: torch.Tensor, fmt: F.Format,
                     sources: torch.Tensor | None, total: int) -> torch.Tensor:
    """The pass of :func:`columns_by_group`."""
    m, k = x2.shape
    out = torch.empty((k, total), dtype=torch.uint8, device=x2.device)  # every element written
    if not out.numel():
        return out.view(fmt.storage_dtype)
    x2 = x2 if x2.dtype in (torch.float32, torch.bfloat16, torch.float16) else x2.float()
    bits = amax.detach().float().contiguous().view(torch.int32) & 0x7FFFFFFF  # as the amax kernel's
    cast = dict(CAST=1, EXP=fmt.exp_bits, MAN=fmt.man_bits, SPECIAL=SPECIALS[fmt.special], FMAX=fmt.max,
                EMAX=fmt.emax, RULE=RULE_AMAX, HW=int(x2.is_cuda))
    _padded(x2, sources, total, out, group.contiguous(), bits, cast, ("columns", fmt.name))
    return out.view(fmt.storage_dtype)


def _features_padded(rows: torch.Tensor, sources: torch.Tensor | None, total: int) -> torch.Tensor:
    """The pass of :func:`features_padded`."""
    m, k = rows.shape
    out = torch.empty((k, total), dtype=rows.dtype, device=rows.device)
    if out.numel():
        raw = _bits(rows)
        _padded(raw, sources, total, _bits(out), raw, raw, _COPY, ("features padded", rows.element_size()))
    return out


def _transposed(x: torch.Tensor) -> torch.Tensor:
    """The pass of :func:`transposed`."""
    e, r, k = x.shape
    out = torch.empty((e, k, r), dtype=x.dtype, device=x.device)
    if out.numel():
        src = _bits(x.contiguous())
        br, bk = TRANSPOSE_TILE
        grid = (triton.cdiv(r, br), triton.cdiv(k, bk), e)
        launch.launch(transpose_kernel, grid, (src, r, k, _bits(out)), dict(BR=br, BK=bk, num_warps=4),
                      ("transposed", x.element_size()), x.is_cuda)
    return out


# [Note: how kernels become operators] in lowprec.kernels.ops: compiled graphs (and Python dispatch modes)
# call these passes as operators, eager code calls them directly. A format travels by its name.


def _amax_by_group_fake(x2, group, n_groups):
    return x2.new_empty((n_groups, x2.shape[1]), dtype=torch.float32)


def _amax_scales_op(amax, fmt):
    return _amax_scales(amax, F.get(fmt))


def _amax_scales_fake(amax, fmt):
    return torch.empty_like(amax, dtype=torch.float32), torch.empty_like(amax, dtype=torch.float32)


def _columns_op(x2, group, amax, fmt, sources, total):
    return _columns_by_group(x2, group, amax, F.get(fmt), sources, total)


def _columns_fake(x2, group, amax, fmt, sources, total):
    return x2.new_empty((x2.shape[1], total), dtype=F.get(fmt).storage_dtype)


def _features_fake(rows, sources, total):
    return rows.new_empty((rows.shape[1], total))


_GROUP_AMAX = define("group_amax(Tensor x, Tensor group, int n_groups) -> Tensor", _amax_by_group,
                     _amax_by_group_fake)
_AMAX_SCALES = define("amax_scales(Tensor amax, str fmt) -> (Tensor, Tensor)", _amax_scales_op, _amax_scales_fake)
_COLUMNS = define("columns_by_group(Tensor x, Tensor group, Tensor amax, str fmt, Tensor? sources, int total) "
                  "-> Tensor", _columns_op, _columns_fake)
_FEATURES = define("features_padded(Tensor rows, Tensor? sources, int total) -> Tensor", _features_padded,
                   _features_fake)
_TRANSPOSED = define("transposed(Tensor x) -> Tensor", _transposed,
                     lambda x: x.new_empty((x.shape[0], x.shape[2], x.shape[1])))


def amax_by_group(x2: torch.Tensor, group: torch.Tensor, n_groups: int) -> torch.Tensor:
    """``(n_groups, K)`` float32: the maximum of ``|x2[t, k]|`` over the rows ``t`` of each group (0 for a
    group without rows, NaN where one of its values is NaN); ``x2`` ``(M, K)`` float32, bfloat16 or
    float16 with its rows grouped, ``group`` ``(M,)`` each row's group."""
    return (_GROUP_AMAX if as_operators() else _amax_by_group)(x2, group, n_groups)


def amax_scales(amax: torch.Tensor, fmt: F.Format) -> tuple[torch.Tensor, torch.Tensor]:
    """``(amax with every NaN torch.nan's, amax_scale(amax, fmt))`` of a float32 ``amax`` (each expert's,
    or each expert and feature's), in one pass in place of the reference's seven small ones: the scale from
    the amax by the cast kernels' own helper, bit for bit the reference's."""
    return _AMAX_SCALES(amax, fmt.name) if as_operators() else _amax_scales(amax, fmt)


def columns_by_group(x2: torch.Tensor, group: torch.Tensor, amax: torch.Tensor, fmt: F.Format,
                     sources: torch.Tensor | None, total: int) -> torch.Tensor:
    """Codes ``(K, total)`` in ``fmt``'s storage dtype, features-major: ``x2[t, k]`` (float32, bfloat16 or
    float16) scaled by ``amax_scale(amax[group[t], k])`` at ``[k, p]`` where ``sources[p] == t`` (``sources``
    None: ``p == t``), zero codes where ``sources[p]`` is -1; ``group`` ``(M,)`` int64, ``amax`` ``(G, K)``
    float32 (NaN for a group whose feature holds one)."""
    if as_operators():
        return _COLUMNS(x2, group, amax, fmt.name, sources, total)
    return _columns_by_group(x2, group, amax, fmt, sources, total)


def features_padded(rows: torch.Tensor, sources: torch.Tensor | None, total: int) -> torch.Tensor:
    """``(K, total)``: token rows ``(T, K)`` (codes or values, their bits as they are) transposed, column
    ``p`` holding row ``sources[p]`` (``sources`` None: row ``p``), zeros where ``sources[p]`` is -1."""
    return (_FEATURES if as_operators() else _features_padded)(rows, sources, total)


def transposed(x: torch.Tensor) -> torch.Tensor:
    """``(E, K, R)``, contiguous: each expert's ``x[e]`` (``(E, R, K)``: codes or values, their bits as they
    are) transposed, as ``x.transpose(1, 2).contiguous()`` makes it (which on the H200 moves one-byte codes at
    about a sixth of the bandwidth: BENCHMARKS.md, run 84)."""
    return (_TRANSPOSED if as_operators() else _transposed)(x)


__all__ = ["amax_by_group", "amax_scales", "columns_by_group", "features_padded", "transposed"]
