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
"""
from __future__ import annotations

import torch

from lowprec import kernels as K
from lowprec.nn.casts import CastState, Operand, QuantizedWeight, cast_operand, input_casts, weight_casts
from lowprec.nn.plan import HP, GemmPlan, LayerPlan
from lowprec.quant import QuantizedTensor
from lowprec.telemetry.collect import probe


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
          record: bool = True):
    """The forward GEMM; also what backward needs: (y, x.T cast or None, w.T cast or None, the delayed
    scale to cast w.T with in backward or None). Where backward recasts weight.T the w.T cast is None
    (see [Note: what backward keeps]). ``record``: add the amaxes to the delayed-scaling history
    (training, not evaluation)."""
    out_dtype = output_dtype(x)
    w_op = plan.weight
    direct = isinstance(weight, QuantizedWeight) and weight.serves(w_op)
    # an FP8 primary weight's transposed codes are taken from the parameter in backward, never kept
    recast = need_dgrad and (weight.resident if direct else plan.recast_weight_t and not state.caching)
    scale_t = None
    delayed_t = w_op.transposed is not None and w_op.transposed.transposed.delayed
    if recast and not direct and state.delayed is not None and delayed_t:
        # taken before this forward records the weight's amax, as the forward's own cast takes it
        scale_t = state.delayed.scale(w_op.role, w_op.transposed.transposed.fmt, weight)
    with torch.autocast(x.device.type, enabled=False):
        x2 = x.reshape(-1, x.shape[-1])  # (M, K)
        qx, qx_t = input_casts(x, x2, plan.input, need_wgrad, state, record)
        qw, qw_t = weight_casts(weight, w_op, state, need_dgrad and not recast, record)
        collector = probe()  # None but on a sampled step (see [Note: telemetry under torch.compile])
        if collector is not None:
            collector.forward(state, plan, x2, None if isinstance(weight, QuantizedWeight) else weight, qx, qx_t,
                              qw, qw_t)
        y = gemm(qx, qw, plan.fprop, out_dtype)  # (M, N)
        if bias is not None:
            y = y + bias.to(out_dtype)
    return y.view(*x.shape[:-1], y.shape[-1]), qx_t, qw_t, scale_t


def _weight_t(weight: torch.Tensor, plan: LayerPlan, scale_t: torch.Tensor | None) -> Operand:
    """weight.T's cast made again in backward, with forward's delayed scale and no amax recorded: the
    same bits as forward would have made (every backend equals the reference)."""
    if isinstance(weight, QuantizedWeight):  # an FP8 primary weight (see lowprec.nn.fp8_weight)
        if weight.serves(plan.weight):
            return weight.quantized(transposed=True)
        weight = weight.dequantize()
    route = plan.weight.transposed
    return K.cast(weight, route, scale_t=scale_t).transposed


class LinearFunction(torch.autograd.Function):
    """``y = x @ w.T + b`` with every GEMM operand cast as ``plan`` says (see [Note: the three GEMMs]
    in ``lowprec.recipes``); ``state`` holds the weight cache and the delayed-scaling history."""

    @staticmethod
    def forward(ctx, x, weight, bias, plan: LayerPlan, state: CastState):
        need_dgrad, need_wgrad = ctx.needs_input_grad[:2]
        y, qx_t, qw_t, scale_t = fprop(x, weight, bias, plan, state, need_dgrad, need_wgrad)
        x_saved, x_meta = _save(qx_t)
        w_saved, w_meta = _save(qw_t)
        recast = need_dgrad and qw_t is None  # the parameter itself: no copy, and a version check
        ctx.save_for_backward(*x_saved, *w_saved, weight if recast else None, scale_t)
        ctx.meta = (x_meta, w_meta, x.shape, x.dtype, weight.dtype, bias.dtype if bias is not None else None)
        ctx.plan, ctx.state = plan, state
        return y

    @staticmethod
    def backward(ctx, dy):
        x_meta, w_meta, x_shape, x_dtype, w_dtype, b_dtype = ctx.meta
        saved = ctx.saved_tensors
        qx_t, qw_t = _restore(saved[:3], x_meta), _restore(saved[3:6], w_meta)
        weight, scale_t = saved[6:8]
        plan: LayerPlan = ctx.plan
        need_dgrad, need_wgrad, need_bias = ctx.needs_input_grad[:3]
        dx = dw = db = None
        with torch.autocast(dy.device.type, enabled=False):
            if weight is not None:
                qw_t = _weight_t(weight.detach(), plan, scale_t)
            dy2 = dy.reshape(-1, dy.shape[-1])  # (M, N)
            if need_dgrad or need_wgrad:  # a frozen input (the first layer) needs only wgrad's operand
                qdy, qdy_t = cast_operand(dy2, plan.grad_output, need_dgrad, need_wgrad, ctx.state.delayed, True)
                collector = probe()
                if collector is not None:
                    collector.backward(ctx.state, plan, dy2, qdy, qdy_t, weight, qw_t if weight is not None else None)
            if need_dgrad:
                dx = gemm(qdy, qw_t, plan.dgrad, x_dtype).view(x_shape)  # (M, K)
            if need_wgrad:
                dw = gemm(qdy_t, qx_t, plan.wgrad, w_dtype)  # (N, K)
            if b_dtype is not None and need_bias:
                db = dy2.sum(0).to(b_dtype)
        return dx, dw, db, None, None
