"""An independent reference for ``lowprec.quant``: numpy (float64 where a rule asks for it) and ml_dtypes.

Nothing here imports ``lowprec``. Every constant is written out by hand from the specs (OCP MX v1.0,
arXiv 2209.05433, arXiv 2509.25149), and each scale rule is written from its formula (NVFP4's from
TransformerEngine's order of float32 operations), so a test that compares ``quantize`` with this
module compares two implementations, not one with itself.

[Note: the reference 2-D view]
As in ``lowprec.quant``, a tensor is seen as ``(M, K) = (prod(shape[:-1]), shape[-1])``, tiled into
``br x bc`` blocks (``None``: the whole dimension), zero-padded up to whole blocks.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from tests.formats._oracle import ML_DTYPES as _ALL_ML_DTYPES

ML_DTYPES = {k: _ALL_ML_DTYPES[k] for k in ("e4m3", "e5m2", "e3m2", "e2m3", "e2m1")}
FMAX = {"e4m3": 448.0, "e5m2": 57344.0, "e3m2": 28.0, "e2m3": 7.5, "e2m1": 6.0}
"""Largest finite value of each element format (OCP MX v1.0 tables, arXiv 2209.05433)."""
EMAX = {"e4m3": 8, "e5m2": 15, "e3m2": 4, "e2m3": 2, "e2m1": 2}
"""Exponent of the largest binade, floor(log2(FMAX))."""
MAN_BITS = {"e4m3": 3, "e5m2": 2, "e3m2": 2, "e2m3": 3, "e2m1": 1}
MIN_SUBNORMAL = {"e4m3": 2.0**-9, "e5m2": 2.0**-16, "e3m2": 2.0**-4, "e2m3": 2.0**-3, "e2m1": 0.5}
E4M3_MAX = 448.0
FP32_TINY = np.float32(2.0**-126)
FP32_MAX = np.float32(np.finfo(np.float32).max)


@dataclass(frozen=True)
class Spec:
    """A granularity written out by hand: block shape on the 2-D view and the scale rule."""

    name: str
    br: int | None
    bc: int | None
    rule: str  # "amax" | "floor" | "ceil" | "nvfp4"


def view_2d(x: torch.Tensor) -> np.ndarray:
    """float32 numpy ``(M, K)`` view of any tensor (0-d and 1-d tensors are one row)."""
    a = x.detach().float().cpu().numpy()
    return a.reshape(1, 1) if a.ndim == 0 else a.reshape(-1, a.shape[-1])


def padded_blocks(x2: np.ndarray, spec: Spec) -> np.ndarray:
    """``(Mb, br, Kb, bc)`` blocks of the zero-padded 2-D view."""
    m, k = x2.shape
    br, bc = spec.br or m, spec.bc or k
    mp, kp = -(-m // br) * br, -(-k // bc) * bc
    xp = np.zeros((mp, kp), np.float32)
    xp[:m, :k] = x2
    return xp.reshape(mp // br, br, kp // bc, bc)


def block_amax(blocks: np.ndarray) -> np.ndarray:
    """float64 largest magnitude per block; NaN if the block holds NaN, inf if it holds inf."""
    a = np.abs(blocks.astype(np.float64))
    amax = a.max(axis=(1, 3))
    return np.where(np.isnan(a).any(axis=(1, 3)), np.nan, amax)


def cast(v: np.ndarray, fmt: str) -> np.ndarray:
    """ml_dtypes round-to-nearest-even cast of float32 ``v``, saturating at the format's max."""
    v = np.clip(np.asarray(v, np.float32), -FMAX[fmt], FMAX[fmt])
    return v.astype(ML_DTYPES[fmt])


def amax_rule(amax: np.ndarray, fmt: str) -> np.ndarray:
    """FP32 ``amax / fmax``: 1 for a zero block, at least FP32's smallest normal, NaN if non-finite."""
    with np.errstate(invalid="ignore"):
        s = (amax / FMAX[fmt]).astype(np.float32)  # float64 quotient rounded once more: exact for / (53 >= 2*24+2)
    s = np.maximum(s, FP32_TINY)
    s = np.where(amax == 0, np.float32(1), s)
    return np.where(np.isfinite(amax), s, np.nan).astype(np.float32)


def floor_rule(amax: np.ndarray, fmt: str) -> np.ndarray:
    """E8M0 ``2^(floor(log2 amax) - emax)``, exponent clamped to [-127, 127]; NaN if non-finite."""
    with np.errstate(divide="ignore", invalid="ignore"):
        e = np.floor(np.log2(amax)) - EMAX[fmt]
    e = np.clip(np.nan_to_num(e, nan=0.0, neginf=-127.0, posinf=127.0), -127, 127)
    return np.where(np.isfinite(amax), np.exp2(e), np.nan).astype(np.float32)


def ceil_rule(amax: np.ndarray, fmt: str) -> np.ndarray:
    """E8M0 ``2^ceil(log2(fp32(amax / fmax)))``, exponent clamped to [-127, 127]; NaN if non-finite."""
    with np.errstate(divide="ignore", invalid="ignore"):
        ratio = amax.astype(np.float32) / np.float32(FMAX[fmt])  # the rule's FP32 division
        e = np.ceil(np.log2(ratio.astype(np.float64)))
    e = np.clip(np.nan_to_num(e, nan=0.0, neginf=-127.0, posinf=127.0), -127, 127)
    return np.where(np.isfinite(amax), np.exp2(e), np.nan).astype(np.float32)


def nvfp4_rule(amax: np.ndarray, fmt: str) -> tuple[np.ndarray, np.float32, np.ndarray]:
    """(E4M3 block scales, FP32 global decode scale, FP32 block encode scales) in TransformerEngine's
    order, each step one float32 operation: global encode ``G = min(448 * fmax / amax_t, max)`` over
    the finite blocks (1 when zero), ``g = 1 / G``, block ``s = e4m3(amax_b * (G * (1 / fmax)))``,
    block encode ``e = min(1 / (s * g), max)``; NaN scales for non-finite blocks."""
    finite = np.isfinite(amax)
    amax_t = np.float32(amax[finite].max()) if finite.any() else np.float32(0)
    with np.errstate(divide="ignore", over="ignore", invalid="ignore"):
        big = np.float32(FMAX[fmt] * E4M3_MAX) / amax_t if amax_t > 0 else np.float32(1)
        big = np.minimum(big, FP32_MAX)
        g = np.float32(1) / big
        multiplier = big * (np.float32(1) / np.float32(FMAX[fmt]))
        s = np.minimum(np.where(finite, amax, 0).astype(np.float32) * multiplier, FP32_MAX)
        s = cast(s, "e4m3").astype(np.float32)
        enc = np.minimum(np.float32(1) / (s * g), FP32_MAX)
    return np.where(finite, s, np.nan).astype(np.float32), g, np.where(finite, enc, np.nan).astype(np.float32)


@dataclass(frozen=True)
class Reference:
    scale: np.ndarray  # (Mb, Kb) float32
    global_scale: np.float32 | None
    eff: np.ndarray  # (Mb, Kb) float32, the scale that multiplies decoded values
    values: np.ndarray  # (Mp, Kp) float32 decoded element values
    codes: np.ndarray  # (Mp, Kp) uint8 bit codes (ml_dtypes' layout: one right-aligned code per byte)
    scaled: np.ndarray  # (Mp, Kp) float64 |x / eff| (NVFP4: |x * e|), before rounding (0 in dead blocks)


def quantize_ref(x: torch.Tensor, fmt: str, spec: Spec) -> Reference:
    """The whole quantization of ``x`` by the reference: scales, then ml_dtypes' cast of x / scale."""
    blocks = padded_blocks(view_2d(x), spec)  # (Mb, br, Kb, bc)
    amax = block_amax(blocks)  # (Mb, Kb)
    g = None
    if spec.rule == "amax":
        scale = amax_rule(amax, fmt)
    elif spec.rule == "floor":
        scale = floor_rule(amax, fmt)
    elif spec.rule == "ceil":
        scale = ceil_rule(amax, fmt)
    else:
        scale, g, enc = nvfp4_rule(amax, fmt)
    eff = scale if g is None else (scale * g).astype(np.float32)
    with np.errstate(invalid="ignore", divide="ignore", over="ignore"):
        if g is None:  # x / scale; blocks with a zero or NaN scale store zeros
            e4 = eff[:, None, :, None]
            dead = ~np.isfinite(e4) | (e4 == 0)
            scaled = np.where(dead, np.float32(0), blocks / np.where(dead, np.float32(1), e4))
        else:  # x * e; a NaN block stores zeros, an underflowed one x * e (cast saturates it)
            e4 = enc[:, None, :, None]
            scaled = np.where(np.isnan(e4), np.float32(0), blocks * e4)
    scaled = scaled.astype(np.float32)
    mp, kp = blocks.shape[0] * blocks.shape[1], blocks.shape[2] * blocks.shape[3]
    lp = cast(scaled.reshape(mp, kp), fmt)
    return Reference(scale, g, eff, lp.astype(np.float32), lp.view(np.uint8),
                     np.abs(scaled.reshape(mp, kp).astype(np.float64)))


def expand(per_block: np.ndarray, br: int, bc: int) -> np.ndarray:
    """A per-block array repeated over each block's elements."""
    return np.repeat(np.repeat(per_block, br, axis=0), bc, axis=1)


def dequantize_ref(ref: Reference, shape: tuple[int, ...]) -> np.ndarray:
    """float32 ``values * eff`` cropped to ``shape``."""
    mb, kb = ref.eff.shape
    mp, kp = ref.values.shape
    full = (ref.values * expand(ref.eff, mp // mb, kp // kb)).astype(np.float32)
    m = int(np.prod(shape[:-1])) if len(shape) else 1
    k = shape[-1] if len(shape) else 1
    return full[:m, :k].reshape(shape)


def codes_of(data: torch.Tensor) -> np.ndarray:
    """A QuantizedTensor's element storage as uint8 codes (float8 dtypes viewed as bytes)."""
    return data.view(torch.uint8).cpu().numpy()


def wide_range(shape: tuple[int, ...], seed: int, lo: float = -12.0, hi: float = 12.0) -> torch.Tensor:
    """Normal values times 2^u, u uniform in [lo, hi) per element, so blocks span many binades."""
    gen = torch.Generator().manual_seed(seed)
    mag = torch.exp2(torch.empty(shape).uniform_(lo, hi, generator=gen))
    return torch.randn(shape, generator=gen) * mag
