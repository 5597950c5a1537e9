"""Vector sets for NVFP4 that sit on rounding ties in TransformerEngine's order of operations.

Built with numpy and the reference alone (``tests/quant/_reference.py``), never with ``lowprec``:

* element ties: each block holds its amax and values within two FP32 ulps of ``t / e``, with ``e`` the
  block's encode scale and ``t`` an E2M1 midpoint (0.25, 0.75, ..., 5), so ``x * e`` rounded to FP32
  lands on ``t`` itself for many of them, where dividing by ``s * g`` instead need not;
* scale ties: half the blocks take an amax within two ulps of ``m / (G * fp32(1 / 6))``, with ``m`` an
  E4M3 midpoint, so the E4M3 rounding of the block scale meets exact ties too.

``tie_heavy`` returns the 2-D view the reference quantizes; blocks are ``br x bc`` tiles of it.
"""
from __future__ import annotations

import numpy as np
import torch

from tests.quant._reference import ML_DTYPES, nvfp4_rule

E2M1_TIES = np.array([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0], np.float32)
"""Midpoints between neighbouring E2M1 magnitudes: where round-to-nearest-even decides."""


def e4m3_midpoints() -> np.ndarray:
    """Midpoints between neighbouring positive E4M3 values below 448 (exact in FP32)."""
    vals = np.arange(1, 127, dtype=np.uint8).view(ML_DTYPES["e4m3"]).astype(np.float32)  # 2^-9 .. 448
    return ((vals[1:] + vals[:-1]) / 2).astype(np.float32)


def nudge(a: np.ndarray, ulps: np.ndarray) -> np.ndarray:
    """float32 ``a`` moved by ``ulps`` units in the last place away from zero (negative: towards)."""
    bits = np.abs(a).astype(np.float32).view(np.int32) + ulps.astype(np.int32)
    return np.copysign(np.maximum(bits, 0).view(np.float32), a).astype(np.float32)


def tie_heavy(mb: int, kb: int, br: int, bc: int, seed: int) -> torch.Tensor:
    """``(mb * br, kb * bc)`` float32 values: ``mb x kb`` blocks of ``br x bc``, built as above."""
    rng = np.random.default_rng(seed)
    n = br * bc
    amax_t = np.float32(np.exp2(rng.uniform(-40, 40)) * rng.uniform(1, 2))
    big = np.minimum(np.float32(2688) / amax_t, np.float32(np.finfo(np.float32).max))
    multiplier = big * (np.float32(1) / np.float32(6))
    mids = rng.choice(e4m3_midpoints(), (mb, kb))
    on_tie = nudge((mids / multiplier).astype(np.float32), rng.integers(-2, 3, (mb, kb)))
    spread = (amax_t * np.exp2(rng.uniform(-22, 0, (mb, kb)))).astype(np.float32)  # some scales underflow
    amax = np.minimum(np.where(rng.random((mb, kb)) < 0.5, on_tie, spread), amax_t).astype(np.float32)
    amax[0, 0] = amax_t
    _, _, enc = nvfp4_rule(amax.astype(np.float64), "e2m1")  # (mb, kb): what x is multiplied by
    t = rng.choice(E2M1_TIES, (mb, kb, n - 1)) * rng.choice(np.float32([-1, 1]), (mb, kb, n - 1))
    with np.errstate(over="ignore"):
        x = nudge((t / enc[..., None]).astype(np.float32), rng.integers(-2, 3, t.shape))
    x = np.clip(x, -amax[..., None], amax[..., None])  # never above the block's amax
    top = amax * rng.choice(np.float32([-1, 1]), (mb, kb))
    blocks = rng.permuted(np.concatenate([top[..., None], x], axis=2), axis=2)  # (mb, kb, n)
    grid = blocks.reshape(mb, kb, br, bc).transpose(0, 2, 1, 3).reshape(mb * br, kb * bc)
    return torch.from_numpy(np.ascontiguousarray(grid, np.float32))
