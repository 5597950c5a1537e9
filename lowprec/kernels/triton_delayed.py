"""A delayed scale on the GPU that reads the operand only when its history has no amax yet.

[Note: a delayed scale without reading the operand]
A compiled cast cannot ask the host whether its role's history holds an amax (that would sync), so
the scale it takes is the history's where the flag ``ready`` says so, else the operand's current
scale. Computing both and choosing reads the whole operand at every step, for a value used only
before the first amax. Here two launches decide on the device instead: the first, over the operand's
tiles, reads the flag in every program and reduces ``|x|`` (atomic max of its int32 bits, NaN above
inf, as ``triton_tiles.amax_kernel`` does) only where it is not set, so a ready scale costs one byte
per program; the second, one program, stores the bank's scale, or the scale of that amax by
``lowprec.quant.scales.amax_scale``'s rule (``triton_numerics.scale_from_amax``, exact division), into
the (1, 1) output. No host sync, and the result equals ``lowprec.kernels.delayed_scale``'s reference
bit for bit.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from lowprec import formats as F
from lowprec.kernels import triton_launch as launch
from lowprec.kernels.triton_numerics import RULE_AMAX, abs_bits, bf16_value, scale_from_amax

_BM, _BK, _WARPS = 32, 256, 4
"""Tile of the amax pass: 8192 elements per program, so a ready scale launches few programs."""


@triton.jit
def _amax_unless_ready(x_ptr, sxm, sxk, M, K, ready_ptr, r, amax_ptr, BM: tl.constexpr, BK: tl.constexpr):
    """Atomic max of ``|x|``'s int32 bits into ``amax_ptr`` (zeroed), unless ``ready[r]`` is set."""
    if tl.load(ready_ptr + r) == 0:
        offs_m = tl.program_id(0) * BM + tl.arange(0, BM)
        offs_k = tl.program_id(1) * BK + tl.arange(0, BK)
        mask = (offs_m[:, None] < M) & (offs_k[None, :] < K)
        x = tl.load(x_ptr + offs_m[:, None] * sxm + offs_k[None, :] * sxk, mask=mask, other=0.0)
        if x.dtype == tl.bfloat16:  # by its bits: the interpreter flushes bf16 subnormals
            v = bf16_value(x.to(tl.int16, bitcast=True))
        else:
            v = x.to(tl.float32)
        tl.atomic_max(amax_ptr, tl.max(tl.max(abs_bits(v), axis=1), axis=0))


@triton.jit
def _pick(ready_ptr, r, scales_ptr, k, out_ptr, FMAX: tl.constexpr, EMAX: tl.constexpr):
    """Over the amax bits the first pass left in ``out_ptr``: ``scales[k]`` where ``ready[r]`` is set,
    else the scale of that amax."""
    if tl.load(ready_ptr + r) != 0:
        tl.store(out_ptr, tl.load(scales_ptr + k).to(tl.int32, bitcast=True))
    else:
        s = scale_from_amax(tl.load(out_ptr), 1.0, RULE_AMAX, FMAX, EMAX)
        tl.store(out_ptr, s.to(tl.int32, bitcast=True))


def delayed_scale(x2: torch.Tensor, scales: torch.Tensor, ready: torch.Tensor, k: int, r: int,
                  fmt: F.Format) -> torch.Tensor:
    """(1, 1) float32: ``scales[k]`` where ``ready[r]``, else ``amax_scale(|x2|.max(), fmt)``; ``x2``
    is 2-D, ``scales`` float32 and ``ready`` bool, on one device (see [Note: a delayed scale without
    reading the operand])."""
    m, n = x2.shape
    out = torch.zeros(1, 1, dtype=torch.int32, device=x2.device)  # the amax's bits, then the scale's
    flags = ready.view(torch.uint8)
    if x2.numel():
        grid = (triton.cdiv(m, _BM), triton.cdiv(n, _BK))
        _launch(_amax_unless_ready, grid, (x2, x2.stride(0), x2.stride(1), m, n, flags, r, out),
                dict(BM=_BM, BK=_BK, num_warps=_WARPS), x2.is_cuda)
    _launch(_pick, (1,), (flags, r, scales, k, out), dict(FMAX=fmt.max, EMAX=fmt.emax, num_warps=1), x2.is_cuda)
    return out.view(torch.float32)


def _launch(kernel, grid: tuple[int, ...], args: tuple, kw: dict, cuda: bool) -> None:
    if cuda:  # through the launch cache: see [Note: launching a Triton kernel cheaply]
        launch.run(kernel, grid, args, kw, ("delayed_scale", tuple(sorted(kw.items()))))
    else:
        kernel[grid](*args, **kw)
