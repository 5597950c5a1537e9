"""``cast_pair``: the two casts of one linear-layer operand from one read, with what the recipes add.

A linear layer casts each high-precision operand twice: along K for one GEMM and, transposed, for
another (see [Note: the three GEMMs] in ``lowprec.recipes``). ``cast_pair`` does both in one call,
and also what a recipe may ask on the way: the random Hadamard transform of the transposed side
(NVFP4's weight-gradient operands) and the amax that delayed scaling records. On CUDA the Triton
kernels read the operand once for all of it; elsewhere (or for casts they do not cover) the
reference operations run one after the other, with the same values.
"""
from __future__ import annotations

import torch

from lowprec import formats as F
from lowprec import kernels as K  # attribute lookups at call time: kernels/__init__ imports this module
from lowprec.quant import Granularity, QuantizedTensor, hadamard_padded

HADAMARD_BLOCK = 16


def cast_pair(
    x2: torch.Tensor, fmt, granularity: Granularity, fmt_t, granularity_t: Granularity, *,
    rounding: str = "nearest", rounding_t: str = "nearest", scale: torch.Tensor | None = None,
    hadamard_t: int | None = None, record_amax: bool = False, generator: torch.Generator | None = None,
    backend: str | None = None,
) -> tuple[QuantizedTensor, QuantizedTensor, torch.Tensor | None]:
    """``(cast of x2 along K, cast of x2.T along M, amax of x2 or None)``.

    ``scale``: a given per-tensor scale (delayed scaling) for both casts. ``hadamard_t``: the seed of
    the 16-point random Hadamard transform applied to ``x2.T`` (zero-padded to a multiple of 16 along
    its last dimension) before its cast, as ``lowprec.quant.hadamard``. ``record_amax``: also return
    ``x2.abs().amax()`` (NaN if x2 holds one), for the amax history."""
    requested = backend  # the transposed cast picks its own backend unless the caller chose one
    backend = backend or K.quantize_backend(x2, fmt, granularity, rounding)
    if backend == "triton":
        from lowprec.kernels import triton_quant

        fused = triton_quant.quantize_pair(x2, fmt, granularity, fmt_t, granularity_t, rounding=rounding,
                                           rounding_t=rounding_t, scale=scale, generator=generator,
                                           hadamard_t=hadamard_t, record_amax=record_amax)
        if fused is not None:
            return fused
    amax = x2.detach().abs().amax().float() if record_amax else None
    q = K.quantize(x2, fmt, granularity, rounding=rounding, scale=scale, generator=generator, backend=backend)
    per_tensor = (granularity.block_rows, granularity.block_cols) == (None, None)
    if per_tensor and granularity == granularity_t and q.fmt.name == F.get(fmt_t).name and hadamard_t is None \
            and rounding == rounding_t == "nearest":  # the same scale: the transposed data is the cast
        return q, QuantizedTensor(q.data.t().contiguous(), q.scale, q.fmt, granularity, x2.t().shape, x2.dtype), amax
    xt = x2.t() if hadamard_t is None else hadamard_padded(x2.t(), HADAMARD_BLOCK, hadamard_t)
    q_t = K.quantize(xt, fmt_t, granularity_t, rounding=rounding_t, scale=scale, generator=generator,
                     backend=requested)
    return q, q_t, amax
