"""Every expert's per-tensor casts of one operand in a few kernels, for all experts at once.

[Note: batched per-expert casts]
A ``GroupedLinear`` under a recipe whose every cast is per tensor (``fp8-current``: one scale per
operand, from its amax) casts each expert's operands with scales of its own: expert ``e``'s rows of the
input with the amax of those rows, its weight with the amax of ``weight[e]``. Casting expert by expert
costs a handful of kernel launches per expert, per operand, per GEMM: on a GPU, for 32 or 64 small
experts, the launches and not the arithmetic set the time. The casts here give the same bits in a
fixed number of kernels whatever the number of experts:

1. each expert's amax: the rows' amaxes reduced by expert (``scatter_reduce``, a maximum: exact in any
   order, NaN kept), or the weight's over its last two dimensions;
2. each expert's scale from its amax, by the same function a per-tensor cast uses
   (``lowprec.quant.scales.amax_scale``);
3. every row divided by its expert's scale and rounded, in one pass: on a GPU the row-wise cast's
   Triton kernel given each row's expert amax instead of its own (``kernels.triton_quant.rows_by_amax``),
   elsewhere ``quantize`` given each row's expert scale; the same division and the same rounding,
   element by element, as expert ``e``'s own cast (``kernels.route.grouped_rows_backend`` chooses).

So the codes and scales equal a loop of per-expert casts bit for bit (``tests/nn/test_grouped_casts.py``
holds that for every format pair the per-tensor recipes use, zero-token experts, and non-finite
values). An operand's transposed cast (backward's ``x.T`` and ``weight.T``) is the same codes
transposed where its format is the along-K side's (per tensor, the scale does not depend on the
layout), else a second cast from the same amaxes.

The GEMMs then run per expert on views of these codes (:func:`expert`), through the layer plan's own
GEMM path, so each equals the loop's bit for bit on the CPU. Only the casts are batched today; a grouped
scaled GEMM (``torch._scaled_grouped_mm``) over the same codes is the next step.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from lowprec import formats as F
from lowprec.kernels.route import Backend, CastSpec, grouped_rows_backend
from lowprec.nn.plan import LayerPlan, OperandPlan
from lowprec.quant import QuantizedTensor, quantize, rowwise, tensorwise
from lowprec.quant.granularity import GranularityKind, ScaleRule
from lowprec.quant.scales import amax_scale


def batches(plan: LayerPlan) -> bool:
    """Whether every cast of ``plan`` is one this module makes: quantized, per tensor, scaled by its
    current amax, rounded to nearest, without a Hadamard rotation."""
    for op in (plan.input, plan.weight, plan.grad_output):
        if op is None or op.delayed:
            return False
        for c in (op.cast_k, op.cast_t):
            g = c.granularity
            if (c.fmt is None or g is None or g.kind is not GranularityKind.TENSOR or g.rule is not ScaleRule.AMAX
                    or F.as_rounding(c.rounding) is not F.Rounding.NEAREST or c.hadamard):
                return False
    return True


@dataclass(frozen=True, slots=True)
class Cast:
    """One side of an operand cast for every expert: the codes of all rows (or of the transposed
    weights) and each expert's scale."""

    data: torch.Tensor
    """Rows ``(T, K)`` of every expert, or weights ``(E, rows, K)``, in the format's storage dtype."""
    scales: torch.Tensor
    """``(E,)`` float32: expert ``e``'s per-tensor scale."""
    fmt: F.Format
    shape_dtype: torch.dtype
    """The dtype of the tensor cast (what ``dequantize`` gives back)."""
    aligned: torch.Tensor = field(init=False, repr=False)
    """``(E, 4)`` float32, column 0 the scales: expert ``e``'s scale at a 16-byte boundary, as cuBLAS
    reads a scale (a view of ``scales[e]`` alone sits 4 bytes after expert ``e - 1``'s and is refused)."""

    def __post_init__(self) -> None:
        aligned = self.scales.new_zeros(self.scales.shape[0], 4)
        aligned[:, 0] = self.scales
        object.__setattr__(self, "aligned", aligned)

    def expert(self, e: int, rows: slice | None = None, transposed: bool = False) -> QuantizedTensor:
        """Expert ``e``'s operand, as its own per-tensor cast would make it: its rows (``rows``, for a
        cast of token rows) or its weight, transposed (codes ``(K, n)``, contiguous) or not."""
        codes = self.data[rows] if rows is not None else self.data[e]
        if transposed:
            codes = codes.t().contiguous()
        return QuantizedTensor(codes, self.aligned[e, :1].view(1, 1), self.fmt, tensorwise(), codes.shape,
                               self.shape_dtype)


def expert_of_rows(counts: tuple[int, ...], device: torch.device) -> torch.Tensor:
    """``(T,)`` int64: the expert of each row of tokens grouped by expert with ``counts`` rows each."""
    return torch.repeat_interleave(torch.arange(len(counts), device=device),
                                   torch.tensor(counts, device=device))


def _sides(op: OperandPlan, need_k: bool, need_t: bool):
    return (op.cast_k.fmt if need_k else None), (op.cast_t.fmt if need_t else None)


def _cast(x2: torch.Tensor, row_amax: torch.Tensor, row_scales: torch.Tensor, scales: torch.Tensor,
          fmt: F.Format) -> Cast:
    """``x2``'s rows, row ``i`` scaled by ``row_scales[i]`` (its expert's scale, from its expert's amax
    ``row_amax[i]``): on the route's backend, the same bits either way."""
    spec = CastSpec.of(fmt, rowwise(), F.Rounding.NEAREST)
    if x2.numel() and grouped_rows_backend(spec, x2.device) is Backend.TRITON:
        from lowprec.kernels import triton_quant  # Triton: imported where it runs

        data = triton_quant.rows_by_amax(x2, spec, row_amax)
    else:  # the division and rounding of a per-tensor cast, given each row's scale
        data = quantize(x2, fmt, rowwise(), scale=row_scales).data
    return Cast(data, scales, fmt, x2.dtype)


def cast_rows(x2: torch.Tensor, expert: torch.Tensor, n_experts: int, op: OperandPlan, need_k: bool,
              need_t: bool) -> tuple[Cast | None, Cast | None]:
    """Rows ``x2`` (T, K) grouped by expert (``expert``: each row's) cast along K and for the transposed
    side, each expert with its own scale; see [Note: batched per-expert casts]. The transposed side's
    codes stay in the rows' layout (``Cast.expert(..., transposed=True)`` transposes an expert's)."""
    row_amax = x2.detach().abs().amax(dim=1).float()  # (T,)
    amax = torch.zeros(n_experts, device=x2.device).scatter_reduce(0, expert, row_amax, "amax")  # (E,)
    # NaN kept whatever the device's maximum does with it: a per-tensor cast's amax of a NaN is NaN
    nan = torch.zeros(n_experts, device=x2.device).scatter_reduce(0, expert, row_amax.isnan().float(), "amax")
    amax = torch.where(nan > 0, torch.nan, amax)
    return _both(x2, amax, lambda s: s[expert], op, need_k, need_t)


def cast_weights(weight: torch.Tensor, op: OperandPlan, need_k: bool,
                 need_t: bool) -> tuple[Cast | None, Cast | None]:
    """Experts' weights ``(E, out, in)`` cast per expert: along K (codes ``(E, out, in)``) and for the
    transposed side (codes ``(E, out, in)`` too, transposed per expert by ``Cast.expert``)."""
    e, out, k = weight.shape
    amax = weight.detach().abs().float().amax(dim=(1, 2))  # (E,)
    flat = weight.detach().reshape(e * out, k)
    kc, tc = _both(flat, amax, lambda s: s.repeat_interleave(out), op, need_k, need_t)
    return tuple(None if c is None else Cast(c.data.view(e, out, k), c.scales, c.fmt, c.shape_dtype)
                 for c in (kc, tc))


def _both(x2, amax, per_row, op: OperandPlan, need_k: bool, need_t: bool) -> tuple[Cast | None, Cast | None]:
    """The sides asked for, one cast per format; ``per_row`` spreads an (E,) vector over x2's rows."""
    fk, ft = _sides(op, need_k, need_t)
    out: dict[F.Format, Cast] = {}
    for fmt in (fk, ft):
        if fmt is not None and fmt not in out:
            scales = amax_scale(amax, fmt)  # (E,) as a per-tensor cast computes it from its amax
            out[fmt] = _cast(x2, per_row(amax), per_row(scales).unsqueeze(1), scales, fmt)
    return (out[fk] if fk is not None else None), (out[ft] if ft is not None else None)


__all__ = ["Cast", "batches", "cast_rows", "cast_weights", "expert_of_rows"]
