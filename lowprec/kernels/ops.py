"""lowprec's kernels as ``torch.library`` operators that compiled graphs call.

[Note: how kernels become operators]
A compiled graph keeps a Triton kernel as an opaque operator with a fake implementation (shapes and
dtypes only), and calls it once per use in every training step: hundreds of calls per step for the
casts of a converted model. ``torch.library.custom_op`` wraps each call in Python layers (autograd
and mutation checks, argument re-parsing) that cost about 30 microseconds per call on a CPU core,
against about 6 for an operator defined from its schema and implemented directly (``define``
below). The operators here are functional (fresh outputs, no input written) and never see autograd
(their callers detach their inputs), so the direct form loses nothing. Eager code skips them and
calls the implementations, but under a Python dispatch mode, which then sees one operator per call.
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


def _copy(x: torch.Tensor) -> torch.Tensor:
    return x.clone()


def _copy_fake(x: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(x)


keep = define("keep(Tensor x) -> Tensor", _copy, _copy_fake)
"""A copy of ``x`` that a compiled backward reads as forward made it: the partitioner never recomputes
an opaque operator that forward needs, so backward takes this output (or what forward made from it)
rather than recompute ``x`` from the graph's inputs, which forward may have written meanwhile (a
delayed-scaling history: see [Note: delayed scaling under torch.compile] in ``lowprec.nn.delayed``).
Compiled code only; one small tensor per use."""


def as_operators() -> bool:
    """Whether the kernels run as their ``torch.library`` operators rather than by direct calls: in a
    compiled graph, and under a Python dispatch mode (selective checkpointing's, a FLOP counter's, fake
    tensors'). A mode intercepts every ATen operator of a direct call (a cast's few allocations), each
    through Python, but an operator once, its implementation running below the mode: on one H200, eager 1B
    fp8-current under selective checkpointing went from 0.53x to 0.82x BF16's speed (3B: 0.78x to 1.12x)."""
    return torch.compiler.is_compiling() or torch._C._len_torch_dispatch_stack() > 0
