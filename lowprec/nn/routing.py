"""What a mixture-of-experts layer does with its routing under ``torch.compile``.

[Note: experts under torch.compile]
A ``GroupedLinear`` that reads its experts' token counts on the host (the per-expert loops and the grouped
GEMMs' padding are sized by them) cannot sit in a compiled graph: traced by Dynamo, such a read is a graph
break, and the code after it is specialized on the counts it read, so every step (which routes differently)
compiled again, until Dynamo's recompile limit sent the whole frame back to eager without a word beyond
torch's own warning (a ``moe-tiny`` step took 17 s on a CPU instead of 0.1). Two ways follow:

* experts that need no count run in the graph, on the offsets as the device holds them
  (``GroupedLinear.takes_offsets``), the offsets checked by a device assertion: high-precision BF16 experts
  on a GPU (one ``torch._grouped_mm`` per projection), and FP8 experts whose casts are batched per tensor
  (current or delayed), per row, in FP32 blocks or MX (``fp8-current``, ``fp8-delayed``, ``fp8-rowwise``,
  ``fp8-blockwise``, ``mxfp8``, ``mxfp4``) on a device that runs all three of
  their GEMMs grouped (an sm90 GPU: ``torch._scaled_grouped_mm`` and lowprec's grouped Triton GEMMs, which
  find each expert's rows from the offsets on the device; MX GEMMs folded to row scales, the weight
  gradient's folded per expert over the blocks its tokens fill). Their amaxes, scales, casts and folds are
  device work, and the weight gradient's padded layout is sized for any routing
  (``kernels.grouped_gemm.padded_bound``: the rows plus 15 per expert, 31 for MX blocks, zero columns after
  the last expert's), so the graph's shapes do not depend on the routing and it compiles once;
  the compiler fuses the SwiGLU and the casts' neighbours around them and merges the gate's and up's casts of
  the same rows. They compute what the counted experts compute, bit for bit (``tests/nn/test_experts_on_device.py``);
* the others (other recipes, biases, devices without those grouped GEMMs, the CPU, expert parallelism's
  all-to-all) run outside the graph: :func:`outside_graphs` wraps them in ``torch.compiler.disable``, and the
  compiled model is a graph before each MoE layer's experts (attention, norms, the router, the sort) and one
  after (the combine, the shared experts, the next block), of the same shapes at every step, so it also
  compiles once.

Eager code reads the counts once per MoE layer in both cases (the counted path, whose padding is exact, and
which shares the gate's and up's casts); measured on the H200, the device path ran no faster eagerly.

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
