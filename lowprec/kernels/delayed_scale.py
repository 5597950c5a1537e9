"""``delayed_scale``: the scale a compiled delayed cast takes, as one opaque operator.

A delayed cast scales by its role's history once the history holds an amax, and by the operand's own
amax before (see [Note: delayed scaling] in ``lowprec.nn.delayed``). Compiled code cannot ask the host
which, so the choice is made on the device; as one operator it is one node of the graph where the
choice written in tensor operations was a dozen, and, on CUDA through Triton, it reads the operand only
before the first amax (see [Note: a delayed scale without reading the operand] in
``lowprec.kernels.triton_delayed``). Being opaque, it is also never recomputed by the partitioner: a
compiled backward takes forward's scale as forward made it (see [Note: delayed scaling under
torch.compile] in ``lowprec.nn.delayed``).
"""
from __future__ import annotations

import torch

from lowprec import formats as F
from lowprec.kernels.capability import triton_available
from lowprec.kernels.ops import define
from lowprec.quant.scales import amax_scale


def reference(x2: torch.Tensor, scales: torch.Tensor, ready: torch.Tensor, k: int, r: int,
              fmt: F.Format) -> torch.Tensor:
    """(1, 1) float32: ``scales[k]`` where ``ready[r]``, else ``amax_scale(|x2|.max(), fmt)`` (reads x2
    either way)."""
    current = amax_scale(x2.detach().abs().amax().float(), fmt)
    return torch.where(ready[r], scales[k], current).reshape(1, 1)


def _impl(x2: torch.Tensor, scales: torch.Tensor, ready: torch.Tensor, k: int, r: int, fmt: str) -> torch.Tensor:
    f = F.get(fmt)
    if x2.is_cuda and x2.dim() == 2 and triton_available():
        from lowprec.kernels import triton_delayed

        return triton_delayed.delayed_scale(x2, scales, ready, k, r, f)
    return reference(x2, scales, ready, k, r, f)


def _fake(x2: torch.Tensor, scales: torch.Tensor, ready: torch.Tensor, k: int, r: int, fmt: str) -> torch.Tensor:
    return scales.new_empty(1, 1)


delayed_scale = define("delayed_scale(Tensor x2, Tensor scales, Tensor ready, int k, int r, str fmt) -> Tensor",
                       _impl, _fake)
"""``delayed_scale(x2, scales, ready, k, r, fmt_name)``: :func:`reference`'s value, (1, 1) float32, one
opaque operator (compiled code; eager code decides on the host)."""
