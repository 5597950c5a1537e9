"""Rounding onto a format's grid: round half to even, or stochastically (unbiased).

Computed in float32 (float64 for float64 inputs, so they are rounded once, not twice) with operations
that are exact (scaling by powers of two, ``torch.round``), so the results are bit-exact on every device.
"""
from __future__ import annotations

import enum
import math

import torch

from lowprec._checks import check_choice, check_tensor, describe, fail
from lowprec.formats.table import Format, Kind, get


class Rounding(str, enum.Enum):
    """How a value between two neighbours of a format is rounded. A ``str`` enum, so ``"nearest"`` is
    accepted wherever a ``Rounding`` is; code that decides by it resolves the name once
    (``Rounding(name)``) and compares members, never strings."""

    NEAREST = "nearest"
    """Round half to even."""
    STOCHASTIC = "stochastic"
    """Round away from zero with probability equal to the distance from the lower neighbour, over the
    gap (unbiased)."""


ROUNDINGS = tuple(r.value for r in Rounding)


def as_rounding(rounding: str | Rounding, name: str = "rounding") -> Rounding:
    """``rounding`` as a :class:`Rounding` member; an unknown name is an error naming ``name``."""
    if isinstance(rounding, Rounding):  # a member: no string compare on the casts' path
        return rounding
    check_choice(name, rounding, ROUNDINGS)
    return Rounding(rounding)


def _quantum(a: torch.Tensor, f: Format) -> torch.Tensor:
    """The grid spacing at |x| = a: 2^(E - man_bits), E the binade of a (at least emin)."""
    if f.kind is Kind.INT:
        return torch.ones_like(a)
    _, e = torch.frexp(a)  # a = m * 2^e, m in [0.5, 1)
    binade = (e - 1).clamp_min(f.emin)
    return pow2(binade - f.man_bits, a.dtype, f.emin - f.man_bits)


def pow2(e: torch.Tensor, dtype: torch.dtype = torch.float32, lowest: int = -1074) -> torch.Tensor:
    """``2.0 ** e`` exactly, for integer ``e`` no smaller than ``lowest``. Where every result is a
    normal float32 this writes the exponent bits directly (``torch.ldexp`` computes a power)."""
    if dtype == torch.float32 and lowest >= -126:
        return ((e.to(torch.int32) + 127).clamp(1, 254) << 23).view(torch.float32)
    return torch.ldexp(torch.ones(e.shape, dtype=dtype, device=e.device), e)


def round_to(
    x: torch.Tensor,
    fmt: str | Format,
    rounding: str | Rounding = Rounding.NEAREST,
    saturate: bool = True,
    generator: torch.Generator | None = None,
    rand: torch.Tensor | None = None,
) -> torch.Tensor:
    """``x`` rounded onto the grid of ``fmt``, returned as float32.

    ``rounding="nearest"`` rounds half to even. ``"stochastic"`` rounds away from zero with
    probability equal to the distance from the lower grid point (in units of the grid spacing),
    so ``E[round_to(x)] = x``; it uses ``rand`` (uniform float32 in [0, 1), x's shape) when given,
    else draws it from ``generator``. A value rounds away from zero exactly when ``rand < frac``.

    Overflow: with ``saturate`` a finite value beyond the largest finite goes to the largest finite
    of its sign (the training-cast convention); without, it follows the format's own rule (inf
    where there is inf, NaN where there is NaN, an error where there is neither).
    Inf and NaN inputs are never made finite: inf stays inf where the format has it, else becomes
    NaN; a format without NaN (FP6, FP4, ints) raises for them. Block formats keep NaN in the
    block scale instead (see ``lowprec.quant``).
    """
    f = get(fmt)
    x = check_tensor("x", x)
    stochastic = as_rounding(rounding) is Rounding.STOCHASTIC
    # float64 stays float64: going through float32 first would round twice (wrong ties) and turn
    # finite values beyond float32's range into inf before saturation could see them.
    x = x.double() if x.dtype == torch.float64 else x.float()
    finite = torch.isfinite(x)
    if not f.has_nan and not bool(finite.all()):
        fail("x", f"finite values ({f.name} has no inf or NaN; block formats carry them in the scale)",
             "a tensor containing inf or NaN")
    if f.kind is Kind.EXPONENT and bool((x <= 0).any()):
        fail("x", "positive values (e8m0 has no sign and no zero)", "a tensor with values <= 0")
    if stochastic:
        if rand is None:
            rand = torch.rand(x.shape, generator=generator, device=x.device)
        elif not isinstance(rand, torch.Tensor) or rand.shape != x.shape or rand.dtype != torch.float32:
            fail("rand", f"a float32 tensor of shape {tuple(x.shape)}", describe(rand),
                 ValueError if isinstance(rand, torch.Tensor) else TypeError)
    y = round_unchecked(x, f, rand if stochastic else None, saturate=saturate)
    if not saturate and not f.has_nan and bool(torch.isnan(y).any()):  # x is finite here: NaN = overflow
        fail("x", f"values within [{f.lowest}, {f.max}] ({f.name} has no inf or NaN to overflow to)",
             "values beyond it with saturate=False")
    return y


def round_unchecked(x: torch.Tensor, fmt: str | Format, rand: torch.Tensor | None = None,
                    saturate: bool = True) -> torch.Tensor:
    """:func:`round_to` without argument checks and without host synchronisation (no data-dependent
    branch), for callers that guarantee a float32/float64 ``x``, finite wherever ``fmt`` has no NaN, and
    positive for e8m0: ``lowprec.quant`` and the kernels. ``rand`` given: stochastic rounding.
    Without ``saturate``, overflow goes to inf or NaN (NaN where the format has neither)."""
    f = get(fmt)
    if rand is None and saturate and f.kind is Kind.FLOAT and f.torch_dtype is not None and f.bits <= 16 \
            and x.dtype == torch.float32:
        return _round_native(x, f)
    return _round_formula(x, f, rand, saturate)


def _round_native(x: torch.Tensor, f: Format) -> torch.Tensor:
    """Round-to-nearest-even by torch's own cast (one kernel instead of a dozen), after the clamp that
    makes it saturate and the rule that keeps non-finite values non-finite. Tested bit for bit
    against :func:`_round_formula` on every tie and binade edge."""
    nonfinite = x if f.has_inf else torch.copysign(torch.full_like(x, math.nan), x)
    y = x.clamp(f.lowest, f.max).to(f.torch_dtype).float()
    return torch.where(torch.isfinite(x), y, nonfinite)


def _round_formula(x: torch.Tensor, f: Format, rand: torch.Tensor | None, saturate: bool) -> torch.Tensor:
    finite = torch.isfinite(x)
    a = torch.where(finite, x.abs(), 0.0)
    q = _quantum(a, f)
    t = a / q  # exact: q is a power of two
    if rand is None:
        r = torch.round(t)  # half to even
    else:
        low = torch.floor(t)
        r = low + (rand.to(x.device) < (t - low)).to(t.dtype)
    y = r * q
    if f.kind is Kind.EXPONENT:  # no zero: values below 2^-127 round to it
        y = y.clamp_min(f.min_subnormal)
    y = torch.copysign(y, x) if f.signed else y
    over = finite & ((y > f.max) | (y < f.lowest))
    if saturate:
        y = torch.where(over, torch.where(y > 0, f.max, f.lowest), y)
    else:
        y = torch.where(over, torch.copysign(torch.full_like(y, math.inf if f.has_inf else math.nan), x), y)
    # NaN keeps x's sign, so encode gives -inf and -NaN the negative NaN code
    y = torch.where(finite, y, x if f.has_inf else torch.copysign(torch.full_like(x, math.nan), x))
    return y.float()
