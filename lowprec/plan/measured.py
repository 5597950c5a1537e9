"""The planner's memory for each recompute mode beside the memory a run measured: what a benchmark checks.

A benchmark trains one configuration with ``lowprec train --recompute none``, ``selective`` and ``full`` and
measures each mode's peak memory per GPU (and, where it can tell them apart, the activations: the peak less
what the same step holds before its forward). :func:`compare_recompute` plans that configuration once per
mode and sets the planner's figures beside the measured ones, each with its relative error; the issue's
bar is 10% (``tolerance``).
"""
from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping

from lowprec._checks import fail
from lowprec.plan.activations import RECOMPUTE
from lowprec.plan.planner import PlanConfig, plan

ACTIVATIONS = "activations"
"""The prefix of the planner's activation components (``activations: mlp``, ``activations: output``, ...)."""


@dataclasses.dataclass(frozen=True, slots=True)
class ModeMemory:
    """One recompute mode: the planner's bytes per GPU and the measured ones (None: not measured)."""

    mode: str
    planned_total: float
    planned_activations: float
    measured_total: float | None = None
    measured_activations: float | None = None

    @property
    def total_error(self) -> float:
        """(planned - measured) / measured for the whole step's peak; NaN where not measured."""
        return _error(self.planned_total, self.measured_total)

    @property
    def activations_error(self) -> float:
        """The same for the activations alone."""
        return _error(self.planned_activations, self.measured_activations)

    def within(self, tolerance: float = 0.10) -> bool:
        """Every measured figure within ``tolerance`` of the planner's (relative to the measured one)."""
        errors = [e for e in (self.total_error, self.activations_error) if not math.isnan(e)]
        return bool(errors) and all(abs(e) <= tolerance for e in errors)


def _error(planned: float, measured: float | None) -> float:
    return math.nan if measured is None else (planned - measured) / measured


def planned_memory(config: PlanConfig, mode: str) -> tuple[float, float]:
    """(total, activations) bytes per GPU the planner gives ``config`` with ``--recompute mode``."""
    training = dataclasses.replace(config.training, recompute=mode)
    memory = plan(dataclasses.replace(config, training=training)).memory
    activations = sum(c.bytes for c in memory.components if c.name.startswith(ACTIVATIONS))
    return memory.total, activations


def compare_recompute(config: PlanConfig, *, totals: Mapping[str, float] | None = None,
                      activations: Mapping[str, float] | None = None) -> list[ModeMemory]:
    """The planner's figures for each recompute mode measured, beside the measured ones: ``totals``, each
    mode's peak bytes per GPU, and ``activations``, its activation bytes (either may be left out); keys among
    ``none``, ``selective`` and ``full``. ``config`` is planned as it is but for its ``training.recompute``."""
    totals, activations = totals or {}, activations or {}
    for name, given in (("totals", totals), ("activations", activations)):
        for mode in given:
            if mode not in RECOMPUTE:
                fail(name, "keys among " + ", ".join(map(repr, RECOMPUTE)), repr(mode))
    rows = []
    for mode in (m for m in RECOMPUTE if m in totals or m in activations):
        planned_total, planned_acts = planned_memory(config, mode)
        rows.append(ModeMemory(mode, planned_total, planned_acts, totals.get(mode), activations.get(mode)))
    return rows
