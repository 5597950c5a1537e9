"""Fast versions of ``lowprec.quant``'s operations and the scaled GEMMs, and the choice of backend.

[Note: backends]
``torch`` is the pure-torch reference in ``lowprec.quant`` (any device). ``triton`` kernels run on
CUDA and equal the reference bit for bit. ``cublas`` is ``torch._scaled_mm``. ``emulated`` computes a
GEMM a device lacks from the exact quantized values. A cast's backend is chosen by
``kernels.route`` and a GEMM's by ``kernels.gemm.gemm_path``, from the device's capability, once per
layer and device (never at import); ``backend=`` forces one.
"""
from __future__ import annotations

import torch

from lowprec.kernels.capability import Capability, capability
from lowprec.kernels.gemm import gemm_backend, gemm_path, scaled_mm
from lowprec.kernels.route import Backend, CastRoute, CastSpec, Pairing, backend_for, route
from lowprec.quant import Granularity, QuantizedTensor
from lowprec.quant import quantize as _reference_quantize


def quantize(
    x: torch.Tensor, fmt, granularity: Granularity, *, rounding: str = "nearest", saturate: bool = True,
    scale: torch.Tensor | None = None, generator: torch.Generator | None = None, backend: str | None = None,
) -> QuantizedTensor:
    """``lowprec.quant.quantize`` on the backend the route chooses for x's device (same values, bit for
    bit), or on ``backend``."""
    spec = CastSpec.of(fmt, granularity, rounding, delayed=scale is not None)
    if backend_for(spec, x.device, backend) is Backend.TRITON and saturate:
        from lowprec.kernels import triton_quant

        return triton_quant.quantize(x, fmt, granularity, rounding=rounding, scale=scale, generator=generator)
    return _reference_quantize(x, fmt, granularity, rounding=rounding, saturate=saturate, scale=scale,
                               generator=generator)


from lowprec.kernels.cast import Casts, cast  # noqa: E402  (cast calls quantize above)

__all__ = ["Backend", "Capability", "CastRoute", "CastSpec", "Casts", "Pairing", "backend_for", "capability",
           "cast", "gemm_backend", "gemm_path", "quantize", "route", "scaled_mm"]
