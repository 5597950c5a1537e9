"""``cast``: one operand's casts along a route, the one entry the layers above call.

A route (``lowprec.kernels.route``) says which sides are made and how; ``cast`` follows it without
asking the device again. On the Triton backend the kernels read the operand once for every side
(and the amax delayed scaling records); on the reference backend the sides are cast one after the
other, through ``lowprec.kernels.quantize``, with the same values.

[Note: casts a compiled backward makes]
Backward makes some casts again rather than keep forward's (weight.T; a layer's input under
``torch.compile``: see ``lowprec.nn.function``). In a compiled graph a Triton cast is an opaque
operator, which the compiler's partitioner never recomputes; one whose inputs all exist in forward it
moves into forward and saves its output, undoing the point. ``after`` (backward passes its incoming
gradient) makes the operator depend on a backward tensor it never reads, so it stays in backward.

[Note: folded casts in compiled code]
A folded side (``CastSpec.folded``) is one Triton pass in eager code, where it is faster than an MX cast and a
second pass that folds it. In a compiled graph the MX cast stays one opaque operator and the fold becomes
the reference's elementwise ops (``kernels.fold.fold`` there), which the compiler fuses with what reads
and writes around them: measured faster there (BENCHMARKS.md). The route carries the unfolded casts for it
(``CastRoute.unfolded``); the bits are the same either way.
"""
from __future__ import annotations

from typing import NamedTuple

import torch

from lowprec.kernels import routed  # looked up at call time, so a test's spy on routed.quantize sees it
from lowprec.kernels.fold import fold, fold_reference
from lowprec.kernels.route import Backend, CastRoute, CastSpec, Pairing
from lowprec.quant import QuantizedTensor, hadamard_padded
from lowprec.quant.hadamard import RHT_BLOCK


class Casts(NamedTuple):
    """What :func:`cast` made: the sides a route asked for (None otherwise) and the recorded amax."""

    along_k: QuantizedTensor | None
    transposed: QuantizedTensor | None
    amax: torch.Tensor | None


def _one(x: torch.Tensor, spec: CastSpec, backend: Backend, scale, generator) -> QuantizedTensor:
    if spec.hadamard_seed is not None:
        x = hadamard_padded(x, RHT_BLOCK, spec.hadamard_seed)
    q = routed.quantize(x, spec.fmt, spec.granularity, rounding=spec.rounding, scale=scale, generator=generator,
                        backend=backend.value)
    return fold_reference(q) if spec.folded else q


def _folded(q: QuantizedTensor | None, spec: CastSpec | None) -> QuantizedTensor | None:
    return fold(q) if q is not None and spec.folded else q


def cast(x2: torch.Tensor, route: CastRoute, *, scale_k: torch.Tensor | None = None,
         scale_t: torch.Tensor | None = None, record_amax: bool = False,
         generator: torch.Generator | None = None, after: torch.Tensor | None = None) -> Casts:
    """``x2 (M, K)`` cast as ``route.along_k`` and ``x2.T`` as ``route.transposed``; ``scale_k`` /
    ``scale_t`` are the sides' delayed scales (None: current scaling); ``record_amax`` also returns
    ``x2.abs().amax()`` (NaN if x2 holds one) for the amax history. ``after``: a backward tensor the
    cast comes after in compiled code (see [Note: casts a compiled backward makes])."""
    a, b = route.along_k, route.transposed
    if route.unfolded is not None and torch.compiler.is_compiling():  # see [Note: folded casts in compiled code]
        c = cast(x2, route.unfolded, scale_k=scale_k, scale_t=scale_t, record_amax=record_amax, generator=generator,
                 after=after)
        return Casts(_folded(c.along_k, a), _folded(c.transposed, b), c.amax)
    if route.pairing is Pairing.FUSED and x2.numel():
        from lowprec.kernels import triton_quant

        # one pass: a given scale serves every side (the route fused them only where they share it)
        scale = scale_k if a is not None else scale_t
        return Casts(*triton_quant.cast(x2, a, b, scale=scale, generator=generator, record_amax=record_amax,
                                        templates=route.templates, after=after))
    amax = x2.detach().abs().amax().float() if record_amax else None
    q = _one(x2, a, route.backend_k, scale_k, generator) if a is not None else None
    if b is None:
        return Casts(q, None, amax)
    if route.pairing is Pairing.TRANSPOSED:  # the same scale: the transposed data is the cast
        q_t = QuantizedTensor(q.data.t().contiguous(), q.scale, q.fmt, q.granularity, x2.t().shape, x2.dtype)
        return Casts(q, q_t, amax)
    return Casts(q, _one(x2.t(), b, route.backend_t, scale_t, generator), amax)
