"""A linear layer whose casts go through ``lowprec.kernels.fused.cast_pair``: each operand read once
for both of its casts, the transposed copy, the Hadamard transform and the delayed-scaling amax
fused in. The benchmarks time it beside ``lowprec.nn.Linear`` to show what fusing the casts buys;
``FusedLinear`` is a blueprint for ``lowprec.nn.function``, not a second public layer.
"""
from __future__ import annotations

import torch
import torch.nn as nn

from lowprec import formats as F
from lowprec import recipes as R
from lowprec.kernels import scaled_mm
from lowprec.kernels.fused import cast_pair
from lowprec.quant import QuantizedTensor
from lowprec.quant.scales import amax_scale

HADAMARD_SEED = 0x5EED


class _Delayed:
    """Per-role amax history of fixed length (a new tensor each step, so compiled graphs see one
    shape); the scale uses its max. Before a role's first amax, current scaling."""

    def __init__(self, length: int = 16) -> None:
        self.hist: dict[str, torch.Tensor] = {}
        self.length = length

    def scale(self, role: str, fmt: str) -> torch.Tensor | None:
        h = self.hist.get(role)
        return None if h is None else amax_scale(h.amax(), F.get(fmt)).reshape(1, 1)

    def record(self, role: str, amax: torch.Tensor) -> None:
        amax = torch.where(torch.isfinite(amax), amax, 0.0).reshape(1)
        h = self.hist.get(role)
        h = amax.new_zeros(self.length) if h is None else h
        self.hist[role] = torch.cat([h[1:], amax])  # (length,)


def _pair(x2: torch.Tensor, c: R.Cast, c_t: R.Cast, state: _Delayed, role: str):
    delayed = c.scaling is R.Scaling.DELAYED
    scale = state.scale(role, c.format) if delayed else None
    q, q_t, amax = cast_pair(x2, c.format, c.granularity, c_t.format, c_t.granularity, rounding=c.rounding,
                             rounding_t=c_t.rounding, scale=scale, record_amax=delayed,
                             hadamard_t=HADAMARD_SEED if c_t.hadamard else None)
    if delayed:
        state.record(role, amax)
    return q, q_t


class _Fn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, recipe: R.Recipe, state: _Delayed):
        x2 = x.reshape(-1, x.shape[-1])  # (M, K)
        qx, qx_t = _pair(x2, recipe.fprop.lhs, recipe.wgrad.rhs, state, "input")
        qw, qw_t = _pair(weight, recipe.fprop.rhs, recipe.dgrad.rhs, state, "weight")
        y = scaled_mm(qx, qw, x.dtype, fast_accum=recipe.fprop.fast_accum)  # (M, N)
        # low-precision copies only: never more memory than BF16
        ctx.save_for_backward(qx_t.data, qx_t.scale, qx_t.global_scale, qw_t.data, qw_t.scale, qw_t.global_scale)
        ctx.meta = [(q.fmt, q.granularity, q.shape, q.dtype) for q in (qx_t, qw_t)]
        ctx.recipe, ctx.state, ctx.x_shape, ctx.dtypes = recipe, state, x.shape, (x.dtype, weight.dtype)
        return y.view(*x.shape[:-1], y.shape[-1])

    @staticmethod
    def backward(ctx, dy):
        t = ctx.saved_tensors
        (fx, gx, sx, dx_), (fw, gw, sw, dw_) = ctx.meta
        qx_t = QuantizedTensor(t[0], t[1], fx, gx, sx, dx_, t[2])
        qw_t = QuantizedTensor(t[3], t[4], fw, gw, sw, dw_, t[5])
        r: R.Recipe = ctx.recipe
        dy2 = dy.reshape(-1, dy.shape[-1])  # (M, N)
        qdy, qdy_t = _pair(dy2, r.dgrad.lhs, r.wgrad.lhs, ctx.state, "grad_output")
        dx = scaled_mm(qdy, qw_t, ctx.dtypes[0], fast_accum=r.dgrad.fast_accum).view(ctx.x_shape)  # (M, K)
        dw = scaled_mm(qdy_t, qx_t, ctx.dtypes[1], fast_accum=r.wgrad.fast_accum)  # (N, K)
        return dx, dw, None, None


class FusedLinear(nn.Module):
    """Bias-free linear with ``recipe``'s casts, sharing ``linear``'s weight."""

    def __init__(self, linear: nn.Linear, recipe: str | R.Recipe) -> None:
        super().__init__()
        self.weight = linear.weight
        self.recipe = R.get(recipe)
        self.state = _Delayed()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _Fn.apply(x, self.weight, self.recipe, self.state)


def fuse(model: nn.Module, recipe: str | R.Recipe) -> nn.Module:
    """Swap every ``nn.Linear`` (bias-free) of ``model`` for a :class:`FusedLinear`, in place."""
    for name, mod in list(model.named_modules()):
        for child_name, child in list(mod.named_children()):
            if type(child) is nn.Linear:
                setattr(mod, child_name, FusedLinear(child, recipe))
    return model
