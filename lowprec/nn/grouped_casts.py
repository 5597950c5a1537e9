"""Every expert's casts of one operand in a few kernels, for all experts at once: per tensor, per row, blocks.

[Note: batched per-expert casts]
A ``GroupedLinear`` casts each expert's operands with scales of its own: under a per-tensor recipe
(``fp8-current``) expert ``e``'s rows of the input take the amax of those rows, its weight the amax of
``weight[e]``; under a row-wise one (``fp8-rowwise``) every row takes its own amax, and the transposed
operands of the weight gradient (``x_e.T``, ``dy_e.T``, cast along the tokens) take the amax of each
feature over the expert's tokens only. Casting expert by expert costs a handful of kernel launches per
expert, per operand, per GEMM: on a GPU, for 32 or 64 small experts, the launches and not the arithmetic
set the time. The casts here give the same bits in a fixed number of kernels whatever the number of
experts:

- **per tensor**: each expert's amax (:func:`expert_scales`: on a GPU one Triton pass over the rows,
  ``kernels.triton_grouped.amax_by_group``, elsewhere a segmented reduction; a maximum is exact in any
  order, and NaN is kept), its scale by the function a per-tensor cast uses
  (``lowprec.quant.scales.amax_scale``; on a GPU the cast kernels' own helper in one pass,
  ``kernels.triton_grouped.amax_scales``; under delayed scaling each expert's scale is its history's, as
  the last fold left it, or before its first record its amax's, the same function of either, and its amax is
  recorded into its history, where it has tokens: ``lowprec.nn.delayed_bank.BankRows``, one gather and one
  write for all experts), and every row divided by its expert's scale in one pass: on a GPU
  the row-wise cast's Triton kernel given each row's expert amax instead of its own
  (``kernels.triton_quant.rows_by_amax``), elsewhere ``quantize`` given each row's expert scale
  (``kernels.route.grouped_rows_backend`` chooses). An operand's transposed side is the same codes
  transposed where its format is the same (the scale does not depend on the layout);
- **per row**: the rows of the input and of the output gradient are independent of the experts, so one
  row-wise cast of all of them (``kernels.quantize``) is every expert's; the weights' rows likewise, and
  ``weight[e].T``'s from one transposed copy of the weights; the tokens' transposed sides take the amax of
  each (expert, feature) pair (:func:`expert_scales` again) and one pass dividing by those scales (on a
  GPU ``kernels.triton_grouped.columns_by_group``, elsewhere ``quantize`` given a scale per element);
- **blocks** (MX; ``fp8-blockwise``'s FP32 scales per 1 x 128 block of the tokens, per 128 x 128 block of
  the weights): blocks run along K within a row, so one cast of all token rows is every expert's; the
  weights' blocks are every expert's from one cast of their rows stacked (of one transposed copy for
  ``weight[e].T``) where the block's height divides the expert's rows, so that no block spans two experts,
  and expert by expert otherwise; the tokens' transposed side (along the tokens) puts each expert's tokens
  at the start of a whole block, padded with zeros as the expert's own cast pads them, so that one cast of
  that layout never puts two experts in a block.

- **NVFP4** (16-element E4M3 block scales under an FP32 global scale from the whole tensor's amax): as blocks
  above, each expert's global scale from its own operand's finite amax (the maximum of its blocks', by a
  segmented reduction), handed to one cast of all experts' rows as one global amax per row or block column:
  on a GPU one Triton pass (``kernels.triton_quant.nvfp4_by_lines``, the NVFP4 cast kernel reading a global
  amax per block row; it checks itself against the reference on its first use on a device, and where it fails
  the casts stay on the reference, said once), elsewhere ``lowprec.quant.quantize``'s ``global_amax``
  (:func:`nvfp4_lines_backend` chooses); the amaxes and a side's Hadamard transform are the
  reference's tensor operations on every device; a rotated side (the weight gradient's, random Hadamard transform in
  blocks of 16 along the tokens) is transformed in the padded layout, where no block holds two experts; the
  uniform numbers of stochastic rounding are drawn from the global generator expert by expert, each expert's
  along-K side then its transposed side, with the shapes its own cast draws, so the bits are the loop's where a
  Linear's cast draws from that generator too (the reference's casts: the CPU; on a GPU a Linear's Triton cast
  draws from Philox, and the two round with different numbers of one distribution).

So the codes and scales equal a loop of per-expert casts bit for bit (``tests/nn/test_grouped_casts.py``:
every side of both kinds, zero-token experts, non-finite values). :meth:`ExpertCast.expert` hands each
expert's operand to the layer plan's GEMM path, so on the CPU each expert's GEMM equals the loop's bit for
bit; on a GPU the grouped GEMMs of ``lowprec.kernels.grouped_gemm`` read the same codes and scales.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass, field

import torch
import torch.nn.functional as nnf

from lowprec import formats as F
from lowprec.kernels import grouped_gemm as GG
from lowprec.kernels import quantize as routed_quantize
from lowprec.kernels.route import Backend, CastSpec, backend_for, grouped_rows_backend
from lowprec.nn.delayed_bank import BankRows
from lowprec.nn.plan import LayerPlan, OperandPlan
from lowprec.quant import Granularity, QuantizedTensor, blockwise, hadamard_padded, quantize, rowwise, tensorwise
from lowprec.quant.granularity import GranularityKind, ScaleRule
from lowprec.quant.hadamard import RHT_BLOCK
from lowprec.quant.quantize import block_amax, pad_to_blocks
from lowprec.quant.scales import amax_scale
from lowprec.recipes import Scaling

TENSOR, ROW, MX, BLOCK = GranularityKind.TENSOR, GranularityKind.ROW, GranularityKind.MX, GranularityKind.BLOCK
NVFP4 = GranularityKind.NVFP4
BLOCKS = frozenset({MX, BLOCK, NVFP4})
"""The kinds whose scales change along K in blocks."""


def _batchable(g, tokens: bool) -> bool:
    """Per tensor or per row scaled by the current amax, MX blocks of one row along K, or FP32 block scales
    from the current amax (a token side's blocks one row high: rows of tokens are independent of the
    experts)."""
    if g.kind in (TENSOR, ROW):
        return g.rule is ScaleRule.AMAX
    if g.kind is BLOCK:
        return g.rule is ScaleRule.AMAX and (g.block_rows == 1 or not tokens)
    if g.kind is NVFP4:
        return g.block_rows == 1 or not tokens
    return g.kind is MX and g.block_rows == 1


def batched_kind(plan: LayerPlan) -> GranularityKind | None:
    """``TENSOR``, ``ROW``, ``MX``, ``BLOCK`` or ``NVFP4`` where every cast of ``plan`` is one this module
    makes (quantized, all per tensor scaled by the current amax or by delay, all per row scaled by its current
    amax, all MX, or all FP32 blocks, rounded to nearest, no Hadamard rotation; or all NVFP4, whose casts may
    round stochastically and rotate); None otherwise."""
    kinds = set()
    for op in (plan.input, plan.weight, plan.grad_output):
        if op is None:
            return None
        if op.delayed and any(c.scaling is not Scaling.DELAYED for c in (op.cast_k, op.cast_t)):
            return None  # one side delayed, the other current: the loop
        for c in (op.cast_k, op.cast_t):
            g = c.granularity
            if c.fmt is None or g is None or not _batchable(g, op is not plan.weight):
                return None
            if g.kind is not NVFP4 and (c.hadamard or F.as_rounding(c.rounding) is not F.Rounding.NEAREST):
                return None
            kinds.add(g.kind)
    return kinds.pop() if len(kinds) == 1 else None


def token_blocks(plan: LayerPlan) -> tuple[int, ...]:
    """The block widths along the tokens of ``plan``'s MX or FP32-block token sides (the input's and the
    output gradient's casts for the weight gradient), each a padding of the tokens :meth:`Groups.padded`
    makes; () for other plans."""
    if batched_kind(plan) not in BLOCKS:
        return ()
    return tuple(sorted({op.cast_t.granularity.block_cols for op in (plan.input, plan.grad_output)}))


def batches(plan: LayerPlan) -> bool:
    """Whether :func:`batched_kind` covers ``plan``."""
    return batched_kind(plan) is not None


def _aligned(scales: torch.Tensor) -> torch.Tensor:
    """``(n, 4)`` float32, column 0 the scales: each at a 16-byte boundary, as cuBLAS reads a scale (a view
    of ``scales[e]`` alone sits 4 bytes after ``scales[e - 1]`` and is refused)."""
    out = scales.new_zeros(scales.shape[0], 4)
    out[:, 0] = scales
    return out


class Side(enum.Enum):
    """How an :class:`ExpertCast`'s scales lie (see its ``scales``)."""

    TENSOR = "tensor"
    """One per expert."""
    ROW = "row"
    """One per row of the codes."""
    COLUMN = "column"
    """One per expert and feature: a token side cast along the tokens."""
    BLOCKS = "blocks"
    """Blocks along K (MX, or FP32 scales per 1 x 128 and 128 x 128 blocks): token rows or weights."""
    BLOCK_TOKENS = "block-tokens"
    """Blocks along the tokens, each expert's from a whole block on."""


ROW_SCALED = frozenset({Side.TENSOR, Side.ROW, Side.COLUMN})
"""The sides a row-scaled FP8 GEMM takes."""


@dataclass(frozen=True, slots=True)
class ExpertCast:
    """One side of an operand's casts for every expert.

    ``data``: codes of the token rows ``(T, K)``, or of the weights ``(E, R, K)``. ``scales``: per
    ``kind``: ``TENSOR`` ``(E,)`` one per expert; ``ROW`` one per row of ``data`` (``(T,)`` or
    ``(E * R,)``); ``COLUMN`` ``(E, K)`` one per expert and feature (a token side cast along the tokens,
    whose ``data`` is ``(K, P)``: features-major, expert ``e``'s tokens from column ``starts[e]`` on).
    ``flip``: the expert's operand is its codes transposed (a per-tensor side whose transposed codes are
    the same bits)."""

    data: torch.Tensor
    scales: torch.Tensor
    fmt: F.Format
    dtype: torch.dtype
    """The dtype of the tensor cast (what ``dequantize`` gives back)."""
    kind: Side
    flip: bool = False
    granularity: Granularity | None = None
    """Block sides: the blocks' granularity."""
    starts: tuple[int, ...] = ()
    """``BLOCK_TOKENS``, ``COLUMN``: where each expert's tokens begin in ``data``'s columns (at a whole
    block, at a multiple of 16)."""
    width: int = 0
    """``BLOCKS``: K before padding to whole blocks."""
    height: int = 0
    """``BLOCKS`` weights: each expert's rows before padding to whole blocks (0: token rows)."""
    globals: torch.Tensor | None = None
    """NVFP4: each expert's global decode scale, ``(E,)`` (its own tensor's, as its own cast makes it)."""
    rotated: bool = False
    """A side cast after the random Hadamard transform: each expert's operand keeps K padded to whole blocks,
    as the transform pads it (``lowprec.quant.hadamard_padded``)."""
    aligned: torch.Tensor | None = field(default=None, init=False, repr=False)
    """``TENSOR``: the scales as cuBLAS reads one expert's (:func:`_aligned`), made when an expert's operand
    is first asked for (the grouped GEMMs read ``scales`` as they are)."""

    def expert(self, e: int, rows: slice | None = None) -> QuantizedTensor:
        """Expert ``e``'s operand, as its own cast would make it: its token rows ``rows``, or its weight."""
        if self.kind in (Side.BLOCKS, Side.BLOCK_TOKENS):
            return self._block_expert(e, rows)
        if self.kind is Side.COLUMN:  # features-major: the expert's columns, one scale per feature
            first = self.starts[e]
            codes = self.data[:, first:first + rows.stop - rows.start].contiguous()
            return QuantizedTensor(codes, self.scales[e].unsqueeze(1).clone(), self.fmt, rowwise(), codes.shape,
                                   self.dtype)
        codes = self.data[rows] if rows is not None else self.data[e]
        if self.kind is Side.TENSOR:
            if self.aligned is None:
                object.__setattr__(self, "aligned", _aligned(self.scales))
            scale, g = self.aligned[e, :1].view(1, 1), tensorwise()
        elif self.kind is Side.ROW:
            n = codes.shape[0]
            first = rows.start if rows is not None else e * n
            scale, g = self.scales[first:first + n].unsqueeze(1).clone(), rowwise()  # its own, aligned
        if self.flip:
            codes = codes.t().contiguous()
        return QuantizedTensor(codes, scale, self.fmt, g, codes.shape, self.dtype)

    def _block_expert(self, e: int, rows: slice | None) -> QuantizedTensor:
        bc = self.granularity.block_cols
        if self.kind is Side.BLOCK_TOKENS:  # (K, tokens): the expert's columns, from a whole block on
            n = rows.stop - rows.start
            first, width = self.starts[e], -(-n // bc) * bc
            # contiguous: the fold and dequantize kernels read rows of K with no gap
            codes = self.data[:, first:first + width].contiguous()
            scale = self.scales[:, first // bc:(first + width) // bc].contiguous()
            shape = torch.Size((self.data.shape[0], width if self.rotated else n))
        else:  # token rows along K, or a weight
            codes = self.data[rows] if rows is not None else self.data[e]
            scale = self.scales[rows] if rows is not None else self.scales[e]
            k = -(-self.width // bc) * bc if self.rotated else self.width
            shape = torch.Size((self.height if rows is None else codes.shape[0], k))
        g = self.globals[e] if self.globals is not None else None
        return QuantizedTensor(codes, scale, self.fmt, self.granularity, shape, self.dtype, g)

    def blocks_all(self) -> QuantizedTensor:
        """A block side along K as one operand: every token row, or every expert's weight rows stacked."""
        codes, scale = self.data.reshape(-1, self.data.shape[-1]), self.scales.reshape(-1, self.scales.shape[-1])
        return QuantizedTensor(codes, scale, self.fmt, self.granularity, torch.Size((codes.shape[0], self.width)),
                               self.dtype)

    def block_tokens_all(self) -> QuantizedTensor:
        """A ``BLOCK_TOKENS`` side as one operand: ``(K, P)``, every expert's tokens in their padded columns."""
        return QuantizedTensor(self.data, self.scales, self.fmt, self.granularity, self.data.shape, self.dtype)

    def token_scales(self, expert: torch.Tensor) -> torch.Tensor:
        """``(T,)``: each token row's scale (a side cast along K)."""
        return self.scales[expert] if self.kind is Side.TENSOR else self.scales

    def weight_codes(self) -> torch.Tensor:
        """``(E, R, K)``: every expert's operand codes, as a grouped GEMM's second operand reads them."""
        return GG.transposed(self.data) if self.flip else self.data

    def weight_scales(self) -> torch.Tensor:
        """``(E, R)``: the scale of each row of every expert's :meth:`weight_codes`."""
        e, r = self.data.shape[0], self.data.shape[2 if self.flip else 1]
        return self.scales[:, None].expand(e, r) if self.kind is Side.TENSOR else self.scales.view(e, r)

    def feature_scales(self, n_experts: int) -> torch.Tensor:
        """``(E * K,)``: the scale of each feature of each expert (a token side cast along the tokens)."""
        if self.kind is Side.TENSOR:
            return self.scales[:, None].expand(n_experts, self.data.shape[1]).reshape(-1)
        return self.scales.reshape(-1)


@dataclass(frozen=True, slots=True, eq=False)
class Groups:
    """Token rows grouped by expert, on the rows' device and, where they were read, on the host (made once
    per forward from the offsets the layer is given, so that nothing waits for the device again). Equal only
    to itself: the layers that read the same rows share their casts for the same groups object."""

    counts: tuple[int, ...] | None
    """Each expert's rows (host); None where they were not read (:meth:`on_device`)."""
    lengths: torch.Tensor
    """``(E,)`` int64: the same on the device."""
    offsets: torch.Tensor
    """``(E,)`` int32: cumulative, as the grouped GEMMs take them."""
    expert: torch.Tensor
    """``(T,)`` int64: each row's expert."""
    _padded: dict = field(default_factory=dict, init=False, repr=False, compare=False)

    @property
    def n_experts(self) -> int:
        return self.lengths.shape[0]

    def padded(self, multiple: int = 16) -> GG.Padding:
        """The tokens padded per expert to multiples of ``multiple`` (16: the grouped GEMM's K groups; an MX
        block: no block holds two experts) (``kernels.grouped_gemm.token_padding``; to the bound of any
        routing where the counts were not read), worked out once for the layers and casts that share these
        groups."""
        if multiple not in self._padded:
            self._padded[multiple] = GG.token_padding(self.counts, self.lengths, multiple, rows=self.expert.shape[0])
        return self._padded[multiple]

    @staticmethod
    def of(counts: tuple[int, ...] | None, offsets: torch.Tensor, rows: int | None = None) -> Groups:
        """Groups of ``offsets`` (cumulative, on the device) whose ``counts`` the host read, or (``counts``
        None) of ``rows`` rows whose counts stay on the device."""
        ends = offsets.to(torch.int64)
        lengths = torch.diff(ends, prepend=ends.new_zeros(1))
        rows = sum(counts) if counts is not None else rows
        expert = torch.repeat_interleave(torch.arange(lengths.shape[0], device=offsets.device), lengths,
                                         output_size=rows)
        return Groups(counts, lengths, offsets.to(torch.int32), expert)


def groups(counts: tuple[int, ...], device: torch.device | str = "cpu") -> Groups:
    """:class:`Groups` of ``counts`` on ``device`` (for callers without the offsets on the device)."""
    return Groups.of(tuple(counts), torch.tensor(counts, device=device, dtype=torch.int64).cumsum(0))


def _amax_by(values: torch.Tensor, g: Groups) -> torch.Tensor:
    """The maximum of ``values`` (``(T,)`` or ``(T, K)``, non-negative, rows grouped as ``g``) over each
    expert's rows: ``(E,)`` or ``(E, K)``, 0 for an expert without rows, NaN where one of its values is
    NaN (whatever the device's maximum does with NaN). A segmented reduction: a maximum is exact in any
    order, and no two experts write one place."""
    lengths = g.lengths
    amax = torch.segment_reduce(values, "max", lengths=lengths, axis=0, initial=0.0, unsafe=True)
    nan = torch.segment_reduce(values.isnan().float(), "max", lengths=lengths, axis=0, initial=0.0, unsafe=True)
    return torch.where(nan > 0, torch.nan, amax)


def _on_triton(fmt: F.Format, device: torch.device) -> bool:
    """Whether the route runs ``fmt``'s row-wise cast on Triton on ``device`` (the batched casts' kernels)."""
    return grouped_rows_backend(CastSpec.of(fmt, rowwise(), F.Rounding.NEAREST), device) is Backend.TRITON


def _scales(amax: torch.Tensor, fmt: F.Format) -> tuple[torch.Tensor, torch.Tensor]:
    """``(amax, its scales)``: every NaN of ``amax`` made torch.nan, and ``amax_scale(amax, fmt)``; on Triton
    one pass (``triton_grouped.amax_scales``), the same bits."""
    if amax.numel() and _on_triton(fmt, amax.device):
        from lowprec.kernels import triton_grouped  # Triton: imported where it runs

        return triton_grouped.amax_scales(amax, fmt)
    return torch.where(amax.isnan(), torch.nan, amax), amax_scale(amax, fmt)


def expert_scales(x2: torch.Tensor, g: Groups, fmt: F.Format, per_feature: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Each expert's amax of the token rows ``x2`` (T, K), per feature ``(E, K)`` or of the whole expert
    ``(E,)`` (0 for an expert without rows, NaN where one of its values is NaN), and the scales ``fmt``'s cast
    takes from them. Where the route runs ``fmt``'s row-wise cast on Triton, one pass over ``x2``
    (``triton_grouped.amax_by_group``) and one over the amaxes; elsewhere a segmented reduction. Both are
    exact, so they agree bit for bit."""
    if x2.numel() and _on_triton(fmt, x2.device):
        from lowprec.kernels import triton_grouped  # Triton: imported where it runs

        amax = triton_grouped.amax_by_group(x2.detach(), g.expert, g.n_experts)  # (E, K)
        return _scales(amax if per_feature else amax.amax(dim=1), fmt)
    values = x2.detach().abs().float()
    amax = _amax_by(values if per_feature else values.amax(dim=1), g)
    return amax, amax_scale(amax, fmt)


def _per_tensor(x2: torch.Tensor, amax: torch.Tensor, scales: torch.Tensor | None, per_row, fmt: F.Format,
                flip: bool) -> ExpertCast:
    """``x2``'s rows, each divided by its expert's scale (``per_row`` spreads an ``(E,)`` vector over the
    rows; ``scales``: ``fmt``'s scales of ``amax``, or None to work them out); see [Note: batched per-expert
    casts]."""
    if scales is None:
        scales = _scales(amax, fmt)[1]  # (E,) as a per-tensor cast computes it from its amax
    spec = CastSpec.of(fmt, rowwise(), F.Rounding.NEAREST)
    if x2.numel() and grouped_rows_backend(spec, x2.device) is Backend.TRITON:
        from lowprec.kernels import triton_quant  # Triton: imported where it runs

        data = triton_quant.rows_by_amax(x2, spec, per_row(amax))
    else:  # the division and rounding of a per-tensor cast, given each row's scale
        data = quantize(x2, fmt, rowwise(), scale=per_row(scales).unsqueeze(1)).data
    return ExpertCast(data, scales, fmt, x2.dtype, Side.TENSOR, flip)


def _rows(x2: torch.Tensor, fmt: F.Format) -> ExpertCast:
    q = routed_quantize(x2, fmt, rowwise())  # rows are independent of the experts
    return ExpertCast(q.data, q.scale.reshape(-1), fmt, x2.dtype, Side.ROW)


def _columns(x2: torch.Tensor, g: Groups, fmt: F.Format) -> ExpertCast:
    """The token rows' transposed side per expert: each (expert, feature) scaled by its amax over the
    expert's tokens; codes laid out features-major, each expert's tokens from a 16-aligned column on, zero
    codes between (``kernels.grouped_gemm.features_padded``: the weight gradient's grouped GEMM reads
    them as they are)."""
    amax, scales = expert_scales(x2, g, fmt, True)  # (E, K)
    padding = g.padded()
    spec = CastSpec.of(fmt, rowwise(), F.Rounding.NEAREST)
    if x2.numel() and grouped_rows_backend(spec, x2.device) is Backend.TRITON:
        from lowprec.kernels import triton_grouped  # Triton: imported where it runs

        data = triton_grouped.columns_by_group(x2.detach(), g.expert, amax, fmt, padding.sources, padding.total)
    else:
        codes = quantize(x2, fmt, blockwise(1, 1), scale=scales[g.expert]).data  # each element by its scale
        data = GG.features_padded(codes, padding)
    starts = GG.padded_starts(g.counts) if g.counts is not None else ()  # the per-expert loop's
    return ExpertCast(data, scales, fmt, x2.dtype, Side.COLUMN, starts=starts)


def _blocks(x2: torch.Tensor, fmt: F.Format, gran: Granularity) -> ExpertCast:
    """Rows cast along K in blocks one row high (MX, FP32 1 x 128; rows are independent of the experts)."""
    q = routed_quantize(x2, fmt, gran)
    return ExpertCast(q.data, q.scale, fmt, x2.dtype, Side.BLOCKS, granularity=gran, width=x2.shape[-1])


def _block_tokens(x2: torch.Tensor, g: Groups, fmt: F.Format, gran: Granularity) -> ExpertCast:
    """The token rows' transposed side in blocks along the tokens (MX, FP32 1 x 128): each expert's tokens
    start a block (its rows padded with zeros to whole blocks, as its own cast pads them), so no block holds
    two experts (nor the zero blocks after the last expert's, where the counts stay on the device)."""
    bc = gran.block_cols
    xp = GG.features_padded(x2.detach(), g.padded(bc))  # each expert's tokens from a whole block on
    q = routed_quantize(xp, fmt, gran)  # (K, P): blocks along the padded tokens
    starts = GG.padded_starts(g.counts, bc) if g.counts is not None else ()  # per expert: read counts only
    return ExpertCast(q.data, q.scale, fmt, x2.dtype, Side.BLOCK_TOKENS, granularity=gran, starts=starts)


def _weight_blocks(w: torch.Tensor, fmt: F.Format, gran: Granularity) -> ExpertCast:
    """Experts' weights ``(E, R, K)`` cast along K in blocks (MX; FP32 blocks of 1 or 128 rows), each expert's
    blocks its own: one cast of the rows stacked where the block height divides R (no block then spans two
    experts), else expert by expert."""
    e, r, k = w.shape
    if r % (gran.block_rows or 1) == 0:
        q = routed_quantize(w.reshape(e * r, k), fmt, gran)
        data, scales = q.data.view(e, r, -1), q.scale.view(e, -1, q.scale.shape[-1])
    else:  # each expert's last block of rows is padded, as its own cast pads it
        qs = [routed_quantize(w[i], fmt, gran) for i in range(e)]
        data, scales = torch.stack([q.data for q in qs]), torch.stack([q.scale for q in qs])
    return ExpertCast(data, scales, fmt, w.dtype, Side.BLOCKS, granularity=gran, width=k, height=r)


def _seed(op: OperandPlan, k_side: bool) -> int | None:
    """The seed of the random Hadamard transform the plan gives the side (None: no transform)."""
    if not (op.cast_k if k_side else op.cast_t).hadamard:
        return None
    for r in (op.both, op.along_k if k_side else op.transposed):
        spec = None if r is None else (r.along_k if k_side else r.transposed)
        if spec is not None:
            return spec.hadamard_seed
    return None


def _rotated(x: torch.Tensor, seed: int | None) -> torch.Tensor:
    """``x`` after the side's random Hadamard transform along its last dimension, padded to whole blocks as
    a Linear's cast pads it (``kernels.cast``), or ``x`` without one."""
    return hadamard_padded(x, RHT_BLOCK, seed) if seed is not None else x


def _finite_block_amax(x2: torch.Tensor, gran: Granularity) -> torch.Tensor:
    """Each block's largest finite magnitude (0 for a block without one), the block grid of ``x2``."""
    br, bc = gran.blocks(*x2.shape)
    a = block_amax(pad_to_blocks(x2.detach().float(), br, bc), br, bc)
    return torch.where(torch.isfinite(a), a, 0.0)


def _segment_max(values: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """The maximum of each run of ``lengths`` consecutive ``values`` (non-negative; 0 for an empty run)."""
    return torch.segment_reduce(values, "max", lengths=lengths, axis=0, initial=0.0, unsafe=True)


def nvfp4_lines_backend(spec: CastSpec, device: torch.device) -> Backend:
    """Whether the experts' NVFP4 casts (every expert's rows under its own global scale, in one cast) run on
    Triton (``kernels.triton_quant.nvfp4_by_lines``: where the kernels cover ``spec``, the side's NVFP4 cast
    without its Hadamard transform, and the kernel passed its first-use check on the device) or on the
    reference's operations given a global amax per block row."""
    if backend_for(spec, device) is not Backend.TRITON:
        return Backend.TORCH
    from lowprec.kernels import triton_quant  # Triton: imported where it runs

    return Backend.TRITON if triton_quant.nvfp4_lines_checked(device) else Backend.TORCH


def _nvfp4_cast(x2: torch.Tensor, fmt: F.Format, gran: Granularity, line_amax: torch.Tensor,
                rand: torch.Tensor | None, transposed: bool = False) -> QuantizedTensor:
    """``x2`` along K, or ``x2.T`` along its rows where ``transposed``, cast in NVFP4 blocks, each block row of
    ``x2`` under the global scale of its own finite amax ``line_amax`` (one per block row of ``x2``: its
    expert's), rounded stochastically with ``rand`` where given: one Triton pass where the route says so
    (:func:`nvfp4_lines_backend`), else the reference given those global amaxes; the same bits."""
    rounding = F.Rounding.STOCHASTIC if rand is not None else F.Rounding.NEAREST
    spec = CastSpec.of(fmt, gran, rounding)
    if x2.numel() and nvfp4_lines_backend(spec, x2.device) is Backend.TRITON:
        from lowprec.kernels import triton_quant  # Triton: imported where it runs

        return triton_quant.nvfp4_by_lines(x2, spec, line_amax, transposed=transposed, rand=rand)
    if transposed:
        return quantize(x2.t(), fmt, gran, rounding=rounding, rand=rand, global_amax=line_amax.unsqueeze(0))
    return quantize(x2, fmt, gran, rounding=rounding, rand=rand, global_amax=line_amax.unsqueeze(1))


def _nvfp4_rows(x2: torch.Tensor, g: Groups, fmt: F.Format, gran: Granularity, seed: int | None,
                rand: torch.Tensor | None) -> ExpertCast:
    """Token rows cast along K in NVFP4 blocks one row high, each expert's global scale from its own rows'
    amax, as its own cast takes it: one cast of all rows (``quantize``'s ``global_amax``, one per row)."""
    x = _rotated(x2.detach(), seed)
    per_row = _finite_block_amax(x, gran).amax(dim=1) if x.shape[1] else x.new_zeros(x.shape[0], dtype=torch.float32)
    amax = _segment_max(per_row, g.lengths)  # (E,)
    q = _nvfp4_cast(x, fmt, gran, amax[g.expert], rand)
    return ExpertCast(q.data, q.scale, fmt, x2.dtype, Side.BLOCKS, granularity=gran, width=x2.shape[-1],
                      globals=_globals(q.global_scale, g.expert, g.n_experts), rotated=seed is not None)


def _globals(scales: torch.Tensor, owner: torch.Tensor, n_experts: int) -> torch.Tensor:
    """``(E,)``: each expert's global decode scale from a quantization's ``global_scale``, one per block row or
    block column, ``owner`` naming each one's expert (an expert without any: 1, the scale of an all-zero
    tensor)."""
    flat = scales.reshape(-1) if scales.dim() else scales.reshape(1)
    out = torch.ones(n_experts, dtype=flat.dtype, device=flat.device)
    return out.scatter(0, owner, flat) if flat.numel() == owner.numel() else out


def _nvfp4_block_tokens(x2: torch.Tensor, g: Groups, fmt: F.Format, gran: Granularity, seed: int | None,
                        rand: torch.Tensor | None) -> ExpertCast:
    """The token rows' transposed side in NVFP4 blocks along the tokens: each expert's tokens from a whole
    block on (zeros after them), rotated block by block (no block holds two experts), each expert's global
    scale from its own columns' amax."""
    bc = gran.block_cols
    padding = g.padded(bc)
    x = _rotated(GG.features_padded(x2.detach(), padding), seed)  # (K, P): P whole blocks, each one expert's
    lengths = padding.ends.diff(prepend=padding.ends.new_zeros(1)).to(torch.int64) // bc  # blocks per expert
    per_block = _finite_block_amax(x, gran).amax(dim=0) if x.shape[0] else x.new_zeros(x.shape[1] // bc)
    amax = _segment_max(per_block, lengths)  # (E,)
    owner = torch.repeat_interleave(torch.arange(g.n_experts, device=x.device), lengths,
                                    output_size=x.shape[1] // bc)
    q = _nvfp4_cast(x.t(), fmt, gran, amax[owner], rand, transposed=True)  # (K, P) along P: x.t()'s side B
    starts = GG.padded_starts(g.counts, bc)
    return ExpertCast(q.data, q.scale, fmt, x2.dtype, Side.BLOCK_TOKENS, granularity=gran, starts=starts,
                      globals=_globals(q.global_scale, owner, g.n_experts), rotated=seed is not None)


def _nvfp4_weights(w: torch.Tensor, fmt: F.Format, gran: Granularity, seed: int | None) -> ExpertCast:
    """Experts' weights ``(E, R, K)`` in NVFP4 blocks, each expert's global scale its own: one cast of the rows
    stacked where the block height divides R, else expert by expert."""
    e, r, k = w.shape
    w = _rotated(w.detach(), seed)
    rows = gran.block_rows or 1
    if r % rows == 0 and e:
        flat = w.reshape(e * r, w.shape[-1])
        per_row = _finite_block_amax(flat, gran).amax(dim=1)  # (E * R / rows,)
        amax = per_row.view(e, -1).amax(dim=1)  # (E,)
        owner = torch.arange(e, device=w.device).repeat_interleave(r // rows)
        q = _nvfp4_cast(flat, fmt, gran, amax[owner], None)
        data, scales = q.data.view(e, r, -1), q.scale.view(e, -1, q.scale.shape[-1])
        globals_ = _globals(q.global_scale, owner, e)
    else:  # each expert's last block of rows is padded, as its own cast pads it
        qs = [quantize(w[i], fmt, gran) for i in range(e)]
        data, scales = torch.stack([q.data for q in qs]), torch.stack([q.scale for q in qs])
        globals_ = torch.stack([q.global_scale.reshape(()) for q in qs])
    return ExpertCast(data, scales, fmt, w.dtype, Side.BLOCKS, granularity=gran, width=k, height=r,
                      globals=globals_, rotated=seed is not None)


def _nvfp4_draws(x2: torch.Tensor, g: Groups, op: OperandPlan, fk, ft) -> tuple:
    """The uniform numbers a loop of each expert's own casts would draw for stochastic rounding, in its order
    (expert by expert; each expert's cast along K, then its transposed cast), from the global generator, laid
    out as the batched casts read them: ``(rows along K, the tokens' padded columns)``, None where a side
    rounds to nearest or is not made."""
    sk, st = fk is not None and op.cast_k.stochastic, ft is not None and op.cast_t.stochastic
    if not (sk or st):
        return None, None
    k, dev = x2.shape[1], x2.device
    kk = k + (-k) % RHT_BLOCK if _seed(op, True) is not None else k
    bc = op.cast_t.granularity.block_cols
    rotated_t = _seed(op, False) is not None
    ks, ts = [], []
    for n in g.counts:
        if n == 0:
            continue
        if sk:
            ks.append(torch.rand((n, kk), device=dev))
        if st:
            width = -(-n // bc) * bc
            t = torch.rand((k, width if rotated_t else n), device=dev)
            ts.append(t if rotated_t else nnf.pad(t, (0, width - n)))
    rk = torch.cat(ks) if sk and ks else (x2.new_zeros((0, kk), dtype=torch.float32) if sk else None)
    rt = torch.cat(ts, dim=1) if st and ts else (x2.new_zeros((k, 0), dtype=torch.float32) if st else None)
    return rk, rt


def _formats(op: OperandPlan, need_k: bool, need_t: bool) -> tuple[F.Format | None, F.Format | None]:
    return (op.cast_k.fmt if need_k else None), (op.cast_t.fmt if need_t else None)


def _delayed_amax(amax: torch.Tensor, op: OperandPlan, delay: BankRows | None, record: bool) -> torch.Tensor:
    """``amax``, each expert's current amax of ``op``'s tensor, or where ``op`` scales by delay the amax each
    expert's delayed scale comes from (its history's, as the last fold left it; its current one before its
    first record), with the current amaxes recorded (``record``: training) for each expert with tokens; see
    [Note: batched per-expert casts]."""
    if not op.delayed:
        return amax
    if delay is None:
        raise ValueError(f"{op.role.name.lower()}: a delayed cast needs each expert's history (delay=BankRows)")
    if record:
        delay.record(op.role, amax)
    return delay.amax(op.role, amax)


def cast_rows(x2: torch.Tensor, g: Groups, op: OperandPlan, need_k: bool, need_t: bool,
              delay: BankRows | None = None, record: bool = False) -> tuple[ExpertCast | None, ExpertCast | None]:
    """Token rows ``x2`` (T, K) grouped by expert as ``g`` says, cast along K and for the transposed side
    (the weight gradient's, along the tokens), as ``op`` says; see [Note: batched per-expert casts].
    ``delay``: the experts' delayed-scaling rows, for a plan that scales by delay; ``record``: their amaxes
    recorded (training)."""
    fk, ft = _formats(op, need_k, need_t)
    if fk is None and ft is None:  # neither side needed (a backward for the bias alone)
        return None, None
    if op.cast_k.granularity.kind is ROW:
        return (_rows(x2, fk) if fk is not None else None,
                _columns(x2, g, ft) if ft is not None else None)
    if op.cast_k.granularity.kind is NVFP4:
        rk, rt = _nvfp4_draws(x2, g, op, fk, ft)
        return (_nvfp4_rows(x2, g, fk, op.cast_k.granularity, _seed(op, True), rk) if fk is not None else None,
                _nvfp4_block_tokens(x2, g, ft, op.cast_t.granularity, _seed(op, False), rt) if ft is not None
                else None)
    if op.cast_k.granularity.kind in BLOCKS:
        return (_blocks(x2, fk, op.cast_k.granularity) if fk is not None else None,
                _block_tokens(x2, g, ft, op.cast_t.granularity) if ft is not None else None)
    expert = g.expert
    first = fk if fk is not None else ft
    amax, scales = expert_scales(x2, g, first, False)  # (E,)
    if op.delayed:
        amax, scales = _delayed_amax(amax, op, delay, record), None
    k = _per_tensor(x2, amax, scales, lambda v: v[expert], fk, False) if fk is not None else None
    if ft is None:
        return k, None
    if ft == fk:  # the same codes, transposed per expert
        return k, ExpertCast(k.data, k.scales, k.fmt, k.dtype, Side.TENSOR, True)
    return k, _per_tensor(x2, amax, scales if ft == first else None, lambda v: v[expert], ft, True)


def cast_weights(weight: torch.Tensor, op: OperandPlan, need_k: bool, need_t: bool, delay: BankRows | None = None,
                 record: bool = False) -> tuple[ExpertCast | None, ExpertCast | None]:
    """Experts' weights ``(E, out, in)`` cast along K (``weight[e]``) and transposed (``weight[e].T``, for
    the input gradient), each expert with its own scales (``delay``, ``record``: as :func:`cast_rows`)."""
    e, out, k = weight.shape
    fk, ft = _formats(op, need_k, need_t)
    w = weight.detach()
    if op.cast_k.granularity.kind is NVFP4:  # weight[e].T's rows are weight[e]'s columns: one transposed copy
        return (_nvfp4_weights(w, fk, op.cast_k.granularity, _seed(op, True)) if fk is not None else None,
                _nvfp4_weights(w.transpose(1, 2), ft, op.cast_t.granularity, _seed(op, False)) if ft is not None
                else None)
    if op.cast_k.granularity.kind in BLOCKS:  # weight[e].T's rows are weight[e]'s columns: one transposed copy
        return (_weight_blocks(w, fk, op.cast_k.granularity) if fk is not None else None,
                _weight_blocks(w.transpose(1, 2), ft, op.cast_t.granularity) if ft is not None else None)
    if op.cast_k.granularity.kind is ROW:
        kc = tc = None
        if fk is not None:
            kc = _rows(w.reshape(e * out, k), fk)
            kc = ExpertCast(kc.data.view(e, out, k), kc.scales, fk, weight.dtype, Side.ROW)
        if ft is not None:  # weight[e].T's rows are weight[e]'s columns: one transposed copy
            tc = _rows(w.transpose(1, 2).reshape(e * k, out), ft)
            tc = ExpertCast(tc.data.view(e, k, out), tc.scales, ft, weight.dtype, Side.ROW)
        return kc, tc
    amax = w.abs().amax(dim=(1, 2)).float()  # (E,): a maximum is exact in the weights' own dtype
    amax = _delayed_amax(amax, op, delay, record)
    flat = w.reshape(e * out, k)

    def spread(v):
        return v.repeat_interleave(out)

    out_casts = []
    for fmt, flip in ((fk, False), (ft, True)):
        if fmt is None:
            out_casts.append(None)
        elif flip and fmt == fk and out_casts[0] is not None:  # the same codes, transposed per expert
            c = out_casts[0]
            out_casts.append(ExpertCast(c.data, c.scales, c.fmt, c.dtype, Side.TENSOR, True))
        else:
            c = _per_tensor(flat, amax, None, spread, fmt, flip)
            out_casts.append(ExpertCast(c.data.view(e, out, k), c.scales, fmt, weight.dtype, Side.TENSOR, flip))
    return out_casts[0], out_casts[1]


__all__ = ["ROW_SCALED", "ExpertCast", "Groups", "Side", "batched_kind", "batches", "cast_rows", "cast_weights",
           "groups"]
