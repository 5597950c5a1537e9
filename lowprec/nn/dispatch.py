"""A mixture of experts' token dispatch and combine as row permutations whose gradients are gathers too.

[Note: dispatch and combine]
A MoE layer sends each token's ``k`` copies to its experts in expert order, ``rows = x[order // k]``, and
brings the experts' outputs back in token order, ``y[inverse]``, where ``order`` sorts the ``N * k`` (token,
slot) pairs by expert and ``inverse`` undoes it. Written as advanced indexing, autograd differentiates both
into ``index_put_(..., accumulate=True)``, which on a GPU sorts its indices again and accumulates row by row,
and the inverse permutation itself was a second sort (``order.argsort()``). Both are unnecessary: ``order`` is
a permutation, so

* the inverse is one scatter of ``arange`` (no sort); the sort that makes ``order`` sorts 16-bit keys
  (:func:`expert_order`);
* the gradient of the dispatch is ``grad_rows[inverse]`` viewed ``(N, k, D)`` and summed over the ``k``
  copies: a gather and a reduction, each token's copies summed in slot order, the same on every run;
* the gradient of the combine is ``grad[order]``: a gather.

:func:`dispatch` and :func:`combine` compute the same forward values as the indexing (bit for bit: they
are the same gathers) and these gradients; the dispatch's gradient sums each token's ``k`` copies in one
reduction rather than one accumulation after another, so its last bits may differ from the indexing's
(``tests/nn/test_dispatch.py``).
"""
from __future__ import annotations

import torch


def expert_order(experts: torch.Tensor, n_experts: int) -> torch.Tensor:
    """The (token, slot) pairs sorted by expert, stably (1-D int64): ``experts.argsort(stable=True)`` of the
    flattened ``(N, k)`` experts, sorted as keys of the narrowest integer type that holds ``n_experts``, so
    a GPU's radix sort makes 2 passes over 16-bit keys rather than 8 over 64-bit ones (the same order: a
    stable sort of the same values)."""
    keys = experts.flatten()
    narrow = torch.int16 if n_experts <= torch.iinfo(torch.int16).max else torch.int32
    return keys.to(narrow).argsort(stable=True)


def inverse_permutation(order: torch.Tensor) -> torch.Tensor:
    """``inv`` with ``inv[order[i]] = i`` for a permutation ``order`` of ``0..n-1`` (1-D int64): one scatter."""
    return torch.empty_like(order).scatter_(0, order, torch.arange(order.numel(), device=order.device))


class _Dispatch(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, order: torch.Tensor, inverse: torch.Tensor, k: int,
                slot_major: bool) -> torch.Tensor:
        ctx.save_for_backward(inverse)
        ctx.k, ctx.slot_major = k, slot_major
        token = order % x.shape[0] if slot_major else torch.div(order, k, rounding_mode="floor")
        return x.index_select(0, token)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (inverse,) = ctx.saved_tensors
        pairs = grad.index_select(0, inverse)  # (N * k, D) in pair order
        d = grad.shape[-1]
        summed = pairs.view(ctx.k, -1, d).sum(dim=0) if ctx.slot_major else pairs.view(-1, ctx.k, d).sum(dim=1)
        return summed, None, None, None, None


class _Combine(torch.autograd.Function):
    @staticmethod
    def forward(ctx, y: torch.Tensor, order: torch.Tensor, inverse: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(order)
        return y.index_select(0, inverse)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (order,) = ctx.saved_tensors
        return grad.index_select(0, order), None, None


def dispatch(x: torch.Tensor, order: torch.Tensor, inverse: torch.Tensor, k: int,
             slot_major: bool = False) -> torch.Tensor:
    """``x[order // k]``: ``(N, D)`` tokens to ``(N * k, D)`` rows in expert order, where pair ``i`` of
    ``order`` (a permutation of the ``N * k`` (token, slot) pairs, ``inverse`` its inverse) is token ``i // k``'s
    slot ``i % k``; ``slot_major``: pair ``i`` is token ``i % N``'s slot ``i // N`` (``x[order % N]``, the
    pairs slot by slot, as transformers' experts take them). See [Note: dispatch and combine]."""
    return _Dispatch.apply(x, order, inverse, k, slot_major)


def combine(y: torch.Tensor, order: torch.Tensor, inverse: torch.Tensor) -> torch.Tensor:
    """``y[inverse]``: the experts' ``(N * k, D)`` outputs back in (token, slot) order."""
    return _Combine.apply(y, order, inverse)


__all__ = ["combine", "dispatch", "expert_order", "inverse_permutation"]
