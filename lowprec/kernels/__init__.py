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


def quantize_pair(x: torch.Tensor, fmt, granularity: Granularity, fmt_t, granularity_t: Granularity,
                  **kw) -> tuple[QuantizedTensor, QuantizedTensor]:
    """``x`` cast along its rows and ``x.T`` along its columns, from one read of ``x`` where a kernel
    can: :func:`lowprec.kernels.fused.cast_pair` without the amax."""
    q, q_t, _ = cast_pair(x, fmt, granularity, fmt_t, granularity_t, **kw)
    return q, q_t


from lowprec.kernels.fused import cast_pair  # noqa: E402  (fused builds on quantize above)

__all__ = ["Capability", "capability", "gemm_backend", "cast_pair", "gemm_path", "quantize", "quantize_backend",
           "quantize_pair", "scaled_mm"]
