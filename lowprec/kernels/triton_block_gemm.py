"""Block-scaled GEMMs in Triton: MX (FP8, FP6, FP4 elements, E8M0 scales per 32 along K) on FP8 tensor
cores, any MX or NVFP4 pair (E2M1, E4M3 scales per 16, FP32 global scales) on BF16 tensor cores with the
scales decoded in registers. ``a (M, K) @ b (N, K).T``, both quantized along K, as ``kernels.gemm.scaled_mm``.

[Note: block-scaled GEMMs on tensor cores]
Variants (:class:`BlockGemmVariant`), two kinds of arithmetic:

* FP8 (``CHUNK``, ``CHUNK_INLINE``; MX operands, chunks of 32 along K): an MX block of 32 is one K step of an
  FP8 MMA. Codes go to the tensor core as they are: E4M3 and E5M2 as float8, FP6 and FP4 codes re-encoded
  as E4M3 codes on their bits (:func:`_e4m3_codes`: every E2M1, E3M2 and E2M3 value is exact in E4M3,
  subnormals included, so no float conversion runs), in one elementwise pass before the GEMM (``CHUNK``)
  or in registers inside it (``CHUNK_INLINE``). Each 32-wide ``tl.dot`` gives one chunk's FP32 partial
  sum, which is multiplied by ``scale_a[m, chunk] * scale_b[n, chunk]`` before it joins the FP32
  accumulator. The multiplies cost two FP32 operations per output element per chunk, twice the MMA's
  time at Hopper's FP8 rate (128 FP32 lanes against 4096 FP8 products per SM and clock): however well
  they overlap, this path is bound to about half the FP8 peak;
* BF16 (``DEQUANT``; any pair, and the only one for chunks of 16, which no FP8 MMA step fits): each
  element is decoded in registers and multiplied by its block's scale, which is exact in BF16 where the
  emulation's dequantized values are (an element of at most 4 significant bits times a power of two or
  an E4M3 scale; both round the FP32 product to BF16 the same way), and the tile runs through a BF16 dot
  with FP32 accumulation: the emulation's arithmetic, fused. NVFP4's global scales multiply the output at
  the end, in the emulation's order (``a``'s, then ``b``'s).

A 2-D block (NVFP4 weights, 16x16) is constant along K within its chunk too: its scale is shared by 16
rows, and the kernel reads it by ``row // block_rows``.

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
* where every partial sum is representable (small integers times powers of two), every variant equals
  the exact result, and so the emulation, bit for bit.

The output is FP32 or BF16 written by the kernel (BF16 rounded to nearest even on the bits, as torch
rounds); any other ``out_dtype`` is converted from FP32 by torch.
"""
from __future__ import annotations

import enum
import math

import torch
import triton
import triton.language as tl

from lowprec import formats as F
from lowprec._checks import fail
from lowprec.kernels.gemm import emulation_dtype
from lowprec.kernels.triton_block_mx import e4m3_codes_kernel, mx_chunk_kernel, store_tile, tile_of
from lowprec.kernels.triton_numerics import decode_codes
from lowprec.kernels.triton_tiles import _expand
from lowprec.quant import GranularityKind, QuantizedTensor

_FP8_CHUNK, _BF16_CHUNK = 32, 16
_ELEMENTS = tuple(F.get(n) for n in ("e4m3", "e5m2", "e3m2", "e2m3", "e2m1"))
"""The element formats the kernels read: FP8 as float8 dtypes, the narrower ones as E4M3 (FP8 path)."""
_FLOAT8 = {F.get("e4m3"): torch.float8_e4m3fn, F.get("e5m2"): torch.float8_e5m2}
_SCALE_PAD = 256  # the transposed scales' columns: a multiple of every tile's edge


class BlockGemmVariant(str, enum.Enum):
    """Which kernel :func:`block_scaled_mm` runs (see [Note: block-scaled GEMMs on tensor cores])."""

    CHUNK = "chunk"
    """MX on FP8 tensor cores, one chunk per dot; FP6/FP4 codes re-encoded as E4M3 in a pass before."""
    CHUNK_INLINE = "chunk-inline"
    """As ``CHUNK``, FP6/FP4 codes re-encoded in registers inside the GEMM."""
    DEQUANT = "dequant"
    """Any pair: values decoded times their scales into BF16 in registers, a BF16 dot."""


def _configs(*tiles: tuple[int, ...]) -> list[triton.Config]:
    names = ("BLOCK_M", "BLOCK_N", "BLOCK_K")
    return [triton.Config(dict(zip(names, t[:-2])), num_warps=t[-2], num_stages=t[-1]) for t in tiles]


CHUNK_CONFIGS = _configs((128, 128, 8, 4), (64, 128, 4, 4), (64, 256, 8, 3))
"""128x128 over 8 warps (one CTA an SM at ~220 registers), or a 64-row tile over 4 (three CTAs an SM): other
warp groups' scaling runs while one's MMA does. The accumulator and a chunk's partial sum are two tiles of
registers, so no warp group holds more than 64x128."""
DEQUANT_CONFIGS = _configs((128, 128, 64, 8, 4), (128, 256, 64, 8, 3))
_KEY = ["M", "N", "K", "A_EXP", "A_MAN", "B_EXP", "B_MAN"]
_chunk_tuned = triton.autotune(CHUNK_CONFIGS, key=_KEY)(mx_chunk_kernel)


@triton.jit
def _bf16_values(ptr, s_ptr, rows, k, KB, s_first, k0, EXP: tl.constexpr, MAN: tl.constexpr, BR: tl.constexpr,
                 BC: tl.constexpr, ROWS: tl.constexpr, BK: tl.constexpr, S_ROWS, K, BF16: tl.constexpr,
                 EVEN_K: tl.constexpr):
    """``(ROWS, BK)`` values ``decode(code) * block scale`` of rows ``rows``, as BF16 (exact) with ``BF16``,
    else FP32 (Triton's CPU interpreter multiplies BF16 tiles' raw bits in a dot)."""
    ptrs = ptr + rows[:, None].to(tl.int64) * K + k[None, :]
    if EVEN_K:
        c = tl.load(ptrs)
    else:
        c = tl.load(ptrs, mask=k[None, :] < K, other=0)
    if EXP == 4 and MAN == 3:  # the hardware's upcast: exact
        v = c.to(tl.float8e4nv, bitcast=True).to(tl.float32)
    elif EXP == 5 and MAN == 2:
        v = c.to(tl.float8e5, bitcast=True).to(tl.float32)
    else:
        v = decode_codes(c.to(tl.int32), EXP, MAN)
    si = s_first + tl.arange(0, ROWS // BR)
    sj = k0 // BC + tl.arange(0, BK // BC)
    s = tl.load(s_ptr + (si % S_ROWS)[:, None].to(tl.int64) * KB + sj[None, :], mask=sj[None, :] < KB, other=1.0)
    v = v * _expand(s, ROWS, BK, BR, BC)
    if BF16:
        v = v.to(tl.bfloat16)
    return v


@triton.jit
def dequant_gemm_kernel(a_ptr, sa_ptr, b_ptr, sb_ptr, ga_ptr, gb_ptr, out_ptr, M, N, K, KB, SA_ROWS, SB_ROWS,
                        A_EXP: tl.constexpr, A_MAN: tl.constexpr, B_EXP: tl.constexpr, B_MAN: tl.constexpr,
                        A_BR: tl.constexpr, B_BR: tl.constexpr, BC: tl.constexpr, GLOBAL_A: tl.constexpr,
                        GLOBAL_B: tl.constexpr, OUT_BF16: tl.constexpr, DOT_BF16: tl.constexpr,
                        EVEN_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """One ``BLOCK_M x BLOCK_N`` tile of ``out`` through BF16 dots. ``K``: the padded K of both operands (a
    multiple of ``BC``), ``KB = K // BC`` scale columns, ``SA_ROWS``/``SB_ROWS`` scale rows; ``BLOCK_M`` and
    ``BLOCK_N`` multiples of the blocks' rows (so a tile past the end wraps onto whole blocks)."""
    pid_m, pid_n = tile_of(tl.program_id(0), M, N, BLOCK_M, BLOCK_N)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rows_a, rows_b = offs_m % M, offs_n % N  # rows past the end read others: finite, never stored
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        a = _bf16_values(a_ptr, sa_ptr, rows_a, k, KB, pid_m * (BLOCK_M // A_BR), k0, A_EXP, A_MAN, A_BR, BC,
                         BLOCK_M, BLOCK_K, SA_ROWS, K, DOT_BF16, EVEN_K)
        b = _bf16_values(b_ptr, sb_ptr, rows_b, k, KB, pid_n * (BLOCK_N // B_BR), k0, B_EXP, B_MAN, B_BR, BC,
                         BLOCK_N, BLOCK_K, SB_ROWS, K, DOT_BF16, EVEN_K)
        acc = tl.dot(a, tl.trans(b), acc)
    if GLOBAL_A:
        acc = acc * tl.load(ga_ptr)
    if GLOBAL_B:
        acc = acc * tl.load(gb_ptr)
    store_tile(out_ptr, acc, offs_m, offs_n, M, N, OUT_BF16)


_dequant_tuned = triton.autotune(DEQUANT_CONFIGS, key=_KEY + ["BC", "EVEN_K"])(dequant_gemm_kernel)


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


def _fp8_operand(q: QuantizedTensor, recode: bool) -> tuple[torch.Tensor, F.Format]:
    """``q``'s codes as the FP8 kernels read them and their format: float8 where they are, else uint8 codes,
    re-encoded as E4M3 first with ``recode`` (one pass, a byte an element)."""
    data = q.data.view(torch.uint8)
    if q.fmt in _FLOAT8:
        return data.view(_FLOAT8[q.fmt]), q.fmt
    if not recode:
        return data, q.fmt
    out = torch.empty_like(data)
    n, block = data.numel(), 4096
    e4m3_codes_kernel[(triton.cdiv(n, block),)](data, out, n, EXP=q.fmt.exp_bits, MAN=q.fmt.man_bits, BLOCK=block,
                                               num_warps=8)
    return out.view(torch.float8_e4m3fn), F.get("e4m3")


def _scales_t(q: QuantizedTensor, cols: int) -> torch.Tensor:
    """``q``'s scales as ``(K blocks, cols)`` FP32, the rows past the operand's 1 (read, never used)."""
    s = q.scale.float()
    out = torch.ones(s.shape[1], cols, dtype=torch.float32, device=s.device)
    out[:, : s.shape[0]] = s.t()
    return out


def _fp8_gemm(a, b, out, m, n, chunk, variant, tile) -> None:
    da, fa = _fp8_operand(a, variant is BlockGemmVariant.CHUNK)
    db, fb = _fp8_operand(b, variant is BlockGemmVariant.CHUNK)
    cols = triton.cdiv(max(a.scale.shape[0], b.scale.shape[0]), _SCALE_PAD) * _SCALE_PAD
    args = (da, _scales_t(a, cols), db, _scales_t(b, cols), out, m, n, a.data.shape[1], cols)
    consts = dict(A_EXP=fa.exp_bits, A_MAN=fa.man_bits, B_EXP=fb.exp_bits, B_MAN=fb.man_bits, BC=chunk,
                  OUT_BF16=out.dtype == torch.int16)
    if tile is None:
        _chunk_tuned[lambda meta: (triton.cdiv(m, meta["BLOCK_M"]) * triton.cdiv(n, meta["BLOCK_N"]),)](*args, **consts)
    else:
        grid = (triton.cdiv(m, tile[0]) * triton.cdiv(n, tile[1]),)
        mx_chunk_kernel[grid](*args, **consts, BLOCK_M=tile[0], BLOCK_N=tile[1], num_warps=4)


def _dequant_gemm(a, b, out, m, n, chunk, tile) -> None:
    kp = a.data.shape[1]
    ga = a.global_scale if a.global_scale is not None else a.scale  # any tensor where there is none
    gb = b.global_scale if b.global_scale is not None else b.scale
    args = (a.data.view(torch.uint8), a.scale.float().contiguous(), b.data.view(torch.uint8),
            b.scale.float().contiguous(), ga, gb, out, m, n, kp, kp // chunk, a.scale.shape[0], b.scale.shape[0])
    consts = dict(A_EXP=a.fmt.exp_bits, A_MAN=a.fmt.man_bits, B_EXP=b.fmt.exp_bits, B_MAN=b.fmt.man_bits,
                  A_BR=a.block_shape[0], B_BR=b.block_shape[0], BC=chunk, GLOBAL_A=a.global_scale is not None,
                  GLOBAL_B=b.global_scale is not None, OUT_BF16=out.dtype == torch.int16,
                  DOT_BF16=a.data.is_cuda)  # a CPU tensor: the interpreter, whose BF16 dot is wrong
    if tile is None:
        def grid(meta: dict) -> tuple[int]:
            return (triton.cdiv(m, meta["BLOCK_M"]) * triton.cdiv(n, meta["BLOCK_N"]),)

        _dequant_tuned[grid](*args, **consts, EVEN_K=all(kp % c.kwargs["BLOCK_K"] == 0 for c in DEQUANT_CONFIGS))
    else:
        bm, bn, bk = tile
        grid = (triton.cdiv(m, bm) * triton.cdiv(n, bn),)
        dequant_gemm_kernel[grid](*args, **consts, EVEN_K=kp % bk == 0, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk,
                                  num_warps=4)


def block_scaled_mm(a: QuantizedTensor, b: QuantizedTensor, out_dtype: torch.dtype = torch.float32, *,
                    tile: tuple[int, int, int] | None = None,
                    variant: BlockGemmVariant | str | None = None) -> torch.Tensor:
    """``a (M, K) @ b (N, K).T -> (M, N)`` in ``out_dtype`` (M, N: the operands' original row counts) for
    MX or NVFP4 operands quantized along K (see [Note: block-scaled GEMMs on tensor cores]). ``tile``:
    ``(BLOCK_M, BLOCK_N, BLOCK_K)`` instead of the autotuned tiles (Triton's CPU interpreter, tests; the FP8
    variants step one chunk of K and ignore ``BLOCK_K``). ``variant``: the kernel; none: ``CHUNK`` for two
    MX operands with chunks of 32, else ``DEQUANT``."""
    chunk = _chunk(a, b)
    if a.shape[-1] != b.shape[-1]:  # then their padded K, whole blocks of one size, are equal too
        fail("a/b", "operands with the same reduction dimension K", f"{tuple(a.shape)} and {tuple(b.shape)}")
    mx_pair = a.granularity.kind is b.granularity.kind is GranularityKind.MX and chunk % _FP8_CHUNK == 0
    if variant is None:
        variant = BlockGemmVariant.CHUNK if mx_pair else BlockGemmVariant.DEQUANT
    if variant not in tuple(BlockGemmVariant):  # a str enum: its values compare equal to its members
        fail("variant", f"one of {', '.join(v.value for v in BlockGemmVariant)}", repr(variant))
    variant = BlockGemmVariant(variant)
    if variant is not BlockGemmVariant.DEQUANT and not mx_pair:
        fail("variant", "dequant for operands other than two MX ones with blocks of 32",
             f"{variant.value} for {a.granularity} and {b.granularity}")
    m, n = math.prod(a.shape[:-1]), math.prod(b.shape[:-1])
    bf16_out = out_dtype == torch.bfloat16
    out = torch.empty(m, n, dtype=torch.bfloat16 if bf16_out else torch.float32, device=a.data.device)
    if m == 0 or n == 0:
        return out.to(out_dtype)
    raw = out.view(torch.int16) if bf16_out else out  # a BF16 output is written as its bits
    if variant is BlockGemmVariant.DEQUANT:
        _dequant_gemm(a, b, raw, m, n, chunk, tile)
    else:
        _fp8_gemm(a, b, raw, m, n, chunk, variant, tile)
    return out if bf16_out else out.to(out_dtype)
