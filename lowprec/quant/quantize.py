"""``quantize``: the pure-torch reference that maps a tensor onto a format with a granularity.

Fast kernels (``lowprec.kernels``) must equal this bit for bit.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as nnf

from lowprec import formats as F
from lowprec._checks import check_same_device, check_tensor, describe, fail
from lowprec.quant import scales as S
from lowprec.quant.granularity import Granularity, ScaleRule
from lowprec.quant.tensor import QuantizedTensor, store

_FP32_MAX = torch.finfo(torch.float32).max


def as_2d(x: torch.Tensor) -> torch.Tensor:
    """The (M, K) view of [Note: the 2-D view]; a 0-d or 1-d tensor is one row."""
    # M spelled out, not -1: reshape cannot infer -1 for an empty tensor (an MoE expert given no tokens)
    return x.reshape(math.prod(x.shape[:-1]), x.shape[-1]) if x.dim() else x.reshape(1, 1)


def pad_to_blocks(x2: torch.Tensor, br: int, bc: int) -> torch.Tensor:
    m, k = x2.shape
    pm, pk = (-m) % br, (-k) % bc
    return nnf.pad(x2, (0, pk, 0, pm)) if pm or pk else x2


def block_amax(xp: torch.Tensor, br: int, bc: int) -> torch.Tensor:
    """Largest magnitude per block of a padded 2-D tensor; NaN where a block holds NaN."""
    mp, kp = xp.shape
    return xp.abs().view(mp // br, br, kp // bc, bc).amax(dim=(1, 3))  # (Mb, Kb)


def given_scale(scale: torch.Tensor, grid: tuple[int, int]) -> torch.Tensor:
    """A caller's scale as the (Mb, Kb) block grid, copied: a delayed-scaling buffer is updated in
    place after each step, and a QuantizedTensor must keep the scale it was quantized with."""
    try:
        return torch.broadcast_to(scale.float(), grid).clone()
    except RuntimeError:
        fail("scale", f"a tensor broadcastable to the block grid {grid}", describe(scale))


def _broadcasts(t: torch.Tensor, grid: tuple[int, int]) -> bool:
    try:
        return tuple(torch.broadcast_shapes(t.shape, grid)) == grid
    except RuntimeError:
        return False


def _check_args(x, fmt, granularity, rounding, scale, rand) -> tuple[F.Format, Granularity]:
    check_tensor("x", x)
    f = F.get(fmt)
    if not isinstance(granularity, Granularity):
        fail("granularity", "a lowprec.quant.Granularity (tensorwise(), mx(32), ...)", describe(granularity), TypeError)
    F.as_rounding(rounding)
    if f.kind is F.Kind.EXPONENT:
        fail("fmt", "an element format (e8m0 is a scale format)", f.name)
    if granularity.rule is not ScaleRule.AMAX and f.kind is not F.Kind.FLOAT:
        fail("fmt", f"a floating-point element format for {granularity} scales", f.name)
    if scale is not None:
        check_tensor("scale", scale)
        if granularity.rule is not ScaleRule.AMAX:
            fail("scale", f"None for {granularity} (its scales are always computed from the data)", describe(scale))
    if rand is not None and (not isinstance(rand, torch.Tensor) or rand.shape != x.shape):
        fail("rand", f"a float32 tensor of x's shape {tuple(x.shape)}", describe(rand))
    check_same_device(x=x, scale=scale, rand=rand)
    return f, granularity


def _divide(blocks: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``blocks / scale`` rounded once in FP32; zeros in blocks whose scale is NaN or zero (NaN lives
    in the scale)."""
    dead = ~torch.isfinite(scale) | (scale == 0)  # (Mb, 1, Kb, 1)
    return torch.where(dead, 0.0, blocks / torch.where(dead, 1.0, scale))


def _nvfp4(blocks: torch.Tensor, amax: torch.Tensor, f: F.Format,
           tensor_amax: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(E4M3 block scales, global decode scale, scaled elements) in the order of [Note: NVFP4's
    order of operations]: each element is multiplied by its block's encode scale. ``tensor_amax``: the
    finite amax the global scale comes from, broadcastable to the block grid (a global scale per group of
    blocks: experts cast together), instead of the whole tensor's."""
    if tensor_amax is None:
        finite = torch.where(torch.isfinite(amax), amax, 0.0)  # (Mb, Kb)
        tensor_amax = finite.amax() if finite.numel() else finite.new_zeros(())
    global_encode, global_scale = S.nvfp4_global_scales(tensor_amax, f)
    s = S.nvfp4_block_scale(amax, f, global_encode)  # (Mb, Kb)
    e = S.nvfp4_encode_scale(s, global_scale)[:, None, :, None]  # (Mb, 1, Kb, 1)
    scaled = torch.where(torch.isnan(e), 0.0, blocks * e)  # a block holding inf or NaN stores zeros
    # A block whose E4M3 scale underflowed to 0 has e = FP32 max: its codes are x * e clamped, as TE's.
    scaled = torch.where(e == _FP32_MAX, scaled.clamp(-f.max, f.max), scaled)
    return s, global_scale, scaled


def quantize(
    x: torch.Tensor,
    fmt: str | F.Format,
    granularity: Granularity,
    *,
    rounding: str | F.Rounding = F.Rounding.NEAREST,
    saturate: bool = True,
    scale: torch.Tensor | None = None,
    rand: torch.Tensor | None = None,
    generator: torch.Generator | None = None,
    global_amax: torch.Tensor | None = None,
) -> QuantizedTensor:
    """Quantize ``x`` onto ``fmt`` with one scale per block of ``granularity``.

    ``scale``: a given FP32 dequantizing scale (delayed scaling), broadcastable to the block grid
    ``(M_blocks, K_blocks)``, used instead of one computed from ``x``; only for FP32 (AMAX) scales.
    ``rounding="stochastic"`` takes ``rand`` (uniform [0, 1) float32, x's shape) or draws it from
    ``generator``; see :func:`lowprec.formats.round_to`. ``saturate`` as there. ``global_amax`` (NVFP4
    only): the finite amaxes NVFP4's global scales come from, broadcastable to the block grid, one per group
    of blocks (the experts of a mixture, cast together, each as its own tensor); the result's
    ``global_scale`` then has that shape.
    """
    f, g = _check_args(x, fmt, granularity, rounding, scale, rand)
    if global_amax is not None and g.rule is not ScaleRule.NVFP4:
        fail("global_amax", f"None for {g} (a global scale is NVFP4's)", describe(global_amax))
    x2 = as_2d(x.detach()).float()  # (M, K)
    br, bc = g.blocks(*x2.shape)
    xp = pad_to_blocks(x2, br, bc).contiguous()  # (Mp, Kp)
    mp, kp = xp.shape
    blocks = xp.view(mp // br, br, kp // bc, bc)
    global_scale = None
    if scale is not None:
        s = given_scale(scale, (mp // br, kp // bc))
        if not f.has_nan:  # the element format cannot hold inf/NaN: the block scale carries it
            s = torch.where(torch.isfinite(block_amax(xp, br, bc)), s, torch.nan)
        scaled = _divide(blocks, s[:, None, :, None])
    elif g.rule is ScaleRule.NVFP4:
        grid = (mp // br, kp // bc)
        if global_amax is not None and not _broadcasts(global_amax, grid):
            fail("global_amax", f"a tensor broadcastable to the block grid {grid}", describe(global_amax))
        s, global_scale, scaled = _nvfp4(blocks, block_amax(xp, br, bc), f,
                                         global_amax.float() if global_amax is not None else None)
    else:
        s = S.block_scales(block_amax(xp, br, bc), f, g.rule)
        scaled = _divide(blocks, s[:, None, :, None])
    scaled = scaled.view(mp, kp)
    r = None
    if F.as_rounding(rounding) is F.Rounding.STOCHASTIC:
        r = rand if rand is not None else torch.rand(x.shape, generator=generator, device=x.device)
        r = pad_to_blocks(as_2d(r.float()), br, bc)
    if saturate:  # no host sync: a GEMM operand's cast must not stall the GPU or break a graph
        values = F.round_unchecked(scaled, f, r)
    else:
        values = F.round_to(scaled, f, rounding=rounding, saturate=False, rand=r)
    return QuantizedTensor(store(values, f), s, f, g, x.shape, x.dtype, global_scale)


def dequantize(q: QuantizedTensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """``q.dequantize(dtype)``."""
    return q.dequantize(dtype)


def fake_quantize(x: torch.Tensor, fmt: str | F.Format, granularity: Granularity, **kw) -> torch.Tensor:
    """``dequantize(quantize(x, ...))`` in x's dtype: the values a low-precision GEMM sees."""
    return quantize(x, fmt, granularity, **kw).dequantize()


def error_bound(q: QuantizedTensor) -> torch.Tensor:
    """Largest error ``|dequantize(q) - x|`` per element of the padded 2-D view (float32), valid where
    the element did not saturate (nor, under NVFP4, sit in a block whose E4M3 scale underflowed to 0):
    half the grid spacing at the decoded value (at zero, the format's smallest step) times the scale,
    plus the FP32 rounding of ``x / scale`` (NVFP4: of ``x * fp32(1 / scale)``, two roundings) and of
    ``value * scale``."""
    v = q.values().abs()  # (Mp, Kp)
    spacing = torch.where(v == 0, q.fmt.min_subnormal, F._quantum(v, q.fmt))  # grid step at each value
    mb, kb = q.scale.shape
    br, bc = q.block_shape
    eff = q.effective_scale()[:, None, :, None]  # (Mb, 1, Kb, 1)
    v4 = v.view(mb, br, kb, bc)  # (Mb, br, Kb, bc)
    half = spacing.view(mb, br, kb, bc) / 2
    # x / scale and value * scale each round once in FP32 (2^-24 relative, 2^-150 absolute among
    # subnormals), NVFP4's x * fp32(1 / scale) twice; 2^-22 leaves room for rounding this sum itself.
    bound = (half + (v4 + half) * 2.0**-22) * eff + 2.0**-149
    return bound.view(q.data.shape)
