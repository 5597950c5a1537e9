"""Block-scaled GEMMs in Triton: MX (FP8, FP6, FP4 elements, E8M0 scales per 32 along K) on FP8 tensor
cores, NVFP4 (E2M1, E4M3 scales per 16, FP32 global scales) on BF16 tensor cores with the scales decoded
in registers. ``a (M, K) @ b (N, K).T``, both quantized along K, as ``kernels.gemm.scaled_mm``.

[Note: block-scaled GEMMs on tensor cores]
Two paths, chosen by the block size along K (the *chunk*):

* chunks of 32 (MX): an MX block of 32 is one K step of an FP8 MMA. Codes go to the tensor core as they
  are: E4M3 and E5M2 by a bitcast, FP6 and FP4 codes re-encoded as E4M3 codes on their bits
  (:func:`_e4m3_codes`: every E2M1, E3M2 and E2M3 value is exact in E4M3, subnormals included, so no
  float conversion runs). Each 32-wide ``tl.dot`` gives one chunk's FP32 partial sum, which is multiplied
  by ``scale_a[m, chunk] * scale_b[n, chunk]`` before it joins the FP32 accumulator;
* chunks of 16 (NVFP4): Triton's FP8 dot needs K >= 32, so a 16-wide chunk cannot be one FP8 MMA.
  Each element is decoded in registers and multiplied by its block's E4M3 scale, which is exact in BF16
  (an E2M1 significand of 2 bits times an E4M3 one of 4), and the tile runs through a BF16 dot with FP32
  accumulation: the emulation's arithmetic, fused. The global scales multiply the output at the end, in
  the emulation's order (``a``'s, then ``b``'s).

A 2-D block (NVFP4 weights, 16x16) is constant along K within its chunk too: its scale is shared by 16
rows, and the kernels read it by ``row // block_rows``.

Exactness against ``gemm._emulated`` (every product of two quantized values is exact in FP32 on both
sides; only sums are rounded):

* on the FP8 path the tensor core sums a chunk's 32 products itself. DeepSeek-V3 (arXiv 2412.19437)
  reports that Hopper's FP8 MMA keeps about 14 bits when it accumulates; under that model a chunk's
  partial sum is off by at most ``32 * 2^-13 * max|a_k b_k| <= 2^-8 * sum_k |a_k b_k|`` over the chunk,
  a bound to measure on the GPU (``benchmarks/bench_block_gemm.py`` prints it), not a guarantee. Then
  chunk sums add in FP32 in K order where the emulation sums all of K in its own order: both within
  ``K * 2^-24 * sum_k |a_k b_k|`` of the exact sum. The chunk scales multiply exactly while
  ``scale_a * scale_b`` is a normal FP32 (E8M0 scales between 2^-63 and 2^63 each);
* on the BF16 path both sides multiply the same BF16 values with FP32 accumulation: only the order of
  the sums differs (within ``2 K * 2^-24 * sum_k |a_k b_k|``);
* where every partial sum is representable (small integers times powers of two), both equal the exact
  result, and so each other, bit for bit.

The output is FP32 or BF16 written by the kernel (BF16 rounded to nearest even on the bits, as torch
rounds); any other ``out_dtype`` is converted from FP32 by torch.
"""
from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from lowprec import formats as F
from lowprec._checks import fail
from lowprec.kernels.gemm import emulation_dtype
from lowprec.kernels.triton_dequant import _decode
from lowprec.kernels.triton_numerics import bf16_bits
from lowprec.kernels.triton_tiles import _expand
from lowprec.quant import GranularityKind, QuantizedTensor

DOT_K = tl.constexpr(32)
"""One FP8 MMA step along K: Triton's smallest K for 8-bit dot operands on NVIDIA GPUs."""
_FP8_CHUNK, _BF16_CHUNK = 32, 16
_ELEMENTS = tuple(F.get(n) for n in ("e4m3", "e5m2", "e3m2", "e2m3", "e2m1"))
"""The element formats the kernels read: FP8 as float8 dtypes, the narrower ones as E4M3 (FP8 path)."""
_GROUP_M = tl.constexpr(8)  # tiles walked 8 tile rows at a time: neighbouring programs share operands in L2
CONFIGS = [triton.Config({"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk}, num_warps=w, num_stages=s)
           for bm, bn, bk, w, s in ((128, 128, 128, 8, 3), (128, 128, 64, 8, 4), (128, 128, 128, 8, 4),
                                    (128, 64, 128, 4, 3), (64, 128, 128, 4, 3), (64, 64, 128, 4, 4))]
"""Autotuned tiles. 128x128 accumulators take 8 warps: each chunk's partial sum is a second tile of registers."""


@triton.jit
def _e4m3_codes(c, EXP: tl.constexpr, MAN: tl.constexpr):
    """E4M3 codes (int32) of the same values as ``c``, codes of a narrower format (FP6, FP4) with sign bit
    ``EXP + MAN``. Exact: the format's values lie inside E4M3's normal range, its mantissa within 3 bits."""
    bias = (1 << (EXP - 1)) - 1
    ef = (c >> MAN) & ((1 << EXP) - 1)
    man = c & ((1 << MAN) - 1)
    p = (man >= 2).to(tl.int32) + (man >= 4).to(tl.int32)  # a subnormal's leading bit: man = 2^p * 1.f
    sub = ((p + 8 - bias - MAN) << 3) | ((man - (1 << p)) << (3 - p))  # man * 2^(1 - bias - MAN), normalized
    mag = tl.where(ef > 0, ((ef - bias + 7) << 3) | (man << (3 - MAN)), tl.where(man > 0, sub, 0))
    return (((c >> (EXP + MAN)) & 1) << 7) | mag


@triton.jit
def _fp8(c, EXP: tl.constexpr, MAN: tl.constexpr):
    """uint8 codes -> an FP8 tile the tensor core multiplies exactly."""
    if EXP == 5 and MAN == 2:
        v = c.to(tl.float8e5, bitcast=True)
    elif EXP == 4 and MAN == 3:
        v = c.to(tl.float8e4nv, bitcast=True)
    else:
        v = _e4m3_codes(c.to(tl.int32), EXP, MAN).to(tl.uint8).to(tl.float8e4nv, bitcast=True)
    return v


@triton.jit
def _row_scales(s_ptr, rows, R, kb, KB, BR: tl.constexpr):
    """Each row's scale of K block ``kb`` (1 where masked: a masked chunk's codes are zero)."""
    return tl.load(s_ptr + (rows // BR).to(tl.int64) * KB + kb, mask=(rows < R) & (rows * 0 + kb < KB),
                   other=1.0)


@triton.jit
def _bf16_values(ptr, s_ptr, rows, k, R, K, KB, first_row, k0, EXP: tl.constexpr, MAN: tl.constexpr,
                 BR: tl.constexpr, BC: tl.constexpr, ROWS: tl.constexpr, BK: tl.constexpr, BF16: tl.constexpr):
    """``(ROWS, BK)`` values ``decode(code) * block scale`` of rows ``rows``, as BF16 (exact) with ``BF16``,
    else FP32 (Triton's CPU interpreter multiplies BF16 tiles' raw bits in a dot)."""
    mask = (rows[:, None] < R) & (k[None, :] < K)
    c = tl.load(ptr + rows[:, None].to(tl.int64) * K + k[None, :], mask=mask, other=0)
    si = first_row // BR + tl.arange(0, ROWS // BR)
    sj = k0 // BC + tl.arange(0, BK // BC)
    s = tl.load(s_ptr + si[:, None].to(tl.int64) * KB + sj[None, :],
                mask=(si[:, None] < tl.cdiv(R, BR)) & (sj[None, :] < KB), other=1.0)
    v = _decode(c.to(tl.int32), EXP, MAN) * _expand(s, ROWS, BK, BR, BC)
    if BF16:
        v = v.to(tl.bfloat16)
    return v


@triton.jit
def block_gemm_kernel(a_ptr, sa_ptr, b_ptr, sb_ptr, ga_ptr, gb_ptr, out_ptr, M, N, K, KB,
                      A_EXP: tl.constexpr, A_MAN: tl.constexpr, B_EXP: tl.constexpr, B_MAN: tl.constexpr,
                      A_BR: tl.constexpr, B_BR: tl.constexpr, BC: tl.constexpr, FP8: tl.constexpr,
                      GLOBAL_A: tl.constexpr, GLOBAL_B: tl.constexpr, OUT_BF16: tl.constexpr,
                      DOT_BF16: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """One ``BLOCK_M x BLOCK_N`` tile of ``out``. ``K``: the padded K of both operands (a multiple of
    ``BC``), ``KB = K // BC`` scale columns; ``M``, ``N``: the output's rows and columns."""
    pid = tl.program_id(0)
    tiles_m = tl.cdiv(M, BLOCK_M)
    tiles_n = tl.cdiv(N, BLOCK_N)
    group = _GROUP_M * tiles_n
    first = (pid // group) * _GROUP_M
    rows_in_group = tl.minimum(tiles_m - first, _GROUP_M)
    pid_m = first + (pid % group) % rows_in_group
    pid_n = (pid % group) // rows_in_group
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    if FP8:
        a_rows = a_ptr + offs_m[:, None].to(tl.int64) * K  # (BM, 1)
        b_cols = b_ptr + offs_n[None, :].to(tl.int64) * K  # (1, BN): b read as b.T
        for k0 in range(0, K, BLOCK_K):
            for c in tl.static_range(BLOCK_K // DOT_K):
                kc = k0 + c * DOT_K
                k = kc + tl.arange(0, DOT_K)
                a = tl.load(a_rows + k[None, :], mask=(offs_m[:, None] < M) & (k[None, :] < K), other=0)
                b = tl.load(b_cols + k[:, None], mask=(k[:, None] < K) & (offs_n[None, :] < N), other=0)
                part = tl.dot(_fp8(a, A_EXP, A_MAN), _fp8(b, B_EXP, B_MAN))  # (BM, BN): this chunk, FP32
                sa = _row_scales(sa_ptr, offs_m, M, kc // BC, KB, A_BR)
                sb = _row_scales(sb_ptr, offs_n, N, kc // BC, KB, B_BR)
                acc += part * (sa[:, None] * sb[None, :])
    else:
        for k0 in range(0, K, BLOCK_K):
            k = k0 + tl.arange(0, BLOCK_K)
            a = _bf16_values(a_ptr, sa_ptr, offs_m, k, M, K, KB, pid_m * BLOCK_M, k0, A_EXP, A_MAN, A_BR, BC,
                             BLOCK_M, BLOCK_K, DOT_BF16)
            b = _bf16_values(b_ptr, sb_ptr, offs_n, k, N, K, KB, pid_n * BLOCK_N, k0, B_EXP, B_MAN, B_BR, BC,
                             BLOCK_N, BLOCK_K, DOT_BF16)
            acc = tl.dot(a, tl.trans(b), acc)
    if GLOBAL_A:
        acc = acc * tl.load(ga_ptr)
    if GLOBAL_B:
        acc = acc * tl.load(gb_ptr)
    out = out_ptr + offs_m[:, None].to(tl.int64) * N + offs_n[None, :]
    mask = (offs_m[:, None] < M) & (offs_n[None, :] < N)
    if OUT_BF16:
        tl.store(out, bf16_bits(acc), mask=mask)  # out_ptr: the int16 view of a BF16 output
    else:
        tl.store(out, acc, mask=mask)


_tuned = triton.autotune(CONFIGS, key=["M", "N", "K", "A_EXP", "A_MAN", "B_EXP", "B_MAN", "FP8"])(block_gemm_kernel)


def _chunk(a: QuantizedTensor, b: QuantizedTensor) -> int:
    """The operands' common block size along K, checked against what the kernels cover."""
    kinds = (GranularityKind.MX, GranularityKind.NVFP4)
    ga, gb = a.granularity, b.granularity
    if ga.kind not in kinds or gb.kind not in kinds or ga.block_cols != gb.block_cols:
        fail("a/b", "MX or NVFP4 block scales with one block size along K", f"{ga} and {gb}")
    for name, q in (("a", a), ("b", b)):
        if q.fmt not in _ELEMENTS:
            fail(f"{name}.fmt", f"one of {', '.join(f.name for f in _ELEMENTS)}", q.fmt.name)
    chunk = ga.block_cols
    if chunk % _FP8_CHUNK == 0:
        return chunk
    if chunk % _BF16_CHUNK == 0 and emulation_dtype(a.fmt, ga, b.fmt, gb, "cuda") == torch.bfloat16:
        return chunk
    fail("a/b", "blocks of a multiple of 32 along K, or of 16 with values exact in BF16",
         f"{a.fmt.name}/{ga} and {b.fmt.name}/{gb}")


def block_scaled_mm(a: QuantizedTensor, b: QuantizedTensor, out_dtype: torch.dtype = torch.float32, *,
                    tile: tuple[int, int, int] | None = None) -> torch.Tensor:
    """``a (M, K) @ b (N, K).T -> (M, N)`` in ``out_dtype`` (M, N: the operands' original row counts) for
    MX or NVFP4 operands quantized along K (see [Note: block-scaled GEMMs on tensor cores]). ``tile``:
    ``(BLOCK_M, BLOCK_N, BLOCK_K)`` instead of the autotuned tiles (Triton's CPU interpreter, tests)."""
    chunk = _chunk(a, b)
    if a.shape[-1] != b.shape[-1]:  # then their padded K, whole blocks of one size, are equal too
        fail("a/b", "operands with the same reduction dimension K", f"{tuple(a.shape)} and {tuple(b.shape)}")
    m, n = math.prod(a.shape[:-1]), math.prod(b.shape[:-1])
    bf16_out = out_dtype == torch.bfloat16
    out = torch.empty(m, n, dtype=torch.bfloat16 if bf16_out else torch.float32, device=a.data.device)
    if m == 0 or n == 0:
        return out.to(out_dtype)
    kp = a.data.shape[1]
    ga = a.global_scale if a.global_scale is not None else a.scale  # any tensor where there is none
    gb = b.global_scale if b.global_scale is not None else b.scale
    args = (a.data.view(torch.uint8), a.scale.contiguous(), b.data.view(torch.uint8), b.scale.contiguous(), ga, gb,
            out.view(torch.int16) if bf16_out else out, m, n, kp, kp // chunk)
    consts = dict(A_EXP=a.fmt.exp_bits, A_MAN=a.fmt.man_bits, B_EXP=b.fmt.exp_bits, B_MAN=b.fmt.man_bits,
                  A_BR=a.block_shape[0], B_BR=b.block_shape[0], BC=chunk, FP8=chunk % _FP8_CHUNK == 0,
                  GLOBAL_A=a.global_scale is not None, GLOBAL_B=b.global_scale is not None, OUT_BF16=bf16_out,
                  DOT_BF16=a.data.is_cuda)  # a CPU tensor: the interpreter, whose BF16 dot is wrong
    if tile is None:
        def grid(meta: dict) -> tuple[int]:
            return (triton.cdiv(m, meta["BLOCK_M"]) * triton.cdiv(n, meta["BLOCK_N"]),)

        _tuned[grid](*args, **consts)
    else:
        bm, bn, bk = tile
        grid = (triton.cdiv(m, bm) * triton.cdiv(n, bn),)
        block_gemm_kernel[grid](*args, **consts, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, num_warps=4)
    return out if bf16_out else out.to(out_dtype)
