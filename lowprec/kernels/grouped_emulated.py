"""Every expert's emulated block-scaled GEMM as one grouped BF16 GEMM: NVFP4 experts on Hopper (and MX experts
where MX GEMMs are emulated in BF16).

[Note: grouped emulated GEMMs]
An emulated GEMM (``kernels.gemm``, ``GemmPath.EMULATED``) multiplies the exact quantized values, each
element times its block scale, which for FP8/FP6/FP4 elements under E8M0 or E4M3 block scales is exact in
BF16 (``gemm.exact_in_bf16``), with FP32 accumulation; NVFP4's global scales multiply the FP32 output, the
left operand's first. Expert by expert that is a handful of launches per expert and GEMM (decode both
operands, one GEMM, two products, a conversion): for 32 experts some 600 launches per layer and step. Here the
experts' operands are decoded at once (one pass over every token row, one over the stacked weights, or one
over each side of the weight gradient laid out per expert) and multiplied by one ``torch._grouped_mm``, the
grouped BF16 GEMM the BF16 experts run; the global scales multiply its output per expert, in the loop's
order.

What differs from the loop: PyTorch's grouped BF16 GEMM returns BF16 (it takes no other output dtype), so
each output is rounded to BF16 before the global scales multiply it, where the loop multiplies the FP32 sum;
with NVFP4 that is one more rounding of a BF16 ulp at most (none without global scales, where the output's
dtype is BF16 anyway), and an FP32 weight gradient keeps BF16's precision, as BF16 training's has. The order
of the FP32 sums inside the kernel may differ from cuBLAS's, as for every grouped GEMM. The tests hold the
result to the loop by an SQNR floor and by one BF16 rounding per value (``tests/nn/test_grouped_emulated.py``,
on the CPU, where the same functions run on PyTorch's CPU grouped GEMM).

The operands, as ``lowprec.nn.grouped_casts`` lays them out:

* :func:`by_rows`: token rows ``a`` ``(T, K)`` (blocks along K, one row high) times each expert's ``b[e]``
  ``(R, K)``, the weights stacked ``(E * R, K)``, each expert's rows whole blocks: the forward and the input
  gradient;
* :func:`by_features`: the weight gradient, ``a`` ``(M, P)`` and ``b`` ``(N, P)`` cast along the tokens,
  expert ``e``'s tokens in the columns ``ends[e - 1]:ends[e]`` (each from a whole block on, zeros or the
  Hadamard transform's values of the padding between), so that no block holds two experts.
"""
from __future__ import annotations

import torch

from lowprec.kernels.gemm import emulated_operand, exact_in_bf16
from lowprec.quant import QuantizedTensor

DEVICES = ("cuda",)
"""Device types whose emulated GEMMs run in BF16 (``gemm.emulation_dtype``: FP32 elsewhere, where the experts
loop to keep the loop's FP32 values) and have PyTorch's grouped BF16 GEMM."""
ALIGN = 16
"""What every dimension the grouped GEMM strides over must be a multiple of (16-byte strides, and the
multiple its K groups take)."""


def runs(device: torch.device, a: QuantizedTensor, b: QuantizedTensor, *dims: int) -> bool:
    """Whether ``a`` and ``b``'s emulated GEMM runs grouped on ``device``: BF16 holds both operands' values
    exactly, the device has the grouped GEMM, and ``dims`` (the output's and the operands' strided
    dimensions) are multiples of :data:`ALIGN`."""
    return (device.type in DEVICES and hasattr(torch, "_grouped_mm")
            and exact_in_bf16(a.fmt, a.granularity) and exact_in_bf16(b.fmt, b.granularity)
            and all(d % ALIGN == 0 for d in dims))


def _values(q: QuantizedTensor) -> torch.Tensor:
    """``q``'s elements times their block scales, in BF16 (exact), padded as the codes are."""
    return emulated_operand(q, torch.bfloat16)[0]  # block sides: no scale stays outside


def _scaled(out: torch.Tensor, a_globals: torch.Tensor | None, b_globals: torch.Tensor | None,
            index: torch.Tensor | None, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """``out`` times ``a_globals`` then ``b_globals`` (``(E,)`` each, or None), each picked per expert by
    ``index`` (None: the experts are ``out``'s first dimension) and viewed as ``shape``, in FP32, then ``dtype``."""
    if a_globals is None and b_globals is None:
        return out.to(dtype)
    out = out.float()
    for g in (a_globals, b_globals):
        if g is not None:
            out = out * (g[index] if index is not None else g).view(shape)
    return out.to(dtype)


def by_rows(a: QuantizedTensor, b: QuantizedTensor, n_experts: int, offsets: torch.Tensor, expert: torch.Tensor,
            a_globals: torch.Tensor | None, b_globals: torch.Tensor | None, out_dtype: torch.dtype) -> torch.Tensor:
    """``(T, R)``: token row ``t`` of ``a`` ``(T, K)`` times the rows of its expert's ``b[e]`` (``b``: ``(E * R, K)``,
    the experts' weights stacked), emulated (see [Note: grouped emulated GEMMs]). ``offsets``: ``(E,)``
    cumulative token counts on the device; ``expert``: ``(T,)`` each row's expert; ``*_globals``: ``(E,)`` each
    expert's global decode scale (NVFP4) or None."""
    va, vb = _values(a), _values(b)
    t, r = a.shape[0], b.shape[0] // n_experts
    vb = vb[: n_experts * r].view(n_experts, r, vb.shape[-1])
    y = torch._grouped_mm(va[:t], vb.transpose(1, 2), offs=offsets.to(torch.int32))  # (T, R) BF16
    return _scaled(y, a_globals, b_globals, expert, (-1, 1), out_dtype)


def by_features(a: QuantizedTensor, b: QuantizedTensor, ends: torch.Tensor, live: torch.Tensor,
                a_globals: torch.Tensor | None, b_globals: torch.Tensor | None, out_dtype: torch.dtype) -> torch.Tensor:
    """``(E, M, N)``: each expert's ``a[:, its columns] @ b[:, its columns].T`` (``a`` ``(M, P)``, ``b`` ``(N, P)``,
    expert ``e``'s columns ``ends[e - 1]:ends[e]``), emulated (see [Note: grouped emulated GEMMs]); zero for an
    expert not ``live`` (without tokens), as the loop leaves it."""
    va, vb = _values(a), _values(b)
    m, n = a.shape[0], b.shape[0]
    dw = torch._grouped_mm(va[:m], vb[:n].t(), offs=ends.to(torch.int32))  # (E, M, N) BF16
    dw = _scaled(dw, a_globals, b_globals, None, (-1, 1, 1), out_dtype)
    return torch.where(live.view(-1, 1, 1), dw, 0.0)
