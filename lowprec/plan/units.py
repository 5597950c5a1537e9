"""Units the planner reports in."""
from __future__ import annotations

GB = 1e9
"""Decimal gigabyte, the unit vendors quote accelerator memory in."""


def count(n: float) -> str:
    """A large count compactly and without ambiguity: ``70.55e9``, ``4.1e6``, ``69,888``, ``0.5``."""
    for exp in (12, 9, 6):
        if abs(n) >= 10**exp:
            return f"{n / 10**exp:.4g}e{exp}"
    return f"{n:,.0f}" if abs(n) >= 1000 else f"{n:.4g}"
