"""Backward keeps quantized operands, never a high-precision copy: the bytes autograd saves for a
converted layer, beyond the parameters (alive anyway), are at most a BF16 ``torch.nn.Linear``'s on
the same BF16 input, and about half of them for the FP8 recipes (one byte per element where BF16
keeps two). No copy of the weight is kept: backward casts weight.T from the parameter."""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from lowprec import recipes as R
from tests.nn.common import make_linear, randn, saved_for_backward

M, K, N = 512, 256, 256
FP8_FAMILY = ("fp8-delayed", "fp8-current", "fp8-rowwise", "fp8-blockwise", "mxfp8")
FP8_HALF_LIMIT = 0.57
"""FP8 data is half of BF16; scales add up to 1/8 on top (MXFP8 keeps one float32 per 32 elements)."""


def _without_parameters(module: nn.Module, fn) -> tuple[int, list[torch.Tensor]]:
    params = {p.untyped_storage().data_ptr() for p in module.parameters()}
    _, kept = saved_for_backward(fn)
    kept = [t for t in kept if t is not None and t.untyped_storage().data_ptr() not in params]
    return sum({t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in kept}.values()), kept


def _bf16_reference_bytes(x: torch.Tensor) -> int:
    ref = nn.Linear(K, N, dtype=torch.bfloat16)
    return _without_parameters(ref, lambda: ref(x))[0]


def _layer_bytes(recipe: str, x: torch.Tensor) -> tuple[int, list[torch.Tensor]]:
    lin = make_linear(recipe, K, N, dtype=torch.bfloat16)
    return _without_parameters(lin, lambda: lin(x))


def test_the_bf16_reference_saves_its_input_beside_the_weight():
    x = randn(M, K, seed=0, dtype=torch.bfloat16).requires_grad_()
    ref = nn.Linear(K, N, dtype=torch.bfloat16)
    assert saved_for_backward(lambda: ref(x))[0] == 2 * (M * K + N * K)
    assert _bf16_reference_bytes(x) == 2 * M * K


@pytest.mark.parametrize("recipe", R.names())
def test_backward_saves_no_more_than_bf16(recipe):
    x = randn(M, K, seed=0, dtype=torch.bfloat16).requires_grad_()
    bf16 = _bf16_reference_bytes(x)
    got, kept = _layer_bytes(recipe, x)
    if R.get(recipe).hp_dtype is not None:  # bf16/fp16: a cast copy of the weight stands for the parameter
        bf16 += 2 * N * K
    assert 0 < got <= bf16, f"{recipe}: {got} bytes saved, BF16 saves {bf16}"
    if recipe in FP8_FAMILY:
        assert got <= FP8_HALF_LIMIT * bf16, f"{recipe}: {got / bf16:.3f} of BF16"
    if R.get(recipe).low_precision:
        big = [t for t in kept if t.numel() >= N * K // 4]  # data; scales are at most 1/16 of it
        assert big and all(t.element_size() == 1 for t in big), (
            f"{recipe}: a high-precision tensor is saved: {[(t.dtype, tuple(t.shape)) for t in big]}")


@pytest.mark.parametrize("recipe", ["fp8-current", "fp8-delayed", "fp8-blockwise", "mxfp8", "nvfp4"])
def test_no_weight_copy_is_kept_for_backward(recipe):
    x = randn(M, K, seed=0, dtype=torch.bfloat16).requires_grad_()
    _, kept = _layer_bytes(recipe, x)
    assert all(t.shape[-1] != K or t.shape[0] != N for t in kept if t.dim() == 2), (
        f"{recipe}: {[(t.dtype, tuple(t.shape)) for t in kept]}")
