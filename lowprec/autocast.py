"""``lowprec.autocast``: override or disable the recipe bound to converted layers, in a region.

The state is one ``contextvars`` value, so it is per thread and per asyncio task, nests, and is
restored on exit even when the region raises. It affects ``lowprec.nn.Linear`` modules that have a
recipe; layers a conversion keeps in high precision stay there. A high-precision region may also
record the amaxes of the layers bound to a delayed recipe (``record_amax``: see [Note: lazy scale
initialisation] in ``lowprec.nn.record``).

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
from lowprec._checks import describe, fail


@dataclass(frozen=True, slots=True)
class _Override:
    enabled: bool
    recipe: R.Recipe | None
    record_amax: bool = False


_OVERRIDE: contextvars.ContextVar[_Override | None] = contextvars.ContextVar("lowprec_autocast", default=None)


class _Mirror:
    """What compiled code reads (see [Note: autocast under torch.compile])."""

    override: _Override | None = None


_MIRROR = _Mirror()


@contextlib.contextmanager
def autocast(recipe: str | R.Recipe | None = None, enabled: bool = True, *,
             record_amax: bool = False) -> Iterator[None]:
    """In this region converted layers use ``recipe`` instead of their bound one, or, with
    ``enabled=False``, run in high precision (e.g. evaluation in BF16)::

        with lowprec.autocast(enabled=False):
            val_loss = model(batch)

    ``record_amax`` (with an unscaled ``recipe`` such as ``"bf16"``, or ``enabled=False``): layers bound
    to a delayed-scaling recipe still compute in high precision, and record into their amax histories
    what a step of that recipe would, so that the first delayed step after the region takes its scales
    from them (see [Note: lazy scale initialisation] in ``lowprec.nn.record``)::

        with lowprec.autocast("bf16", record_amax=True):
            model(batch).sum().backward()
    """
    resolved = R.get(recipe) if recipe is not None else None
    if not isinstance(record_amax, bool):
        fail("record_amax", "a bool", describe(record_amax), TypeError)
    if record_amax and enabled and (resolved is None or resolved.hp_dtype is None):
        fail("record_amax", "a region in high precision (an unscaled recipe such as 'bf16', or enabled=False)",
             f"recipe={resolved.name if resolved is not None else None!r}")
    override = _Override(bool(enabled), resolved, record_amax)
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


def records_amax() -> bool:
    """Whether layers here record their bound delayed recipe's amaxes while they run in high precision
    (``autocast(..., record_amax=True)``)."""
    o = _MIRROR.override if torch.compiler.is_compiling() else _OVERRIDE.get()
    return o is not None and o.record_amax
