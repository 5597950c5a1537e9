"""A weight on a serving format's scale grid: the trained codes where they fit, else the FP32 master quantized anew.

[Note: fitting a trained weight]
A serving format stores, per quantized linear, codes of one element format and one scale per block of its own
shape: per output channel (``1 x in``), ``128 x 128``, ``1 x 32`` (MX) or ``1 x 16`` (NVFP4). The recipe's
weight cast (``LayerWeight.trained``) fits that grid when

* its element format is the format's (E4M3, E2M1), and its scales are in the format's scale format (FP32, E8M0,
  or E4M3 under an FP32 global scale);
* every block of the format lies inside one block of the trained weight: along each dimension the trained
  block spans the whole dimension or is a multiple of the format's block.

The format's scales are then the trained ones repeated (a 16x16 NVFP4 tile gives sixteen identical 1x16 scales,
a per-tensor FP8 scale one scale per channel) and its codes are the trained codes: no value is rounded a second
time, and the stored weight dequantizes to what the forward GEMM multiplied. A weight that does not fit (another
element format, a per-row scale asked to serve 128x128 blocks, no trained weight at all) is quantized from the
FP32 master with lowprec's own quantizer onto the format's grid, and says so (:data:`FROM_MASTER`).
"""
from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

import torch

from lowprec import formats as F
from lowprec._checks import describe, fail
from lowprec.export.layout import AS_TRAINED, FROM_MASTER, LayerWeight
from lowprec.quant import Granularity, GranularityKind, QuantizedTensor, quantize


@dataclass(frozen=True, slots=True)
class Grid:
    """What a serving format stores for one weight: its element format and the blocks that share one scale."""

    fmt: F.Format
    """The element format of the stored codes."""
    granularity: Granularity
    """The format's blocks along the weight's 2-D view ``(rows, in)``, and the rule lowprec quantizes a master
    with onto them (its scale format is the one the format stores)."""


@dataclass(frozen=True, slots=True)
class Coded:
    """A weight on a format's grid, before the format names, packs and casts its tensors."""

    codes: torch.Tensor
    """``(rows, in)``: the element format's storage (a float8 dtype, or one uint8 code per FP4 element)."""
    scale: torch.Tensor
    """``(ceil(rows / block_rows), ceil(in / block_cols))`` float32, exact in the format's scale format; a block
    spanning a whole dimension counts once along it (per channel: ``(rows, 1)``)."""
    global_scale: torch.Tensor | None
    """NVFP4's FP32 global scale as lowprec stores it, the one that dequantizes: ``x ~= decode * scale * g``."""
    how: str
    """:data:`AS_TRAINED` or :data:`FROM_MASTER`."""


def rows_cols(shape: torch.Size) -> tuple[int, int]:
    """The 2-D view ``(prod(shape[:-1]), shape[-1])`` every granularity works on."""
    return math.prod(shape[:-1]), shape[-1]


def _along(trained: int | None, ours: int | None) -> bool:
    """One dimension of [Note: fitting a trained weight]: does every block of ours lie inside a trained one?"""
    if trained is None:  # the trained block spans the whole dimension
        return True
    return ours is not None and trained % ours == 0


def fits(q: QuantizedTensor, grid: Grid) -> bool:
    """Whether ``q``'s codes and scales can be written on ``grid`` as they are."""
    g, ours = q.granularity, grid.granularity
    if q.fmt.name != grid.fmt.name or g.scale_format.name != ours.scale_format.name:
        return False
    if (q.global_scale is not None) != (ours.kind is GranularityKind.NVFP4):
        return False
    return _along(g.block_rows, ours.block_rows) and _along(g.block_cols, ours.block_cols)


def _expand(scale: torch.Tensor, trained: int | None, ours: int | None, dim: int, size: int) -> torch.Tensor:
    """The trained scales along ``dim`` repeated onto our blocks over ``size`` elements."""
    n = 1 if ours is None else -(-size // ours)  # blocks of ours along this dimension
    if trained is None:  # one trained scale along the whole dimension
        return scale.expand(*(n if d == dim else s for d, s in enumerate(scale.shape)))
    return scale.repeat_interleave(trained // ours, dim=dim).narrow(dim, 0, n)


def _on_grid(q: QuantizedTensor, grid: Grid, how: str) -> Coded:
    rows, cols = rows_cols(q.shape)
    g, ours = q.granularity, grid.granularity
    scale = _expand(q.scale, g.block_rows, ours.block_rows, 0, rows)
    scale = _expand(scale, g.block_cols, ours.block_cols, 1, cols)
    codes = q.data[:rows, :cols]
    return Coded(codes.contiguous(), scale.contiguous(), q.global_scale, how)


def coded(w: LayerWeight, grid: Grid) -> Coded:
    """``w`` on ``grid``: its trained codes when they fit (:data:`AS_TRAINED`), else its master quantized with
    ``grid.granularity`` (:data:`FROM_MASTER`). See [Note: fitting a trained weight]."""
    if not isinstance(w, LayerWeight):
        fail("w", "a lowprec.export.LayerWeight", describe(w), TypeError)
    if w.per_expert:
        return _experts_coded(w, grid)
    q = w.trained
    if q is not None:
        if tuple(q.shape) != tuple(w.master.shape):
            fail("w.trained", f"a quantized weight of the master's shape {tuple(w.master.shape)}", repr(q))
        if fits(q, grid):
            return _on_grid(q, grid, AS_TRAINED)
    fresh = quantize(w.master.detach().float(), grid.fmt, grid.granularity)
    return _on_grid(fresh, grid, FROM_MASTER)


def _experts_coded(w: LayerWeight, grid: Grid) -> Coded:
    """A fused experts' weight ``(E, out, in)`` on ``grid``, expert by expert (each with its own trained cast):
    the experts' codes and scales stacked along rows, as the 2-D view ``(E * out, in)`` holds them. The grid's
    blocks must not span experts (one row, or a row count dividing ``out``); NVFP4's one global scale per
    tensor cannot stand for the experts' own, so there the whole weight is quantized from the master."""
    e, out, _ = w.master.shape
    rows = grid.granularity.block_rows
    if len(w.per_expert) != e:
        fail("w.per_expert", f"one trained cast per expert ({e})", len(w.per_expert))
    if grid.granularity.kind is GranularityKind.NVFP4 or rows is None or out % rows:
        fresh = quantize(w.master.detach().float(), grid.fmt, grid.granularity)
        return _on_grid(fresh, grid, FROM_MASTER)
    parts = [coded(LayerWeight(w.name, w.master[i], q, w.recipe), grid) for i, q in enumerate(w.per_expert)]
    how = AS_TRAINED if all(p.how == AS_TRAINED for p in parts) else FROM_MASTER
    return Coded(torch.cat([p.codes for p in parts]), torch.cat([p.scale for p in parts]), None, how)


def stored_codes(c: Coded) -> torch.Tensor:
    """The codes as serving formats store them: float8 as they are, FP4 two per byte with the even element in
    the low nibble (:func:`lowprec.formats.pack`; every reader here unpacks ``byte & 0xF`` first)."""
    if c.codes.dtype != torch.uint8:
        return c.codes
    return F.pack(c.codes, "e2m1")


def stored_scale(c: Coded, scale_format: F.Format) -> torch.Tensor:
    """The block scales in the dtype serving formats store them: FP32 as float32, E8M0 as its uint8 code
    (``2^(code - 127)``), E4M3 as float8_e4m3fn. Each is exact: the scales are on that format's grid."""
    if scale_format.bits > 8:
        return c.scale
    if scale_format.torch_dtype is not None:
        return c.scale.to(scale_format.torch_dtype)
    return F.encode(c.scale, scale_format)


def linear_misfit(w: LayerWeight, layout: str, multiple: int, needs: str) -> str | None:
    """Why a layout that stores one ``(out, in)`` weight per linear, in blocks of ``multiple`` along ``in``,
    cannot hold ``w`` (``needs``: who needs the multiple, for the message), or None."""
    if w.fused is not None:
        return f"lowprec writes no {layout} form of fused 3-D experts yet: they stay in high precision"
    if w.master.dim() != 2:
        return f"{layout} stores one (out, in) weight per linear, got {tuple(w.master.shape)}"
    _, cols = rows_cols(w.master.shape)
    if cols % multiple:
        return f"{needs} needs in_features a multiple of {multiple}, got {cols}"
    return None


def checked_input_amax(input_amax: Mapping[str, float] | None) -> Mapping[str, float] | None:
    """A layout's calibrated input amaxes as given (a mapping from a linear's name), or None."""
    if input_amax is not None and not isinstance(input_amax, Mapping):
        fail("input_amax", "a mapping from a linear's name to its input's largest magnitude",
             describe(input_amax), TypeError)
    return input_amax


def layer_input_amax(input_amax: Mapping[str, float], name: str) -> float:
    """The calibrated input amax of the linear ``name``, which calibration must have recorded."""
    if name not in input_amax:
        fail("input_amax", f"an amax for every quantized linear, {name!r} included", "none")
    return input_amax[name]
