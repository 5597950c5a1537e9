"""What a training run hands back: its per-step history and the figures a comparison reports."""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from lowprec.convert import Coverage

FINAL_WINDOW = 10
"""The final train loss is the mean over this many last finite steps: one step's loss is noise."""


@dataclass(frozen=True, slots=True)
class RunResult:
    recipe: str
    history: tuple[dict[str, Any], ...]
    """One row per step, with the columns of :data:`lowprec.train.logs.COLUMNS`."""
    tokens_per_s: float
    """Training throughput of the steps run in this process (validation and checkpoints excluded)."""
    peak_memory_bytes: int | None
    """CUDA allocator peak, or the process's RSS peak on Linux CPUs; None where unknown."""
    diverged: bool
    """Stopped early after too many skipped (non-finite) steps in a row."""
    conversion: str
    """The conversion report: which linears run in the recipe, which stay in high precision and why."""
    out_dir: str | None = None
    coverage: Coverage | None = None
    """How many linears run the recipe (``ConversionReport.coverage``); None where unknown."""

    @property
    def steps(self) -> int:
        return self.history[-1]["step"] if self.history else 0

    @property
    def skipped_steps(self) -> int:
        return sum(1 for r in self.history if r["skipped"])

    @property
    def final_train_loss(self) -> float:
        losses = [r["loss"] for r in self.history if not r["skipped"] and math.isfinite(r["loss"])]
        if not losses or self.diverged:
            return math.nan
        tail = losses[-FINAL_WINDOW:]
        return sum(tail) / len(tail)

    @property
    def final_val_loss(self) -> float:
        vals = [r["val_loss"] for r in self.history if r.get("val_loss") is not None]
        return vals[-1] if vals and not self.diverged else math.nan

    @property
    def has_nan(self) -> bool:
        """A non-finite loss anywhere, or a run that diverged."""
        values = [r["loss"] for r in self.history] + [r["val_loss"] for r in self.history
                                                       if r.get("val_loss") is not None]
        return self.diverged or any(not math.isfinite(v) for v in values)
