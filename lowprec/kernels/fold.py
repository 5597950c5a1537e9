"""MX operands folded to one power-of-two scale per row, for FP8 tensor cores that have no block scales.

[Note: folding MX blocks into rows]
An MX operand is ``code * 2^e[row, block]``: elements of at most 3 mantissa bits (E4M3, E5M2, E3M2,
E2M3, E2M1) and E8M0 scales, powers of two. Hopper's FP8 tensor cores take one scale per row of each
operand (``torch._scaled_mm`` with row-wise scales), not one per 32 elements. But a power of two moves
between a scale and its element without rounding while the element stays on the FP8 grid, so each row
can carry one scale ``R = 2^(max_block e - h)`` and each element the rest of its block's:

    folded = round(code * 2^(e[row, block] - max_block e + h)),   value = folded * R

in E4M3 (E5M2 for E5M2 elements). ``h`` is the headroom that puts the row's largest block at the top of
the target's range: 0 for E4M3 and E5M2 elements, 6 for E2M1 (6 * 2^6 = 384 <= 448), 5 for E2M3, 4 for
E3M2. Then the GEMM of the folded operands is the row-wise FP8 GEMM cuBLAS runs at FP8 speed, with the
two row scales multiplying each output (exact: powers of two).

What it changes: nothing for a folded value at or above the target's smallest normal (``2^-6`` for
E4M3, ``2^-14`` for E5M2), since shifting an element of at most 3 mantissa bits keeps its bits there.
Below, the target's subnormals keep fewer bits, so ``folded`` is rounded to nearest-even onto their
step (``2^-9``, ``2^-16``): an element off by at most half of it, ``2^-10 R`` (E4M3) or ``2^-17 R``
(E5M2). The row's largest block holds a code of at least ``2^7 R`` (E4M3 elements: a block's largest code
is at least 224 with scales rounded up, 256 rounded down; FP4/FP6: at least half the format's largest
times ``2^h``; E2M3 alone only 120 R), so the rounded elements are at least ``2^-13`` smaller than their
row's largest (E2M3: ``2^-12.9``), and each element is within ``2^-17`` of its row's largest magnitude of
the value the emulation multiplies (``2^-16`` for E2M3). Every element is exact where a row's blocks have
scales within a few binades of each other (E2M1: within 14 binades; E4M3: only elements that stay normal).
NaN blocks (the E8M0 NaN scale) and NaN or infinite elements stay NaN or infinite. Zeros fold to +0
whatever their sign (the same product; Triton and inductor negate a float as ``0 - x``, so a decoded -0
would lose its sign in compiled code and keep it in eager, and the codes would differ by device).

A GEMM of folded operands (``GemmPath.FOLDED`` in ``lowprec.kernels.gemm``) therefore differs from the
emulation by that rounding of tiny elements and by the tensor cores' accumulation; where every element
folds exactly and every partial sum is representable it equals the emulation bit for bit, which is what
it checks on a device's first use (:data:`CHECK`, see [Note: GEMM paths that check themselves]).
:func:`fold` runs a Triton kernel eagerly on a CUDA device with Triton (``kernels.triton_fold``, bit-exact
with :func:`fold_reference`), and the reference's elementwise ops elsewhere and in compiled code, where the
compiler fuses them.
"""
from __future__ import annotations

import math

import torch

from lowprec._checks import fail
from lowprec.kernels.first_use import FirstUseCheck, integer_operands
from lowprec.kernels.fold_rule import ELEMENTS, MIN_SHIFT, NAN_EXPONENT, foldable, headroom, target
from lowprec.kernels.route import Backend, fold_backend
from lowprec.quant import QuantizedTensor, mx, rowwise


def _check(q: QuantizedTensor) -> None:
    if not isinstance(q, QuantizedTensor) or not foldable(q.fmt, q.granularity) or q.global_scale is not None:
        got = q if not isinstance(q, QuantizedTensor) else f"{q.fmt.name} with {q.granularity}"
        fail("q", "an MX operand (E4M3, E5M2, FP6 or FP4 elements, E8M0 scales per 1 x N block)", got)


def exponents(scale: torch.Tensor) -> torch.Tensor:
    """int32 ``log2`` of power-of-two float32 scales (E8M0's, 2^-127 included), from their bits; NaN ->
    ``NAN_EXPONENT``."""
    bits = scale.view(torch.int32)
    biased = (bits >> 23) & 0xFF
    e = torch.where(biased == 0, torch.full_like(biased, -127), biased - 127)  # 2^-127: FP32's one subnormal here
    return torch.where(scale.isnan(), torch.full_like(e, NAN_EXPONENT), e)


def _less_headroom(top: torch.Tensor, h: int) -> torch.Tensor:
    """A row's (or segment's) largest block exponent ``top`` less ``h``; 0 where it has no finite-scaled block
    (NaN blocks only, or none)."""
    return torch.where(top == NAN_EXPONENT, torch.zeros_like(top), top - h)


def row_exponents(e: torch.Tensor, h: int) -> torch.Tensor:
    """``(M,)`` int32: each row's largest block exponent minus ``h`` (0 for a row of NaN blocks only)."""
    return _less_headroom(e.amax(dim=1), h)


def _folded_codes(q: QuantizedTensor, e: torch.Tensor, r: torch.Tensor) -> torch.Tensor:
    """``q``'s elements times ``2^(e - r)`` per block (``r`` ``(M, KB)``: the exponent of the scale each block
    is folded to), rounded onto the target's grid."""
    shift = (e - r).clamp(min=MIN_SHIFT)  # (M, KB); NaN blocks: far below, made NaN next
    factor = torch.ldexp(torch.ones_like(q.scale), shift)
    factor = torch.where(q.scale.isnan(), torch.full_like(factor, math.nan), factor)
    m, kb = q.scale.shape
    v = q.values().view(m, kb, -1) * factor[:, :, None]  # exact: a power of two times a few bits, normal
    v = torch.where(v == 0, 0.0, v)  # every zero +0: a compiled negation may drop a -0's sign, so none is kept
    return v.view(q.data.shape).to(target(q.fmt).torch_dtype)  # nearest-even onto the target's grid, never past its max


def fold_reference(q: QuantizedTensor) -> QuantizedTensor:
    """``q`` (MX) as a row-wise FP8 operand: see [Note: folding MX blocks into rows]. Pure torch."""
    _check(q)
    e = exponents(q.scale)  # (M, KB)
    r = row_exponents(e, headroom(q.fmt))  # (M,)
    scale = torch.ldexp(torch.ones(q.shape[0], 1, dtype=torch.float32, device=q.data.device), r[:, None])  # (M, 1)
    return QuantizedTensor(_folded_codes(q, e, r[:, None]), scale, target(q.fmt), rowwise(), q.shape, q.dtype)


def fold_segments(q: QuantizedTensor, segment: torch.Tensor, n_segments: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``q`` (MX) folded with a scale per row *and segment*: ``segment`` ``(KB,)`` int64 gives each block
    column's segment (in ``[0, n_segments)``). Each row's blocks in one segment fold to one power of two,
    as :func:`fold_reference` folds a row, so the codes of a segment's columns equal the fold of those
    columns alone, bit for bit. What the experts' weight gradient needs: MX blocks along the tokens, each
    expert's tokens a segment, one scale per (feature, expert). Returns the codes ``(M, K)`` in the target
    format and the scales ``(M, n_segments)`` (float32 powers of two; 1 for a segment without a block or
    with NaN blocks only). Pure torch."""
    _check(q)
    e = exponents(q.scale)  # (M, KB)
    m, kb = e.shape
    if segment.shape != (kb,):
        fail("segment", f"one segment per block column, shape ({kb},)", tuple(segment.shape))
    index = segment.to(device=e.device, dtype=torch.int64).expand(m, kb)
    top = e.new_full((m, n_segments), NAN_EXPONENT).scatter_reduce(1, index, e, "amax")  # NaN blocks: lowest
    r = _less_headroom(top, headroom(q.fmt))  # (M, S)
    scales = torch.ldexp(torch.ones(m, n_segments, dtype=torch.float32, device=e.device), r)
    return _folded_codes(q, e, r.gather(1, index)), scales


def fold(q: QuantizedTensor, backend: str | Backend | None = None) -> QuantizedTensor:
    """``q`` (MX) as a row-wise FP8 operand, on the route the device takes (``backend`` forces one)."""
    _check(q)
    bc = q.granularity.block_cols
    triton_block = bc & (bc - 1) == 0  # the kernel's tiles are powers of two; MX's 32 is
    if triton_block and fold_backend(q.data.device, compiling=torch.compiler.is_compiling(),
                                     backend=backend) is Backend.TRITON:
        from lowprec.kernels.triton_fold import fold_triton  # Triton: imported where it runs

        return fold_triton(q, target(q.fmt), headroom(q.fmt), MIN_SHIFT, NAN_EXPONENT)
    return fold_reference(q)


def _problems(device: torch.device) -> list[tuple[str, QuantizedTensor, QuantizedTensor]]:
    """E4M3 and E2M1 operands whose folding is exact (blocks up to four binades apart), K not a multiple of 128."""
    return [(fmt, *integer_operands(device, fmt, mx(32))) for fmt in ("e4m3", "e2m1")]


CHECK = FirstUseCheck("MX GEMMs on folded FP8 operands", "MX GEMMs stay emulated there", _problems)
"""The folded GEMM's first-use check (see [Note: GEMM paths that check themselves])."""


__all__ = ["CHECK", "ELEMENTS", "exponents", "fold", "fold_reference", "fold_segments", "foldable", "headroom",
           "target"]
