"""The autograd of a low-precision linear layer, with its three GEMMs written out.

The function receives the layer's frozen :class:`~lowprec.nn.plan.LayerPlan` and its
:class:`~lowprec.nn.casts.CastState`, never the module: what to cast, how, and on which backend was
decided when the plan was built, and so was what forward keeps for backward: the plan's
:class:`~lowprec.nn.plan.SavePlan` for the kind of weight the layer holds (plain, FP8 primary,
quantized by FSDP2's all-gather), inside ``cached_weight_casts`` or not, compiled or not. Forward
and backward both follow it; the tensors travel as a named :class:`Saved`.

[Note: what backward keeps]
Forward casts the input twice from the one high-precision copy it reads: along K for fprop, and
(transposed) along the tokens for wgrad. Only the second is saved for backward, so a converted
layer keeps one low-precision copy of its input where a BF16 layer keeps a BF16 one. The weight's
transposed cast (dgrad's operand) is not kept: backward makes it again from the parameter, which
is alive anyway, through the same kernel and with the forward's delayed scale (same bits). That
costs one read of the weight per step and spares a copy of every weight from forward to backward,
so a converted model never keeps more than a BF16 one. Inside ``cached_weight_casts`` the cached
cast is kept instead, and a stochastically rounded weight cast is kept (a second draw would differ).

[Note: recasting the input in backward]
Under ``torch.compile`` a layer whose plan says ``recast_input`` keeps its high-precision input
instead of the input's transposed cast, and backward makes that cast again, with forward's scale
where it is one per tensor (the along-K cast's: same amax or delayed scale, same format) and from
the tensor alone otherwise: the same bits. Kept this way, the input need not cost anything: the
compiler's partitioner decides what backward gets, and where the input is a norm's or SwiGLU's output
it rebuilds it from what their own backward keeps (their inputs) rather than save it; the attention
output is saved by attention's backward anyway. Forward then writes one cast of the input instead of
two, and backward reads the input once more (and recomputes what made it). The cast ops are opaque
to the compiler, so without this their outputs must be saved: one byte per element of every
converted linear's input. Eager code keeps the cast: there the input would be an extra copy in its
own dtype. ``Policy.recast_inputs`` turns it on (off by default: on the H200 it costs the compiled
1B step about 3% of its speed for 9% of its peak, the re-read of the input in backward; not while
the norms keep FP8 copies, from which their outputs cannot be rebuilt). The recast takes the
reference's traced operations, which the compiler fuses with what rebuilds the input; an opaque
Triton recast makes the partitioner save the input instead of rebuilding it, unless the operations
that make the input are marked for recomputation (selective activation checkpointing's
``MUST_RECOMPUTE``). Measured on the CPU through the interpreter, a norm and a converted linear of
64 x 128 -> 256 keep 172.8 kB for backward without the recast, 197.4 kB with an opaque recast, and
164.4 kB with it and the norm so marked. Not built: the traced recast's kernels already take the GPU
time torchao's take for the same work (BENCHMARKS.md, run 15).
"""
from __future__ import annotations

from typing import NamedTuple

import torch
import torch.distributed as dist

from lowprec import kernels as K
from lowprec.nn.casts import (
    CastState,
    Operand,
    QuantizedWeight,
    agreed_scale,
    cast_operand,
    input_casts,
    record_weight_amax,
    weight_casts,
    weight_operand,
)
from lowprec.nn.casts import serves as weight_serves
from lowprec.nn.plan import HP, GemmPlan, LayerPlan, SavePlan, WeightKind, WeightT
from lowprec.nn.probe import probe
from lowprec.nn.stored_codes import stored_operand
from lowprec.quant import QuantizedTensor


def _hp(op: Operand, dtype: torch.dtype) -> torch.Tensor:
    return op.dequantize(dtype) if isinstance(op, QuantizedTensor) else op.to(dtype)


def gemm(a: Operand, b: Operand, g: GemmPlan, out_dtype: torch.dtype) -> torch.Tensor:
    """``a (M, K) @ b (N, K).T`` on the plan's path: the scaled GEMM when both operands are quantized,
    else in high precision (the wider of the operands' dtypes)."""
    if g.path is not HP:
        return K.scaled_mm(a, b, out_dtype, fast_accum=g.fast_accum, backend=g.path)
    dtypes = [op.dtype for op in (a, b) if isinstance(op, torch.Tensor)]
    dt = max(dtypes, key=lambda d: d.itemsize) if dtypes else out_dtype
    return (_hp(a, dt) @ _hp(b, dt).t()).to(out_dtype)


def output_dtype(x: torch.Tensor) -> torch.dtype:
    dev = x.device.type
    return torch.get_autocast_dtype(dev) if torch.is_autocast_enabled(dev) else x.dtype


def save_plan(weight: torch.Tensor, codes: tuple, plan: LayerPlan, state: CastState) -> SavePlan:
    """The layer plan's :class:`~lowprec.nn.plan.SavePlan` for this weight, here (cached casts or not,
    compiled or not)."""
    if codes:
        kind, serves = WeightKind.STORED, plan.stored_weight
    elif isinstance(weight, QuantizedWeight):
        kind = WeightKind.RESIDENT if weight.resident else WeightKind.GATHERED
        serves = weight_serves(weight, plan.weight)
    else:
        kind, serves = WeightKind.PLAIN, False
    return plan.save(kind, serves, state.caching, torch.compiler.is_compiling())


class Forward(NamedTuple):
    """What :func:`fprop` gives: the output, and what backward needs as its save plan says."""

    y: torch.Tensor
    save: SavePlan
    x_t: Operand | None
    """x.T's cast, kept; None where wgrad does not run or backward casts it again."""
    w_t: Operand | None
    """weight.T's cast, kept (``WeightT.KEPT``); None otherwise."""
    scale_t: torch.Tensor | None
    """The scale backward casts weight.T with: forward's delayed scale (``SavePlan.scale_t``), or under
    tensor parallelism the per-tensor scale forward agreed over the group; else None."""
    x_scale: torch.Tensor | None
    """The per-tensor scale backward casts x.T with (``SavePlan.input_scale``), or None."""


def fprop(x, weight, bias, plan: LayerPlan, state: CastState, need_dgrad: bool, need_wgrad: bool,
          record: bool = True, codes: tuple = ()) -> Forward:
    """The forward GEMM, and what backward needs as the layer's save plan says (see [Note: what backward
    keeps] and [Note: recasting the input in backward]). ``record``: add the amaxes to the
    delayed-scaling history (training, not evaluation). ``codes``: an FP8 primary weight's (codes,
    scales, amax) as plain tensors, or () (see [Note: FP8 primary weights under torch.compile] in
    ``lowprec.nn.stored_codes``)."""
    out_dtype = output_dtype(x)
    w_op = plan.weight
    save = save_plan(weight, codes, plan, state)
    stored = _stored(codes, plan, weight.shape, weight.dtype)
    keep_w_t = need_dgrad and save.weight_t is WeightT.KEPT
    recast_x = need_wgrad and save.input_recast
    scale_t = None
    with torch.autocast(x.device.type, enabled=False):
        x2 = x.reshape(-1, x.shape[-1])  # (M, K)
        qx, qx_t = input_casts(x, x2, plan.input, need_wgrad and not recast_x, state, record)
        # per tensor, backward's x.T cast takes forward's scale (see _recast_route in lowprec.nn.plan)
        x_scale = qx.scale if recast_x and save.input_scale else None
        if save.direct and stored is not None:  # the codes are the operand (and in backward, transposed)
            qw, qw_t = stored, None
            record_weight_amax(state.delayed, w_op, codes[2], record)
        else:
            qw, qw_t = weight_casts(weight, w_op, state, keep_w_t, record, stored)
            if need_dgrad and save.scale_t and state.delayed is not None:
                scale_t = qw.scale  # forward's own, taken before this forward recorded the weight's amax
            elif (need_dgrad and state.group is not None and save.weight_t is WeightT.PARAMETER
                  and w_op.transposed_takes_k_scale):
                scale_t = qw.scale  # the scale agreed over the tensor-parallel group: backward's weight.T
                # takes it rather than agree the same amax again (see agreed_scale)
        collector = probe()  # None but on a sampled step (see [Note: telemetry under torch.compile])
        if collector is not None:
            quantized = stored is not None or isinstance(weight, QuantizedWeight)
            collector.forward(state, plan, x2, None if quantized else weight, qx, qx_t, qw, qw_t)
        y = gemm(qx, qw, plan.fprop, out_dtype)  # (M, N)
        if bias is not None:
            y = y + bias.to(out_dtype)
    return Forward(y.view(*x.shape[:-1], y.shape[-1]), save, qx_t, qw_t, scale_t, x_scale)


def _stored(codes: tuple, plan: LayerPlan, shape: torch.Size, dtype: torch.dtype,
            transposed: bool = False) -> QuantizedTensor | None:
    """An FP8 primary weight's codes (``codes``: codes, scales, ...) as its operand, or None without."""
    if not codes:
        return None
    return stored_operand(codes[0], codes[1], plan.weight_storage, shape, dtype, transposed)


def weight_t_again(weight: torch.Tensor, plan: LayerPlan, scale_t: torch.Tensor | None,
                   after: torch.Tensor | None = None, group: dist.ProcessGroup | None = None) -> Operand:
    """weight.T's cast made again in backward, with forward's delayed scale and no amax recorded: the
    same bits as forward would have made (every backend equals the reference). ``after``: backward's
    incoming gradient (see [Note: casts a compiled backward makes] in ``lowprec.kernels.cast``).
    ``group``: the tensor-parallel group the weight is a shard of (see ``lowprec.nn.casts.agreed_scale``)."""
    if isinstance(weight, QuantizedWeight):  # an FP8 weight all-gathered by FSDP2, or not held by a layer
        if weight_serves(weight, plan.weight):
            return weight_operand(weight, transposed=True)
        weight = weight.dequantize()
    route = plan.weight.transposed
    if scale_t is None and route.transposed is not None and not route.transposed.delayed:
        scale_t = agreed_scale(weight, route.transposed, group)
    return K.cast(weight, route, scale_t=scale_t, after=after).transposed


def _input_t(x: torch.Tensor, plan: LayerPlan, x_scale: torch.Tensor | None, after: torch.Tensor) -> Operand:
    """x.T's cast made again in backward (see [Note: recasting the input in backward]); ``after`` as
    for :func:`weight_t_again`."""
    x2 = x.detach().reshape(-1, x.shape[-1])
    return K.cast(x2, plan.input.recast, scale_t=x_scale, after=after).transposed


def _stored_t(codes: tuple, plan: LayerPlan, shape: torch.Size, dtype: torch.dtype,
              scale_t: torch.Tensor | None, after: torch.Tensor | None = None) -> Operand:
    """weight.T's operand from an FP8 primary weight's codes: the codes transposed where they serve the
    recipe, else the decoded weight cast as :func:`weight_t_again` casts it."""
    if plan.stored_weight:
        return _stored(codes, plan, shape, dtype, transposed=True)
    return weight_t_again(_stored(codes, plan, shape, dtype).dequantize(dtype), plan, scale_t, after)


class Saved(NamedTuple):
    """The tensors forward gives ``save_for_backward``, by name (autograd takes a flat sequence)."""

    x_t: tuple = (None, None, None)
    """x.T's cast (``QuantizedTensor.to_saved``), or the input itself and its scale to cast it again by."""
    w_t: tuple = (None, None, None)
    """weight.T's cast, where kept."""
    scale_t: torch.Tensor | None = None
    weight: torch.Tensor | None = None
    """The parameter, where backward casts weight.T again from it (no copy, and a version check)."""
    codes: tuple = (None, None)
    """An FP8 primary weight's codes and scales, where backward takes weight.T from them: compiled
    code cannot unwrap the parameter."""

    def flat(self) -> tuple:
        return (*self.x_t, *self.w_t, self.scale_t, self.weight, *self.codes)

    @classmethod
    def of(cls, tensors: tuple) -> Saved:
        return cls(tuple(tensors[:3]), tuple(tensors[3:6]), tensors[6], tensors[7], tuple(tensors[8:10]))


def pack_operand(op: Operand | None) -> tuple[tuple, tuple | None]:
    """A kept cast for ``save_for_backward``, with the metadata to rebuild it (None: a plain tensor)."""
    if isinstance(op, QuantizedTensor):
        return op.to_saved()
    return (op, None, None), None


def unpack_operand(tensors: tuple, meta: tuple | None) -> Operand | None:
    return QuantizedTensor.from_saved(tensors, meta) if meta is not None else tensors[0]


class Meta(NamedTuple):
    """What backward needs besides tensors."""

    save: SavePlan
    x_meta: tuple | None
    w_meta: tuple | None
    x_shape: torch.Size
    x_dtype: torch.dtype
    w_shape: torch.Size
    w_dtype: torch.dtype
    b_dtype: torch.dtype | None


class LinearFunction(torch.autograd.Function):
    """``y = x @ w.T + b`` with every GEMM operand cast as ``plan`` says (see [Note: the three GEMMs]
    in ``lowprec.recipes``); ``state`` holds the weight cache and the delayed-scaling history."""

    @staticmethod
    def forward(ctx, x, weight, bias, plan: LayerPlan, state: CastState, data=None, scale=None, amax=None):
        # data, scale, amax: an FP8 primary weight's codes as plain tensors (see lowprec.nn.stored_codes)
        need_dgrad, need_wgrad = ctx.needs_input_grad[:2]
        codes = (data, scale, amax) if data is not None else ()
        f = fprop(x, weight, bias, plan, state, need_dgrad, need_wgrad, codes=codes)
        recast_x = need_wgrad and f.save.input_recast
        # x itself, for the compiler to keep or rebuild, with the scale to cast it again by
        x_saved, x_meta = pack_operand(f.x_t) if not recast_x else ((x, f.x_scale, None), None)
        w_saved, w_meta = pack_operand(f.w_t)
        w_from = f.save.weight_t if need_dgrad else None
        ctx.save_for_backward(*Saved(
            x_saved, w_saved, f.scale_t,
            weight=weight if w_from is WeightT.PARAMETER else None,
            codes=(data, scale) if w_from is WeightT.CODES else (None, None)).flat())
        ctx.meta = Meta(f.save, x_meta, w_meta, x.shape, x.dtype, weight.shape, weight.dtype,
                        bias.dtype if bias is not None else None)
        ctx.plan, ctx.state = plan, state
        return f.y

    @staticmethod
    def backward(ctx, dy):
        meta: Meta = ctx.meta
        saved = Saved.of(ctx.saved_tensors)
        plan: LayerPlan = ctx.plan
        need_dgrad, need_wgrad, need_bias = ctx.needs_input_grad[:3]
        recast_x = need_wgrad and meta.save.input_recast
        qx_t = unpack_operand(saved.x_t, meta.x_meta) if not recast_x else None
        dx = dw = db = None
        with torch.autocast(dy.device.type, enabled=False):
            w_from = meta.save.weight_t if need_dgrad else None
            if w_from is WeightT.CODES:
                qw_t = _stored_t(saved.codes, plan, meta.w_shape, meta.w_dtype, saved.scale_t, dy)
            elif w_from is WeightT.PARAMETER:
                qw_t = weight_t_again(saved.weight.detach(), plan, saved.scale_t, dy, ctx.state.group)
            else:
                qw_t = unpack_operand(saved.w_t, meta.w_meta)
            dy2 = dy.reshape(-1, dy.shape[-1])  # (M, N)
            if need_dgrad or need_wgrad:  # a frozen input (the first layer) needs only wgrad's operand
                qdy, qdy_t = cast_operand(dy2, plan.grad_output, need_dgrad, need_wgrad, ctx.state.delayed, True,
                                          ctx.state.group)
                collector = probe()
                if collector is not None:
                    collector.backward(ctx.state, plan, dy2, qdy, qdy_t, saved.weight,
                                       qw_t if saved.weight is not None else None)
            if need_dgrad:
                dx = gemm(qdy, qw_t, plan.dgrad, meta.x_dtype).view(meta.x_shape)  # (M, K)
            if need_wgrad:
                if recast_x:
                    # compiled code only, where telemetry's sampled steps run eagerly and keep the cast
                    qx_t = _input_t(saved.x_t[0], plan, saved.x_t[1], dy)
                dw = gemm(qdy_t, qx_t, plan.wgrad, meta.w_dtype)  # (N, K)
            if meta.b_dtype is not None and need_bias:
                db = dy2.sum(0).to(meta.b_dtype)
        return dx, dw, db, None, None, None, None, None
