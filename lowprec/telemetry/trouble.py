"""Which layers a run's telemetry shows in trouble, and the policy that keeps them in high precision.

[Note: the trouble score]
Each record is judged against floors of the format its operand was cast to, read from the format
table (:mod:`lowprec.formats`), so that what a format does by design is never a flag:

* underflow: flagged above ``UNDERFLOW_SCALE / sqrt(reach)``, where ``reach = log2(max /
  (min_subnormal / 2))``, the format's ``binades`` plus one (the values between half the smallest
  subnormal and it round up rather than flush), is how far below its block's largest value an element
  survives the cast. A format that reaches fewer binades down flushes more of a healthy operand's small
  elements, though less than in proportion (much of what a wide format flushes was numerically zero to
  begin with): E2M1 reaches 4.6 binades (floor 0.93: in a 300-step run of the small model on an H200,
  NVFP4 flushed up to 0.49 of a SwiGLU output and MXFP4, whose blocks of 32 hold larger outliers, up to
  0.71), E4M3 18.8 (0.46: up to 0.15 of an attention projection's gradient in the reference runs), E5M2 32.8 (0.35),
  BF16 262 (0.12);
* saturation: flagged above ``SATURATION_FLOOR`` (5%) in every format, since clipping is the scale's
  doing, not the format's: current scaling never clips, a delayed scale behind a growing amax clips up
  to 2% in a reference run's first steps, and a fault (an operand scaled up between two steps) clips
  most of the tensor;
* SQNR: flagged under ``ideal - SQNR_ALLOWANCE_DB``, where ``ideal = 6.02 * man_bits + 14.5`` dB is
  the SQNR of rounding values spread evenly over a binade (the error uniform in half a grid step):
  E4M3 32.5 dB (floor 2.5), E5M2 26.5 (-3.5), E2M1 20.5 (-9.5). A cast loses SQNR through what it
  clips or flushes, which the two figures above judge; this flag is for a cast whose error outweighs
  the operand (a reference fp8-delayed run's first steps fall to 3 dB on E5M2 gradients and train on).

A record's trouble is its worst figure's distance to the floor, as a fraction of the floor
(``underflow / floor``, ``saturation / floor``, ``max(0, ideal - SQNR) / allowance``), so 1 is at the
floor; a record with a non-finite amax or a NaN SQNR (inf or NaN in the operand) scores inf. A
layer's score is its worst record's over every operand and sampled step; layers scoring
``TROUBLE_THRESHOLD`` (1) or more are flagged and suggested for high precision. A record without a
format (a file written before it was recorded) is judged by the most lenient floors of the table's
element formats (E2M1's). The reference figures above, unless said otherwise, are the largest of
20-step runs of every preset on a two-block model of width 128 (the embedded corpus, CPU) and of
300-step runs of the small model (H200); tests/telemetry/test_trouble_presets.py
runs each preset briefly and asserts that nothing is flagged, and tests/telemetry/test_inspect.py that
an injected fault is.
"""
from __future__ import annotations

import enum
import math
from collections import defaultdict
from dataclasses import dataclass, replace

from lowprec import formats as F
from lowprec._checks import fail
from lowprec.policy import Policy
from lowprec.telemetry.experts import split_expert
from lowprec.telemetry.stats import OperandStats

TROUBLE_THRESHOLD = 1.0
"""A layer scoring this or more is flagged and suggested for high precision (see [Note: the trouble score])."""
UNDERFLOW_SCALE = 2.0
"""Underflow floor times the square root of the binades a format reaches below a block's largest value."""
SATURATION_FLOOR = 0.05
"""The fraction of an operand's elements clipped, in any format, above which it is flagged."""
SQNR_ALLOWANCE_DB = 30.0
"""How far under its format's ideal SQNR a record may fall before it is flagged."""


def reach(fmt: F.Format) -> float:
    """How many binades below a block's largest value an element of ``fmt`` survives the cast: its dynamic
    range (``binades``) and the half binade under its smallest subnormal, which rounds up to it."""
    return fmt.binades + 1


def ideal_sqnr_db(fmt: F.Format) -> float:
    """The SQNR of rounding values spread evenly over a binade onto ``fmt``'s grid: the rounding error is
    uniform in half a step 2^-m, so noise/signal = 2^-2m / 12 / (7/3)."""
    return 20 * math.log10(2) * fmt.man_bits + 10 * math.log10(28)


@dataclass(frozen=True, slots=True)
class Floors:
    """Where a figure of an operand cast to ``fmt`` is flagged (see [Note: the trouble score])."""

    fmt: F.Format | None
    underflow: float
    """Flagged above this fraction flushed to zero."""
    saturation: float
    """Flagged above this fraction clipped."""
    sqnr_db: float
    """Flagged under this SQNR."""


def _lenient() -> F.Format:
    """The element format whose floors are widest: the one keeping the fewest binades (E2M1)."""
    return min((f for f in F.FORMATS.values() if f.kind is F.Kind.FLOAT), key=reach)


def floors(fmt: F.Format | None) -> Floors:
    """The floors of an operand cast to ``fmt`` (None: unknown, judged by the most lenient)."""
    f = fmt if fmt is not None else _lenient()
    return Floors(fmt, min(1.0, UNDERFLOW_SCALE / math.sqrt(reach(f))), SATURATION_FLOOR,
                  ideal_sqnr_db(f) - SQNR_ALLOWANCE_DB)


class Figure(str, enum.Enum):
    """What a record is judged by: an :class:`OperandStats` figure, or its values being non-finite."""

    UNDERFLOW = "underflow"
    SATURATION = "saturation"
    SQNR = "sqnr_db"
    NON_FINITE = "non-finite"


@dataclass(frozen=True, slots=True)
class Flag:
    """The figure of a record that scored, beside its floor."""

    figure: Figure
    value: float
    floor: float

    def __str__(self) -> str:
        if self.figure is Figure.NON_FINITE:
            return "non-finite values (always flagged)"
        if self.figure is Figure.SQNR:
            return f"SQNR {self.value:.1f} dB (flag below {self.floor:.1f})"
        return f"{self.figure.value} {self.value:.3g} (flag above {self.floor:.3g})"


@dataclass(frozen=True, slots=True)
class LayerTrouble:
    """One layer's summary over a run's sampled steps."""

    layer: str
    score: float
    """The worst record's trouble (see [Note: the trouble score]); 1 is at its floor."""
    worst: str
    """``gemm.operand @ step`` of the record that scored it."""
    worst_sqnr_db: float
    max_saturation: float
    max_underflow: float
    flag: Flag | None = None
    """The worst record's figure that scored, with its floor."""


def record_trouble(r: OperandStats) -> tuple[float, Flag]:
    """A record's trouble and the figure that scored it (see [Note: the trouble score])."""
    if not math.isfinite(r.amax) or math.isnan(r.sqnr_db):
        return math.inf, Flag(Figure.NON_FINITE, math.nan, math.nan)
    fl = floors(r.fmt)
    ideal = fl.sqnr_db + SQNR_ALLOWANCE_DB
    scored = [(r.underflow / fl.underflow, Flag(Figure.UNDERFLOW, r.underflow, fl.underflow)),
              (r.saturation / fl.saturation, Flag(Figure.SATURATION, r.saturation, fl.saturation)),
              (max(0.0, ideal - r.sqnr_db) / SQNR_ALLOWANCE_DB, Flag(Figure.SQNR, r.sqnr_db, fl.sqnr_db))]
    return max(scored, key=lambda t: t[0])


def rank_layers(records: list[OperandStats]) -> list[LayerTrouble]:
    """Every layer of ``records``, the most troubled first (ties: in the order they appear)."""
    by_layer: dict[str, list[tuple[float, Flag, OperandStats]]] = defaultdict(list)
    for r in records:
        by_layer[r.layer].append((*record_trouble(r), r))
    out = []
    for layer, scored in by_layer.items():
        score, flag, worst = max(scored, key=lambda t: t[0])
        rs = [r for *_, r in scored]
        sqnrs = [r.sqnr_db for r in rs]
        out.append(LayerTrouble(layer, score, f"{worst.gemm}.{worst.operand} @ step {worst.step}",
                                math.nan if any(map(math.isnan, sqnrs)) else min(sqnrs),
                                max(r.saturation for r in rs), max(r.underflow for r in rs), flag))
    return sorted(out, key=lambda t: -t.score)


def suggest_policy(ranked: list[LayerTrouble], threshold: float = TROUBLE_THRESHOLD,
                   base: Policy | None = None) -> Policy:
    """``base`` (default: the default policy) with the layers scoring at least ``threshold`` added to
    its ``exclude`` patterns (exact names), so that ``train --policy`` keeps them in high precision; an
    expert in trouble names its ``GroupedLinear``, which a policy keeps whole (see [Note: telemetry per
    expert] in ``lowprec.telemetry.experts``)."""
    base = base if base is not None else Policy()
    troubled = tuple(dict.fromkeys(split_expert(t.layer)[0] for t in ranked if t.score >= threshold))
    if callable(base.exclude):
        fail("base", "a Policy whose exclude is glob patterns", "a predicate", TypeError)
    kept = tuple(base.exclude or ())
    return replace(base, exclude=kept + tuple(n for n in troubled if n not in kept) or None)
