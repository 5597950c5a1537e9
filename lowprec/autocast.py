"""``lowprec.autocast``: override or disable the recipe bound to converted layers, in a region.

The state is one ``contextvars`` value, so it is per thread and per asyncio task, nests, and is
restored on exit even when the region raises. It affects ``lowprec.nn.Linear`` modules only.
"""
from __future__ import annotations

import contextlib
import contextvars
from dataclasses import dataclass
from typing import Iterator

from lowprec import recipes as R


@dataclass(frozen=True, slots=True)
class _Override:
    enabled: bool
    recipe: R.Recipe | None


_OVERRIDE: contextvars.ContextVar[_Override | None] = contextvars.ContextVar("lowprec_autocast", default=None)


@contextlib.contextmanager
def autocast(recipe: str | R.Recipe | None = None, enabled: bool = True) -> Iterator[None]:
    """In this region converted layers use ``recipe`` instead of their bound one, or, with
    ``enabled=False``, run in high precision (e.g. evaluation in BF16)::

        with lowprec.autocast(enabled=False):
            val_loss = model(batch)
    """
    override = _Override(bool(enabled), R.get(recipe) if recipe is not None else None)
    token = _OVERRIDE.set(override)
    try:
        yield
    finally:
        _OVERRIDE.reset(token)


def resolve(bound: R.Recipe | None) -> R.Recipe | None:
    """The recipe a layer bound to ``bound`` uses here and now (None: high precision)."""
    o = _OVERRIDE.get()
    if o is None:
        return bound
    if not o.enabled:
        return None
    return o.recipe if o.recipe is not None else bound
