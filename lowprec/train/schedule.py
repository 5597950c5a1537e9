"""The learning-rate schedule: linear warmup, then cosine decay to a floor, stretched when a run grows.

A pure function of the step and of a few saved numbers, so a resumed run needs no scheduler state
beyond what its checkpoint records to follow the same curve.

[Note: growing a run]
A run trained to ``T`` steps and resumed at step ``k`` with ``--steps T2`` (``T2 != T``) keeps the
learning rates of steps ``1..k`` as they were and continues from the rate step ``k`` used: warmup
keeps its length, and what was left of the cosine decay at ``k`` (its progress ``p_k``) is stretched
over the new remaining steps, so progress runs linearly from ``p_k`` at ``k`` to 1 at ``T2``. The rate
is continuous at ``k`` and reaches the floor at ``T2``. A run resumed after it finished (``p_k = 1``)
stays at the floor; one resumed during warmup gets the whole schedule of ``T2`` steps. Each growth
adds one :class:`Decay` piece; resumed with the same ``--steps``, the schedule is unchanged.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from lowprec._checks import fail


@dataclass(frozen=True, kw_only=True, slots=True)
class Decay:
    """One piece of the cosine decay: its progress runs linearly from ``progress`` after step ``start`` to 1
    at step ``end``, and stays at 1 after it."""

    start: int
    """The last step before this piece: warmup's last step, or the step a grown run was resumed at."""
    progress: float
    """How far through the cosine (0: the peak, 1: the floor) the rate of step ``start`` was."""
    end: int
    """The step at which the floor is reached."""

    def progress_at(self, step: int) -> float:
        return self.progress + (1.0 - self.progress) * min(1.0, (step - self.start) / max(1, self.end - self.start))


@dataclass(frozen=True, kw_only=True, slots=True)
class Schedule:
    """Linear warmup to ``lr`` at step ``warmup_steps``, then cosine decay to ``lr * min_lr_ratio`` in pieces."""

    lr: float
    """The peak rate, reached at the end of warmup."""
    warmup_steps: int
    min_lr_ratio: float
    """The floor is ``lr * min_lr_ratio``."""
    decays: tuple[Decay, ...]
    """The decay's pieces, by ``start``: one per length the run was trained to (see [Note: growing a run])."""

    @staticmethod
    def of(*, lr: float, warmup_steps: int, total_steps: int, min_lr_ratio: float = 0.1) -> Schedule:
        """The schedule of a run of ``total_steps``: one cosine from warmup's end to the last step."""
        return Schedule(lr=lr, warmup_steps=warmup_steps, min_lr_ratio=min_lr_ratio,
                        decays=(Decay(start=warmup_steps, progress=0.0, end=total_steps),))

    @property
    def total_steps(self) -> int:
        """The step the floor is reached at, in the schedule's latest piece."""
        return self.decays[-1].end

    def _progress(self, step: int) -> float:
        piece = self.decays[0]
        for d in self.decays[1:]:
            if d.start < step:
                piece = d
        return piece.progress_at(step)

    def lr_at(self, step: int) -> float:
        """The learning rate of step ``step`` (1-based)."""
        if step <= self.warmup_steps:
            return self.lr * step / self.warmup_steps
        floor = self.lr * self.min_lr_ratio
        return floor + (self.lr - floor) * 0.5 * (1.0 + math.cos(math.pi * self._progress(step)))

    def grown(self, step: int, total_steps: int) -> Schedule:
        """The schedule of this run resumed after ``step`` to train to ``total_steps`` (see [Note: growing a run])."""
        if total_steps == self.total_steps:
            return self  # the same run resumed: the same curve, bit for bit
        if total_steps < step:
            fail("total_steps", f"at least the step resumed at ({step})", total_steps)
        start = max(step, self.warmup_steps)
        kept = tuple(d for d in self.decays if d.start < start)
        piece = Decay(start=start, progress=self._progress(start) if kept else 0.0, end=total_steps)
        return Schedule(lr=self.lr, warmup_steps=self.warmup_steps, min_lr_ratio=self.min_lr_ratio,
                        decays=(*kept, piece))

    def to_dict(self) -> dict[str, Any]:
        return {"lr": self.lr, "warmup_steps": self.warmup_steps, "min_lr_ratio": self.min_lr_ratio,
                "decays": [[d.start, d.progress, d.end] for d in self.decays]}

    @staticmethod
    def from_dict(saved: dict[str, Any]) -> Schedule:
        return Schedule(lr=saved["lr"], warmup_steps=saved["warmup_steps"], min_lr_ratio=saved["min_lr_ratio"],
                        decays=tuple(Decay(start=s, progress=p, end=e) for s, p, e in saved["decays"]))


def lr_at(step: int, *, lr: float, warmup_steps: int, total_steps: int, min_lr_ratio: float = 0.1) -> float:
    """The learning rate of step ``step`` (1-based) in a run of ``total_steps`` that never grew.

    Warmup rises linearly to ``lr`` at step ``warmup_steps``; cosine then decays to
    ``lr * min_lr_ratio`` at ``total_steps`` and stays there if training goes on.
    """
    return Schedule.of(lr=lr, warmup_steps=warmup_steps, total_steps=total_steps, min_lr_ratio=min_lr_ratio).lr_at(step)
