"""Bytes a rank puts on the wire, counted at torch.distributed's collectives (for benchmarks and tests).

``with count_traffic() as t: ...`` counts, per kind of collective, the bytes of every input this rank
hands to torch.distributed inside the region (an all-gather's shard, a reduce-scatter's or an
all-reduce's whole input, an all-to-all's input), whoever calls it: FSDP2, DDP, lowprec's own
gradient communication. That is what the rank sends, before the algorithm's own traffic pattern (a
ring all-reduce moves about twice its input); ratios between runs of one pattern hold either way.
The functions are wrapped for the region only, on the ``torch.distributed`` module, as FSDP2 and
DDP look them up at call time, and on its functional collectives' module, which tensor parallelism
calls. A caller that wants its bytes told apart names them: inside
``labelled("ep_dispatch")`` an all-to-all counts as ``all_to_all:ep_dispatch``.
"""
from __future__ import annotations

import contextlib
from collections import Counter
from collections.abc import Iterator

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol

_COUNTED = {
    "all_gather_into_tensor": ("all_gather", 1), "all_gather_single": ("all_gather", 1),
    "_all_gather_base": ("all_gather", 1), "all_gather": ("all_gather", 1),
    "reduce_scatter_tensor": ("reduce_scatter", 1), "reduce_scatter_single": ("reduce_scatter", 1),
    "_reduce_scatter_base": ("reduce_scatter", 1), "all_reduce": ("all_reduce", 0),
    "all_to_all_single": ("all_to_all", 1), "broadcast": ("broadcast", 0),
}
"""torch.distributed function -> (kind, position of the input tensor among its arguments)."""

_FUNCTIONAL = {"all_gather_single": ("all_gather", 0), "reduce_scatter_single": ("reduce_scatter", 0),
               "all_reduce": ("all_reduce", 0)}
"""The same for ``torch.distributed._functional_collectives`` (the input first; its ``*_autograd`` forms call
these, but the backward of those runs the operators below them, uncounted)."""

_LABELS: list[str] = []
"""The innermost :func:`labelled` region's name last."""


@contextlib.contextmanager
def labelled(name: str) -> Iterator[None]:
    """Count the collectives called inside the region as ``<kind>:<name>`` (see the module's doc)."""
    _LABELS.append(name)
    try:
        yield
    finally:
        _LABELS.pop()


def _nbytes(x) -> int:
    if isinstance(x, torch.Tensor):
        return x.numel() * x.element_size()
    if isinstance(x, (list, tuple)):
        return sum(_nbytes(t) for t in x)
    return 0


class Traffic(Counter):
    """Bytes by kind of collective (``all_gather``, ``reduce_scatter``, ``all_reduce``, ...)."""

    @property
    def total(self) -> int:
        return sum(self.values())


@contextlib.contextmanager
def count_traffic() -> Iterator[Traffic]:
    """Count the bytes this rank hands to torch.distributed's collectives inside the region."""
    traffic = Traffic()
    saved = {}

    def wrap(module, name: str, kind: str, pos: int):
        real = getattr(module, name)

        def counted(*args, **kwargs):
            named = kwargs.get("input_tensor", kwargs.get("input", kwargs.get("tensor")))
            arg = args[pos] if len(args) > pos else named
            traffic[f"{kind}:{_LABELS[-1]}" if _LABELS else kind] += _nbytes(arg)
            return real(*args, **kwargs)

        return real, counted

    for module, table in ((dist, _COUNTED), (funcol, _FUNCTIONAL)):
        for name, (kind, pos) in table.items():
            if hasattr(module, name):
                saved[module, name], counted = wrap(module, name, kind, pos)
                setattr(module, name, counted)
    try:
        yield traffic
    finally:
        for (module, name), real in saved.items():
            setattr(module, name, real)
