"""Every expert's FP8 GEMM in one Triton launch, for the operand pairs PyTorch's grouped FP8 GEMM refuses
(E5M2 gradients times E4M3: ``fp8-current``'s input and weight gradients) and for the weight gradients it
runs slower (E4M3 without fast accumulation: ``fp8-rowwise``'s).

[Note: grouped FP8 GEMMs in Triton]
The two kinds of ``kernels.grouped_gemm`` ([Note: one grouped GEMM for the experts]), with the same
operands and scales:

* :data:`~lowprec.kernels.grouped_gemm.ROWS` (:func:`grouped_rows`): token rows ``a`` ``(T, K)`` times each
  expert's ``b[e]`` ``(N, K)``. Each ``BLOCK_M`` rows of one expert is a tile, so no tile mixes experts and
  nothing is padded; a program finds its tile (expert, first row, end) from the cumulative offsets on the
  device (:func:`_find_tile`: the experts' tile counts, their running sum, and the first expert whose sum
  passes the program's index), so the host needs no count and the grid is sized by the rows alone: at most
  ``cdiv(T, BLOCK_M) + E - 1`` tiles, the programs past the last tile returning at once. Each program runs
  one tile against one block of ``b[e]``'s rows;
* :data:`~lowprec.kernels.grouped_gemm.FEATURES` (:func:`grouped_features`): each expert's features over
  its own tokens, from the features-major layout of ``grouped_gemm.features_padded`` (``(M, P)`` and ``(N,
  P)``, each expert's tokens from a 16-aligned column on, zero codes between): a program runs one
  ``(expert, M block, N block)`` and walks K over that expert's columns only (an expert without tokens
  writes zeros).

Both multiply the codes as FP8 on the tensor cores (``tl.dot`` of float8 tiles; every product of two FP8
values is exact in FP32) and scale the FP32 sum once in the epilogue, ``acc * row scale * column scale``,
as the grouped torch kernel does; BF16 outputs are rounded to nearest even on the bits. Hopper's FP8 MMA
keeps fewer bits than FP32 while it accumulates (about 14, DeepSeek-V3 reports), so each ``BLOCK_K`` chunk
(128 products) is summed by the tensor core alone and then added to an FP32 accumulator in registers, as
DeepGEMM promotes every 128 (``max_num_imprecise_acc``: Triton's default on sm90 keeps all of K inside
the MMA). Accumulating all of K there put the input gradients of ``moe-1b``'s experts 1.2% (relative norm)
from the per-expert cuBLAS GEMMs on the H200, where PyTorch's grouped kernel is 4e-4 off. A forward GEMM
whose plan asks for cuBLAS's fast accumulation (the recipes' forward) gets the same from the rows kernel
(``fast_accum``): all of K inside the MMA.
So they equal the per-expert GEMMs up to the order of the FP32 sums and the tensor core's accumulation,
and bit for bit where every partial sum is representable. ``kernels.grouped_gemm`` checks them on a
device's first use as it checks PyTorch's.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from lowprec.kernels import triton_launch as launch
from lowprec.kernels.ops import as_operators, define
from lowprec.kernels.triton_block_mx import store_tile

BM, BN, BK = 128, 128, 128
"""Tiles: 128 rows of one expert, 128 columns, 128 along K (four K steps of the FP8 MMA per load)."""
WARPS, STAGES, FEATURE_STAGES = 8, 3, 4
"""Warps and pipeline stages; the weight gradient's kernel with four stages was 3% faster on the H200 (run 57)."""


@triton.jit
def _k_tile(ptr, rows, k, row_stride, K, EVEN_K: tl.constexpr):
    """``(len(rows), BK)`` codes of ``rows`` at columns ``k`` (zero past ``K``)."""
    ptrs = ptr + rows[:, None].to(tl.int64) * row_stride + k[None, :]
    if EVEN_K:
        return tl.load(ptrs)
    return tl.load(ptrs, mask=k[None, :] < K, other=0.0)


@triton.jit
def _find_tile(ends_ptr, tile, E, EP: tl.constexpr, BLOCK_M: tl.constexpr):
    """``(expert, first row, end)`` of the ``tile``-th tile of ``BLOCK_M`` rows of one expert, experts in order
    (``expert`` is ``E`` past the last tile); ``ends`` the ``E`` cumulative offsets, ``EP`` a power of two
    at least ``E``."""
    idx = tl.arange(0, EP)
    live = idx < E
    end = tl.load(ends_ptr + idx, mask=live, other=0)
    start = tl.load(ends_ptr + idx - 1, mask=live & (idx > 0), other=0)
    n_tiles = tl.where(live, (end - start + BLOCK_M - 1) // BLOCK_M, 0)
    through = tl.cumsum(n_tiles, 0)  # tiles of the experts up to each one
    e = tl.sum((through <= tile).to(tl.int32), 0)  # experts whose tiles all come before this one
    mine = idx == e
    first = tl.sum(tl.where(mine, start + (tile - (through - n_tiles)) * BLOCK_M, 0), 0)
    return e, first, tl.sum(tl.where(mine, end, 0), 0)


@triton.jit
def rows_kernel(a_ptr, sa_ptr, b_ptr, sb_ptr, ends_ptr, out_ptr, N, K, E, OUT_BF16: tl.constexpr,
                EVEN_K: tl.constexpr, FAST: tl.constexpr, EP: tl.constexpr, BLOCK_M: tl.constexpr,
                BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """One tile of rows of one expert times one block of its weight's rows: ``out[r, n] = sa[r] * sb[e, n] *
    sum_k a[r, k] b[e, n, k]``."""
    e, first, end = _find_tile(ends_ptr, tl.program_id(0), E, EP, BLOCK_M)
    if e >= E:  # past the last tile (the grid is sized by the rows alone)
        return
    pid_n = tl.program_id(1)
    offs_m = first + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rows_a = tl.minimum(offs_m, end - 1)  # rows past the tile's end read its last: never stored
    rows_b = e.to(tl.int64) * N + tl.minimum(offs_n, N - 1)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        a = _k_tile(a_ptr, rows_a, k, K, K, EVEN_K)
        b = _k_tile(b_ptr, rows_b, k, K, K, EVEN_K)
        if FAST:  # all of K inside the MMA, as cuBLAS's fast accumulation
            acc = tl.dot(a, tl.trans(b), acc)
        else:
            acc = tl.dot(a, tl.trans(b), acc, max_num_imprecise_acc=BLOCK_K)  # promoted every BLOCK_K: the Note
    sa = tl.load(sa_ptr + rows_a)
    sb = tl.load(sb_ptr + rows_b)
    acc = acc * sa[:, None] * sb[None, :]
    store_tile(out_ptr, acc, offs_m, offs_n, end, N, OUT_BF16)


@triton.jit
def features_kernel(a_ptr, sa_ptr, b_ptr, sb_ptr, ends_ptr, out_ptr, M, N, P, OUT_BF16: tl.constexpr,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """One ``(expert, M block, N block)``: ``out[e, m, n] = sa[e, m] * sb[e, n] * sum_t a[m, t] b[n, t]`` over
    the expert's columns ``t`` of the features-major ``a`` ``(M, P)`` and ``b`` ``(N, P)``."""
    e = tl.program_id(0)
    tiles_n = tl.cdiv(N, BLOCK_N)
    pid_m = tl.program_id(1) // tiles_n
    pid_n = tl.program_id(1) % tiles_n
    # each expert's columns start and end at multiples of 16 (the padding): told to the compiler, its loads
    # along the tokens are 16 bytes wide (unhinted, every code was a load of its own)
    start = tl.multiple_of(tl.load(ends_ptr + e - 1, mask=e > 0, other=0), 16)
    end = tl.multiple_of(tl.load(ends_ptr + e), 16)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rows_a = tl.minimum(offs_m, M - 1)
    rows_b = tl.minimum(offs_n, N - 1)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(start, end, BLOCK_K):  # the expert's columns: zero codes past its end add nothing
        k = k0 + tl.arange(0, BLOCK_K)
        a = _k_tile(a_ptr, rows_a, k, P, end, False)
        b = _k_tile(b_ptr, rows_b, k, P, end, False)
        acc = tl.dot(a, tl.trans(b), acc, max_num_imprecise_acc=BLOCK_K)  # promoted every BLOCK_K: the Note
    sa = tl.load(sa_ptr + e * M + rows_a)
    sb = tl.load(sb_ptr + e * N + rows_b)
    acc = acc * sa[:, None] * sb[None, :]
    store_tile(out_ptr + e.to(tl.int64) * M * N, acc, offs_m, offs_n, M, N, OUT_BF16)


def _output(shape: tuple[int, ...], out_dtype: torch.dtype, device) -> tuple[torch.Tensor, torch.Tensor, bool]:
    bf16 = out_dtype == torch.bfloat16
    out = torch.empty(shape, dtype=torch.bfloat16 if bf16 else torch.float32, device=device)
    return out, (out.view(torch.int16) if bf16 else out), bf16


def _launch_options(device: torch.device, stages: int = STAGES) -> dict:
    return dict(num_warps=WARPS, num_stages=stages) if device.type == "cuda" else {}


def _grouped_rows(a: torch.Tensor, a_scales: torch.Tensor, b: torch.Tensor, b_scales: torch.Tensor,
                 ends: torch.Tensor, out_dtype: torch.dtype, fast_accum: bool = False) -> torch.Tensor:
    """The launch of :func:`grouped_rows`."""
    t, k = a.shape
    e, n = b.shape[:2]
    out, raw, bf16 = _output((t, n), out_dtype, a.device)
    if t == 0 or n == 0:
        return out.to(out_dtype)
    grid = (triton.cdiv(t, BM) + e - 1, triton.cdiv(n, BN))  # every expert's tiles, and a few that return
    args = (a.contiguous(), a_scales.float().contiguous(), b.contiguous(), b_scales.float().contiguous(),
            ends.to(torch.int32).contiguous(), raw, n, k, e)
    meta = dict(OUT_BF16=bf16, EVEN_K=k % BK == 0, FAST=fast_accum, EP=max(16, triton.next_power_of_2(e)),
                BLOCK_M=BM, BLOCK_N=BN, BLOCK_K=BK, **_launch_options(a.device))
    launch.launch(rows_kernel, grid, args, meta, ("grouped rows", bf16, k % BK == 0, fast_accum), a.is_cuda)
    return out if bf16 else out.to(out_dtype)


def _grouped_features(a_t: torch.Tensor, a_scales: torch.Tensor, b_t: torch.Tensor, b_scales: torch.Tensor,
                     ends: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    """The launch of :func:`grouped_features`."""
    (m, p), n, e = a_t.shape, b_t.shape[0], ends.shape[0]
    out, raw, bf16 = _output((e, m, n), out_dtype, a_t.device)
    if out.numel() == 0:
        return out.to(out_dtype)
    grid = (e, triton.cdiv(m, BM) * triton.cdiv(n, BN))
    args = (a_t.contiguous(), a_scales.float().contiguous(), b_t.contiguous(), b_scales.float().contiguous(),
            ends.to(torch.int32).contiguous(), raw, m, n, p)
    meta = dict(OUT_BF16=bf16, BLOCK_M=BM, BLOCK_N=BN, BLOCK_K=BK, **_launch_options(a_t.device, FEATURE_STAGES))
    launch.launch(features_kernel, grid, args, meta, ("grouped features", bf16), a_t.is_cuda)
    return out if bf16 else out.to(out_dtype)




# [Note: how kernels become operators] in lowprec.kernels.ops: compiled graphs call these GEMMs as operators


def _rows_fake(a, a_scales, b, b_scales, ends, out_dtype, fast_accum):
    return a.new_empty((a.shape[0], b.shape[1]), dtype=out_dtype)


def _features_fake(a_t, a_scales, b_t, b_scales, ends, out_dtype):
    return a_t.new_empty((ends.shape[0], a_t.shape[0], b_t.shape[0]), dtype=out_dtype)


_ROWS = define("grouped_rows(Tensor a, Tensor a_scales, Tensor b, Tensor b_scales, Tensor ends, ScalarType out_dtype, "
               "bool fast_accum) -> Tensor", _grouped_rows, _rows_fake)
_FEATURES = define("grouped_features(Tensor a_t, Tensor a_scales, Tensor b_t, Tensor b_scales, Tensor ends, "
                   "ScalarType out_dtype) -> Tensor", _grouped_features, _features_fake)


def grouped_rows(a: torch.Tensor, a_scales: torch.Tensor, b: torch.Tensor, b_scales: torch.Tensor,
                 ends: torch.Tensor, out_dtype: torch.dtype, fast_accum: bool = False) -> torch.Tensor:
    """``(T, N)``: every expert's rows of ``a`` (float8 ``(T, K)``, ``a_scales`` ``(T,)``; rows grouped by
    ``ends``, the ``E`` cumulative offsets on the device, read there) times its ``b[e].T`` (float8
    ``(E, N, K)``, ``b_scales`` ``(E, N)``); ``fast_accum``: all of K accumulated inside the tensor core, as a
    recipe's forward asks of cuBLAS."""
    return (_ROWS if as_operators() else _grouped_rows)(a, a_scales, b, b_scales, ends, out_dtype, fast_accum)


def grouped_features(a_t: torch.Tensor, a_scales: torch.Tensor, b_t: torch.Tensor, b_scales: torch.Tensor,
                     ends: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    """``(E, M, N)``: for every expert, its columns of ``a_t`` (float8 ``(M, P)``) times those of ``b_t``
    (float8 ``(N, P)``) transposed, scaled by ``a_scales`` ``(E * M,)`` and ``b_scales`` ``(E * N,)``;
    ``ends`` the padded offsets (int32, each a multiple of 16: ``grouped_gemm.token_padding``)."""
    return (_FEATURES if as_operators() else _grouped_features)(a_t, a_scales, b_t, b_scales, ends, out_dtype)


__all__ = ["grouped_features", "grouped_rows"]
