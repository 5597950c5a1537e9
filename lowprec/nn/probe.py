"""Where a linear layer reports its casts on a sampled step: the receiver of the region it runs in.

The layers own the probe; what receives the reports (``lowprec.telemetry.collect.Collector``) sits above
them and installs itself with :func:`reporting_to`, so the layers never import telemetry. See [Note:
telemetry under torch.compile] in ``lowprec.telemetry.collect`` for why the probe is a ``contextvars``
value read only outside compiled graphs.
"""
from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator
from typing import Any

import torch

_RECEIVER: contextvars.ContextVar[Any | None] = contextvars.ContextVar("lowprec_telemetry", default=None)


def probe() -> Any | None:
    """The receiver of the sampled region the caller runs in, or None; always None while the compiler
    traces, so compiled graphs hold nothing of telemetry (see [Note: telemetry under torch.compile])."""
    if torch.compiler.is_compiling():
        return None
    return _RECEIVER.get()


@contextlib.contextmanager
def reporting_to(receiver: Any) -> Iterator[Any]:
    """Layers report their casts to ``receiver`` (its ``forward`` and ``backward``) in the region."""
    token = _RECEIVER.set(receiver)
    try:
        yield receiver
    finally:
        _RECEIVER.reset(token)
