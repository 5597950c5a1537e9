"""How a non-linear op saves its inputs for backward: as they are, or in FP8 with FP32 scales.

[Note: saved activations]
Between its linears a decoder block runs non-linear ops whose backward needs their inputs:
RMSNorm its input (the residual stream), SwiGLU the outputs of the gate and up projections. A
converted :class:`~lowprec.nn.Linear` saves its own input quantized (see [Note: what backward
keeps] in ``lowprec.nn.function``); these ops save theirs in the model's dtype unless told
otherwise. As COAT (arXiv 2410.19313) does, :class:`SavedActivations` stores them in FP8 (E4M3 by
default) with one FP32 scale per tensor or per ``1 x B`` block along the last dimension.

The forward still computes in high precision, so its output is what it was without; only the copy
kept for backward is quantized. Backward dequantizes it and differentiates the high-precision op
at the dequantized inputs: each gradient is exact for inputs within E4M3's relative error
(``2^-4``) of the true ones. A saved E4M3 element costs 1 byte, plus 4 per scale: 1 + 4/128 with
1 x 128 blocks, against 2 in BF16 and 4 in FP32. A last dimension that is not a multiple of the
block is padded to one by the cast (dims of 128k lose nothing).

Where each runs is ``lowprec.kernels.route``'s to say (``saved_cast_backend``,
``saved_dequantize_backend``): in eager code on CUDA the cast is one fused Triton pass through
``lowprec.kernels.cast`` (FP8 per tensor, per row and ``1 x B`` are all covered), and BF16 inputs saved
in ``1 x B`` blocks are dequantized by one Triton pass too (``lowprec.kernels.triton_dequant``);
elsewhere, and in compiled code, the reference's operations, which the compiler fuses itself. Both give
the same bits. What is kept is ``QuantizedTensor.to_saved``'s packing.

The saved copy is the op's input, not its output, so it is a different tensor from the one the
next converted Linear saves (the norm's output, SwiGLU's product): the two cannot share storage.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field, replace

import torch

from lowprec import kernels as K
from lowprec._checks import describe, fail
from lowprec.kernels.route import Backend, saved_cast_backend, saved_dequantize_backend
from lowprec.quant import Granularity, GranularityKind, QuantizedTensor, ScaleRule, blockwise, quantize, tensorwise
from lowprec.quant.quantize import as_2d

FP8_FORMATS = ("e4m3", "e5m2")
"""Element formats a saved activation may take."""


@dataclass(frozen=True, slots=True, kw_only=True)
class SavedActivations:
    """How norms and SwiGLU save their inputs for backward (``Policy.saved_activations``)."""

    fmt: str = "e4m3"
    """The FP8 element format: ``e4m3`` (COAT's choice: activations need precision more than range,
    and a per-block scale gives the range) or ``e5m2``."""
    granularity: Granularity = field(default_factory=lambda: blockwise(1, 128))
    """FP32 scales: ``tensorwise()``, ``rowwise()`` or ``blockwise(1, B)`` blocks along the last
    dimension (COAT's per-group scaling; default ``1 x 128``)."""

    def __post_init__(self) -> None:
        if self.fmt not in FP8_FORMATS:
            fail("fmt", "one of " + ", ".join(map(repr, FP8_FORMATS)), describe(self.fmt))
        g = self.granularity
        if not isinstance(g, Granularity):
            fail("granularity", "a lowprec.quant.Granularity", describe(g), TypeError)
        line = g.kind in (GranularityKind.TENSOR, GranularityKind.ROW) or (
            g.kind is GranularityKind.BLOCK and g.block_rows == 1)
        if g.rule is not ScaleRule.AMAX or not line:
            fail("granularity", "tensorwise(), rowwise() or blockwise(1, B) (FP32 scales)", str(g))

    def __str__(self) -> str:
        return f"{self.fmt} {self.granularity}"


_BLOCK = re.compile(r"1x([1-9][0-9]*)")


def fp8_activations(spec: str = "1x128") -> SavedActivations:
    """E4M3 saved activations by name: ``"tensor"`` (one scale per tensor) or ``"1xB"`` (FP32 scales per
    ``1 x B`` block along the last dimension), as ``--fp8-activations`` takes them."""
    if spec == "tensor":
        return SavedActivations(granularity=tensorwise())
    m = _BLOCK.fullmatch(spec) if isinstance(spec, str) else None
    if m is None:
        fail("fp8_activations", "'tensor' or '1xB' such as '1x128'", describe(spec))
    return SavedActivations(granularity=blockwise(1, int(m.group(1))))


def check_saved(saved: object) -> SavedActivations | None:
    if saved is not None and not isinstance(saved, SavedActivations):
        fail("saved", "None or a lowprec.nn.SavedActivations", describe(saved), TypeError)
    return saved


def _quantize(x: torch.Tensor, saved: SavedActivations, backend: str | None) -> QuantizedTensor:
    """``lowprec.quant.quantize(x, saved.fmt, saved.granularity)``, bit for bit, on the backend
    ``kernels.route.saved_cast_backend`` takes."""
    backend = saved_cast_backend(saved.fmt, saved.granularity, x.device, compiling=torch.compiler.is_compiling(),
                                 backend=backend)
    if backend is Backend.TORCH:
        return quantize(x, saved.fmt, saved.granularity)
    spec = K.CastSpec.of(saved.fmt, saved.granularity)
    q = K.cast(as_2d(x), K.route(spec, None, x.device, backend)).along_k
    return replace(q, shape=x.shape)


def pack(x: torch.Tensor, saved: SavedActivations | None, *,
         backend: str | None = None) -> tuple[tuple, tuple | None]:
    """Tensors for ``save_for_backward`` (always three) and the metadata to rebuild ``x``: ``x`` itself (no
    copy) when ``saved`` is None, else its FP8 codes and scales (``QuantizedTensor.to_saved``), cast on the
    backend the device takes (or on ``backend``: tests)."""
    if saved is None:
        return (x, None, None), None
    return _quantize(x.detach(), saved, backend).to_saved()


def unpack(tensors: tuple, meta: tuple | None, *, backend: str | None = None) -> torch.Tensor:
    """The saved input, dequantized to its original dtype where it was quantized, on the backend
    ``kernels.route.saved_dequantize_backend`` takes (or on ``backend``: tests); the same bits either way."""
    if meta is None:
        return tensors[0]
    q = QuantizedTensor.from_saved(tensors, meta)
    chosen = saved_dequantize_backend(q.data.device, q.dtype, q.granularity,
                                      compiling=torch.compiler.is_compiling(), backend=backend)
    if q.data.numel() and chosen is Backend.TRITON:
        from lowprec.kernels.triton_dequant import dequantize_blocks  # Triton: imported where it runs

        return q.crop(dequantize_blocks(q.data, q.scale, q.fmt.exp_bits, q.fmt.man_bits))
    return q.dequantize()
