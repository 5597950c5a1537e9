"""``lowprec.autocast``: override or disable the recipe bound to converted layers, in a region.

The state is one ``contextvars`` value, so it is per thread and per asyncio task, nests, and is
restored on exit even when the region raises. It affects ``lowprec.nn.Linear`` modules that have a
recipe; layers a conversion keeps in high precision stay there.

[Note: autocast under torch.compile]
Dynamo cannot trace ``ContextVar.get``. While compiling, the layer reads a mirror instead: a plain
object holding the override most recently entered or restored, on which dynamo installs a guard,
so entering or leaving a region recompiles (or picks the matching cached graph) rather than
silently reusing a graph traced under another recipe. The mirror is shared by threads: threads that
run *compiled* models under different autocast regions at the same time are not supported.
"""
from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from lowprec import recipes as R


@dataclass(frozen=True, slots=True)
class _Override:
    enabled: bool
    recipe: R.Recipe | None


_OVERRIDE: contextvars.ContextVar[_Override | None] = contextvars.ContextVar("lowprec_autocast", default=None)


class _Mirror:
    """What compiled code reads (see [Note: autocast under torch.compile])."""

    override: _Override | None = None


_MIRROR = _Mirror()


@contextlib.contextmanager
def autocast(recipe: str | R.Recipe | None = None, enabled: bool = True) -> Iterator[None]:
    """In this region converted layers use ``recipe`` instead of their bound one, or, with
    ``enabled=False``, run in high precision (e.g. evaluation in BF16)::

        with lowprec.autocast(enabled=False):
            val_loss = model(batch)
    """
    override = _Override(bool(enabled), R.get(recipe) if recipe is not None else None)
    token = _OVERRIDE.set(override)
    _MIRROR.override = override
    try:
        yield
    finally:
        _OVERRIDE.reset(token)
        _MIRROR.override = _OVERRIDE.get()


def resolve(bound: R.Recipe | None) -> R.Recipe | None:
    """The recipe a layer bound to ``bound`` uses here and now (None: high precision)."""
    o = _MIRROR.override if torch.compiler.is_compiling() else _OVERRIDE.get()
    if o is None or bound is None:
        return bound
    if not o.enabled:
        return None
    return o.recipe if o.recipe is not None else bound
