"""Every expert's FP8 GEMM in one Triton launch, for the operand pairs PyTorch's grouped FP8 GEMM refuses
(E5M2 gradients times E4M3: ``fp8-current``'s input and weight gradients) and for the gradients it runs
slower (E4M3 without fast accumulation: ``fp8-rowwise``'s).

[Note: grouped FP8 GEMMs in Triton]
The two kinds of ``kernels.grouped_gemm`` ([Note: one grouped GEMM for the experts]), with the same
operands and scales:

* :data:`~lowprec.kernels.grouped_gemm.ROWS` (:func:`grouped_rows`): token rows ``a`` ``(T, K)`` times each
  expert's ``b[e]`` ``(N, K)``. Each ``BLOCK_M`` rows of one expert is a tile, so no tile mixes experts and
  nothing is padded; a program finds its tile (expert, first row, end) from the cumulative offsets on the
  device (:func:`_find_tile`: the experts' tile counts, their running sum, and the first expert whose sum
  passes the tile's index), so the host needs no count: the kernel counts the tiles itself (at most
  ``cdiv(T, BLOCK_M) + E - 1`` of rows, times the blocks of ``b[e]``'s rows). A tile is one tile of rows
  against one block of ``b[e]``'s rows;
* :data:`~lowprec.kernels.grouped_gemm.FEATURES` (:func:`grouped_features`): each expert's features over
  its own tokens, from the features-major layout of ``grouped_gemm.features_padded`` (``(M, P)`` and ``(N,
  P)``, each expert's tokens from a 16-aligned column on, zero codes between): a tile is one
  ``(expert, M block, N block)``, which walks K over that expert's columns only (an expert without tokens
  writes zeros).

Both are persistent: a launch has a few programs per multiprocessor, each walking the tiles ``program,
program + programs, ...`` (the rows kind counts its tiles from the offsets on the device), and both read
their operands through tensor-memory-accelerator descriptors made on the device (``tl.make_tensor_descriptor``:
whole ``(rows, BLOCK_K)`` boxes, zeros past the tensor's edge, so no load is masked; the weight gradient's
last chunk of an expert zeroes the next expert's columns in registers). The rows kind flattens its two loops
into one pipeline, so a tile's loads start while the last tile's epilogue runs, with 256-row tiles. On the
H200 at ``moe-1b``'s shapes (65,536 routed rows, 32 unbalanced experts, widths 1024 and 512; run 70) this
took the input gradients' GEMMs from 0.223 and 0.165 ms to 0.144 and 0.114, and the weight gradients' from
0.167 to 0.125, with the same bits as the pointer-loading kernels they replace. A descriptor made on the
device needs Triton's global scratch, which :func:`lowprec.kernels.triton_launch.device_workspace` gives
Triton in the launching thread (autograd's backward runs on a thread of its own).

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

Block scales (:func:`grouped_rows_blocked`, :func:`grouped_features_blocked`; ``fp8-blockwise``'s experts,
DeepSeek-V3's scaling: 1 x 128 blocks of the tokens along K, 128 x 128 blocks of the weights, 1 x 128 blocks
along the tokens for the weight gradient): the same two kinds and tiles, whose K step is one block
(:data:`BLOCK`). Each step's 128 products are summed by the tensor core alone into a fresh FP32 tile, which
is multiplied by its block's scales and added to the accumulator in registers (DeepGEMM's promotion, with the
scales folded in); where one weight block covers the tile's columns (128 x 128 blocks) the two scales
multiply into one per row first, so the step costs one fused multiply-add per element: three separate
operations per element kept the rows kind at 434 us at ``moe-1b``'s forward shapes on the H200, one took it
to 141 us (486 TFLOP/s; the row-scaled kernel takes 107; runs 75-76). Token scales are read chunk-major
(``(K / BLOCK, T)``: a tile's scales of one chunk are adjacent). The weight gradient's kind needs each
expert's tokens in whole blocks (``grouped_gemm.token_padding(..., BLOCK)``, as the casts lay them out), so no
chunk holds two experts and no partial chunk is masked.
"""
from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from lowprec.kernels import triton_launch as launch
from lowprec.kernels.ops import as_operators, define
from lowprec.kernels.triton_block_mx import store_tile

ROWS_TILES = (256, 128, 128)
"""The rows kind's tiles (rows of one expert, columns, K): 256 rows cut its time by 14-15% against 128 (run 70)."""
BLOCKED_ROWS_TILES = (128, 128, 128)
"""The rows kind's tiles with block scales: each K step adds a scaled FP32 partial tile to the accumulator in
registers, so 256 rows would hold two such tiles per program. On the H200 at ``moe-1b``'s shapes 128-row tiles
(one program per multiprocessor, flattened loops) ran within 7% of the best of 24 variants of tile, programs,
flattening and stages (64 rows, two programs per multiprocessor: 132 against 141 us; run 76)."""
BLOCK = 128
"""The block scales' width along K that the blocked kernels take: their K step (``BLOCK_K``), DeepSeek-V3's
1 x 128 and 128 x 128 blocks."""
FEATURE_TILES = (256, 128, 128)
"""The weight gradient's tiles (features of ``a``, features of ``b``, tokens): 256 features of ``a`` with two
programs per multiprocessor ran 20-29% faster than 128 with three at the experts' shapes of ``moe-1b``,
Mixtral-8x7B and Qwen3-30B-A3B (0.148 to 0.118 ms, 5.21 to 4.14, 0.99 to 0.76; the same bits; run 84)."""
BLOCKED_FEATURE_TILES = (128, 128, 128)
"""The same with block scales, whose FP32 partial tile per K step doubles a program's accumulators."""
WARPS, STAGES, FEATURE_STAGES = 8, 3, 4
"""Warps and pipeline stages; the weight gradient's kernel with four stages was 3% faster on the H200 (run 57)."""
ROWS_PER_SM, FEATURES_PER_SM, BLOCKED_FEATURES_PER_SM = 1, 2, 3
"""Programs per multiprocessor: one for the flattened rows kind; for the weight gradient, whose programs
overlap each other's epilogues, two of its 256-feature tiles (run 84), three of the blocked kernel's 128
(two took 0.133 ms, three 0.125, four 0.129 at 128; run 70)."""
INTERPRETED_PROGRAMS = 3
"""Programs of a launch in Triton's CPU interpreter: few, so each walks several tiles as on a GPU."""


@triton.jit
def _expert_tiles(ends_ptr, E, EP: tl.constexpr, BLOCK_M: tl.constexpr):
    """Per expert (a vector of ``EP``, a power of two at least ``E``): its first row, its end, and its tiles
    of ``BLOCK_M`` rows, from the ``E`` cumulative offsets ``ends`` (zero tiles past ``E``)."""
    idx = tl.arange(0, EP)
    live = idx < E
    end = tl.load(ends_ptr + idx, mask=live, other=0)
    start = tl.load(ends_ptr + idx - 1, mask=live & (idx > 0), other=0)
    return start, end, tl.where(live, (end - start + BLOCK_M - 1) // BLOCK_M, 0)


@triton.jit
def _find_tile(ends_ptr, tile, E, EP: tl.constexpr, BLOCK_M: tl.constexpr):
    """``(expert, first row, end)`` of the ``tile``-th tile of ``BLOCK_M`` rows of one expert, experts in
    order."""
    start, end, n_tiles = _expert_tiles(ends_ptr, E, EP, BLOCK_M)
    through = tl.cumsum(n_tiles, 0)  # tiles of the experts up to each one
    e = tl.sum((through <= tile).to(tl.int32), 0)  # experts whose tiles all come before this one
    mine = tl.arange(0, EP) == e
    first = tl.sum(tl.where(mine, start + (tile - (through - n_tiles)) * BLOCK_M, 0), 0)
    return e, first, tl.sum(tl.where(mine, end, 0), 0)


@triton.jit
def _feature_tile(tile, M, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """``(expert, first row of a, first row of b)`` of the weight gradient's ``tile``-th tile: experts in
    order, each ``cdiv(M, BLOCK_M) x cdiv(N, BLOCK_N)`` tiles."""
    tiles_n = tl.cdiv(N, BLOCK_N)
    per_expert = tl.cdiv(M, BLOCK_M) * tiles_n
    return tile // per_expert, (tile % per_expert) // tiles_n * BLOCK_M, (tile % tiles_n) * BLOCK_N


@triton.jit
def rows_kernel(a_ptr, sa_ptr, b_ptr, sb_ptr, ends_ptr, out_ptr, T, N, K, E, OUT_BF16: tl.constexpr,
                FAST: tl.constexpr, EP: tl.constexpr, PROGRAMS: tl.constexpr, BLOCK_M: tl.constexpr,
                BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """Tiles of rows of one expert times blocks of its weight's rows: ``out[r, n] = sa[r] * sb[e, n] *
    sum_k a[r, k] b[e, n, k]``, ``a`` ``(T, K)``, ``b`` ``(E * N, K)``."""
    a_desc = tl.make_tensor_descriptor(a_ptr, shape=[T, K], strides=[K, 1], block_shape=[BLOCK_M, BLOCK_K])
    b_desc = tl.make_tensor_descriptor(b_ptr, shape=[E * N, K], strides=[K, 1], block_shape=[BLOCK_N, BLOCK_K])
    tiles_n = tl.cdiv(N, BLOCK_N)
    tiles = tl.sum(_expert_tiles(ends_ptr, E, EP, BLOCK_M)[2], 0) * tiles_n
    for tile in tl.range(tl.program_id(0), tiles, PROGRAMS, flatten=True):
        e, first, end = _find_tile(ends_ptr, tile // tiles_n, E, EP, BLOCK_M)
        first_n = (tile % tiles_n) * BLOCK_N
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            # rows past the expert's end are the next expert's (or zeros past T), columns past N the next
            # expert's weight (or zeros): multiplied, never stored
            a = a_desc.load([first, k0])
            b = b_desc.load([e * N + first_n, k0])
            if FAST:  # all of K inside the MMA, as cuBLAS's fast accumulation
                acc = tl.dot(a, b.T, acc)
            else:
                acc = tl.dot(a, b.T, acc, max_num_imprecise_acc=BLOCK_K)  # promoted every BLOCK_K: the Note
        offs_m = first + tl.arange(0, BLOCK_M)
        offs_n = first_n + tl.arange(0, BLOCK_N)
        sa = tl.load(sa_ptr + tl.minimum(offs_m, end - 1))
        sb = tl.load(sb_ptr + e.to(tl.int64) * N + tl.minimum(offs_n, N - 1))
        acc = acc * sa[:, None] * sb[None, :]
        store_tile(out_ptr, acc, offs_m, offs_n, end, N, OUT_BF16)


@triton.jit
def features_kernel(a_ptr, sa_ptr, b_ptr, sb_ptr, ends_ptr, out_ptr, M, N, P, E, OUT_BF16: tl.constexpr,
                    PROGRAMS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """Each ``(expert, M block, N block)``: ``out[e, m, n] = sa[e, m] * sb[e, n] * sum_t a[m, t] b[n, t]`` over
    the expert's columns ``t`` of the features-major ``a`` ``(M, P)`` and ``b`` ``(N, P)``."""
    a_desc = tl.make_tensor_descriptor(a_ptr, shape=[M, P], strides=[P, 1], block_shape=[BLOCK_M, BLOCK_K])
    b_desc = tl.make_tensor_descriptor(b_ptr, shape=[N, P], strides=[P, 1], block_shape=[BLOCK_N, BLOCK_K])
    tiles = E * tl.cdiv(M, BLOCK_M) * tl.cdiv(N, BLOCK_N)
    for tile in tl.range(tl.program_id(0), tiles, PROGRAMS):
        e, first_m, first_n = _feature_tile(tile, M, N, BLOCK_M, BLOCK_N)
        # each expert's columns start and end at multiples of 16 (the padding)
        start = tl.multiple_of(tl.load(ends_ptr + e - 1, mask=e > 0, other=0), 16)
        end = tl.multiple_of(tl.load(ends_ptr + e), 16)
        whole = start + (end - start) // BLOCK_K * BLOCK_K
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(start, whole, BLOCK_K):  # the expert's whole chunks (an expert without tokens: none)
            a = a_desc.load([first_m, k0])
            b = b_desc.load([first_n, k0])
            acc = tl.dot(a, b.T, acc, max_num_imprecise_acc=BLOCK_K)  # promoted every BLOCK_K: the Note
        if whole < end:  # its last chunk reaches into the next expert's columns: zeroed on one side
            a = a_desc.load([first_m, whole])
            b = b_desc.load([first_n, whole])
            b = tl.where((whole + tl.arange(0, BLOCK_K))[None, :] < end, b, tl.zeros_like(b))
            acc = tl.dot(a, b.T, acc, max_num_imprecise_acc=BLOCK_K)
        offs_m = first_m + tl.arange(0, BLOCK_M)
        offs_n = first_n + tl.arange(0, BLOCK_N)
        sa = tl.load(sa_ptr + e * M + tl.minimum(offs_m, M - 1))
        sb = tl.load(sb_ptr + e * N + tl.minimum(offs_n, N - 1))
        acc = acc * sa[:, None] * sb[None, :]
        store_tile(out_ptr + e.to(tl.int64) * M * N, acc, offs_m, offs_n, M, N, OUT_BF16)


@triton.jit
def rows_blocked_kernel(a_ptr, sa_ptr, b_ptr, sb_ptr, ends_ptr, out_ptr, T, N, K, E, SB_ROWS: tl.constexpr,
                        OUT_BF16: tl.constexpr, EP: tl.constexpr, PROGRAMS: tl.constexpr, BLOCK_M: tl.constexpr,
                        BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """:func:`rows_kernel` with block scales along K (``BLOCK_K`` wide): ``out[r, n] = sum_c sa[c, r] *
    sb[e, n // SB_ROWS, c] * sum_{k in chunk c} a[r, k] b[e, n, k]``, ``sa`` ``(K / BLOCK_K, T)`` (chunk-major:
    each chunk's scales of a tile's rows are adjacent), ``sb`` ``(E, N / SB_ROWS, K / BLOCK_K)``."""
    a_desc = tl.make_tensor_descriptor(a_ptr, shape=[T, K], strides=[K, 1], block_shape=[BLOCK_M, BLOCK_K])
    b_desc = tl.make_tensor_descriptor(b_ptr, shape=[E * N, K], strides=[K, 1], block_shape=[BLOCK_N, BLOCK_K])
    tiles_n = tl.cdiv(N, BLOCK_N)
    kb = tl.cdiv(K, BLOCK_K)
    nb = tl.cdiv(N, SB_ROWS)
    tiles = tl.sum(_expert_tiles(ends_ptr, E, EP, BLOCK_M)[2], 0) * tiles_n
    for tile in tl.range(tl.program_id(0), tiles, PROGRAMS, flatten=True):
        e, first, end = _find_tile(ends_ptr, tile // tiles_n, E, EP, BLOCK_M)
        first_n = (tile % tiles_n) * BLOCK_N
        offs_m = first + tl.arange(0, BLOCK_M)
        offs_n = first_n + tl.arange(0, BLOCK_N)
        rows_a = tl.minimum(offs_m, end - 1)  # rows past the expert's end: scaled, never stored
        rows_b = (e.to(tl.int64) * nb + tl.minimum(offs_n, N - 1) // SB_ROWS) * kb
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for c in range(0, kb):
            a = a_desc.load([first, c * BLOCK_K])
            b = b_desc.load([e * N + first_n, c * BLOCK_K])
            part = tl.dot(a, b.T)  # one chunk inside the MMA, promoted to FP32 with its scales: the Note
            sa = tl.load(sa_ptr + c * T + rows_a)
            if SB_ROWS % BLOCK_N == 0:  # one weight block across the tile: one scale per row, one FMA each
                sb = tl.load(sb_ptr + (e.to(tl.int64) * nb + first_n // SB_ROWS) * kb + c)
                acc = part * (sa * sb)[:, None] + acc
            else:
                sb = tl.load(sb_ptr + rows_b + c)
                acc += part * sa[:, None] * sb[None, :]
        store_tile(out_ptr, acc, offs_m, offs_n, end, N, OUT_BF16)


@triton.jit
def features_blocked_kernel(a_ptr, sa_ptr, b_ptr, sb_ptr, ends_ptr, out_ptr, M, N, P, E, OUT_BF16: tl.constexpr,
                            PROGRAMS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                            BLOCK_K: tl.constexpr):
    """:func:`features_kernel` with block scales along the tokens (``BLOCK_K`` wide, each expert's columns
    whole blocks): ``out[e, m, n] = sum_c sa[c, m] * sb[c, n] * sum_{t in chunk c} a[m, t] b[n, t]`` over the
    expert's chunks ``c``, ``sa`` ``(P / BLOCK_K, M)``, ``sb`` ``(P / BLOCK_K, N)``."""
    a_desc = tl.make_tensor_descriptor(a_ptr, shape=[M, P], strides=[P, 1], block_shape=[BLOCK_M, BLOCK_K])
    b_desc = tl.make_tensor_descriptor(b_ptr, shape=[N, P], strides=[P, 1], block_shape=[BLOCK_N, BLOCK_K])
    tiles = E * tl.cdiv(M, BLOCK_M) * tl.cdiv(N, BLOCK_N)
    for tile in tl.range(tl.program_id(0), tiles, PROGRAMS):
        e, first_m, first_n = _feature_tile(tile, M, N, BLOCK_M, BLOCK_N)
        start = tl.multiple_of(tl.load(ends_ptr + e - 1, mask=e > 0, other=0), BLOCK_K)
        end = tl.multiple_of(tl.load(ends_ptr + e), BLOCK_K)
        rows_a = tl.minimum(first_m + tl.arange(0, BLOCK_M), M - 1)
        rows_b = tl.minimum(first_n + tl.arange(0, BLOCK_N), N - 1)
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(start, end, BLOCK_K):  # the expert's blocks (an expert without tokens: none)
            a = a_desc.load([first_m, k0])
            b = b_desc.load([first_n, k0])
            part = tl.dot(a, b.T)
            c = k0 // BLOCK_K
            sa = tl.load(sa_ptr + c * M + rows_a)
            sb = tl.load(sb_ptr + c * N + rows_b)
            acc += part * sa[:, None] * sb[None, :]
        offs_m = first_m + tl.arange(0, BLOCK_M)
        offs_n = first_n + tl.arange(0, BLOCK_N)
        store_tile(out_ptr + e.to(tl.int64) * M * N, acc, offs_m, offs_n, M, N, OUT_BF16)


def _output(shape: tuple[int, ...], out_dtype: torch.dtype, device) -> tuple[torch.Tensor, torch.Tensor, bool]:
    bf16 = out_dtype == torch.bfloat16
    out = torch.empty(shape, dtype=torch.bfloat16 if bf16 else torch.float32, device=device)
    return out, (out.view(torch.int16) if bf16 else out), bf16


def _launch_options(device: torch.device, stages: int) -> dict:
    return dict(num_warps=WARPS, num_stages=stages) if device.type == "cuda" else {}


@functools.cache
def _multiprocessors(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def _programs(device: torch.device, per_sm: int, tiles: int) -> int:
    """Programs of a persistent launch: ``per_sm`` per multiprocessor on a GPU, a few in the interpreter; never
    more than ``tiles``, a bound on the tiles."""
    n = _multiprocessors(device.index if device.index is not None else torch.cuda.current_device()) * per_sm \
        if device.type == "cuda" else INTERPRETED_PROGRAMS
    return max(1, min(n, tiles))


def _operand(t: torch.Tensor, name: str, width: int) -> torch.Tensor:
    """``t`` as a descriptor reads it: contiguous, its rows of ``width`` codes a multiple of 16 bytes, its
    start 16-byte aligned (a view from an unaligned offset is copied)."""
    if width % 16:
        raise ValueError(f"lowprec grouped Triton GEMM: {name} must have rows of a multiple of 16 codes (the tensor "
                         f"memory accelerator's alignment), got {width}")
    t = t.contiguous()
    return t if t.data_ptr() % 16 == 0 else t.clone()


def _launch_rows(a: torch.Tensor, a_scales: torch.Tensor, b: torch.Tensor, b_scales: torch.Tensor,
                 ends: torch.Tensor, out_dtype: torch.dtype, blocked: bool, fast_accum: bool) -> torch.Tensor:
    """One launch of the rows kind: :func:`rows_kernel`, or with block scales :func:`rows_blocked_kernel` (its
    token scales read chunk-major)."""
    t, k = a.shape
    e, n = b.shape[:2]
    out, raw, bf16 = _output((t, n), out_dtype, a.device)
    if t == 0 or n == 0:
        return out.to(out_dtype)
    bm, bn, bk = BLOCKED_ROWS_TILES if blocked else ROWS_TILES
    programs = _programs(a.device, ROWS_PER_SM, (triton.cdiv(t, bm) + e - 1) * triton.cdiv(n, bn))
    sa = a_scales.float()
    args = (_operand(a, "a", k), (sa.t() if blocked else sa).contiguous(), _operand(b, "b", k),
            b_scales.float().contiguous(), ends.to(torch.int32).contiguous(), raw, t, n, k, e)
    # blocked: the rows of b per scale, 1 or a weight block's; else whether all of K stays in the MMA
    variant = dict(SB_ROWS=-(-n // b_scales.shape[1])) if blocked else dict(FAST=fast_accum)
    meta = dict(**variant, OUT_BF16=bf16, EP=max(16, triton.next_power_of_2(e)), PROGRAMS=programs,
                BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, **_launch_options(a.device, STAGES))
    launch.device_workspace()
    kernel = rows_blocked_kernel if blocked else rows_kernel
    launch.launch(kernel, (programs,), args, meta, ("grouped rows", blocked, bf16, *variant.values()), a.is_cuda)
    return out if bf16 else out.to(out_dtype)


def _launch_features(a_t: torch.Tensor, a_scales: torch.Tensor, b_t: torch.Tensor, b_scales: torch.Tensor,
                     ends: torch.Tensor, out_dtype: torch.dtype, blocked: bool) -> torch.Tensor:
    """One launch of the features kind: :func:`features_kernel`, or with block scales
    :func:`features_blocked_kernel` (its scales read chunk-major)."""
    (m, p), n, e = a_t.shape, b_t.shape[0], ends.shape[0]
    out, raw, bf16 = _output((e, m, n), out_dtype, a_t.device)
    if out.numel() == 0:
        return out.to(out_dtype)
    bm, bn, bk = BLOCKED_FEATURE_TILES if blocked else FEATURE_TILES
    per_sm = BLOCKED_FEATURES_PER_SM if blocked else FEATURES_PER_SM
    programs = _programs(a_t.device, per_sm, e * triton.cdiv(m, bm) * triton.cdiv(n, bn))
    sa, sb = a_scales.float(), b_scales.float()
    if blocked:
        sa, sb = sa.t(), sb.t()
    args = (_operand(a_t, "a_t", p), sa.contiguous(), _operand(b_t, "b_t", p), sb.contiguous(),
            ends.to(torch.int32).contiguous(), raw, m, n, p, e)
    meta = dict(OUT_BF16=bf16, PROGRAMS=programs, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk,
                **_launch_options(a_t.device, FEATURE_STAGES))
    launch.device_workspace()
    kernel = features_blocked_kernel if blocked else features_kernel
    launch.launch(kernel, (programs,), args, meta, ("grouped features", blocked, bf16), a_t.is_cuda)
    return out if bf16 else out.to(out_dtype)


def _grouped_rows(a, a_scales, b, b_scales, ends, out_dtype, fast_accum=False):
    """The launch of :func:`grouped_rows`."""
    return _launch_rows(a, a_scales, b, b_scales, ends, out_dtype, False, fast_accum)


def _grouped_features(a_t, a_scales, b_t, b_scales, ends, out_dtype):
    """The launch of :func:`grouped_features`."""
    return _launch_features(a_t, a_scales, b_t, b_scales, ends, out_dtype, False)


def _grouped_rows_blocked(a, a_scales, b, b_scales, ends, out_dtype):
    """The launch of :func:`grouped_rows_blocked`."""
    return _launch_rows(a, a_scales, b, b_scales, ends, out_dtype, True, False)


def _grouped_features_blocked(a_t, a_scales, b_t, b_scales, ends, out_dtype):
    """The launch of :func:`grouped_features_blocked`."""
    return _launch_features(a_t, a_scales, b_t, b_scales, ends, out_dtype, True)


# [Note: how kernels become operators] in lowprec.kernels.ops: compiled graphs call these GEMMs as operators


def _rows_fake(a, a_scales, b, b_scales, ends, out_dtype, fast_accum):
    return a.new_empty((a.shape[0], b.shape[1]), dtype=out_dtype)


def _features_fake(a_t, a_scales, b_t, b_scales, ends, out_dtype):
    return a_t.new_empty((ends.shape[0], a_t.shape[0], b_t.shape[0]), dtype=out_dtype)


_ROWS = define("grouped_rows(Tensor a, Tensor a_scales, Tensor b, Tensor b_scales, Tensor ends, ScalarType out_dtype, "
               "bool fast_accum) -> Tensor", _grouped_rows, _rows_fake)
_FEATURES = define("grouped_features(Tensor a_t, Tensor a_scales, Tensor b_t, Tensor b_scales, Tensor ends, "
                   "ScalarType out_dtype) -> Tensor", _grouped_features, _features_fake)


def _rows_blocked_fake(a, a_scales, b, b_scales, ends, out_dtype):
    return a.new_empty((a.shape[0], b.shape[1]), dtype=out_dtype)


_ROWS_BLOCKED = define("grouped_rows_blocked(Tensor a, Tensor a_scales, Tensor b, Tensor b_scales, Tensor ends, "
                       "ScalarType out_dtype) -> Tensor", _grouped_rows_blocked, _rows_blocked_fake)
_FEATURES_BLOCKED = define("grouped_features_blocked(Tensor a_t, Tensor a_scales, Tensor b_t, Tensor b_scales, "
                           "Tensor ends, ScalarType out_dtype) -> Tensor", _grouped_features_blocked, _features_fake)


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


def grouped_rows_blocked(a: torch.Tensor, a_scales: torch.Tensor, b: torch.Tensor, b_scales: torch.Tensor,
                         ends: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    """:func:`grouped_rows` with block scales along K, blocks of :data:`BLOCK` (DeepSeek-V3's ``fp8-blockwise``
    experts): ``a`` float8 ``(T, K)`` with ``a_scales`` ``(T, K / BLOCK)`` (1 x BLOCK blocks of each row), ``b``
    float8 ``(E, N, K)`` with ``b_scales`` ``(E, N / R, K / BLOCK)`` (R x BLOCK blocks of each expert's rows, R
    1 or BLOCK); K a multiple of BLOCK (codes padded with zeros to whole blocks, as the casts make them)."""
    return (_ROWS_BLOCKED if as_operators() else _grouped_rows_blocked)(a, a_scales, b, b_scales, ends, out_dtype)


def grouped_features_blocked(a_t: torch.Tensor, a_scales: torch.Tensor, b_t: torch.Tensor, b_scales: torch.Tensor,
                             ends: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    """:func:`grouped_features` with block scales along the tokens, blocks of :data:`BLOCK`: ``a_t`` float8
    ``(M, P)`` with ``a_scales`` ``(M, P / BLOCK)``, ``b_t`` ``(N, P)`` with ``b_scales`` ``(N, P / BLOCK)``; each
    expert's tokens whole blocks (``ends`` multiples of BLOCK: ``grouped_gemm.token_padding(..., BLOCK)``)."""
    return (_FEATURES_BLOCKED if as_operators() else _grouped_features_blocked)(a_t, a_scales, b_t, b_scales, ends,
                                                                                 out_dtype)


__all__ = ["BLOCK", "grouped_features", "grouped_features_blocked", "grouped_rows", "grouped_rows_blocked"]
