"""The MX kernels of ``block_scaled_mm`` (``kernels.triton_block_gemm``): operands' codes on the FP8 tensor cores,
one 32-wide chunk of K per dot, each chunk's FP32 partial sum times both blocks' scales; and the pass that
re-encodes FP6/FP4 codes as E4M3 codes before them. See [Note: block-scaled GEMMs on tensor cores].

The loops step one chunk at a time with no mask along K (the padded K is whole chunks), so Triton pipelines
the loads (``num_stages``) and every dot is one ``wgmma`` with K = 32. Scales are read from their transposed
copies ``(KB, rows)``: one chunk's scales of a tile are contiguous.
"""
from __future__ import annotations

import triton
import triton.language as tl

from lowprec.kernels.triton_numerics import bf16_bits

DOT_K = tl.constexpr(32)
"""One FP8 MMA step along K: Triton's smallest K for 8-bit dot operands on NVIDIA GPUs."""
GROUP_M = tl.constexpr(8)  # tiles walked 8 tile rows at a time: neighbouring programs share operands in L2


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
def e4m3_codes_kernel(c_ptr, out_ptr, n, EXP: tl.constexpr, MAN: tl.constexpr, BLOCK: tl.constexpr):
    """``out[i]`` = the E4M3 code of ``c[i]``'s value (uint8 both)."""
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    c = tl.load(c_ptr + offs, mask=offs < n, other=0)
    tl.store(out_ptr + offs, _e4m3_codes(c.to(tl.int32), EXP, MAN).to(tl.uint8), mask=offs < n)


@triton.jit
def tile_of(pid, M, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """Program ``pid``'s tile (row, column), walking ``GROUP_M`` tile rows at a time."""
    tiles_m = tl.cdiv(M, BLOCK_M)
    group = GROUP_M * tl.cdiv(N, BLOCK_N)
    first = (pid // group) * GROUP_M
    rows_in_group = tl.minimum(tiles_m - first, GROUP_M)
    return first + (pid % group) % rows_in_group, (pid % group) // rows_in_group


@triton.jit
def store_tile(out_ptr, acc, offs_m, offs_n, M, N, OUT_BF16: tl.constexpr):
    out = out_ptr + offs_m[:, None].to(tl.int64) * N + offs_n[None, :]
    mask = (offs_m[:, None] < M) & (offs_n[None, :] < N)
    if OUT_BF16:
        tl.store(out, bf16_bits(acc), mask=mask)  # out_ptr: the int16 view of a BF16 output
    else:
        tl.store(out, acc, mask=mask)


@triton.jit
def mx_chunk_kernel(a_ptr, sa_ptr, b_ptr, sb_ptr, out_ptr, M, N, K, S_COLS,
                    A_EXP: tl.constexpr, A_MAN: tl.constexpr, B_EXP: tl.constexpr, B_MAN: tl.constexpr,
                    BC: tl.constexpr, OUT_BF16: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """One ``BLOCK_M x BLOCK_N`` tile of ``out``, one chunk of K per iteration. ``K``: the padded K of both
    operands (whole chunks); ``sa``/``sb``: the scales transposed, ``(K // BC, S_COLS)``, their columns
    padded past every tile (so loaded unmasked, at addresses a base plus constants)."""
    pid_m, pid_n = tile_of(tl.program_id(0), M, N, BLOCK_M, BLOCK_N)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    kk = tl.arange(0, DOT_K)
    # rows past the end read row r - M: finite codes, never stored; so no masks on loads
    a_ptrs = a_ptr + (offs_m % M)[:, None].to(tl.int64) * K + kk[None, :]  # (BM, 32)
    b_ptrs = b_ptr + (offs_n % N)[None, :].to(tl.int64) * K + kk[:, None]  # (32, BN): b read as b.T
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, DOT_K):
        s_row = (k0 // BC) * S_COLS  # loaded before the dot: their latency hides behind the MMA
        sa = tl.load(sa_ptr + s_row + offs_m)
        sb = tl.load(sb_ptr + s_row + offs_n)
        part = tl.dot(_fp8(tl.load(a_ptrs), A_EXP, A_MAN), _fp8(tl.load(b_ptrs), B_EXP, B_MAN))  # (BM, BN) FP32
        acc += part * (sa[:, None] * sb[None, :])
        a_ptrs += DOT_K
        b_ptrs += DOT_K
    store_tile(out_ptr, acc, offs_m, offs_n, M, N, OUT_BF16)
