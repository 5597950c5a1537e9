"""The block Hadamard transform against hand-written matrices and numpy's Kronecker products."""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from lowprec.quant import hadamard, hadamard_matrix

H2 = np.array([[1, 1], [1, -1]], dtype=np.float64)
H4 = np.array([[1, 1, 1, 1], [1, -1, 1, -1], [1, 1, -1, -1], [1, -1, -1, 1]], dtype=np.float64)


def sylvester(n: int) -> np.ndarray:
    """The n x n Sylvester Hadamard matrix as a Kronecker power of H2 (unnormalised)."""
    h = np.ones((1, 1))
    while h.shape[0] < n:
        h = np.kron(H2, h)
    return h


def test_matches_hand_written_2x2_and_4x4():
    np.testing.assert_allclose(hadamard_matrix(2, dtype=torch.float64).numpy(), H2 / math.sqrt(2), rtol=0, atol=1e-15)
    np.testing.assert_allclose(hadamard_matrix(4, dtype=torch.float64).numpy(), H4 / 2, rtol=0, atol=1e-15)
    assert hadamard_matrix(1).tolist() == [[1.0]]


@pytest.mark.parametrize("block", [2, 4, 16, 64, 256])
@pytest.mark.parametrize("seed", [None, 0, 7])
def test_orthonormal(block, seed):
    m = hadamard_matrix(block, seed).double()
    eye = torch.eye(block, dtype=torch.float64)
    assert torch.allclose(m @ m.T, eye, rtol=0, atol=1e-6)
    assert torch.allclose(m.T @ m, eye, rtol=0, atol=1e-6)


@pytest.mark.parametrize("block", [4, 16, 128])
def test_seeded_matrix_is_sylvester_with_random_row_signs(block):
    h = sylvester(block) / math.sqrt(block)
    m = hadamard_matrix(block, seed=3, dtype=torch.float64).numpy()
    ratio = m / h  # (block, block): every row a constant +1 or -1
    assert np.all(np.abs(ratio) == 1.0)
    assert np.all(ratio == ratio[:, :1])
    signs = ratio[:, 0]
    if block >= 16:
        assert (signs == 1).any() and (signs == -1).any()


def test_signs_reproduce_from_a_seed_and_differ_across_seeds():
    a, b = hadamard_matrix(32, seed=11), hadamard_matrix(32, seed=11)
    assert torch.equal(a, b)
    others = [hadamard_matrix(32, seed=s) for s in (12, 13, 14)]
    assert all(not torch.equal(a, o) for o in others)
    assert not torch.equal(a, hadamard_matrix(32))  # 2^-32 chance that a seed gives all + signs


@pytest.mark.parametrize("seed", [None, 5])
def test_transform_is_blockwise_x_times_matrix(seed):
    x = torch.randn(3, 4, 64, generator=torch.Generator().manual_seed(0))
    m = hadamard_matrix(16, seed, dtype=torch.float64).numpy()
    want = (x.double().numpy().reshape(3, 4, 4, 16) @ m).reshape(3, 4, 64)
    np.testing.assert_allclose(hadamard(x, 16, seed).numpy(), want, rtol=0, atol=1e-5)


@pytest.mark.parametrize("block", [2, 16, 128])
@pytest.mark.parametrize("seed", [None, 1])
def test_inverse_recovers_x(block, seed):
    x = torch.randn(8, 256, generator=torch.Generator().manual_seed(1))
    y = hadamard(x, block, seed)
    assert not torch.allclose(y, x)
    back = hadamard(y, block, seed, inverse=True)
    assert torch.allclose(back, x, rtol=0, atol=1e-5)


@pytest.mark.parametrize("seed", [None, 2])
def test_gemm_is_invariant(seed):
    gen = torch.Generator().manual_seed(2)
    a, b = torch.randn(64, 128, generator=gen), torch.randn(32, 128, generator=gen)
    got = hadamard(a, 16, seed) @ hadamard(b, 16, seed).T
    want = (a.double() @ b.double().T).float()
    assert torch.allclose(got, want, rtol=0, atol=1e-4 * want.abs().max().item())


def test_spreads_an_outlier_across_its_block():
    x = torch.zeros(1, 32)
    x[0, 3] = 64.0
    y = hadamard(x, 16, seed=4)
    # a single spike maps onto a row of D H / 4: magnitude 64 / 4 everywhere in its block
    assert torch.equal(y[0, :16].abs(), torch.full((16,), 16.0))
    assert torch.equal(y[0, 16:], torch.zeros(16))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_keeps_dtype(dtype):
    x = torch.randn(4, 32).to(dtype)
    y = hadamard(x, 16, seed=0)
    assert y.dtype == dtype
    want = hadamard(x.float(), 16, seed=0).to(dtype)
    assert torch.equal(y, want)


@pytest.mark.parametrize("block", [0, -1, 3, 12, True, 3.5, "16", None])
def test_bad_block_sizes_raise_naming_block(block):
    with pytest.raises(ValueError, match=r"^block: expected a power of two, got "):
        hadamard_matrix(block)
    with pytest.raises(ValueError, match=r"^block: expected a power of two, got "):
        hadamard(torch.randn(4, 48), block)


def test_bad_x_and_seed_raise_naming_them():
    with pytest.raises(ValueError, match=r"^x: expected a last dimension divisible by block=16, got .*\(4, 24\)"):
        hadamard(torch.randn(4, 24), 16)
    with pytest.raises(ValueError, match=r"^x: expected a last dimension divisible by block=16"):
        hadamard(torch.tensor(1.0), 16)
    with pytest.raises(TypeError, match=r"^x: expected a float32, float16 or bfloat16 tensor, got .*int64"):
        hadamard(torch.arange(32), 16)
    with pytest.raises(TypeError, match=r"^seed: expected an int or None, got '1' \(str\)"):
        hadamard_matrix(16, seed="1")
