"""lowprec's kernels as ``torch.library`` operators that compiled graphs call.

[Note: how kernels become operators]
A compiled graph keeps a Triton kernel as an opaque operator with a fake implementation (shapes and
dtypes only), and calls it once per use in every training step: hundreds of calls per step for the
casts of a converted model. ``torch.library.custom_op`` wraps each call in Python layers (autograd
and mutation checks, argument re-parsing) that cost about 30 microseconds per call on a CPU core,
against about 6 for an operator defined from its schema and implemented directly (``define``
below). The operators never see autograd (their callers detach their inputs), and are functional
(fresh outputs, no input written) except where the schema says what one writes (``Tensor(a!)``: the
delayed-scaling records of ``lowprec.nn.delayed_bank``), which functionalization then writes as one node
(``auto_functionalized``), as it would a ``custom_op`` with ``mutates_args``; so the direct form loses
nothing. Eager code skips them and calls the implementations.
"""
from __future__ import annotations

from collections.abc import Callable

import torch

_LIB = torch.library.Library("lowprec", "DEF")


def define(schema: str, impl: Callable, fake: Callable) -> Callable:
    """The operator ``lowprec::<name>`` of ``schema`` ("name(Tensor x, int[] plan, ...) -> ..."), run by
    ``impl`` on every device, with ``fake`` for tracing; returns ``torch.ops.lowprec.<name>.default``."""
    name = schema.split("(", 1)[0]
    _LIB.define(schema)
    _LIB.impl(name, impl, "CompositeExplicitAutograd")
    torch.library.register_fake(f"lowprec::{name}", fake, lib=_LIB)
    return getattr(torch.ops.lowprec, name).default

