"""Every expert's FP8 GEMM in one ``torch._scaled_grouped_mm``, where the device runs it and it agrees with
the expert-by-expert GEMMs.

[Note: one grouped GEMM for the experts]
Experts cast per tensor (``lowprec.nn.grouped_casts``) hold E4M3 codes of all their rows ``(T, K)``
with one scale per expert, and E4M3 weights ``(E, N, K)`` with one scale per expert. PyTorch's grouped
FP8 GEMM takes row-wise scales: a scale per row of the tokens and per output column of each expert's
weight. An expert's per-tensor scale repeated over its rows and columns is such a scale, so one launch
computes every expert's ``rows @ weight[e].T`` with the values of the per-expert GEMMs; the
accumulation inside the tensor cores and the epilogue (``acc * row scale * column scale`` here,
``acc * (scale_a * scale_b)`` in cuBLAS's per-tensor GEMM) may differ in the last bits.

It runs on CUDA devices of compute capability 9.0 and newer (PyTorch's kernels for them), both
operands E4M3, ``K`` and ``N`` multiples of 16. The first time it runs on a device it checks itself
against the per-expert GEMMs computed from the exact values (E4M3 products in FP32) on a small problem
of unbalanced experts, one of them without tokens; if they disagree beyond the output's rounding, or
the call fails, it warns once and the experts stay expert by expert on that device. ``lowprec.nn.GroupedLinear`` asks
:func:`grouped_fprop` for its forward GEMM; backward's GEMMs stay per expert (its gradient casts are
E5M2, which the grouped kernel does not take, and the weight gradient groups along K).
"""
from __future__ import annotations

import warnings

import torch

_CHECKED: dict[torch.device, bool] = {}
"""Per device: whether the grouped GEMM ran and agreed with the per-expert GEMMs on first use."""
E4M3 = torch.float8_e4m3fn
TOLERANCE = 2.0 ** -7
"""Largest relative difference from the per-expert GEMMs the self-check accepts: BF16's rounding of the
output (2^-8) twice."""


def _grouped(a, a_scales, b, b_scales, offsets, out_dtype, fast_accum: bool) -> torch.Tensor:
    """``(T, N)``: rows of expert ``e`` times ``b[e].T``; ``a_scales`` ``(T,)`` per row, ``b_scales`` ``(E,)``."""
    n = b.shape[1]
    return torch._scaled_grouped_mm(a, b.transpose(-2, -1), a_scales, b_scales[:, None].expand(-1, n).contiguous(),
                                    offs=offsets, out_dtype=out_dtype, use_fast_accum=fast_accum)


def _reference(a, a_scales, b, b_scales, counts) -> torch.Tensor:
    """The experts' GEMMs from the exact values: E4M3 products are exact in FP32, summed in FP32."""
    out, start = [], 0
    for e, m in enumerate(counts):
        out.append((a[start:start + m].float() @ b[e].float().t()) * a_scales[start:start + m, None] * b_scales[e])
        start += m
    return torch.cat(out)


def _self_check(device: torch.device) -> bool:
    g = torch.Generator(device=device).manual_seed(0)
    counts = (48, 0, 16, 64)
    k, n = 128, 64
    t = sum(counts)
    a = (torch.randn(t, k, device=device, generator=g) * 8).to(E4M3)
    b = (torch.randn(len(counts), n, k, device=device, generator=g) * 8).to(E4M3)
    expert_scales = torch.tensor([0.5, 2.0, 0.25, 4.0], device=device)
    a_scales = expert_scales.repeat_interleave(torch.tensor(counts, device=device))
    b_scales = torch.tensor([1.0, 0.125, 2.0, 0.5], device=device)
    offsets = torch.tensor(counts, device=device).cumsum(0).to(torch.int32)
    try:
        got = _grouped(a, a_scales, b, b_scales, offsets, torch.bfloat16, False).float()
    except (RuntimeError, NotImplementedError) as e:  # a kernel PyTorch lacks for this device
        warnings.warn(f"lowprec: torch._scaled_grouped_mm fails on {device} ({str(e).splitlines()[0]}); "
                      "experts run their FP8 GEMMs one by one", stacklevel=4)
        return False
    want = _reference(a, a_scales, b, b_scales, counts)
    rel = ((got - want).abs().max() / want.abs().max()).item()
    if not rel <= TOLERANCE:
        warnings.warn(f"lowprec: torch._scaled_grouped_mm differs from the per-expert FP8 GEMMs on {device} by "
                      f"{rel:.2e} of the output (more than {TOLERANCE:.2e}); experts run their FP8 GEMMs one by one",
                      stacklevel=4)
        return False
    return True


def runs_grouped(device: torch.device, a_fmt, b_fmt, k: int, n: int) -> bool:
    """Whether the experts' forward GEMM runs as one grouped GEMM here (see [Note: one grouped GEMM for the
    experts]): CUDA of compute capability 9.0 or newer, E4M3 operands, K and N multiples of 16, and the
    device's first-use check passed."""
    if device.type != "cuda" or not hasattr(torch, "_scaled_grouped_mm") or k % 16 or n % 16:
        return False
    if a_fmt.torch_dtype is not E4M3 or b_fmt.torch_dtype is not E4M3:
        return False
    if torch.cuda.get_device_capability(device) < (9, 0):
        return False
    device = torch.device("cuda", device.index if device.index is not None else torch.cuda.current_device())
    if device not in _CHECKED:
        _CHECKED[device] = _self_check(device)
    return _CHECKED[device]


def grouped_fprop(a: torch.Tensor, a_scales: torch.Tensor, b: torch.Tensor, b_scales: torch.Tensor,
                  counts: tuple[int, ...], out_dtype: torch.dtype, fast_accum: bool) -> torch.Tensor:
    """``(T, N)``: every expert's rows of ``a`` (E4M3 ``(T, K)``, ``a_scales`` ``(T,)`` each row's expert's
    scale) times its weight ``b[e]`` (E4M3 ``(E, N, K)``, ``b_scales`` ``(E,)``), in one grouped GEMM."""
    offsets = torch.tensor(counts, device=a.device).cumsum(0).to(torch.int32)
    return _grouped(a, a_scales, b, b_scales, offsets, out_dtype, fast_accum)


def grouped_status() -> dict[str, bool]:
    """Each device checked so far and whether its grouped GEMM passed (for ``lowprec info`` and tests)."""
    return {str(d): ok for d, ok in _CHECKED.items()}


__all__ = ["grouped_fprop", "grouped_status", "runs_grouped"]
