"""What a mixture-of-experts layer does with its routing under ``torch.compile``.

[Note: experts under torch.compile]
A ``GroupedLinear`` reads its experts' token counts on the host (the per-expert loops, the grouped GEMMs'
tiles and padding are sized by them). Traced by Dynamo, such a read is a graph break, and the code after
it is specialized on the counts it read: every step routes differently, so every step compiled again, until
Dynamo's recompile limit sent the whole frame back to eager without a word beyond torch's own warning (a
``moe-tiny`` step took 17 s on a CPU instead of 0.1). So the code that needs the counts, the routed experts
from their grouped rows to their outputs (expert parallelism's all-to-all included), runs outside the
graph: :func:`outside_graphs` wraps it in ``torch.compiler.disable``, and the compiled model is a graph
before each MoE layer's experts (attention, norms, the router, the sort) and one after (the combine, the
shared experts, the next block), of the same shapes at every step, so it compiles once. The experts' own
kernels are already grouped (one cast per operand, one grouped GEMM per projection on a GPU); what the
compiler would add there is the fusion of the SwiGLU between them. Experts that need no count stay in the
graph: high-precision BF16 experts on a GPU, one ``torch._grouped_mm`` per projection on the offsets as the
device holds them (``GroupedLinear.takes_offsets``), the offsets checked by a device assertion.

:func:`expert_counts` counts the tokens per expert in a tensor of a fixed shape (``torch.bincount``'s
depends on the largest index, another break), by an integer ``scatter_add`` (exact in any order).
"""
from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

import torch

_F = TypeVar("_F", bound=Callable)

_REASON = ("lowprec: the routed experts read their token counts on the host; they run outside the compiled "
           "graph so that it is not compiled again for every routing (see [Note: experts under torch.compile] "
           "in lowprec.nn.routing)")


def outside_graphs(fn: _F) -> _F:
    """``fn`` run eagerly when a compiled region calls it (see [Note: experts under torch.compile])."""
    return torch.compiler.disable(fn, reason=_REASON)


def expert_counts(expert: torch.Tensor, n_experts: int) -> torch.Tensor:
    """``(n_experts,)`` int64: how many entries of ``expert`` (integer indices in ``[0, n_experts)``) name each
    expert; no host read, so a compiled graph holds it."""
    ones = torch.ones_like(expert, dtype=torch.int64)
    return torch.zeros(n_experts, dtype=torch.int64, device=expert.device).scatter_add_(0, expert.long(), ones)


__all__ = ["expert_counts", "outside_graphs"]
