"""From a block's largest magnitude to its scale.

[Note: the scale convention]
A stored scale always *dequantizes*: ``x ~= decode(data) * scale``. Quantizing divides by it,
``data = encode(x / scale)``, for every granularity but NVFP4, which multiplies by encode scales
in TransformerEngine's order (see [Note: NVFP4's order of operations]).

Degenerate blocks, the same for every rule:
* all zeros (``amax == 0``): a finite scale (1 for FP32 scales, 2^-127 for E8M0, 0 for an NVFP4
  block with 1 for its global scale), so the block quantizes to zeros and nothing divides by zero;
* any inf or NaN in the block (``amax`` not finite): the scale is NaN, the block's data is zero, and
  the whole block dequantizes to NaN (the MX rule, applied to every granularity). Non-finite values
  are never made finite, and the NaN stays confined to its block.

[Note: NVFP4's order of operations]
NVFP4 scales and codes equal TransformerEngine's (its NVFP4 quantization kernels and their Python
reference) bit for bit, ties included, so its FP32 operations are done in its order. With ``amax``
the largest finite block amax of the tensor, ``fmax`` the element format's largest (6 for E2M1),
each line one FP32 rounding:

1. global encode scale ``G = min(448 * fmax / amax, FP32 max)``, 1 when ``amax`` is 0
   (``448 * fmax`` = 2688 is exact);
2. global decode scale ``g = 1 / G`` (what ``QuantizedTensor.global_scale`` stores);
3. block scale ``s = e4m3(amax_block * (G * r))`` with ``r = fp32(1 / fmax)``, rounded to nearest
   and saturating at 448: the multiplier ``G * r`` rounds once, the product once more, then E4M3;
4. block encode scale ``e = min(1 / (s * g), FP32 max)``: the product rounds, then its reciprocal;
5. element ``encode(x * e)``, the product rounded to FP32, then onto the format (saturating).

The stored scales still dequantize, ``x ~= decode(data) * s * g``: TE's encode scales are
``G ~= 1 / g`` and ``e ~= 1 / (s * g)``, each rounded once, so ``x * e`` can differ from
``x / (s * g)`` in the last place, which moves a value sitting on a rounding tie to the other
side. A block whose E4M3 scale underflows to 0 (its amax about 2^19 below the tensor's) gets
``e = FP32 max``: its codes are ``x * e`` clamped to ``+-fmax`` (TE's codes) and it dequantizes to
zeros whatever they are. Blocks holding inf or NaN stay lowprec's: NaN scale, zero data.
"""
from __future__ import annotations

import struct

import torch

from lowprec import formats as F
from lowprec.quant.granularity import ScaleRule

_E4M3 = F.get("e4m3")
_TINY = torch.finfo(torch.float32).tiny
_FP32_MAX = torch.finfo(torch.float32).max


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


def nvfp4_global_scales(amax: torch.Tensor, fmt: F.Format) -> tuple[torch.Tensor, torch.Tensor]:
    """NVFP4's global (encode ``G``, decode ``g = 1 / G``) scales from the tensor's finite ``amax``
    (steps 1 and 2 of [Note: NVFP4's order of operations]); (1, 1) when ``amax`` is 0."""
    encode = (torch.full_like(amax, fmt.max * _E4M3.max) / amax).clamp_max(_FP32_MAX)
    encode = torch.where(amax > 0, encode, 1.0)
    return encode, torch.ones_like(encode) / encode


def _fp32(v: float) -> float:
    """``v`` rounded to FP32 (to nearest even), as a Python float; plain Python, so compiled code
    takes it as a constant rather than breaking its graph on a tensor's ``item()``."""
    return struct.unpack("f", struct.pack("f", v))[0]


def nvfp4_block_scale(amax: torch.Tensor, fmt: F.Format, global_encode: torch.Tensor) -> torch.Tensor:
    """E4M3 block scale (as FP32) ``e4m3(amax * (G * fp32(1 / fmax)))``, saturating at 448 (step 3);
    NaN for non-finite blocks."""
    finite = torch.isfinite(amax)
    # 1 / fmax rounded to FP32 once, as a Python float that FP32 holds exactly, so the multiply
    # below rounds once on every device whatever precision it widens the scalar to.
    rcp = _fp32(1.0 / fmt.max)
    multiplier = global_encode * rcp
    s = (torch.where(finite, amax, 0.0) * multiplier).clamp_max(_FP32_MAX)
    return _nonfinite_to_nan(F.round_unchecked(s, _E4M3), amax)


def nvfp4_encode_scale(scale: torch.Tensor, global_scale: torch.Tensor) -> torch.Tensor:
    """Per block, the FP32 factor elements are multiplied by: ``min(1 / (s * g), FP32 max)`` (step 4);
    FP32's max where the E4M3 scale is 0, NaN where it is NaN."""
    dequant = scale * global_scale
    return (torch.ones_like(dequant) / dequant).clamp_max(_FP32_MAX)


def block_scales(
    amax: torch.Tensor, fmt: F.Format, rule: ScaleRule, global_encode: torch.Tensor | None = None
) -> torch.Tensor:
    """Scale per block from the blocks' ``amax``, by the granularity's rule (NVFP4: given the
    global encode scale of :func:`nvfp4_global_scales`)."""
    if rule is ScaleRule.AMAX:
        return amax_scale(amax, fmt)
    if rule is ScaleRule.NVFP4:
        return nvfp4_block_scale(amax, fmt, global_encode)
    return mx_scale(amax, fmt, rule)
