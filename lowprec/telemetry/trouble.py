"""Which layers a run's telemetry shows in trouble, and the policy that keeps them in high precision.

[Note: the trouble score]
Each record is judged against its peers: the records of every layer for the same GEMM, operand and
step (the same recipe cast the same role of every layer, so a layer that loses more than its peers
is the one in trouble, whatever the format's usual error). A record's trouble is

    max(0, peer median SQNR - its SQNR)                     dB it loses beyond its peers
  + 100 * saturation                                        1 dB per percent of elements clipped
  + 100 * max(0, underflow - peer median underflow)         1 dB per percent flushed beyond its peers

and a layer's score is its worst record's over every operand and sampled step. A record with a
non-finite amax or a NaN SQNR (inf or NaN in the operand) scores inf. Layers scoring at least the
threshold (default 3: 3 dB, or 3% of the elements clipped) are suggested for high precision.
"""
from __future__ import annotations

import math
import statistics
from collections import defaultdict
from dataclasses import dataclass, replace

from lowprec._checks import fail
from lowprec.policy import Policy
from lowprec.telemetry.stats import OperandStats

TROUBLE_THRESHOLD = 3.0
"""A layer scoring this or more is suggested for high precision (see [Note: the trouble score])."""


@dataclass(frozen=True, slots=True)
class LayerTrouble:
    """One layer's summary over a run's sampled steps."""

    layer: str
    score: float
    """The worst record's trouble (see [Note: the trouble score])."""
    worst: str
    """``gemm.operand @ step`` of the record that scored it."""
    worst_sqnr_db: float
    max_saturation: float
    max_underflow: float


def _record_trouble(r: OperandStats, sqnr_median: float, underflow_median: float) -> float:
    if not math.isfinite(r.amax) or math.isnan(r.sqnr_db):
        return math.inf
    shortfall = max(0.0, sqnr_median - r.sqnr_db) if math.isfinite(r.sqnr_db) else 0.0
    return shortfall + 100 * r.saturation + 100 * max(0.0, r.underflow - underflow_median)


def _finite_median(values: list[float]) -> float:
    finite = [v for v in values if math.isfinite(v)]
    return statistics.median(finite) if finite else math.inf


def rank_layers(records: list[OperandStats]) -> list[LayerTrouble]:
    """Every layer of ``records``, the most troubled first (ties: in the order they appear)."""
    peers: dict[tuple[str, str, int], list[OperandStats]] = defaultdict(list)
    for r in records:
        peers[(r.gemm, r.operand, r.step)].append(r)
    medians = {k: (_finite_median([r.sqnr_db for r in v]), statistics.median([r.underflow for r in v]))
               for k, v in peers.items()}
    by_layer: dict[str, list[tuple[float, OperandStats]]] = defaultdict(list)
    for r in records:
        by_layer[r.layer].append((_record_trouble(r, *medians[(r.gemm, r.operand, r.step)]), r))
    out = []
    for layer, scored in by_layer.items():
        score, worst = max(scored, key=lambda t: t[0])
        rs = [r for _, r in scored]
        sqnrs = [r.sqnr_db for r in rs]
        out.append(LayerTrouble(layer, score, f"{worst.gemm}.{worst.operand} @ step {worst.step}",
                                math.nan if any(map(math.isnan, sqnrs)) else min(sqnrs),
                                max(r.saturation for r in rs), max(r.underflow for r in rs)))
    return sorted(out, key=lambda t: -t.score)


def suggest_policy(ranked: list[LayerTrouble], threshold: float = TROUBLE_THRESHOLD,
                   base: Policy | None = None) -> Policy:
    """``base`` (default: the default policy) with the layers scoring at least ``threshold`` added to
    its ``exclude`` patterns (exact names), so that ``train --policy`` keeps them in high precision."""
    base = base if base is not None else Policy()
    troubled = tuple(t.layer for t in ranked if t.score >= threshold)
    if callable(base.exclude):
        fail("base", "a Policy whose exclude is glob patterns", "a predicate", TypeError)
    kept = tuple(base.exclude or ())
    return replace(base, exclude=kept + tuple(n for n in troubled if n not in kept) or None)
