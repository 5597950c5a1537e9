"""The ladder of ever wider recipes the precision controller moves a GEMM along, derived from formats.

[Note: the ladder]
A recipe's *width* is the bits of its narrowest operand format (a cast kept as it is counts as FP32).
Its next rung is a preset of the next greater width, so every rung is strictly wider and the ladder
ends. Among the presets of that width the rung is the one with the finest scaling (fewest elements
sharing a scale, over its casts: MX blocks of 32 before 1x128 blocks, before a scale per row or per
tensor), then the widest range (most exponent bits: BF16 before FP16, whose range needs loss
scaling), then the first in ``lowprec.recipes.PRESETS``. Finest scaling first because a GEMM widened
for its numerics should lose as little as it can: a block-scaled FP4 recipe goes to the block-scaled
FP8 one. So ``nvfp4`` and ``mxfp4`` go to ``mxfp8``, every FP8 recipe to ``bf16``, and 16-bit recipes
are the top of their ladder. A user's recipe, or a preset added later, gets its ladder by the same rule.
"""
from __future__ import annotations

import math

from lowprec import recipes as R

FP32_BITS = 32
"""The width of a cast kept as it is (``format=None``): high precision, FP32 at most."""


def width(recipe: R.Recipe) -> int:
    """Bits of the narrowest operand format of ``recipe``."""
    return min(FP32_BITS if c.fmt is None else c.fmt.bits for c in recipe.casts().values())


def _coarseness(recipe: R.Recipe) -> float:
    """The most elements sharing one scale in any quantized cast (inf: a whole row or tensor; 0: no scales)."""
    sizes = [math.inf if g.block_rows is None or g.block_cols is None else g.block_rows * g.block_cols
             for g in (c.granularity for c in recipe.casts().values() if c.quantized)]
    return max(sizes, default=0)


def _range_bits(recipe: R.Recipe) -> int:
    """Exponent bits of the narrowest-range operand format."""
    return min(FP32_BITS if c.fmt is None else c.fmt.exp_bits for c in recipe.casts().values())


def next_wider(recipe: R.Recipe) -> R.Recipe | None:
    """The rung above ``recipe`` (see [Note: the ladder]); None at the top."""
    w = width(recipe)
    presets = [make() for make in R.PRESETS.values()]
    wider = [(width(p), _coarseness(p), -_range_bits(p), i) for i, p in enumerate(presets) if width(p) > w]
    return presets[min(wider)[-1]] if wider else None


def ladder(recipe: R.Recipe) -> list[R.Recipe]:
    """``recipe`` and the rungs above it, narrowest first."""
    out = [recipe]
    while (up := next_wider(out[-1])) is not None:
        out.append(up)
    return out
