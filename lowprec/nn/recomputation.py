"""Whether the forward running now is a recomputation of one whose results backward needs.

[Note: recomputed forwards]
Activation checkpointing (``torch.utils.checkpoint``, as ``lowprec.train.recompute`` applies it to the
blocks of a model) runs a block's forward a second time during backward, to make again the tensors it
did not keep. That forward must compute exactly what the first one did and change nothing else: the
first one already recorded its amaxes into the delayed-scaling bank (:mod:`lowprec.nn.delayed_bank`).

Recording the same amax again would mostly be harmless (a forward role's pending amax is the largest of
its records since the last fold, and nothing folds between a forward and its backward), but not always:
a layer outside a converted model folds its own bank at each forward, and a fold in the middle of
backward would move the pending amaxes of the gradients into the histories and change the scales the
rest of backward reads; and selective checkpointing refuses a recomputation that runs an operator the
first forward did not (the first forward of a gradient accumulation step casts each weight, its
recomputation takes the cached cast and would read the weight's last amax to record it again). So while
:func:`recomputing` is true the bank neither records nor folds, and the recomputed forward reads the
scales the first forward read, as it must. For that the first forward must leave them as it read them:
``DelayedBank.last`` (the cached weight's amax recorded again) reads without folding.

The checkpointing code enters :func:`recomputation` around the second forward only. It is a
``contextvars`` value, read in eager code only: under ``torch.compile`` the compiler's partitioner
recomputes inside the graph, never running the Python of a forward twice, so compiled code has
nothing to skip and never reads the variable.
"""
from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator

import torch

_RECOMPUTING: contextvars.ContextVar[bool] = contextvars.ContextVar("lowprec_recomputing", default=False)


def recomputing() -> bool:
    """True inside :func:`recomputation` in eager code; always False while the compiler traces."""
    if torch.compiler.is_compiling():
        return False
    return _RECOMPUTING.get()


@contextlib.contextmanager
def recomputation() -> Iterator[None]:
    """The region is a forward run again to rebuild what backward needs (see [Note: recomputed forwards])."""
    token = _RECOMPUTING.set(True)
    try:
        yield
    finally:
        _RECOMPUTING.reset(token)
