"""``lowprec.nn.GroupedLinear``: the experts of a mixture-of-experts layer, each a linear layer whose
GEMMs run as a recipe says.

[Note: grouped expert GEMMs]
Expert ``e`` holds ``weight[e]`` (out, in) and owns the rows ``offsets[e-1]:offsets[e]`` of the input
(the tokens routed to it, grouped by expert; ``offsets`` are cumulative counts, the convention of
``torch._grouped_mm`` and ``torch._scaled_grouped_mm``). Each expert computes exactly what a
``lowprec.nn.Linear`` with weight ``weight[e]`` and the same recipe computes on its rows, forward and
backward: every operand is cast along its own K with scales of its own (per tensor, per row, blocks, MX,
NVFP4 are all per expert), and each expert's weight gradient runs over its own tokens only. An expert
that received no token casts nothing (the casts take no empty tensor) and its gradient is zero.

How the experts run (the values above hold on every path):

* recipes whose casts are all per tensor, all per row, all MX or all FP32 blocks (``fp8-current``,
  ``fp8-delayed``, ``fp8-rowwise``, ``mxfp8``, ``mxfp4``, ``fp8-blockwise``): every operand's casts are made
  for all experts at once (see [Note: batched per-expert casts] in ``lowprec.nn.grouped_casts``; the same
  bits as expert by expert), and each GEMM whose operands are E4M3 runs as one ``torch._scaled_grouped_mm``
  on a GPU that checks it on first use (see [Note: one grouped GEMM for the experts] in
  ``lowprec.kernels.grouped_gemm``, with lowprec's grouped Triton GEMMs for the pairs that kernel refuses
  or runs slower, and for block scales: ``fp8-blockwise``'s 1 x 128 and 128 x 128 blocks); MX GEMMs so too
  where MX GEMMs run folded: forward and input gradient with every row folded at once (``kernels.fold``), the weight
  gradient with each feature's blocks folded per expert (``kernels.fold.fold_segments``: a scale per
  expert and feature, as the grouped kernel of the features kind takes); the other GEMMs, and all of them
  on the CPU, per expert on views of the batched codes (:class:`BatchedFunction`). A sampled telemetry
  step takes the loop below, which reports every expert's operands;
* NVFP4 (``nvfp4``): its casts batched too, each expert with its own global scale, its stochastic rounding
  drawing what the loop draws and its Hadamard transform block by block (see [Note: batched per-expert casts]),
  its emulated GEMMs as one grouped BF16 GEMM each on a GPU (see [Note: grouped emulated GEMMs] in
  ``lowprec.kernels.grouped_emulated``), per expert on views of the batched codes on the CPU;
* every other recipe (one delayed on some sides only): the loop over the experts in :class:`GroupedFunction`,
  which calls the same plan, casts and GEMMs as ``lowprec.nn.function`` (``fprop``, ``cast_operand``,
  ``gemm``) on each expert's rows;
* no recipe, or BF16 GEMMs: one ``linear`` per expert, or on a GPU one ``torch._grouped_mm``
  (:func:`_grouped_bf16`).

The host reads ``offsets`` once per forward (the loops and the grouped GEMMs' padding need the counts),
or once for several layers given the ``Groups`` :func:`route` made; under ``torch.compile`` such a layer
runs outside the graph. Layers that need no count run in it, on the offsets as the device holds them: BF16
experts on ``torch._grouped_mm``, and per-tensor (current or delayed), per-row, block-scaled and MX experts
where every GEMM runs grouped (:func:`_static_plan`; see [Note: experts under torch.compile] in ``lowprec.nn.routing``).

Under expert parallelism (``lowprec.distributed.expert_parallel``) ``weight`` (and ``bias``) are DTensors
split by experts (``Shard(0)``) over the expert-parallel group: this process computes with its local
experts only, ``offsets`` has one entry per local expert, and expert ``e`` of the local shard is expert
``first + e`` of the layer (its cast state and its telemetry name).

Under delayed scaling (``fp8-delayed``, or a delayed recipe through ``lowprec.autocast``) each expert keeps
amax histories of its own, as a Linear of its weight would: a row each of the delayed-scaling banks
(``lowprec.nn.delayed_bank``; the layer's own, folded by its forward, or its converted model's, folded by the
model's), saved in the layer's ``state_dict`` as one ``(E, rows, roles)`` tensor, reduced across
data-parallel ranks with the linears' (``lowprec.distributed.amax``). Their casts are batched as
``fp8-current``'s are, each expert's scale taken from its own history and its amaxes recorded into it in one
pass for all experts (``lowprec.nn.delayed_bank.BankRows``), and their GEMMs grouped, on the counts read or
as the device holds them; a sampled telemetry step runs each expert's rows through ``lowprec.nn.Linear``'s
autograd function with its state (the loop). Either way the experts equal a loop of delayed Linears bit for
bit, step after step; an expert without tokens records nothing. Expert parallelism refuses it (each rank
would hold other experts' histories). Current scaling per expert
(``fp8-current``, ``fp8-rowwise``, ``fp8-blockwise``, MX, NVFP4) needs no state; DeepSeek-V3's FP8 experts
scale so too.
"""
from __future__ import annotations

import itertools
import math
import warnings

import torch
import torch.nn as nn
import torch.nn.functional as nnf

from lowprec import recipes as R
from lowprec._checks import describe, fail
from lowprec.autocast import records_amax, resolve
from lowprec.kernels import grouped_emulated as GE
from lowprec.kernels import grouped_gemm as GG
from lowprec.kernels.fold import fold, fold_segments, target
from lowprec.kernels.gemm import GemmPath, folded_runs
from lowprec.nn import grouped_casts as GC
from lowprec.nn.casts import CastState, cast_operand, shared_casts
from lowprec.nn.delayed import DelayedState
from lowprec.nn.delayed_bank import BankRows, DelayedBanks
from lowprec.nn.function import (
    Forward,
    LinearFunction,
    Saved,
    fprop,
    gemm,
    output_dtype,
    pack_operand,
    unpack_operand,
    weight_t_again,
)
from lowprec.nn.linear import OptionalExtraState, drop_empty_extra_state
from lowprec.nn.plan import LayerPlan, SavePlan, WeightT, layer_plan, memo_serves
from lowprec.nn.probe import probe
from lowprec.nn.record import record_expert_amaxes
from lowprec.nn.routing import outside_graphs
from lowprec.ranks import is_dtensor

_SAVED = len(Saved().flat())
"""Tensors each expert with tokens gives ``save_for_backward``."""


def _no_delay(recipe: R.Recipe | None, where: str, weight: torch.Tensor) -> R.Recipe | None:
    """``recipe``, refused where it scales by delay and the experts are split over ranks (expert
    parallelism: each rank holds its experts' histories, which the data-parallel reduction of histories
    would mix)."""
    if recipe is not None and recipe.uses_delayed_scaling and is_dtensor(weight):
        fail(where, "a recipe with current scaling under expert parallelism (each rank would keep other "
                    "experts' amax histories; fp8-current scales each expert by its own amax)", recipe.name)
    return recipe


def _experts_forward(x, weight, bias, counts: tuple[int, ...], plan: LayerPlan, states: tuple[CastState, ...],
                     need_dgrad: bool, need_wgrad: bool, record: bool) -> list[Forward | None]:
    """Each expert's :func:`~lowprec.nn.function.fprop` on its rows, with its own cast state (None for an
    expert without tokens)."""
    out, start = [], 0
    for e, n in enumerate(counts):
        b = bias[e] if bias is not None else None
        out.append(fprop(x[start:start + n], weight[e], b, plan, states[e], need_dgrad, need_wgrad, record)
                   if n else None)
        start += n
    return out


def _expert_backward(dy, saved: Saved, save: SavePlan, metas: tuple, plan: LayerPlan, x_dtype: torch.dtype,
                     w_dtype: torch.dtype, need_dgrad: bool, need_wgrad: bool, state: CastState):
    """One expert's dgrad and wgrad, as ``LinearFunction.backward`` makes them (None where not needed),
    its casts reported to telemetry under the expert's ``state``."""
    x_meta, w_meta = metas
    qw_t = None
    if need_dgrad:
        qw_t = (weight_t_again(saved.weight.detach(), plan, saved.scale_t, dy) if save.weight_t is WeightT.PARAMETER
                else unpack_operand(saved.w_t, w_meta))
    if not (need_dgrad or need_wgrad):  # the bias alone
        return None, None
    qdy, qdy_t = cast_operand(dy, plan.grad_output, need_dgrad, need_wgrad, None, True)
    collector = probe()  # None but on a sampled step
    if collector is not None:
        collector.backward(state, plan, dy, qdy, qdy_t, saved.weight, qw_t if saved.weight is not None else None)
    dx = gemm(qdy, qw_t, plan.dgrad, x_dtype) if need_dgrad else None  # (n, in)
    dw = gemm(qdy_t, unpack_operand(saved.x_t, x_meta), plan.wgrad, w_dtype) if need_wgrad else None  # (out, in)
    return dx, dw


class GroupedFunction(torch.autograd.Function):
    """``y[rows of e] = x[rows of e] @ weight[e].T + bias[e]`` for every expert ``e``, each GEMM operand
    cast as ``plan`` (the plan of one expert's shape) says; see [Note: grouped expert GEMMs]."""

    @staticmethod
    def forward(ctx, x, weight, bias, counts: tuple[int, ...], plan: LayerPlan, states: tuple[CastState, ...]):
        need_dgrad, need_wgrad = ctx.needs_input_grad[:2]
        fwds = _experts_forward(x, weight, bias, counts, plan, states, need_dgrad, need_wgrad, True)
        tensors, metas = [], []
        for e, f in enumerate(fwds):
            if f is None:
                continue
            if f.save.input_recast or f.save.scale_t or f.save.direct:  # compiled recasts, delayed, FP8 weights
                fail("weight", "a plain weight under current scaling (GroupedLinear follows no other save plan)",
                     f.save, NotImplementedError)
            (x_saved, x_meta), (w_saved, w_meta) = pack_operand(f.x_t), pack_operand(f.w_t)
            w_param = weight[e] if need_dgrad and f.save.weight_t is WeightT.PARAMETER else None
            tensors += Saved(x_saved, w_saved, weight=w_param).flat()
            metas.append((x_meta, w_meta))
            ctx.save = f.save  # every expert's: one plan, one kind of weight
        ctx.save_for_backward(*tensors)
        ctx.counts, ctx.plan, ctx.metas = counts, plan, metas
        ctx.states = [states[e] for e, f in enumerate(fwds) if f is not None]  # each saved expert's
        ctx.dtypes = (x.dtype, weight.dtype, bias.dtype if bias is not None else None)
        ctx.w_shape = weight.shape[1:]
        return torch.cat([f.y for f in fwds if f is not None])  # (T, out)

    @staticmethod
    def backward(ctx, dy):
        need_dgrad, need_wgrad, need_bias = ctx.needs_input_grad[:3]
        x_dtype, w_dtype, b_dtype = ctx.dtypes
        tensors, plan = ctx.saved_tensors, ctx.plan
        dxs, dws, dbs, k = [], [], [], 0
        with torch.autocast(dy.device.type, enabled=False):
            for dy_e in dy.split(ctx.counts):  # (n, out) each
                if dy_e.shape[0] == 0:  # no tokens: nothing was cast, and nothing moves the weight
                    dws.append(torch.zeros(ctx.w_shape, dtype=w_dtype, device=dy.device))
                    dbs.append(torch.zeros(ctx.w_shape[0], dtype=b_dtype or w_dtype, device=dy.device))
                    continue
                saved = Saved.of(tensors[k * _SAVED:(k + 1) * _SAVED])
                dx, dw = _expert_backward(dy_e, saved, ctx.save, ctx.metas[k], plan, x_dtype, w_dtype,
                                          need_dgrad, need_wgrad, ctx.states[k])
                dxs.append(dx)
                dws.append(dw)
                dbs.append(dy_e.sum(0).to(b_dtype) if b_dtype is not None and need_bias else None)
                k += 1
        dx = torch.cat(dxs) if need_dgrad else None  # (T, in)
        dw = torch.stack(dws) if need_wgrad else None  # (E, out, in)
        db = torch.stack(dbs) if b_dtype is not None and need_bias else None  # (E, out)
        return dx, dw, db, None, None, None


def read_counts(offsets: torch.Tensor, x: torch.Tensor, n_experts: int | None = None,
                num_experts: int | None = None) -> tuple[int, ...]:
    """Each of the ``n_experts`` (None: any number of) experts' token count from ``offsets`` (cumulative
    counts, read on the host), checked against the rows of ``x``; ``num_experts``: the layer's experts, when
    this process holds ``n_experts`` of them."""
    if not isinstance(offsets, torch.Tensor) or offsets.dtype.is_floating_point or offsets.dtype.is_complex \
            or offsets.dtype == torch.bool:
        fail("offsets", "an integer tensor of cumulative token counts", describe(offsets), TypeError)
    if n_experts is None and (offsets.dim() != 1 or offsets.numel() == 0):
        fail("offsets", "a 1-D tensor (one per expert)", describe(offsets))
    if n_experts is not None and offsets.shape != (n_experts,):
        local = "" if num_experts in (None, n_experts) else f" this process holds, of {num_experts}"
        fail("offsets", f"shape ({n_experts},) (one per expert{local})", describe(offsets))
    ends = offsets.tolist()
    counts = tuple(b - a for a, b in zip([0, *ends[:-1]], ends))
    if any(n < 0 for n in counts):
        fail("offsets", "non-decreasing cumulative token counts from 0", ends)
    if ends[-1] != x.shape[0]:
        fail("offsets", f"a last value equal to the number of tokens in x ({x.shape[0]})", ends[-1])
    return counts


def route(x: torch.Tensor, offsets: torch.Tensor) -> GC.Groups:
    """The rows ``x`` (T, in) grouped by expert as ``offsets`` (E,) says, read on the host once: several
    :class:`GroupedLinear`\\ s that take the same rows (an expert's gate, up and down projections) take it
    in place of ``offsets``."""
    counts = read_counts(offsets, x)
    return GC.Groups.of(counts, offsets.to(x.device))


def _rows_of(counts: tuple[int, ...]) -> list[tuple[int, slice]]:
    """``(expert, its rows)`` for every expert, empty ones included."""
    ends = itertools.accumulate(counts)
    return [(e, slice(end - n, end)) for e, (end, n) in enumerate(zip(ends, counts))]


def _slices(counts: tuple[int, ...]) -> list[tuple[int, slice]]:
    """``(expert, its rows)`` for every expert with tokens."""
    return [(e, rows) for e, rows in _rows_of(counts) if rows.start != rows.stop]


def _input_casts(x: torch.Tensor, g: GC.Groups, op, need_wgrad: bool, state: CastState | None,
                 delay: BankRows | None = None, record: bool = False):
    """:func:`~lowprec.nn.grouped_casts.cast_rows` of the rows ``x`` along K (and transposed where the weight
    gradient needs them), taken from the layer's input share when a sibling projection (the experts' gate
    and up) cast the same unchanged rows for the same groups the same way (see ``lowprec.nn.casts.InputShare``;
    never under delayed scaling, each layer's scales its own)."""
    return shared_casts(x, op, state.share if state is not None else None, (need_wgrad, g),
                        lambda: GC.cast_rows(x, g, op, True, need_wgrad, delay, record))


def _batched_forward(x, weight, bias, g: GC.Groups, plan: LayerPlan, need_dgrad: bool, need_wgrad: bool,
                     state: CastState | None = None, delay: BankRows | None = None, record: bool = False):
    """``(y, x's transposed casts, weight.T's casts)``: every expert's forward GEMM with the casts of all
    experts batched (see [Note: batched per-expert casts] in ``lowprec.nn.grouped_casts``), as one grouped
    GEMM where the device runs it (see [Note: one grouped GEMM for the experts]); ``state``: the layer's, whose
    input share the casts of ``x`` come from; ``delay``: the experts' delayed-scaling rows (a delayed plan),
    ``record``: the amaxes recorded into them (a training forward)."""
    out_dtype = output_dtype(x)
    with torch.autocast(x.device.type, enabled=False):
        counts, expert = g.counts, g.expert
        qx, qx_t = _input_casts(x, g, plan.input, need_wgrad, state, delay, record)
        qw, qw_t = GC.cast_weights(weight, plan.weight, True, need_dgrad, delay, record)
        _, n, k = weight.shape
        y = _folded_rows(qx, qw, g, plan.fprop, out_dtype)
        if y is None:
            y = _blocked_rows(qx, qw, g, plan.fprop, out_dtype)
        if y is None:
            y = _emulated_rows(qx, qw, g, plan.fprop, out_dtype)
        if y is None and _row_scaled(plan.fprop, qx, qw) and GG.runs_grouped(GG.ROWS, x.device, qx.fmt, qw.fmt,
                                                                             k, n):
            y = GG.grouped_by_rows(qx.data, qx.token_scales(expert), qw.weight_codes(), qw.weight_scales(),
                                   g.offsets, out_dtype, plan.fprop.fast_accum)
        if y is not None:
            return (y + bias[expert].to(out_dtype) if bias is not None else y), qx_t, qw_t
        ys = []
        for e, rows in _slices(counts):
            y = gemm(qx.expert(e, rows), qw.expert(e), plan.fprop, out_dtype)  # (n, out)
            ys.append(y + bias[e].to(out_dtype) if bias is not None else y)
    return torch.cat(ys), qx_t, qw_t


def _row_scaled(gp, a: GC.ExpertCast, b: GC.ExpertCast) -> bool:
    """A cuBLAS GEMM of per-tensor or per-row casts: what PyTorch's grouped FP8 GEMM takes (MX casts on
    Blackwell's tensor cores are cuBLAS too, but block-scaled: they run per expert)."""
    return gp.path is GemmPath.CUBLAS and a.kind in GC.ROW_SCALED and b.kind in GC.ROW_SCALED


def _folded_rows(a: GC.ExpertCast, b: GC.ExpertCast, g: GC.Groups, gp, dtype) -> torch.Tensor | None:
    """``(T, N)``: every expert's MX rows of ``a`` times its ``b`` (``(E, N, K)``), both folded to row scales
    (see [Note: folding MX blocks into rows] in ``lowprec.kernels.fold``), as one grouped FP8 GEMM; None
    where the plan's GEMM is not folded or the device does not run the grouped one."""
    if gp.path is not GemmPath.FOLDED or a.kind is not GC.Side.BLOCKS:
        return None
    device = a.data.device
    e, n, kp = b.data.shape
    if not GG.runs_grouped(GG.ROWS, device, target(a.fmt), target(b.fmt), kp, n) or not folded_runs(device):
        return None
    fa, fb = fold(a.blocks_all()), fold(b.blocks_all())
    return GG.grouped_by_rows(fa.data, fa.scale.view(-1), fb.data.view(e, n, kp), fb.scale.view(e, n), g.offsets,
                              dtype, gp.fast_accum)


def _folded_features(a: GC.ExpertCast, b: GC.ExpertCast, g: GC.Groups, gp, dtype) -> torch.Tensor | None:
    """``(E, M, N)``: every expert's weight gradient from the MX token sides ``a`` ``(M, P)`` and ``b`` ``(N, P)``
    (blocks along the tokens, each expert's from a whole block on), each folded with one scale per (feature,
    expert) over that expert's blocks alone (``kernels.fold.fold_segments``: the codes of the expert's own
    fold), as one grouped FP8 GEMM of the features kind; None where the plan's GEMM is not folded or the
    device does not run the grouped one."""
    if gp.path is not GemmPath.FOLDED or a.kind is not GC.Side.BLOCK_TOKENS or b.kind is not GC.Side.BLOCK_TOKENS:
        return None
    device = a.data.device
    m, n = a.data.shape[0], b.data.shape[0]
    if not GG.runs_grouped(GG.FEATURES, device, target(a.fmt), target(b.fmt), m, n, fast_accum=gp.fast_accum) \
            or not folded_runs(device):
        return None
    bc = a.granularity.block_cols
    padding = g.padded(bc)  # the layout both sides were cast in (``grouped_casts._block_tokens``)
    first = torch.arange(0, a.scales.shape[1] * bc, bc, device=device)  # each block column's first token
    segment = torch.bucketize(first, padding.ends, right=True).clamp(max=g.n_experts - 1)  # its expert
    fa, sa = fold_segments(a.block_tokens_all(), segment, g.n_experts)
    fb, sb = fold_segments(b.block_tokens_all(), segment, g.n_experts)
    return GG.grouped_by_features_laid_out(fa, sa.t().reshape(-1), fb, sb.t().reshape(-1), padding.ends, dtype,
                                           gp.fast_accum)


def _fp32_blocks(gp, a: GC.ExpertCast, b: GC.ExpertCast) -> bool:
    """A cuBLAS GEMM of FP32 block-scaled sides (``fp8-blockwise``: 1 x 128 and 128 x 128 blocks), each
    expert's weight rows whole blocks: what lowprec's blocked grouped kernels take (MX sides on Blackwell's
    tensor cores are cuBLAS too, with E8M0 scales per 32: they run per expert)."""
    return (gp.path is GemmPath.CUBLAS and a.granularity is not None and b.granularity is not None
            and a.granularity.kind is GC.BLOCK and b.granularity.kind is GC.BLOCK
            and a.granularity.block_cols == b.granularity.block_cols == GG.BLOCK
            and (b.kind is not GC.Side.BLOCKS or b.data.shape[1] == b.height))


def _blocked_rows(a: GC.ExpertCast, b: GC.ExpertCast, g: GC.Groups, gp, dtype) -> torch.Tensor | None:
    """``(T, N)``: every expert's FP32 block-scaled rows of ``a`` times its ``b`` (``(E, N, K)`` in 128 x 128
    blocks), as one grouped GEMM of lowprec's blocked kind; None where the plan's GEMM is not such a pair or
    the device does not run it."""
    if a.kind is not GC.Side.BLOCKS or not _fp32_blocks(gp, a, b):
        return None
    e, n, kp = b.data.shape
    if not GG.runs_grouped(GG.ROWS, a.data.device, a.fmt, b.fmt, kp, n, blocked=True):
        return None
    return GG.grouped_by_rows_blocked(a.data, a.scales, b.data, b.scales, g.offsets, dtype)


def _blocked_features(a: GC.ExpertCast, b: GC.ExpertCast, g: GC.Groups, gp, dtype) -> torch.Tensor | None:
    """``(E, M, N)``: every expert's weight gradient from the FP32 block-scaled token sides ``a`` ``(M, P)`` and
    ``b`` ``(N, P)`` (blocks along the tokens, each expert's from a whole block on), as one grouped GEMM of
    lowprec's blocked kind; None where the plan's GEMM is not such a pair or the device does not run it."""
    if a.kind is not GC.Side.BLOCK_TOKENS or b.kind is not GC.Side.BLOCK_TOKENS or not _fp32_blocks(gp, a, b):
        return None
    m, n = a.data.shape[0], b.data.shape[0]
    if not GG.runs_grouped(GG.FEATURES, a.data.device, a.fmt, b.fmt, m, n, blocked=True):
        return None
    return GG.grouped_by_features_blocked(a.data, a.scales, b.data, b.scales, g.padded(GG.BLOCK).ends, dtype)


def _emulated_rows(a: GC.ExpertCast, b: GC.ExpertCast, g: GC.Groups, gp, dtype) -> torch.Tensor | None:
    """``(T, N)``: every expert's emulated block-scaled GEMM of the rows of ``a`` and its ``b`` (``(E, N, K)``; NVFP4
    on Hopper), as one grouped BF16 GEMM (see [Note: grouped emulated GEMMs] in ``lowprec.kernels.grouped_emulated``);
    None where the plan's GEMM is not emulated, or the device does not run it so (the CPU: FP32, per expert)."""
    if gp.path is not GemmPath.EMULATED or a.kind is not GC.Side.BLOCKS or b.kind is not GC.Side.BLOCKS:
        return None
    e, n, kp = b.data.shape
    qa, qb = a.blocks_all(), b.blocks_all()
    if a.rotated != b.rotated or b.height != n or a.data.shape[-1] != kp \
            or not GE.runs(a.data.device, qa, qb, n, kp):
        return None
    return GE.by_rows(qa, qb, e, g.offsets, g.expert, a.globals, b.globals, dtype)


def _emulated_features(a: GC.ExpertCast, b: GC.ExpertCast, g: GC.Groups, gp, dtype) -> torch.Tensor | None:
    """``(E, M, N)``: every expert's emulated weight gradient from the block token sides ``a`` ``(M, P)`` and
    ``b`` ``(N, P)`` (each expert's tokens from a whole block on), as one grouped BF16 GEMM (see [Note: grouped
    emulated GEMMs]); None where the plan's GEMM is not emulated, or the device does not run it so."""
    if gp.path is not GemmPath.EMULATED or a.kind is not GC.Side.BLOCK_TOKENS or b.kind is not GC.Side.BLOCK_TOKENS:
        return None
    bc = a.granularity.block_cols
    m, n = a.data.shape[0], b.data.shape[0]
    qa, qb = a.block_tokens_all(), b.block_tokens_all()
    if b.granularity.block_cols != bc or a.rotated != b.rotated or a.data.shape[1] != b.data.shape[1] \
            or not GE.runs(a.data.device, qa, qb, m, n):
        return None
    ends = g.padded(bc).ends  # the layout both sides were cast in (``grouped_casts._block_tokens``)
    return GE.by_features(qa, qb, ends, g.lengths > 0, a.globals, b.globals, dtype)


def _pack(c: GC.ExpertCast | None):
    """``(tensors, meta)`` of a side saved for backward: its three tensors (None each where it has none)."""
    if c is None:
        return (None, None, None), None
    return (c.data, c.scales, c.globals), (c.fmt, c.dtype, c.kind, c.flip, c.granularity, c.starts, c.width,
                                           c.height, c.rotated)


def _unpack(tensors, meta) -> GC.ExpertCast | None:
    if meta is None:
        return None
    *fields, rotated = meta
    return GC.ExpertCast(tensors[0], tensors[1], *fields, globals=tensors[2], rotated=rotated)


def _batched_dgrad(qdy, qw_t, g: GC.Groups, plan: LayerPlan, dtype, w_shape) -> torch.Tensor:
    """``(T, in)``: every expert's input gradient, grouped where the device runs it."""
    dx = _folded_rows(qdy, qw_t, g, plan.dgrad, dtype)
    if dx is None:
        dx = _blocked_rows(qdy, qw_t, g, plan.dgrad, dtype)
    if dx is None:
        dx = _emulated_rows(qdy, qw_t, g, plan.dgrad, dtype)
    if dx is not None:
        return dx
    if _row_scaled(plan.dgrad, qdy, qw_t) and GG.runs_grouped(GG.ROWS, g.expert.device, qdy.fmt, qw_t.fmt, *w_shape):
        return GG.grouped_by_rows(qdy.data, qdy.token_scales(g.expert), qw_t.weight_codes(), qw_t.weight_scales(),
                                  g.offsets, dtype, plan.dgrad.fast_accum)
    return torch.cat([gemm(qdy.expert(e, rows), qw_t.expert(e), plan.dgrad, dtype) for e, rows in _slices(g.counts)])


def _batched_wgrad(qdy_t, qx_t, g: GC.Groups, plan: LayerPlan, dtype, w_shape) -> torch.Tensor:
    """``(E, out, in)``: every expert's weight gradient over its own tokens (zero for an expert without)."""
    out_f, in_f = w_shape
    device, counts = g.expert.device, g.counts
    fast = plan.wgrad.fast_accum
    dw = _folded_features(qdy_t, qx_t, g, plan.wgrad, dtype)
    if dw is None:
        dw = _blocked_features(qdy_t, qx_t, g, plan.wgrad, dtype)
    if dw is None:
        dw = _emulated_features(qdy_t, qx_t, g, plan.wgrad, dtype)
    if dw is not None:
        return dw
    if _row_scaled(plan.wgrad, qdy_t, qx_t) and GG.runs_grouped(GG.FEATURES, device, qdy_t.fmt, qx_t.fmt, out_f, in_f,
                                                                fast_accum=fast):
        e = g.n_experts
        a, sa, b, sb = qdy_t.data, qdy_t.feature_scales(e), qx_t.data, qx_t.feature_scales(e)
        if qdy_t.kind is GC.Side.COLUMN:  # both laid out as the grouped GEMM reads them (one kind per plan)
            return GG.grouped_by_features_laid_out(a, sa, b, sb, g.padded().ends, dtype, fast)
        return GG.grouped_by_features(a, sa, b, sb, g.padded(), dtype, fast)
    dws = [torch.zeros(w_shape, dtype=dtype, device=device) for _ in counts]
    for e, rows in _slices(counts):
        dws[e] = gemm(qdy_t.expert(e, rows), qx_t.expert(e, rows), plan.wgrad, dtype)
    return torch.stack(dws)


class BatchedFunction(torch.autograd.Function):
    """:class:`GroupedFunction` for plans whose casts ``lowprec.nn.grouped_casts`` batches (per tensor or
    per row): the same numbers, each operand's casts made for all experts at once, the GEMMs grouped where
    the device runs them."""

    @staticmethod
    def forward(ctx, x, weight, bias, g: GC.Groups, plan: LayerPlan, state: CastState, delay: BankRows | None = None):
        need_dgrad, need_wgrad = ctx.needs_input_grad[:2]
        y, qx_t, qw_t = _batched_forward(x, weight, bias, g, plan, need_dgrad, need_wgrad, state, delay, True)
        (xt, xt_meta), (wt, wt_meta) = _pack(qx_t), _pack(qw_t)
        ctx.save_for_backward(*xt, *wt)
        ctx.metas = (xt_meta, wt_meta)
        ctx.groups, ctx.plan, ctx.delay = g, plan, delay
        ctx.dtypes = (x.dtype, weight.dtype, bias.dtype if bias is not None else None)
        ctx.w_shape = weight.shape[1:]
        return y

    @staticmethod
    def backward(ctx, dy):
        need_dgrad, need_wgrad, need_bias = ctx.needs_input_grad[:3]
        x_dtype, w_dtype, b_dtype = ctx.dtypes
        saved = ctx.saved_tensors
        qx_t, qw_t = _unpack(saved[0:3], ctx.metas[0]), _unpack(saved[3:6], ctx.metas[1])
        plan, g = ctx.plan, ctx.groups
        dx = dw = db = None
        with torch.autocast(dy.device.type, enabled=False):
            qdy, qdy_t = GC.cast_rows(dy, g, plan.grad_output, need_dgrad, need_wgrad, ctx.delay, True)
            if need_dgrad:
                dx = _batched_dgrad(qdy, qw_t, g, plan, x_dtype, ctx.w_shape)  # (T, in)
            if need_wgrad:
                dw = _batched_wgrad(qdy_t, qx_t, g, plan, w_dtype, ctx.w_shape)  # (E, out, in)
            if b_dtype is not None and need_bias:  # each expert's sum, as the loop sums it
                db = torch.stack([dy[rows].sum(0).to(b_dtype) for _, rows in _rows_of(g.counts)])  # (E, out)
        return dx, dw, db, None, None, None, None


def _static_plan(plan: LayerPlan, device: torch.device, w_shape: tuple[int, ...]) -> bool:
    """Whether FP8 experts under ``plan`` run with their counts on the device alone (a compiled graph holds
    them): casts batched per tensor or per row (``grouped_casts``: amaxes, scales and the padded layout are
    device work, the padding sized for any routing), and every GEMM of a linear grouped on ``device``
    (``kernels.grouped_gemm.runs_grouped``: cuBLAS's or lowprec's grouped kernels, which take the offsets on
    the device); MX experts so too where every GEMM runs folded and grouped (the folds are device work, the
    token sides padded to whole blocks for any routing), and FP32 block-scaled experts (``fp8-blockwise``)
    where every GEMM runs on lowprec's blocked grouped kernels; elsewhere the experts read their counts (the
    per-expert loops need them)."""
    kind = GC.batched_kind(plan)
    if kind not in (GC.TENSOR, GC.ROW, GC.MX, GC.BLOCK):
        return False
    path = GemmPath.FOLDED if kind is GC.MX else GemmPath.CUBLAS
    if kind is GC.MX and not folded_runs(device):
        return False
    _, out_f, in_f = w_shape
    gemms = ((GG.ROWS, plan.fprop, plan.input.cast_k, plan.weight.cast_k, (in_f, out_f)),
             (GG.ROWS, plan.dgrad, plan.grad_output.cast_k, plan.weight.cast_t, (out_f, in_f)),
             (GG.FEATURES, plan.wgrad, plan.grad_output.cast_t, plan.input.cast_t, (out_f, in_f)))
    if kind is GC.BLOCK:  # lowprec's blocked kernels: blocks of 128 along K, weights' rows whole blocks
        return out_f % GG.BLOCK == 0 and in_f % GG.BLOCK == 0 and all(
            gp.path is path and a.granularity.block_cols == b.granularity.block_cols == GG.BLOCK
            and GG.runs_grouped(kind_, device, a.fmt, b.fmt, *dims, blocked=True) for kind_, gp, a, b, dims in gemms)
    # an MX GEMM runs on its folded operands' formats (``kernels.fold.target``), its K padded to whole blocks
    return all(gp.path is path
               and GG.runs_grouped(kind_, device, target(a.fmt) if kind is GC.MX else a.fmt,
                                   target(b.fmt) if kind is GC.MX else b.fmt, *dims, fast_accum=gp.fast_accum)
               for kind_, gp, a, b, dims in gemms)


GROUPED_BF16_DEVICES = ("cuda",)
"""Device types whose high-precision BF16 experts run as one ``torch._grouped_mm`` (:func:`_grouped_bf16`)."""


def _bf16_dtype(x, weight, bias, dtype: torch.dtype | None) -> torch.dtype | None:
    """BF16 where high-precision experts run as one ``torch._grouped_mm`` (see :func:`_grouped_bf16`), else None;
    a decision on shapes, dtypes and the device alone, so compiled code makes it too."""
    if x.device.type not in GROUPED_BF16_DEVICES or bias is not None or not hasattr(torch, "_grouped_mm") or \
            weight.shape[1] % 16 or weight.shape[2] % 16:
        return None
    dev = x.device.type
    dt = dtype or (torch.get_autocast_dtype(dev) if torch.is_autocast_enabled(dev) else x.dtype)
    return dt if dt == torch.bfloat16 else None


def _grouped_bf16(x, weight, bias, offsets: torch.Tensor | tuple[int, ...],
                  dtype: torch.dtype | None) -> torch.Tensor | None:
    """High-precision experts on a GPU whose GEMMs run in BF16 (BF16 tensors, autocast to BF16, or the
    ``bf16`` recipe) as one ``torch._grouped_mm`` (PyTorch's grouped BF16 GEMM, FP32 accumulation), the
    baseline MoE training uses; None elsewhere (the CPU, other dtypes, biases, widths not multiples of 16),
    where every expert is its own ``linear``. ``offsets``: the cumulative counts on the device (nothing is read
    on the host), or the counts on the host. Per expert the values are a BF16 GEMM's; the order of accumulation
    inside the kernel may differ from cuBLAS's."""
    dt = _bf16_dtype(x, weight, bias, dtype)
    if dt is None:
        return None
    if not isinstance(offsets, torch.Tensor):  # the counts, on the host
        offsets = torch.tensor(offsets, device=x.device).cumsum(0)
    out = output_dtype(x)
    with torch.autocast(x.device.type, enabled=False):
        y = torch._grouped_mm(x.to(dt), weight.to(dt).transpose(-2, -1), offs=offsets.to(torch.int32))  # (T, out)
    return y.to(out)


class GroupedLinear(OptionalExtraState):
    """``num_experts`` linear layers of one shape, their weights one (E, out, in) parameter (and the
    biases one (E, out)), applied to tokens grouped by expert: ``forward(x, offsets)`` with ``x`` (T, in)
    and ``offsets`` (E,) the cumulative token counts, or the :class:`~lowprec.nn.grouped_casts.Groups` that
    :func:`route` read from them once for several layers (the reference MoE's projections pass it, so a hook
    on them sees it: its ``offsets`` are the tensor). Every expert runs the recipe (None: high precision) as
    a ``lowprec.nn.Linear`` would on its rows; see [Note: grouped expert GEMMs]."""

    def __init__(self, num_experts: int, in_features: int, out_features: int, bias: bool = False,
                 recipe: str | R.Recipe | None = None, device=None, dtype=None) -> None:
        super().__init__()
        for name, v in (("num_experts", num_experts), ("in_features", in_features), ("out_features", out_features)):
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                fail(name, "a positive int", describe(v))
        self.num_experts, self.in_features, self.out_features = num_experts, in_features, out_features
        kw = {"device": device, "dtype": dtype}
        self.weight = nn.Parameter(torch.empty(num_experts, out_features, in_features, **kw))
        self.bias = nn.Parameter(torch.empty(num_experts, out_features, **kw)) if bias else None
        self.reset_parameters()
        self.state = CastState()
        """The layer's: never holds a delayed history or a weight cache."""
        self.expert_states = tuple(CastState() for _ in range(num_experts))
        """Each expert's: its delayed-scaling history under a delayed recipe (a row of the banks each), and
        the name telemetry gives its casts (see [Note: telemetry per expert] in
        ``lowprec.telemetry.experts``)."""
        self._banks = DelayedBanks()
        """Where the experts' delayed-scaling histories live: the layer's own banks, folded by its forward,
        until ``lowprec.convert`` gives it its model's (:meth:`use_banks`)."""
        self._rows: tuple | None = None
        """(bank, rows, the rows on the bank's device): the experts' rows last read (:meth:`_bank_rows`)."""
        self._warned: set[str] = set()
        self.register_state_dict_post_hook(drop_empty_extra_state)
        self.set_recipe(recipe)

    def reset_parameters(self) -> None:
        # what torch.nn.Linear draws for each expert: U(-1/sqrt(in), 1/sqrt(in)) for weight and bias
        bound = 1 / math.sqrt(self.in_features)
        nn.init.uniform_(self.weight, -bound, bound)
        if self.bias is not None:
            nn.init.uniform_(self.bias, -bound, bound)

    def set_recipe(self, recipe: str | R.Recipe | None) -> None:
        """Bind ``recipe`` (None: high precision); a delayed recipe gives each expert a history of its own (see
        [Note: grouped expert GEMMs]), refused under expert parallelism. A recipe other than the bound one
        drops the experts' histories (recorded for other casts)."""
        recipe = _no_delay(R.get(recipe) if recipe is not None else None, "recipe", self.weight)
        if recipe != getattr(self, "recipe", None):
            for s in self.expert_states:
                s.delayed = None
        self.recipe: R.Recipe | None = recipe
        self._plans: tuple[LayerPlan | None, LayerPlan | None] = (None, None)
        """The training and evaluation plans last made eagerly (see :meth:`plan`)."""
        plan = self.plan()
        self.plan(nearest=True)
        if plan is not None and plan.delayed and not self.weight.is_meta:
            self._prepare_delayed(recipe)

    def _prepare_delayed(self, recipe: R.Recipe) -> None:
        """Each expert's delayed-scaling state for ``recipe`` on the weight's device, made or moved outside
        any compiled graph."""
        device = self.weight.device
        for s in self.expert_states:
            if s.delayed is None or s.delayed.config != recipe.delayed:
                s.delayed = DelayedState(recipe.delayed, device, self._banks)
            elif s.delayed.device != device:  # the module moved since
                s.delayed.to(device)

    def use_banks(self, banks: DelayedBanks) -> None:
        """Keep the experts' delayed-scaling states in ``banks``, a converted model's, folded by its forward's
        pre-hook (``lowprec.nn.delayed_bank.bank_layers``), now and for every state made later."""
        self._banks = banks
        for s in self.expert_states:
            if s.delayed is not None:
                s.delayed.rebank(banks)

    def delayed_states(self) -> list[tuple[int, DelayedState]]:
        """``(expert, state)`` of every expert with a delayed-scaling state, experts in order."""
        return [(e, s.delayed) for e, s in enumerate(self.expert_states) if s.delayed is not None]

    def named_delayed_states(self) -> list[tuple[str, DelayedState]]:
        """``(suffix, state)`` of each expert's delayed-scaling state, named as telemetry names the expert
        (``#expert3``)."""
        return [(f"#expert{e}", s) for e, s in self.delayed_states()]

    def _apply(self, fn, recurse: bool = True):
        # .to(), .cuda(), to_empty(): the experts' histories follow the weight
        out = super()._apply(fn, recurse)
        recipe = getattr(self, "recipe", None)
        if recipe is not None and recipe.uses_delayed_scaling and not self.weight.is_meta:
            self._plans = (None, None)
            if self.plan().delayed:
                self._prepare_delayed(recipe)
        return out

    def get_extra_state(self):
        states = self.delayed_states()
        # nothing recorded yet (a fresh layer): no entry, as a Linear's
        if len(states) != self.num_experts or not any(any(s.recorded) for _, s in states):
            return None
        return torch.stack([s.to_tensor() for _, s in states])  # (E, rows, roles)

    def set_extra_state(self, state) -> None:
        recipe = self._restoring(state)
        if recipe is None:
            return
        where = f"GroupedLinear({self.num_experts}, {self.in_features}, {self.out_features})"
        if not isinstance(state, torch.Tensor) or state.dim() != 3 or state.shape[0] != self.num_experts:
            fail("state_dict", f"{where}: one delayed-scaling state per expert, ({self.num_experts}, rows, roles)",
                 describe(state))
        self._prepare_delayed(recipe)
        for e, (_, s) in enumerate(self.delayed_states()):
            s.load_tensor(state[e], f"{where} expert {e}")

    def plan(self, recipe: R.Recipe | None = None, nearest: bool = False) -> LayerPlan | None:
        """The plan of one expert's shape (in, out) for ``recipe`` (default: the bound one) on the weight's
        device; ``nearest``: the evaluation plan, every cast rounded to nearest."""
        recipe = recipe if recipe is not None else self.recipe
        if recipe is None:
            return None
        memo = self._plans[int(nearest)]
        if memo_serves(memo, recipe, self.weight.device):
            return memo
        plan = layer_plan(recipe, self.weight.device, self.in_features, self.out_features, nearest=nearest)
        if not torch.compiler.is_compiling():  # kept for compiled calls, which read it (tracing none)
            self._plans = (plan, self._plans[1]) if not nearest else (self._plans[0], plan)
        return plan

    def local_experts(self) -> range:
        """The experts this process holds: all of them, or under expert parallelism its shard's (see
        [Note: grouped expert GEMMs])."""
        if not is_dtensor(self.weight):
            return range(self.num_experts)
        n = self.weight.to_local().shape[0]
        first = self.weight.device_mesh.get_local_rank() * n  # Shard(0) of E divisible by the group's size
        return range(first, first + n)

    def forward(self, x: torch.Tensor, offsets: torch.Tensor | GC.Groups) -> torch.Tensor:
        # recording amaxes per expert reads the counts: such a region runs the counted path
        if torch.compiler.is_compiling() and isinstance(offsets, torch.Tensor) and not self._recording():
            way = self._on_device(x)
            if way is not None:
                return self._on_offsets(x, offsets, way)
        return self._counted(x, offsets)

    def takes_offsets(self, x: torch.Tensor) -> bool:
        """Whether a compiled call runs on the offsets as the device holds them, with no count read on the
        host (see [Note: experts under torch.compile] in ``lowprec.nn.routing``): high-precision BF16 experts
        as one ``torch._grouped_mm``, and FP8 experts whose casts are batched on a device that runs all
        three of their GEMMs grouped (:func:`_static_plan`; delayed experts once their histories exist). A
        decision on the recipe, shapes, dtypes and the device alone."""
        return self._on_device(x) is not None

    def _on_device(self, x: torch.Tensor) -> torch.dtype | LayerPlan | None:
        """:meth:`takes_offsets`'s way: BF16 (the grouped BF16 GEMM), the FP8 plan, or None."""
        recipe = _no_delay(resolve(self.recipe), "autocast recipe", self.weight)
        plan = self.plan(recipe, nearest=not (self.training and torch.is_grad_enabled())) if recipe is not None \
            else None
        weight = self.weight.to_local() if is_dtensor(self.weight) else self.weight
        if plan is not None and plan.scaled and plan.hp_reason is None:  # FP8 or FP4 GEMMs
            if plan.delayed and not self._delays_ready(recipe, self._local_states()):
                return None  # the histories are made eagerly first
            return plan if self.bias is None and x.shape[0] and _static_plan(plan, x.device, weight.shape) else None
        if recipe is not None and recipe.hp_dtype is None:  # a reason to keep them: said eagerly, once
            return None
        if plan is not None and (plan.scaled or plan.hp_reason is not None):
            return None
        return _bf16_dtype(x, weight, self.bias, plan.hp_dtype if plan is not None else None)

    def _on_offsets(self, x: torch.Tensor, offsets: torch.Tensor, way: torch.dtype | LayerPlan) -> torch.Tensor:
        """:meth:`takes_offsets`'s path: the offsets are checked on the device (an assertion there), not read."""
        n = len(self.local_experts())
        self._check_x(x)
        if offsets.dtype.is_floating_point or offsets.dtype.is_complex or offsets.dtype == torch.bool:
            fail("offsets", "an integer tensor of cumulative token counts", describe(offsets), TypeError)
        if offsets.shape != (n,):
            fail("offsets", f"shape ({n},) (one per expert)", describe(offsets))
        ends = offsets.to(torch.int64)
        torch._assert_async((ends[-1] == x.shape[0]) & (torch.diff(ends, prepend=ends.new_zeros(1)) >= 0).all(),
                            "offsets: expected non-decreasing cumulative token counts ending at x's rows")
        weight = self.weight.to_local() if is_dtensor(self.weight) else self.weight
        if isinstance(way, torch.dtype):
            return _grouped_bf16(x, weight, None, offsets, way)
        g = GC.Groups.of(None, offsets.to(x.device), x.shape[0])  # the counts stay on the device
        for multiple in (16, *GC.token_blocks(way)):  # worked out here, outside the autograd function, which
            g.padded(multiple)                          # only reads them (a compiled graph keeps no side effect)
        delay = self._bank_rows(resolve(self.recipe), self._local_states(), g) if way.delayed else None
        if torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad):
            return BatchedFunction.apply(x, weight, None, g, way, self.state, delay)
        return _batched_forward(x, weight, None, g, way, False, False, self.state, delay)[0]

    def _local_states(self) -> tuple[CastState, ...]:
        """The cast states of the experts this process holds."""
        experts = self.local_experts()
        return self.expert_states[experts.start:experts.stop]

    @outside_graphs  # reads the counts on the host: see [Note: experts under torch.compile]
    def _counted(self, x: torch.Tensor, offsets: torch.Tensor | GC.Groups) -> torch.Tensor:
        experts = self.local_experts()
        weight, bias = (p.to_local() if p is not None and is_dtensor(p) else p for p in (self.weight, self.bias))
        states = self._local_states()
        self._check_x(x)
        g = offsets if isinstance(offsets, GC.Groups) else None
        counts = self._check_groups(g, x, len(experts)) if g is not None else read_counts(offsets, x, len(experts),
                                                                                         self.num_experts)
        recipe = _no_delay(resolve(self.recipe), "autocast recipe", self.weight)
        training = self.training and torch.is_grad_enabled()
        plan = self.plan(recipe, nearest=not training) if recipe is not None else None
        if plan is None or not plan.scaled or x.shape[0] == 0:
            if plan is not None and plan.hp_reason is not None:
                self._warn_once(plan.hp_reason)
            y = self._high_precision(x, weight, bias, counts, plan.hp_dtype if plan is not None else None)
            return self._recorded(x, weight, y, counts, states, training)
        params = (weight, bias) if bias is not None else (weight,)
        grad = torch.is_grad_enabled() and (x.requires_grad or any(p.requires_grad for p in params))
        if GC.batches(plan) and probe() is None:  # a sampled step takes the loop: telemetry per expert
            g = g if g is not None else GC.Groups.of(counts, offsets.to(x.device))
            delay = self._bank_rows(recipe, states, g) if plan.delayed else None
            if grad:
                return BatchedFunction.apply(x, weight, bias, g, plan, self.state, delay)
            return _batched_forward(x, weight, bias, g, plan, False, False, self.state, delay)[0]
        if plan.delayed:
            return self._delayed(x, weight, bias, counts, plan, recipe, states, grad)
        if grad:
            return GroupedFunction.apply(x, weight, bias, counts, plan, states)
        fwds = _experts_forward(x, weight, bias, counts, plan, states, False, False, False)
        return torch.cat([f.y for f in fwds if f is not None])  # inference: no transposed casts

    def _fold_delayed(self, recipe: R.Recipe) -> None:
        """Before a forward reads the experts' delayed scales: their states for ``recipe`` made or moved (eagerly:
        nothing to do unless the recipe changed, through autocast, or the module moved; a compiled call reads
        states that exist), and a layer outside a converted model folds its own bank (a converted model's
        forward folds its banks by its pre-hook)."""
        if not torch.compiler.is_compiling():
            self._prepare_delayed(recipe)
        if not self._banks.by_hook:
            self._banks.fold()

    def _delays_ready(self, recipe: R.Recipe, states: tuple[CastState, ...]) -> bool:
        """Whether every expert of ``states`` holds a delayed-scaling state for ``recipe`` on the weight's device
        (:meth:`_prepare_delayed` has nothing to do: a compiled call may read them)."""
        device = self.weight.device
        return all(s.delayed is not None and s.delayed.config == recipe.delayed and s.delayed.device == device
                   for s in states)

    def _bank_rows(self, recipe: R.Recipe, states: tuple[CastState, ...], g: GC.Groups) -> BankRows:
        """The experts' rows of their delayed-scaling bank, for casts batched over the experts (see [Note:
        batched per-expert casts] in ``lowprec.nn.grouped_casts``): each scales by its own history and records
        into it, as a Linear of its weight does; an expert without tokens records nothing. The states are made
        (or moved) first where needed, and a layer outside a converted model folds its bank, as :meth:`_delayed`
        does."""
        self._fold_delayed(recipe)
        delayed = [s.delayed for s in states]
        bank, rows = delayed[0].bank, tuple(d.row for d in delayed)
        if any(d.bank is not bank for d in delayed):  # one banks object, one config, one device: one bank
            raise RuntimeError("lowprec: a GroupedLinear's experts hold rows of different delayed-scaling banks")
        held = self._rows
        if held is not None and held[0] is bank and held[1] == rows:
            index = held[2]
        else:
            index = torch.tensor(rows, dtype=torch.int64, device=bank.device)
            if not torch.compiler.is_compiling():
                self._rows = (bank, rows, index)
        return BankRows(bank, index, g.lengths > 0)

    def _delayed(self, x, weight, bias, counts: tuple[int, ...], plan: LayerPlan, recipe: R.Recipe,
                 states: tuple[CastState, ...], grad: bool) -> torch.Tensor:
        """Experts under delayed scaling whose casts are not batched (a sampled telemetry step, a recipe
        :func:`~lowprec.nn.grouped_casts.batches` does not cover): each expert's rows through
        ``lowprec.nn.Linear``'s autograd function with its own state (its amax histories), as a Linear of its
        weight would run them."""
        self._fold_delayed(recipe)
        ys, start = [], 0
        for e, n in enumerate(counts):
            if n:
                x_e, b = x[start:start + n], bias[e] if bias is not None else None
                ys.append(LinearFunction.apply(x_e, weight[e], b, plan, states[e]) if grad
                          else fprop(x_e, weight[e], b, plan, states[e], False, False, False).y)
            start += n
        return torch.cat(ys)  # (T, out); inference records nothing, as a Linear's

    def _recording(self) -> bool:
        """Whether a high-precision region records amaxes (``lowprec.autocast(..., record_amax=True)``) and
        this layer is bound to a delayed recipe: see :meth:`_recorded`."""
        return records_amax() and self.recipe is not None and self.recipe.uses_delayed_scaling

    def _recorded(self, x: torch.Tensor, weight: torch.Tensor, y: torch.Tensor, counts: tuple[int, ...],
                  states: tuple[CastState, ...], training: bool) -> torch.Tensor:
        """``y``, the experts' output in high precision; where the region records amaxes and the bound recipe
        scales by delay, each expert with tokens records what a delayed step of its own records (see [Note:
        lazy scale initialisation] in ``lowprec.nn.record``; the trainer's ``--hp-start-steps``)."""
        if not self._recording() or not training:  # inference: a delayed layer records nothing either
            return y
        bound = self.recipe
        plan = self.plan(bound)
        if not plan.delayed:  # a layer its shape keeps in high precision
            return y
        self._fold_delayed(bound)
        record_expert_amaxes(x, weight, y, plan, [(e, states[e].delayed, rows) for e, rows in _slices(counts)])
        return y

    def _check_x(self, x) -> None:
        if not isinstance(x, torch.Tensor) or not x.dtype.is_floating_point or x.dtype.itemsize < 2:
            fail("x", "a float32, bfloat16 or float16 tensor", describe(x), TypeError)
        if x.dim() != 2 or x.shape[1] != self.in_features:
            fail("x", f"a 2-D tensor (tokens, in_features={self.in_features})", describe(x))

    def _check_groups(self, g: GC.Groups, x: torch.Tensor, n_experts: int) -> tuple[int, ...]:
        if len(g.counts) != n_experts:
            local = "" if n_experts == self.num_experts else f" this process holds, of {self.num_experts}"
            fail("offsets", f"groups of {n_experts} experts (one per expert{local})", f"{len(g.counts)}")
        if sum(g.counts) != x.shape[0]:
            fail("offsets", f"groups of the {x.shape[0]} rows of x", f"{sum(g.counts)} rows")
        return g.counts

    def _high_precision(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                        counts: tuple[int, ...], dtype: torch.dtype | None) -> torch.Tensor:
        """One ``linear`` per (local) expert in high precision, as ``lowprec.nn.Linear`` runs without a
        recipe, or (``dtype``: bf16, fp16 recipes) with every operand cast to ``dtype``. BF16 experts on a
        GPU run as one ``torch._grouped_mm`` instead (see :func:`_grouped_bf16`)."""
        grouped = _grouped_bf16(x, weight, bias, counts, dtype)
        if grouped is not None:
            return grouped
        weights = weight.unbind(0)
        biases = bias.unbind(0) if bias is not None else (None,) * len(weights)
        if dtype is None:
            return torch.cat([nnf.linear(x_e, w, b) for x_e, w, b in zip(x.split(counts), weights, biases)])
        out = output_dtype(x)
        with torch.autocast(x.device.type, enabled=False):
            return torch.cat([nnf.linear(x_e.to(dtype), w.to(dtype), b.to(dtype) if b is not None else None).to(out)
                              for x_e, w, b in zip(x.split(counts), weights, biases)])  # (T, out)

    def _warn_once(self, reason: str) -> None:
        if reason not in self._warned:
            self._warned.add(reason)
            warnings.warn(f"lowprec: a GroupedLinear({self.num_experts}, {self.in_features}, {self.out_features}) "
                          f"runs in high precision: {reason}", stacklevel=3)

    def extra_repr(self) -> str:
        r = self.recipe.name if self.recipe is not None else None
        return (f"num_experts={self.num_experts}, in_features={self.in_features}, "
                f"out_features={self.out_features}, bias={self.bias is not None}, recipe={r}")


__all__ = ["GroupedFunction", "GroupedLinear", "read_counts", "route"]
