"""Independent decoders for the serving layouts' tests, and weights as a recipe trained them.

The decoders follow the layouts' documentation with ml_dtypes as the oracle for element values, not lowprec's own
code: FP4 bytes are unpacked low nibble first and decoded by ``ml_dtypes.float4_e2m1fn``, E8M0 codes as
``2^(code - 127)``.
"""
from __future__ import annotations

import ml_dtypes
import numpy as np
import torch

from lowprec import recipes as R
from lowprec.export.layout import LayerWeight
from lowprec.quant import QuantizedTensor, quantize


def fp4_values(packed: torch.Tensor) -> torch.Tensor:
    """float32 values of FP4 bytes: element ``2j`` in the low nibble of byte ``j``, ``2j + 1`` in the high."""
    nibbles = torch.stack([packed & 0xF, packed >> 4], dim=-1).flatten(-2)
    decoded = nibbles.numpy().view(ml_dtypes.float4_e2m1fn).astype(np.float32)
    return torch.from_numpy(decoded)


def e8m0_values(codes: torch.Tensor) -> torch.Tensor:
    """float32 values of E8M0 codes: ``2^(code - 127)`` (255, NaN, never written)."""
    return torch.ldexp(torch.ones(codes.shape), codes.to(torch.int32) - 127)


def nvfp4_as_compressed_tensors_reads(t: dict[str, torch.Tensor]) -> torch.Tensor:
    """compressed-tensors' NVFP4 decompression by the arithmetic it documents: the codes (low nibble first)
    times ``fp32(weight_scale / weight_global_scale)`` per 16-element group, rounded to bfloat16."""
    eff = t["weight_scale"].float() / t["weight_global_scale"]  # (out, in/16)
    return (fp4_values(t["weight_packed"]) * eff.repeat_interleave(16, dim=1)).to(torch.bfloat16)


def trained_weight(master: torch.Tensor, recipe: str) -> QuantizedTensor:
    """``master`` cast as ``recipe``'s forward GEMM casts its weight (the fprop rhs)."""
    cast = R.get(recipe).fprop.rhs
    return quantize(master, cast.fmt, cast.granularity)


def layer(master: torch.Tensor, recipe: str | None = None, name: str = "model.layers.0.mlp.up_proj") -> LayerWeight:
    """A LayerWeight of ``master``, trained under ``recipe`` (None: no trained weight)."""
    q = trained_weight(master, recipe) if recipe is not None else None
    return LayerWeight(name, master, q, recipe)
