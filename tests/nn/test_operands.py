"""The emulated GEMMs' operands are exactly what ``lowprec.quant`` makes of the same tensors.

For every low-precision preset, one forward and backward of a layer records the six operands of its
three GEMMs (see [Note: the three GEMMs] in ``lowprec.recipes``) and compares them, data and scales
bit for bit, with ``lowprec.quant.quantize`` of x, w, dy, w.T, dy.T and x.T under the recipe's casts:
the Hadamard transform first where the cast asks for it, and for stochastic rounding the random bits
torch's generator held when the layer made that cast.
"""
from __future__ import annotations

import pytest
import torch

from lowprec import quant
from lowprec import recipes as R
from lowprec.quant.hadamard import RHT_BLOCK as HADAMARD_BLOCK
from lowprec.quant.hadamard import RHT_SEED as HADAMARD_SEED
from tests.helpers import stochastic_forward_recipe
from tests.nn.common import LOW_PRECISION, GemmSpy, QuantizeSpy, assert_same_quantized, make_linear, randn

M, K, N = 48, 128, 256  # tokens (2 x 24), in, out: all different, K and N multiples of 128


def expected(t: torch.Tensor, cast: R.Cast, rng_state: torch.Tensor | None) -> quant.QuantizedTensor:
    if cast.hadamard:
        t = quant.hadamard(t, HADAMARD_BLOCK, seed=HADAMARD_SEED)
    if cast.rounding == "stochastic":
        torch.set_rng_state(rng_state)
    return quant.quantize(t, cast.format, cast.granularity, rounding=cast.rounding)


@pytest.mark.parametrize("recipe", [*LOW_PRECISION, "sr-forward"])
def test_every_gemm_operand_equals_lowprec_quant_of_the_same_tensor(recipe, monkeypatch):
    r = stochastic_forward_recipe() if recipe == "sr-forward" else R.get(recipe)
    lin = make_linear(r, K, N, seed=1)
    x = randn(2, 24, K, seed=2, scale=3.0).requires_grad_()
    dy = randn(2, 24, N, seed=3, scale=1e-3)
    gemms, casts = GemmSpy(monkeypatch), QuantizeSpy(monkeypatch)
    torch.manual_seed(4)
    lin(x).backward(dy)
    got = gemms.by_gemm(M, K, N)
    assert sorted(got) == ["dgrad", "fprop", "wgrad"]

    x2, dy2, w = x.detach().reshape(M, K), dy.reshape(M, N), lin.weight.detach()
    tensors = {"fprop": (x2, w), "dgrad": (dy2, w.t()), "wgrad": (dy2.t(), x2.t())}
    for gemm, (lhs, rhs) in tensors.items():
        g: R.Gemm = getattr(r, gemm)
        for side, t, cast, q in (("lhs", lhs, g.lhs, got[gemm][0]), ("rhs", rhs, g.rhs, got[gemm][1])):
            state = casts.rng_state_of(q) if cast.rounding == "stochastic" else None
            assert_same_quantized(q, expected(t, cast, state), f"{recipe} {gemm}.{side} ({cast.describe()})")


def test_stochastic_operands_change_with_the_random_bits(monkeypatch):
    # the replay above is only a test if the bits matter: two seeds, two different stochastic casts of x
    lin = make_linear(stochastic_forward_recipe(), K, N, seed=1)
    x = randn(M, K, seed=2).requires_grad_()  # a training forward: evaluation rounds to nearest
    gemms = GemmSpy(monkeypatch)
    for seed in (0, 1):
        torch.manual_seed(seed)
        lin(x)
    (a0, _), (a1, _) = gemms.calls
    assert not torch.equal(a0.data, a1.data)


def test_the_hadamard_transform_leaves_the_weight_gradient_unchanged_in_exact_arithmetic():
    # why nvfp4 may transform both wgrad operands: (A H)(B H)^T = A B^T for the orthonormal H
    a, b = randn(N, M, seed=5, dtype=torch.float64), randn(K, M, seed=6, dtype=torch.float64)
    h = quant.hadamard_matrix(HADAMARD_BLOCK, seed=HADAMARD_SEED, dtype=torch.float64)
    ah = (a.unflatten(-1, (-1, HADAMARD_BLOCK)) @ h).flatten(-2)  # (N, M)
    bh = (b.unflatten(-1, (-1, HADAMARD_BLOCK)) @ h).flatten(-2)  # (K, M)
    torch.testing.assert_close(ah @ bh.T, a @ b.T, rtol=1e-12, atol=1e-12)
