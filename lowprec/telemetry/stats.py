"""What one quantized GEMM operand lost: its :class:`OperandStats`, computed from the high-precision
operand and its cast.

[Note: the telemetry figures]
For a high-precision operand ``x`` and its cast ``q`` (``x ~= decode(q.data) * scale``, each element
with its block's dequantizing scale ``s``, NVFP4's global scale included):

* ``amax``: ``max |x|`` (NaN or inf when ``x`` holds one: telemetry shows non-finite values as they are);
* ``scale``: the largest finite dequantizing scale of the blocks (the scale, for per-tensor scaling);
* ``underflow``: the fraction of elements that are finite and nonzero in ``x`` and decode to 0;
* ``saturation``: the fraction of elements clipped by the scale: finite, in a block whose scale is
  positive, and with ``|x| / s`` at or beyond the format's overflow threshold ``max + spacing / 2``
  (``spacing`` the grid step at ``max``), where a cast that did not saturate would overflow. An element
  just above ``max`` that rounds down to it is ordinary rounding, not clipping; so an amax mapped onto
  ``max`` by a scale rounded in FP32 is never counted. An NVFP4 block whose E4M3 scale underflowed to
  0 counts as underflow, not saturation: the two are disjoint;
* ``sqnr_db``: ``10 log10(sum x^2 / sum (x - deq)^2)`` over the elements finite in both ``x`` and its
  dequantized value ``deq``, in float64; ``+inf`` when the cast is exact, ``-inf`` when ``x`` is all
  zeros and the cast is not.

Fractions are of all of ``x``'s elements (padding excluded). A side the recipe keeps in a 16-bit
format (a plain tensor, BF16 or FP16) has scale 1 and that dtype's max; one kept as it is reads exact.
The five figures are reduced on the operand's device and read back with one host sync.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as nnf

from lowprec import formats as F
from lowprec._checks import check_choice, check_tensor, describe, fail
from lowprec.quant import QuantizedTensor
from lowprec.quant.quantize import as_2d
from lowprec.recipes import GEMMS

OPERANDS = ("input", "weight", "grad_output")


@dataclass(frozen=True, slots=True)
class OperandStats:
    """The figures of [Note: the telemetry figures] for one operand of one GEMM of one layer at one step."""

    layer: str
    """The layer's qualified name in its model (``layers.0.attn.q``)."""
    gemm: str
    """``fprop``, ``dgrad`` or ``wgrad``."""
    operand: str
    """``input``, ``weight`` or ``grad_output``."""
    amax: float
    """Largest magnitude of the high-precision operand."""
    scale: float
    """Largest finite dequantizing block scale (1 for an operand kept in 16 bits)."""
    underflow: float
    """Fraction of elements, nonzero in high precision, that decode to 0."""
    saturation: float
    """Fraction of elements clipped by the scale (beyond the format's overflow threshold)."""
    sqnr_db: float
    """Signal to quantization noise of the cast, in dB (+inf when exact)."""
    step: int
    """The training step (or the caller's count) the operand was sampled at."""
    fmt: F.Format | None = None
    """The element format the operand was cast to (the dtype's for a side kept in 16 bits); None where
    unknown (a ``telemetry.csv`` written before it was recorded). The trouble floors follow it
    (:mod:`lowprec.telemetry.trouble`)."""

    def __post_init__(self) -> None:
        check_choice("gemm", self.gemm, GEMMS)
        check_choice("operand", self.operand, OPERANDS)
        for name in ("underflow", "saturation"):
            v = getattr(self, name)
            if not 0.0 <= v <= 1.0:
                fail(name, "a fraction in [0, 1]", v)
        if self.fmt is not None and not isinstance(self.fmt, F.Format):
            fail("fmt", "a lowprec.formats.Format or None", describe(self.fmt), TypeError)


def cast_format(q: QuantizedTensor | torch.Tensor) -> F.Format | None:
    """The element format of a cast: a quantized tensor's, or the table's format of a plain tensor's dtype."""
    if isinstance(q, QuantizedTensor):
        return q.fmt
    return next((f for f in F.FORMATS.values() if f.torch_dtype == q.dtype), None)


def _top_threshold(fmax: float, spacing: float) -> float:
    """Where a cast that does not saturate overflows: half a grid step above the largest value."""
    return fmax + spacing / 2


def _quantized_view(q: QuantizedTensor) -> tuple[torch.Tensor, torch.Tensor, float]:
    """(decoded values, per-element dequantizing scale, overflow threshold) of q's padded 2-D view."""
    mb, kb = q.scale.shape
    br, bc = q.block_shape
    values = q.values()  # (Mp, Kp)
    s = q.effective_scale().float()[:, None, :, None].expand(mb, br, kb, bc).reshape(values.shape)  # (Mp, Kp)
    f = q.fmt
    spacing = 1.0 if f.kind is F.Kind.INT else 2.0 ** (math.floor(math.log2(f.max)) - f.man_bits)
    return values, s, _top_threshold(f.max, spacing)


def _plain_view(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, float]:
    """The same for a side kept in a floating-point dtype: scale 1, the dtype's overflow threshold."""
    fi = torch.finfo(t.dtype)
    spacing = 2.0 ** (math.frexp(fi.max)[1] - 1) * fi.eps
    v = as_2d(t.detach()).float()
    return v, torch.ones_like(v), _top_threshold(fi.max, spacing)


def stats_tensor(hp: torch.Tensor, q: QuantizedTensor | torch.Tensor) -> torch.Tensor:
    """The five figures ``(amax, scale, underflow, saturation, sqnr_db)`` of [Note: the telemetry figures]
    as one float64 tensor on ``hp``'s device, without a host sync."""
    check_tensor("hp", hp)
    if isinstance(q, QuantizedTensor):
        if tuple(q.shape) != tuple(hp.shape):
            fail("q", f"a cast of a tensor of hp's shape {tuple(hp.shape)}", repr(q))
        values, s, threshold = _quantized_view(q)
    else:
        check_tensor("q", q)
        if q.shape != hp.shape:
            fail("q", f"a tensor of hp's shape {tuple(hp.shape)}", describe(q))
        values, s, threshold = _plain_view(q)
    x2 = as_2d(hp.detach()).float()  # (M, K)
    x = nnf.pad(x2, (0, values.shape[1] - x2.shape[1], 0, values.shape[0] - x2.shape[0]))  # (Mp, Kp), zeros
    deq = values * s  # (Mp, Kp)
    n = max(hp.numel(), 1)
    finite = torch.isfinite(x)
    underflow = (finite & (x != 0) & (deq == 0)).sum() / n
    # division, not threshold * s: threshold * s can overflow FP32 for a huge delayed scale
    saturated = finite & (s > 0) & (x.abs() / torch.where(s > 0, s, 1.0) >= threshold)
    both = finite & torch.isfinite(deq)
    x64 = torch.where(both, x, 0.0).double()
    d64 = torch.where(both, deq, 0.0).double()
    signal, noise = (x64 * x64).sum(), ((x64 - d64) ** 2).sum()
    sqnr = torch.where(noise == 0, math.inf, 10 * torch.log10(signal / noise))
    finite_s = torch.where(torch.isfinite(s), s, -math.inf)
    scale = finite_s.max() if finite_s.numel() else finite_s.new_full((), math.nan)
    scale = torch.where(scale == -math.inf, math.nan, scale)
    amax = hp.detach().abs().amax().float() if hp.numel() else x.new_zeros(())
    return torch.stack([amax.double(), scale.double(), underflow.double(), saturated.sum().double() / n, sqnr])


def operand_stats(hp: torch.Tensor, q: QuantizedTensor | torch.Tensor, *, layer: str, gemm: str, operand: str,
                  step: int) -> OperandStats:
    """:class:`OperandStats` of ``q``, the cast of ``hp`` (a :class:`~lowprec.quant.QuantizedTensor`, or a
    plain tensor for a side kept in 16 bits); one host sync."""
    amax, scale, underflow, saturation, sqnr = stats_tensor(hp, q).tolist()
    return OperandStats(layer, gemm, operand, amax, scale, underflow, saturation, sqnr, step, cast_format(q))
