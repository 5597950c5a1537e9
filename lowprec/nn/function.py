"""The autograd of a low-precision linear layer, with its three GEMMs written out.

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

import threading
import weakref

import torch

from lowprec import formats as F
from lowprec import kernels as K
from lowprec.kernels.fused import HADAMARD_BLOCK
from lowprec.quant import QuantizedTensor, hadamard_padded
from lowprec.recipes import Cast, Gemm, Recipe, Scaling

HADAMARD_SEED = 0x5EED
Operand = QuantizedTensor | torch.Tensor  # a high-precision operand is a plain tensor


def cast(x2: torch.Tensor, c: Cast, scale: torch.Tensor | None = None) -> Operand:
    """One operand (a 2-D view, reduced over its last dimension) cast as ``c`` says; ``scale`` is the
    delayed scale when ``c`` uses delayed scaling."""
    if c.format is None:
        return x2
    if c.granularity is None:  # unscaled cast (bf16/fp16)
        return x2.to(F.get(c.format).torch_dtype)
    if c.hadamard:
        x2 = hadamard_padded(x2, HADAMARD_BLOCK, HADAMARD_SEED)
    return K.quantize(x2, c.format, c.granularity, rounding=c.rounding, scale=scale)


def _delayed_scale(c: Cast | None, state, role: str, x: torch.Tensor) -> torch.Tensor | None:
    if c is None or state is None or c.scaling is not Scaling.DELAYED:
        return None
    return state.scale(role, F.get(c.format), x)


def _fusable(c: Cast, c_t: Cast) -> bool:
    """Both casts from one read (``kernels.cast_pair``): quantized, the Hadamard transform on the
    transposed side only, and one scale source (delayed scaling shares the scale, so one format)."""
    return (c.quantized and c_t.quantized and not c.hadamard and c.scaling is c_t.scaling
            and (c.scaling is not Scaling.DELAYED or c.format == c_t.format))


def cast_pair(x2: torch.Tensor, c: Cast, c_t: Cast | None, state=None, role: str = "",
              record: bool = True) -> tuple[Operand, Operand | None]:
    """``x2`` cast as ``c`` and ``x2.T`` as ``c_t`` (None: not needed), reading x2 once where a kernel
    can. Delayed scales come from ``state``'s history before this tensor's amax is recorded (once,
    and only with ``record``: evaluation must not move the training scales)."""
    delayed = state is not None and any(k is not None and k.scaling is Scaling.DELAYED for k in (c, c_t))
    scale, scale_t = _delayed_scale(c, state, role, x2), _delayed_scale(c_t, state, role, x2)
    if c_t is None or not _fusable(c, c_t):
        a = cast(x2, c, scale)
        b = cast(x2.t(), c_t, scale_t) if c_t is not None else None
        amax = x2.detach().abs().amax() if delayed and record else None
    else:
        a, b, amax = K.cast_pair(x2, c.format, c.granularity, c_t.format, c_t.granularity, rounding=c.rounding,
                                 rounding_t=c_t.rounding, scale=scale, record_amax=delayed and record,
                                 hadamard_t=HADAMARD_SEED if c_t.hadamard else None)
    if amax is not None:
        state.record(role, amax)
    return a, b


class _LastInput:
    """The casts of the last input a converted layer cast, for the layers that read the same tensor
    next (attention's q, k and v projections; the FFN's gate and up): they reuse its casts rather
    than cast it again, which spares the reads and keeps one saved copy where there were three.

    One slot per thread, so at most one input's casts are held beyond their use; the slot empties
    when its input is freed. A write the version counter does not see (through ``x.data``) between
    two layers reading ``x`` is not noticed, as for the weight cache. Only deterministic casts are
    shared (not delayed scaling, whose scales are per layer, nor stochastic rounding). Under
    ``torch.compile`` the compiler removes the repeated casts itself."""

    def __init__(self) -> None:
        self.key: tuple | None = None
        self.ref: weakref.ref | None = None
        self.casts: tuple | None = None

    @staticmethod
    def shareable(c: Cast, c_t: Cast | None) -> bool:
        return all(k is None or (k.scaling is not Scaling.DELAYED and k.rounding == "nearest") for k in (c, c_t))

    def get(self, x: torch.Tensor, key: tuple) -> tuple | None:
        if self.key == key and self.ref is not None and self.ref() is x:
            return self.casts
        return None

    def put(self, x: torch.Tensor, key: tuple, casts: tuple) -> None:
        self.key, self.casts = key, casts
        self.ref = weakref.ref(x, self._forget)

    def _forget(self, ref: weakref.ref) -> None:
        if self.ref is ref:
            self.key = self.ref = self.casts = None


_SLOTS = threading.local()


def _last_input() -> _LastInput:
    """This thread's slot: threads (``nn.DataParallel`` replicas) never see each other's casts."""
    slot = getattr(_SLOTS, "slot", None)
    if slot is None:
        slot = _SLOTS.slot = _LastInput()
    return slot


def input_casts(x: torch.Tensor, x2: torch.Tensor, c: Cast, c_t: Cast | None, state, record: bool):
    """``cast_pair`` of a layer's input ``x`` (``x2``: its 2-D view), shared with the previous layer
    when that one cast the same unchanged tensor the same way (see :class:`_LastInput`)."""
    if torch.compiler.is_compiling() or x.is_inference() or not _LastInput.shareable(c, c_t):
        return cast_pair(x2, c, c_t, state, "input", record)  # inference tensors have no version
    key = (x.data_ptr(), x._version, x.shape, x.stride(), x.dtype, x.device, c, c_t)
    slot = _last_input()
    casts = slot.get(x, key)
    if casts is None:
        casts = cast_pair(x2, c, c_t, state, "input", record)
        slot.put(x, key, casts)
    return casts


def transposed_cast(x2: torch.Tensor, c: Cast, c_t: Cast, scale_t: torch.Tensor | None) -> Operand:
    """The second result of ``cast_pair(x2, c, c_t)`` made again, with the given delayed scale (or
    None) and no amax recorded; the same bits either way (every backend equals the reference). On
    Triton through the fused pass, which reads x2 row by row and writes the transposed cast."""
    if _fusable(c, c_t) and K.quantize_backend(x2, c.format, c.granularity, c.rounding) == "triton":
        # side A's cast is thrown away: nearest, so it draws no random numbers
        return K.cast_pair(x2, c.format, c.granularity, c_t.format, c_t.granularity, rounding="nearest",
                           rounding_t=c_t.rounding, scale=scale_t,
                           hadamard_t=HADAMARD_SEED if c_t.hadamard else None)[1]
    return cast(x2.t(), c_t, scale_t)


def _hp(op: Operand, dtype: torch.dtype) -> torch.Tensor:
    return op.dequantize(dtype) if isinstance(op, QuantizedTensor) else op.to(dtype)


def gemm(a: Operand, b: Operand, g: Gemm, out_dtype: torch.dtype) -> torch.Tensor:
    """``a (M, K) @ b (N, K).T`` on the low-precision path when both operands are quantized, else in
    high precision (the wider of the operands' dtypes)."""
    if isinstance(a, QuantizedTensor) and isinstance(b, QuantizedTensor):
        return K.scaled_mm(a, b, out_dtype, fast_accum=g.fast_accum)
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


def fprop(x, weight, bias, recipe: Recipe, layer, need_dgrad: bool, need_wgrad: bool, record: bool = True):
    """The forward GEMM; also what backward needs: (y, x.T cast or None, w.T cast or None, the delayed
    scale to cast w.T with in backward or None). Where ``layer.defers_weight_t`` the w.T cast is
    None and backward makes it (see [Note: what backward keeps]). ``record``: add the amaxes to the
    delayed-scaling history (training, not evaluation)."""
    out_dtype = output_dtype(x)
    defer = need_dgrad and layer.defers_weight_t(recipe)
    # taken before this forward records the weight's amax, as the forward's own cast takes it
    scale_t = _delayed_scale(recipe.dgrad.rhs, layer.delayed_state, "weight", weight) if defer else None
    with torch.autocast(x.device.type, enabled=False):
        x2 = x.reshape(-1, x.shape[-1])  # (M, K)
        qx, qx_t = input_casts(x, x2, recipe.fprop.lhs, recipe.wgrad.rhs if need_wgrad else None,
                               layer.delayed_state, record)
        qw, qw_t = layer.weight_casts(weight, recipe, need_dgrad and not defer, record)
        y = gemm(qx, qw, recipe.fprop, out_dtype)  # (M, N)
        if bias is not None:
            y = y + bias.to(out_dtype)
    return y.view(*x.shape[:-1], y.shape[-1]), qx_t, qw_t, scale_t


class LinearFunction(torch.autograd.Function):
    """``y = x @ w.T + b`` with every GEMM operand cast as ``recipe`` says (see [Note: the three GEMMs]
    in ``lowprec.recipes``). ``layer`` gives the weight casts (cached per optimizer step) and the
    delayed-scaling state."""

    @staticmethod
    def forward(ctx, x, weight, bias, recipe: Recipe, layer):
        need_dgrad, need_wgrad = ctx.needs_input_grad[:2]
        y, qx_t, qw_t, scale_t = fprop(x, weight, bias, recipe, layer, need_dgrad, need_wgrad)
        x_saved, x_meta = _save(qx_t)
        w_saved, w_meta = _save(qw_t)
        deferred = need_dgrad and qw_t is None  # the parameter itself: no copy, and a version check
        ctx.save_for_backward(*x_saved, *w_saved, weight if deferred else None, scale_t)
        ctx.meta = (x_meta, w_meta, x.shape, x.dtype, weight.dtype, bias.dtype if bias is not None else None)
        ctx.recipe, ctx.layer = recipe, layer
        return y

    @staticmethod
    def backward(ctx, dy):
        x_meta, w_meta, x_shape, x_dtype, w_dtype, b_dtype = ctx.meta
        saved = ctx.saved_tensors
        qx_t, qw_t = _restore(saved[:3], x_meta), _restore(saved[3:6], w_meta)
        weight, scale_t = saved[6:8]
        r: Recipe = ctx.recipe
        need_dgrad, need_wgrad, need_bias = ctx.needs_input_grad[:3]
        dx = dw = db = None
        with torch.autocast(dy.device.type, enabled=False):
            if weight is not None:
                qw_t = transposed_cast(weight.detach(), r.fprop.rhs, r.dgrad.rhs, scale_t)
            dy2 = dy.reshape(-1, dy.shape[-1])  # (M, N)
            state = ctx.layer.delayed_state
            if need_dgrad:
                qdy, qdy_t = cast_pair(dy2, r.dgrad.lhs, r.wgrad.lhs if need_wgrad else None, state, "grad_output")
            else:  # a frozen input (the first layer): only the weight gradient's operand
                qdy, qdy_t = None, cast_pair(dy2.t(), r.wgrad.lhs, None, state, "grad_output")[0]
            if need_dgrad:
                dx = gemm(qdy, qw_t, r.dgrad, x_dtype).view(x_shape)  # (M, K)
            if need_wgrad:
                dw = gemm(qdy_t, qx_t, r.wgrad, w_dtype)  # (N, K)
            if b_dtype is not None and need_bias:
                db = dy2.sum(0).to(b_dtype)
        return dx, dw, db, None, None
