"""An FP8 primary weight's codes as GEMM operands, from plain tensors.

[Note: FP8 primary weights under torch.compile]
Dynamo sees the parameter as a plain tensor: it can neither read the subclass's inner tensors nor call
its methods (a method returning a non-tensor ends the graph). So nothing in a compiled forward asks the
weight anything. The layer's :class:`~lowprec.nn.plan.LayerPlan` is made for the weight the layer holds
(its ``weight_storage``) and says whether the codes serve the GEMMs (``stored_weight``); the layer keeps
the codes, scales and amax as plain tensors (:class:`StoredCodes`, taken by
``lowprec.nn.fp8_weight.stored_codes`` again when the weight moves or is replaced) and passes them to
its autograd function beside the parameter, which receives the gradient. Backward keeps those codes
(no copy: they are the parameter's) rather than the parameter. The optimizer writes the codes in place
(``lowprec.nn.fp8_requantize``), so the compiled graph, whose inputs they are, reads each step's codes.
"""
from __future__ import annotations

from typing import NamedTuple

import torch

from lowprec import formats as F
from lowprec.quant import Granularity, QuantizedTensor

E4M3 = F.get("e4m3")
"""The format of the stored codes."""


class StoredCodes(NamedTuple):
    """What a layer keeps of its FP8 weight for compiled code: Dynamo cannot read the subclass's inner
    tensors, and treats its methods as tensor ops (a graph break), so the layer hands these plain
    tensors to its autograd function instead (see [Note: FP8 primary weights under torch.compile])."""

    granularity: Granularity
    data: torch.Tensor
    scale: torch.Tensor
    amax: torch.Tensor | None


def stored_operand(data: torch.Tensor, scale: torch.Tensor, granularity: Granularity, shape: torch.Size,
                   dtype: torch.dtype, transposed: bool = False) -> QuantizedTensor:
    """Stored codes and scales as the fprop operand of a weight of ``shape`` and ``dtype``, or transposed
    as dgrad's (``weight.T``, (K, N)): plain tensors in, so a compiled graph builds it as eager code does."""
    if transposed:
        data, scale, shape = data.t().contiguous(), scale.t().contiguous(), torch.Size(reversed(shape))
    return QuantizedTensor(data, scale, E4M3, granularity, shape, dtype)
