"""Fast versions of ``lowprec.quant``'s operations and the scaled GEMMs, and the choice of backend.

[Note: backends]
``torch`` is the pure-torch reference in ``lowprec.quant`` (any device). ``triton`` kernels run on
CUDA and equal the reference bit for bit. ``cublas`` is ``torch._scaled_mm``. ``emulated`` computes a
GEMM a device lacks from the exact quantized values. The backend is chosen at the first call for a
device from its capability (never at import) and can be forced with ``backend=``.
"""
from __future__ import annotations

import torch

from lowprec._checks import check_choice
from lowprec.kernels.capability import Capability, capability
from lowprec.kernels.gemm import gemm_backend, gemm_path, scaled_mm
from lowprec.quant import Granularity, QuantizedTensor
from lowprec.quant import quantize as _reference_quantize

QUANTIZE_BACKENDS = ("torch", "triton")


def quantize_backend(x: torch.Tensor, fmt, granularity: Granularity, rounding: str = "nearest") -> str:
    """The backend ``quantize`` takes for this tensor on its device."""
    cap = capability(x.device)
    if cap.triton:
        from lowprec.kernels import triton_quant  # imported on first CUDA use only

        if triton_quant.supports(fmt, granularity, rounding):
            return "triton"
    return "torch"


def quantize(
    x: torch.Tensor, fmt, granularity: Granularity, *, rounding: str = "nearest", saturate: bool = True,
    scale: torch.Tensor | None = None, generator: torch.Generator | None = None, backend: str | None = None,
) -> QuantizedTensor:
    """``lowprec.quant.quantize`` on the fastest backend for x's device (same values, bit for bit)."""
    backend = backend or quantize_backend(x, fmt, granularity, rounding)
    check_choice("backend", backend, QUANTIZE_BACKENDS)
    if backend == "triton":
        from lowprec.kernels import triton_quant

        return triton_quant.quantize(x, fmt, granularity, rounding=rounding, saturate=saturate, scale=scale,
                                     generator=generator)
    return _reference_quantize(x, fmt, granularity, rounding=rounding, saturate=saturate, scale=scale,
                               generator=generator)


def quantize_pair(
    x: torch.Tensor, fmt, granularity: Granularity, fmt_t, granularity_t: Granularity, *,
    rounding: str = "nearest", rounding_t: str = "nearest", scale: torch.Tensor | None = None,
    generator: torch.Generator | None = None, backend: str | None = None,
) -> tuple[QuantizedTensor, QuantizedTensor]:
    """A 2-D tensor quantized along its rows and its transpose along its columns, as the three GEMMs
    of a linear layer need (``x`` for one GEMM, ``x.T`` for another), in one call so that a kernel can
    read ``x`` once. With the same per-tensor configuration on both sides the transposed copy is the
    transposed data under the same scale."""
    backend = backend or quantize_backend(x, fmt, granularity, rounding)
    if backend == "triton" and x.dim() == 2:
        from lowprec.kernels import triton_quant

        fused = triton_quant.quantize_pair(x, fmt, granularity, fmt_t, granularity_t, rounding=rounding,
                                           rounding_t=rounding_t, scale=scale, generator=generator)
        if fused is not None:  # one read of x for both casts
            return fused[0], fused[1]
    q = quantize(x, fmt, granularity, rounding=rounding, scale=scale, generator=generator, backend=backend)
    same = (granularity.block_rows is None and granularity.block_cols is None and granularity == granularity_t
            and q.fmt.name == str(fmt_t) and rounding == rounding_t == "nearest")
    if same:
        q_t = QuantizedTensor(q.data.t().contiguous(), q.scale, q.fmt, granularity, x.t().shape, x.dtype)
        return q, q_t
    q_t = quantize(x.t(), fmt_t, granularity_t, rounding=rounding_t, scale=scale if same else None,
                   generator=generator, backend=backend)
    return q, q_t


__all__ = ["Capability", "capability", "gemm_backend", "gemm_path", "quantize", "quantize_backend", "quantize_pair", "scaled_mm"]
