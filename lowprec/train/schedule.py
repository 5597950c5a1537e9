"""The learning-rate schedule: linear warmup, then cosine decay to a floor.

A pure function of the step, so a resumed run needs no scheduler state to follow the same curve.
"""
from __future__ import annotations

import math


def lr_at(step: int, *, lr: float, warmup_steps: int, total_steps: int, min_lr_ratio: float = 0.1) -> float:
    """The learning rate of step ``step`` (1-based).

    Warmup rises linearly to ``lr`` at step ``warmup_steps``; cosine then decays to
    ``lr * min_lr_ratio`` at ``total_steps`` and stays there if training goes on.
    """
    if step <= warmup_steps:
        return lr * step / warmup_steps
    span = max(1, total_steps - warmup_steps)
    progress = min(1.0, (step - warmup_steps) / span)
    floor = lr * min_lr_ratio
    return floor + (lr - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))
