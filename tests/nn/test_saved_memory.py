"""Backward keeps quantized operands, never a high-precision copy: the bytes autograd saves for a
converted layer are at most a BF16 ``torch.nn.Linear``'s on the same BF16 input, and about half of
them for the FP8 recipes (one byte per element where BF16 keeps two)."""
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


def _bf16_reference_bytes(x: torch.Tensor) -> int:
    ref = nn.Linear(K, N, dtype=torch.bfloat16)
    return saved_for_backward(lambda: ref(x))[0]


def _layer_bytes(recipe: str, x: torch.Tensor) -> tuple[int, list[torch.Tensor]]:
    lin = make_linear(recipe, K, N, dtype=torch.bfloat16)
    return saved_for_backward(lambda: lin(x))


def test_the_bf16_reference_saves_its_input_and_weight():
    x = randn(M, K, seed=0, dtype=torch.bfloat16).requires_grad_()
    assert _bf16_reference_bytes(x) == 2 * (M * K + N * K)


@pytest.mark.parametrize("recipe", R.names())
def test_backward_saves_no_more_than_bf16(recipe):
    x = randn(M, K, seed=0, dtype=torch.bfloat16).requires_grad_()
    bf16 = _bf16_reference_bytes(x)
    got, kept = _layer_bytes(recipe, x)
    assert 0 < got <= bf16, f"{recipe}: {got} bytes saved, BF16 saves {bf16}"
    if recipe in FP8_FAMILY:
        assert got <= FP8_HALF_LIMIT * bf16, f"{recipe}: {got / bf16:.3f} of BF16"
    if R.get(recipe).low_precision:
        big = [t for t in kept if t.numel() >= N * K // 4]  # data; scales are at most 1/16 of it
        assert big and all(t.element_size() == 1 for t in big), (
            f"{recipe}: a high-precision tensor is saved: {[(t.dtype, tuple(t.shape)) for t in big]}")
