"""From a block's largest magnitude to its scale.

[Note: the scale convention]
A stored scale always *dequantizes*: ``x ~= decode(data) * scale``. Quantizing divides by it:
``data = encode(x / scale)``. This holds for every granularity; NVFP4's effective scale is the product
of its E4M3 block scale and its FP32 global scale, computed in FP32 as ``s_block * g``.

Degenerate blocks, the same for every rule:
* all zeros (``amax == 0``): a finite scale (1 for FP32 scales, 2^-127 for E8M0, 1 for NVFP4's
  global scale), so the block quantizes to zeros and nothing divides by zero;
* any inf or NaN in the block (``amax`` not finite): the scale is NaN, the block's data is zero, and
  the whole block dequantizes to NaN (the MX rule, applied to every granularity). Non-finite values
  are never made finite, and the NaN stays confined to its block.
"""
from __future__ import annotations

import torch

from lowprec import formats as F
from lowprec.quant.granularity import ScaleRule

_E4M3 = F.get("e4m3")
_TINY = torch.finfo(torch.float32).tiny


def _div(t: torch.Tensor, c: float) -> torch.Tensor:
    """``t / c`` rounded once in FP32 on every device (ATen on CUDA turns division by a Python
    scalar into a multiply by its rounded reciprocal, one unit in the last place off)."""
    return t / torch.full_like(t, c)


def _nonfinite_to_nan(scale: torch.Tensor, amax: torch.Tensor) -> torch.Tensor:
    return torch.where(torch.isfinite(amax), scale, torch.nan)


def amax_scale(amax: torch.Tensor, fmt: F.Format) -> torch.Tensor:
    """FP32 scale ``amax / fmax``; 1 for zero blocks (never below FP32's smallest normal)."""
    scale = torch.where(amax > 0, _div(amax, fmt.max).clamp_min(_TINY), 1.0)
    return _nonfinite_to_nan(scale, amax)


def _log2_floor(v: torch.Tensor) -> torch.Tensor:
    _, e = torch.frexp(v)  # v = m * 2^e, m in [0.5, 1)
    return e - 1


def _log2_ceil(v: torch.Tensor) -> torch.Tensor:
    m, e = torch.frexp(v)
    return torch.where(m == 0.5, e - 1, e)


def mx_scale(amax: torch.Tensor, fmt: F.Format, rule: ScaleRule) -> torch.Tensor:
    """E8M0 scale (as an FP32 power of two) for MX blocks, by the FLOOR or CEIL rule."""
    finite = torch.isfinite(amax) & (amax > 0)
    safe = torch.where(finite, amax, 1.0)
    if rule is ScaleRule.FLOOR:
        exp = _log2_floor(safe) - fmt.emax
    else:
        ratio = _div(safe, fmt.max)
        # amax / fmax can underflow to 0 in FP32 (amax near 1e-45); log2(0) = -inf clamps to -127,
        # whereas frexp(0) would report exponent 0 and give a scale of 1.
        finite = finite & (ratio > 0)
        exp = _log2_ceil(torch.where(finite, ratio, 1.0))
    exp = torch.where(finite, exp, -127).clamp(-127, 127)
    return _nonfinite_to_nan(torch.ldexp(torch.ones_like(amax), exp), amax)


def nvfp4_global_scale(amax: torch.Tensor, fmt: F.Format) -> torch.Tensor:
    """FP32 global scale ``amax / (fmax * 448)``, so every block scale fits E4M3; 1 when zero."""
    scale = torch.where(amax > 0, _div(amax, fmt.max * _E4M3.max).clamp_min(_TINY), 1.0)
    return torch.where(torch.isfinite(amax), scale, torch.nan)


def nvfp4_block_scale(amax: torch.Tensor, fmt: F.Format, global_scale: torch.Tensor) -> torch.Tensor:
    """E4M3 block scale (as FP32) ``e4m3(amax / fmax / g)``, saturating at 448; NaN for non-finite blocks."""
    finite = torch.isfinite(amax)
    s = _div(torch.where(finite, amax, 0.0), fmt.max) / global_scale
    return _nonfinite_to_nan(F.round_unchecked(torch.nan_to_num(s, nan=0.0), _E4M3), amax)


def block_scales(
    amax: torch.Tensor, fmt: F.Format, rule: ScaleRule, global_scale: torch.Tensor | None = None
) -> torch.Tensor:
    """Scale per block from the blocks' ``amax``, by the granularity's rule."""
    if rule is ScaleRule.AMAX:
        return amax_scale(amax, fmt)
    if rule is ScaleRule.NVFP4:
        return nvfp4_block_scale(amax, fmt, global_scale)
    return mx_scale(amax, fmt, rule)
