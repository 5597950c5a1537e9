"""Fast versions of ``lowprec.quant``'s operations and the scaled GEMMs, and the choice of backend.

[Note: backends]
``torch`` is the pure-torch reference in ``lowprec.quant`` (any device). ``triton`` kernels run on
CUDA and equal the reference bit for bit. ``cublas`` is ``torch._scaled_mm``. ``emulated`` computes a
GEMM a device lacks from the exact quantized values. A cast's backend is chosen by
``kernels.route`` and a GEMM's by ``kernels.gemm.gemm_path``, from the device's capability (looked up
at first use, never at import, and cached per device). A layer takes both when its plan is made
(``lowprec.nn.plan.layer_plan``, cached per recipe, device and shape, so layers alike share one; made
again when the layer moves or changes recipe); a call of ``quantize`` or ``scaled_mm`` without
``backend=`` chooses at the call. ``backend=`` forces one. The Triton-or-reference choices that are not
casts (an emulated GEMM's block dequantize, saved activations, AdamWLP's step) are ``kernels.route``'s
too, asked at each call (see [Note: routes] there).
"""
from __future__ import annotations

from lowprec.kernels.capability import Capability, capability
from lowprec.kernels.cast import Casts, cast
from lowprec.kernels.gemm import GemmPath, folds_at_cast, gemm_backend, gemm_path, scaled_mm
from lowprec.kernels.route import Backend, CastRoute, CastSpec, Pairing, backend_for, route
from lowprec.kernels.routed import quantize, requantize_many

__all__ = ["Backend", "Capability", "CastRoute", "CastSpec", "Casts", "GemmPath", "Pairing", "backend_for",
           "capability", "cast", "folds_at_cast", "gemm_backend", "gemm_path", "quantize", "requantize_many", "route",
           "scaled_mm"]
