"""The autograd of a low-precision linear layer, with its three GEMMs written out.

The function receives the layer's frozen :class:`~lowprec.nn.plan.LayerPlan` and its
:class:`~lowprec.nn.casts.CastState`, never the module: what to cast, how, and on which backend was
decided when the plan was built.

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

import torch

from lowprec import kernels as K
from lowprec.nn.casts import CastState, Operand, QuantizedWeight, cast_operand, input_casts, weight_casts
from lowprec.nn.plan import HP, GemmPlan, LayerPlan
from lowprec.nn.probe import probe
from lowprec.nn.stored_codes import stored_operand
from lowprec.quant import QuantizedTensor


def _hp(op: Operand, dtype: torch.dtype) -> torch.Tensor:
    return op.dequantize(dtype) if isinstance(op, QuantizedTensor) else op.to(dtype)


def gemm(a: Operand, b: Operand, g: GemmPlan, out_dtype: torch.dtype) -> torch.Tensor:
    """``a (M, K) @ b (N, K).T`` on the plan's path: the scaled GEMM when both operands are quantized,
    else in high precision (the wider of the operands' dtypes)."""
    if g.path != HP:
        return K.scaled_mm(a, b, out_dtype, fast_accum=g.fast_accum, backend=g.path)
    dtypes = [op.dtype for op in (a, b) if isinstance(op, torch.Tensor)]
    dt = max(dtypes, key=lambda d: d.itemsize) if dtypes else out_dtype
    return (_hp(a, dt) @ _hp(b, dt).t()).to(out_dtype)


def _save(op: Operand | None) -> tuple[tuple, object]:
    """Tensors to ``save_for_backward`` and the metadata to rebuild the operand."""
    if isinstance(op, QuantizedTensor):
        return (op.data, op.scale, op.global_scale), (op.fmt, op.granularity, op.shape, op.dtype)
    return (op, None, None), None


def _restore(tensors, meta) -> Operand | None:
    if meta is None:
        return tensors[0]
    fmt, gran, shape, dtype = meta
    return QuantizedTensor(tensors[0], tensors[1], fmt, gran, shape, dtype, tensors[2])


def output_dtype(x: torch.Tensor) -> torch.dtype:
    dev = x.device.type
    return torch.get_autocast_dtype(dev) if torch.is_autocast_enabled(dev) else x.dtype


def fprop(x, weight, bias, plan: LayerPlan, state: CastState, need_dgrad: bool, need_wgrad: bool,
          record: bool = True, codes: tuple = (), recast_x: bool = False):
    """The forward GEMM; also what backward needs: (y, x.T cast or None, w.T cast or None, the delayed
    scale to cast w.T with in backward or None, the scale to cast x.T with in backward or None).
    Where backward recasts weight.T the w.T cast is None (see [Note: what backward keeps]), and where
    it recasts x.T (``recast_x``), x.T's (see [Note: recasting the input in backward]). ``record``: add
    the amaxes to the delayed-scaling history (training, not evaluation). ``codes``: an FP8 primary
    weight's (codes, scales, amax) as plain tensors, or () (see [Note: FP8 primary weights under
    torch.compile] in ``lowprec.nn.fp8_weight``)."""
    out_dtype = output_dtype(x)
    w_op = plan.weight
    stored = _stored(codes, plan, weight.shape, weight.dtype)
    direct = plan.stored_weight if stored is not None else isinstance(weight, QuantizedWeight) and weight.serves(w_op)
    # an FP8 primary weight's transposed codes are taken from the parameter in backward, never kept
    resident = stored is not None or (direct and weight.resident)
    recast = need_dgrad and (resident if direct else plan.recast_weight_t and not state.caching)
    scale_t = None
    delayed_t = w_op.transposed is not None and w_op.transposed.transposed.delayed
    with torch.autocast(x.device.type, enabled=False):
        x2 = x.reshape(-1, x.shape[-1])  # (M, K)
        qx, qx_t = input_casts(x, x2, plan.input, need_wgrad and not recast_x, state, record)
        # per tensor, backward's x.T cast takes forward's scale (see _recast_route in lowprec.nn.plan)
        x_scale = qx.scale if recast_x and plan.input.recast.transposed.delayed else None
        if direct and stored is not None:  # the codes are the operand (and in backward, transposed)
            qw, qw_t = stored, None
            if record and w_op.delayed and state.delayed is not None:
                state.delayed.record(w_op.role, codes[2])
        else:
            qw, qw_t = weight_casts(weight, w_op, state, need_dgrad and not recast, record, stored)
            if recast and not direct and state.delayed is not None and delayed_t:
                # forward's own scale, taken before this forward recorded the weight's amax: the plan
                # recasts a delayed weight.T only in forward's format (see [Note: delayed scaling
                # under torch.compile] in lowprec.nn.delayed)
                scale_t = qw.scale
        collector = probe()  # None but on a sampled step (see [Note: telemetry under torch.compile])
        if collector is not None:
            quantized = stored is not None or isinstance(weight, QuantizedWeight)
            collector.forward(state, plan, x2, None if quantized else weight, qx, qx_t, qw, qw_t)
        y = gemm(qx, qw, plan.fprop, out_dtype)  # (M, N)
        if bias is not None:
            y = y + bias.to(out_dtype)
    return y.view(*x.shape[:-1], y.shape[-1]), qx_t, qw_t, scale_t, x_scale


def _stored(codes: tuple, plan: LayerPlan, shape: torch.Size, dtype: torch.dtype,
            transposed: bool = False) -> QuantizedTensor | None:
    """An FP8 primary weight's codes (``codes``: codes, scales, ...) as its operand, or None without."""
    if not codes:
        return None
    return stored_operand(codes[0], codes[1], plan.weight_storage, shape, dtype, transposed)


def _weight_t(weight: torch.Tensor, plan: LayerPlan, scale_t: torch.Tensor | None,
              after: torch.Tensor | None = None) -> Operand:
    """weight.T's cast made again in backward, with forward's delayed scale and no amax recorded: the
    same bits as forward would have made (every backend equals the reference). ``after``: backward's
    incoming gradient (see [Note: casts a compiled backward makes] in ``lowprec.kernels.cast``)."""
    if isinstance(weight, QuantizedWeight):  # an FP8 weight all-gathered by FSDP2, or not held by a layer
        if weight.serves(plan.weight):
            return weight.quantized(transposed=True)
        weight = weight.dequantize()
    route = plan.weight.transposed
    return K.cast(weight, route, scale_t=scale_t, after=after).transposed


def _input_t(x: torch.Tensor, plan: LayerPlan, x_scale: torch.Tensor | None, after: torch.Tensor) -> Operand:
    """x.T's cast made again in backward (see [Note: recasting the input in backward]); ``after`` as
    for :func:`_weight_t`."""
    x2 = x.detach().reshape(-1, x.shape[-1])
    return K.cast(x2, plan.input.recast, scale_t=x_scale, after=after).transposed


def _stored_t(codes: tuple, plan: LayerPlan, shape: torch.Size, dtype: torch.dtype,
              scale_t: torch.Tensor | None, after: torch.Tensor | None = None) -> Operand:
    """weight.T's operand from an FP8 primary weight's codes: the codes transposed where they serve the
    recipe, else the decoded weight cast as :func:`_weight_t` casts it."""
    if plan.stored_weight:
        return _stored(codes, plan, shape, dtype, transposed=True)
    return _weight_t(_stored(codes, plan, shape, dtype).dequantize(dtype), plan, scale_t, after)


class LinearFunction(torch.autograd.Function):
    """``y = x @ w.T + b`` with every GEMM operand cast as ``plan`` says (see [Note: the three GEMMs]
    in ``lowprec.recipes``); ``state`` holds the weight cache and the delayed-scaling history."""

    @staticmethod
    def forward(ctx, x, weight, bias, plan: LayerPlan, state: CastState, data=None, scale=None, amax=None):
        # data, scale, amax: an FP8 primary weight's codes as plain tensors (see lowprec.nn.fp8_weight)
        need_dgrad, need_wgrad = ctx.needs_input_grad[:2]
        codes = (data, scale, amax) if data is not None else ()
        recast_x = need_wgrad and plan.recast_input and torch.compiler.is_compiling()
        y, qx_t, qw_t, scale_t, x_scale = fprop(x, weight, bias, plan, state, need_dgrad, need_wgrad,
                                                codes=codes, recast_x=recast_x)
        # x itself, for the compiler to keep or rebuild, with the scale to cast it again by
        x_saved, x_meta = _save(qx_t) if not recast_x else ((x, x_scale, None), "recast")
        w_saved, w_meta = _save(qw_t)
        recast = need_dgrad and qw_t is None  # the parameter itself: no copy, and a version check
        # an FP8 weight's own codes are kept rather than the parameter, which compiled code cannot unwrap
        kept = (None, data, scale) if recast and codes else (weight if recast else None, None, None)
        ctx.save_for_backward(*x_saved, *w_saved, scale_t, *kept)
        ctx.meta = (x_meta, w_meta, x.shape, x.dtype, weight.shape, weight.dtype,
                    bias.dtype if bias is not None else None)
        ctx.plan, ctx.state = plan, state
        return y

    @staticmethod
    def backward(ctx, dy):
        x_meta, w_meta, x_shape, x_dtype, w_shape, w_dtype, b_dtype = ctx.meta
        saved = ctx.saved_tensors
        recast_x = x_meta == "recast"
        qx_t = _restore(saved[:3], x_meta) if not recast_x else None
        qw_t = _restore(saved[3:6], w_meta)
        scale_t, weight, data, scale = saved[6:10]
        plan: LayerPlan = ctx.plan
        need_dgrad, need_wgrad, need_bias = ctx.needs_input_grad[:3]
        dx = dw = db = None
        with torch.autocast(dy.device.type, enabled=False):
            if data is not None:
                qw_t = _stored_t((data, scale), plan, w_shape, w_dtype, scale_t, dy)
            elif weight is not None:
                qw_t = _weight_t(weight.detach(), plan, scale_t, dy)
            dy2 = dy.reshape(-1, dy.shape[-1])  # (M, N)
            if need_dgrad or need_wgrad:  # a frozen input (the first layer) needs only wgrad's operand
                qdy, qdy_t = cast_operand(dy2, plan.grad_output, need_dgrad, need_wgrad, ctx.state.delayed, True)
                collector = probe()
                if collector is not None:
                    collector.backward(ctx.state, plan, dy2, qdy, qdy_t, weight, qw_t if weight is not None else None)
            if need_dgrad:
                dx = gemm(qdy, qw_t, plan.dgrad, x_dtype).view(x_shape)  # (M, K)
            if need_wgrad:
                if recast_x:
                    # compiled code only, where telemetry's sampled steps run eagerly and keep the cast
                    qx_t = _input_t(saved[0], plan, saved[1], dy)
                dw = gemm(qdy_t, qx_t, plan.wgrad, w_dtype)  # (N, K)
            if b_dtype is not None and need_bias:
                db = dy2.sum(0).to(b_dtype)
        return dx, dw, db, None, None, None, None, None
