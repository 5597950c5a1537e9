"""Scaling granularities: which elements share one scale, and how that scale is chosen.

[Note: the 2-D view]
Every granularity works on a 2-D view of the tensor, ``(M, K) = (prod(shape[:-1]), shape[-1])``. The
last dimension is the one a GEMM reduces over (``x @ w.T`` reduces over the last dimension of both
``x (M, K)`` and ``w (N, K)``). A granularity tiles that view into blocks of ``block_rows x block_cols``
elements; ``None`` means the whole dimension. So:

=================  ===========  ===========  =======================================
granularity        block_rows   block_cols   scales
=================  ===========  ===========  =======================================
tensorwise         None         None         one FP32 scale
rowwise            1            None         one FP32 scale per row
columnwise         None         1            one FP32 scale per column
blockwise(1, 128)  1            128          FP32, DeepSeek-V3 activations/gradients
blockwise(128,128) 128          128          FP32, DeepSeek-V3 weights
mx(32)             1            32           E8M0 (a power of two), OCP MX v1.0
nvfp4(16)          1 (or 16)    16           E4M3 per block, times one FP32 global scale
=================  ===========  ===========  =======================================

Shapes that are not a multiple of the block are padded with zeros inside ``quantize`` (zeros never
change a block's amax) and cropped again by ``dequantize``.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass, field

from lowprec import formats as F
from lowprec._checks import check_positive_int, describe, fail


class ScaleRule(enum.Enum):
    """How a block's scale follows from its largest magnitude ``amax`` (``fmax``: the element
    format's largest finite value, ``emax``: the exponent of its largest binade)."""

    AMAX = "amax"
    """FP32 scale ``amax / fmax``: the block's largest element maps onto the format's largest."""
    FLOOR = "floor"
    """E8M0 scale ``2^(floor(log2(amax)) - emax)`` (OCP MX v1.0). Elements up to ``2^(emax+1)``
    can exceed ``fmax`` after scaling and saturate."""
    CEIL = "ceil"
    """E8M0 scale ``2^ceil(log2(amax / fmax))`` (the MXFP8 pre-training recipe, arXiv 2506.08027):
    rounding the scale up means no element saturates."""
    NVFP4 = "nvfp4"
    """Two levels (arXiv 2509.25149): a global FP32 scale ``g ~= amax_tensor / (fmax * 448)`` and per
    block an E4M3 scale ``s ~= e4m3(amax_block / fmax / g)``; elements are multiplied by
    ``fp32(1 / (s * g))``. The FP32 steps follow TransformerEngine's (see ``lowprec.quant.scales``)."""

    @property
    def scale_format(self) -> F.Format:
        """The format a block scale is exact in (NVFP4's FP32 global scale aside): its bits and codes."""
        return _SCALE_FORMATS[self]


_SCALE_FORMATS = {ScaleRule.AMAX: F.get("fp32"), ScaleRule.FLOOR: F.get("e8m0"), ScaleRule.CEIL: F.get("e8m0"),
                  ScaleRule.NVFP4: F.get("e4m3")}


class GranularityKind(enum.Enum):
    """The shape of a granularity's blocks, as code decides by it (a GEMM path, a kernel mode)."""

    TENSOR = "tensor"
    """One scale for the whole tensor."""
    ROW = "row"
    """One scale per row of the 2-D view (along the whole reduction dimension)."""
    COLUMN = "column"
    """One scale per column."""
    BLOCK = "block"
    """FP32 scales per ``block_rows x block_cols`` tile (``1 x 128``, ``128 x 128``, ...)."""
    MX = "mx"
    """E8M0 scales per ``1 x block_cols`` block (OCP MX)."""
    NVFP4 = "nvfp4"
    """E4M3 scales per block times an FP32 global scale."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Granularity:
    """Which elements share a scale (see [Note: the 2-D view]). Use the constructors below."""

    block_rows: int | None
    """Rows of the 2-D view per block; None for all rows."""
    block_cols: int | None
    """Columns (along the reduction dimension) per block; None for all columns."""
    rule: ScaleRule = ScaleRule.AMAX
    """How the block's scale is computed, and so the scale's format."""
    kind: GranularityKind = field(init=False, repr=False, compare=False)
    """The shape of the blocks, worked out once from the fields above (compiled code reads it on every cast:
    an attribute costs the tracer a step, the decision some hundred)."""

    def __post_init__(self) -> None:
        for name in ("block_rows", "block_cols"):
            v = getattr(self, name)
            if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v <= 0):
                fail(name, "a positive int or None", describe(v))
        if not isinstance(self.rule, ScaleRule):
            fail("rule", "a lowprec.quant.ScaleRule", describe(self.rule), TypeError)
        if self.rule is not ScaleRule.AMAX and self.block_cols is None:
            fail("block_cols", f"a block size for {self.rule.value} scales", "None")
        if self.rule in (ScaleRule.FLOOR, ScaleRule.CEIL) and self.block_rows != 1:
            fail("block_rows", "1 for MX scales (blocks run along the reduction dimension)", self.block_rows)
        object.__setattr__(self, "kind", _kind(self.block_rows, self.block_cols, self.rule))

    @property
    def scale_format(self) -> F.Format:
        """The format of the block scales (FP32, E8M0 or E4M3), from the format table."""
        return self.rule.scale_format

    @property
    def per_tensor(self) -> bool:
        """One FP32 scale for the whole tensor."""
        return self.kind is GranularityKind.TENSOR

    def blocks(self, rows: int, cols: int) -> tuple[int, int]:
        """Block shape for a 2-D view of ``rows x cols`` elements."""
        # at least 1: an empty dimension still needs a block size to divide by
        return (self.block_rows or max(rows, 1), self.block_cols or max(cols, 1))

    def __str__(self) -> str:
        r, c, kind = self.block_rows, self.block_cols, self.kind
        if kind is GranularityKind.MX:
            return f"mx{c}-{self.rule.value}"
        if kind is GranularityKind.NVFP4:
            return f"nvfp4-{r}x{c}" if r != 1 else f"nvfp4-{c}"
        return f"block{r}x{c}" if kind is GranularityKind.BLOCK else kind.value


def _kind(block_rows: int | None, block_cols: int | None, rule: ScaleRule) -> GranularityKind:
    if rule in (ScaleRule.FLOOR, ScaleRule.CEIL):
        return GranularityKind.MX
    if rule is ScaleRule.NVFP4:
        return GranularityKind.NVFP4
    lines = {(None, None): GranularityKind.TENSOR, (1, None): GranularityKind.ROW, (None, 1): GranularityKind.COLUMN}
    return lines.get((block_rows, block_cols), GranularityKind.BLOCK)


def tensorwise() -> Granularity:
    return _TENSORWISE


def rowwise() -> Granularity:
    """One scale per row of the 2-D view (per token for activations, per output channel for weights)."""
    return _ROWWISE


def columnwise() -> Granularity:
    return _COLUMNWISE


# One instance each, shared (a granularity is a frozen value): compiled casts that label their result row-wise
# read a constant instead of tracing a construction and its checks.
_TENSORWISE = Granularity(block_rows=None, block_cols=None)
_ROWWISE = Granularity(block_rows=1, block_cols=None)
_COLUMNWISE = Granularity(block_rows=None, block_cols=1)


# The constructors check their own arguments so that an error names the argument the caller
# passed (``block``), not the field it lands in (``block_cols``).


def blockwise(rows: int = 1, cols: int = 128) -> Granularity:
    """FP32 scales per ``rows x cols`` block: ``(1, 128)`` for activations, ``(128, 128)`` for weights."""
    for name, v in (("rows", rows), ("cols", cols)):
        if v is not None:
            check_positive_int(name, v)
    return Granularity(block_rows=rows, block_cols=cols)


def mx(block: int = 32, rule: str | ScaleRule = ScaleRule.FLOOR) -> Granularity:
    """MX blocks of ``block`` elements along the reduction dimension with E8M0 scales."""
    check_positive_int("block", block)
    mx_rules = (ScaleRule.FLOOR, ScaleRule.CEIL)
    if isinstance(rule, str) and rule in [r.value for r in mx_rules]:
        rule = ScaleRule(rule)
    if rule not in mx_rules:
        fail("rule", "'floor' or 'ceil' (or ScaleRule.FLOOR/CEIL) for MX scales", describe(rule))
    return Granularity(block_rows=1, block_cols=block, rule=rule)


def nvfp4(block: int = 16, two_d: bool = False) -> Granularity:
    """NVFP4: E4M3 scales per ``block`` elements (``block x block`` tiles with ``two_d``, as the
    NVFP4 recipe quantizes weights so that W and W.T share scales) and one FP32 global scale."""
    check_positive_int("block", block)
    if not isinstance(two_d, bool):
        fail("two_d", "a bool", describe(two_d), TypeError)
    return Granularity(block_rows=block if two_d else 1, block_cols=block, rule=ScaleRule.NVFP4)
