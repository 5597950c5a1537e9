"""The folding rule's facts (see [Note: folding MX blocks into rows] in ``lowprec.kernels.fold``): which MX
operands fold, into which FP8 format, with what headroom, and the exponents that stand for a NaN scale and for
a block folded to zero. Formats alone: the cast kernels' plans read them without the fold's machinery.
"""
from __future__ import annotations

import math

from lowprec import formats as F
from lowprec.quant import GranularityKind

E4M3, E5M2 = F.get("e4m3"), F.get("e5m2")
ELEMENTS = tuple(F.get(n) for n in ("e4m3", "e5m2", "e3m2", "e2m3", "e2m1"))
"""The element formats that fold: at most 3 mantissa bits, a range inside E4M3's (or E5M2 itself)."""
NAN_EXPONENT = -1000
"""The exponent a NaN scale stands for: below every real one (E8M0's smallest is -127)."""
MIN_SHIFT = -40
"""Block shifts below this fold to zero alike (every element then lies under half the smallest
subnormal step of the target) and keep the FP32 multiply normal."""


def target(fmt: F.Format) -> F.Format:
    """The FP8 format ``fmt``'s elements fold into: E5M2 for E5M2, E4M3 for the others."""
    return E5M2 if fmt is E5M2 else E4M3


def headroom(fmt: F.Format) -> int:
    """``h``: binades the row's largest block moves up so that its largest element still fits the target."""
    return int(math.floor(math.log2(target(fmt).max / fmt.max)))


def foldable(fmt, granularity) -> bool:
    """Whether an operand of this format and granularity folds (MX: E8M0 scales per 1 x N block)."""
    return (granularity.kind is GranularityKind.MX and granularity.block_rows == 1
            and F.get(fmt) in ELEMENTS)


__all__ = ["E4M3", "E5M2", "ELEMENTS", "MIN_SHIFT", "NAN_EXPONENT", "foldable", "headroom", "target"]
