"""Stochastic rounding through quantize: reproducible given its random bits, unbiased in expectation."""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from lowprec import formats as F
from lowprec.quant import mx, nvfp4, quantize, rowwise, tensorwise
from tests.quant._reference import expand

E2M1_GRID = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])  # OCP MX v1.0, FP4 E2M1 magnitudes


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


@pytest.mark.parametrize(("fmt", "g"), [("e4m3", tensorwise()), ("e5m2", rowwise()), ("e2m1", mx(32)),
                                        ("e2m3", mx(32, "ceil")), ("e2m1", nvfp4(16))], ids=str)
@pytest.mark.parametrize("shape", [(8, 64), (3, 5, 37)])
def test_given_rand_is_deterministic_and_is_round_to_of_x_over_scale(fmt, g, shape):
    x = torch.randn(shape, generator=gen(1)) * 4
    rand = torch.rand(shape, generator=gen(2))
    q1 = quantize(x, fmt, g, rounding="stochastic", rand=rand)
    q2 = quantize(x, fmt, g, rounding="stochastic", rand=rand.clone())
    assert torch.equal(q1.data.view(torch.uint8), q2.data.view(torch.uint8))
    m, k = math.prod(shape[:-1]), shape[-1]
    br, bc = q1.block_shape
    eff = torch.from_numpy(expand(q1.effective_scale().numpy(), br, bc))[:m, :k]
    want = F.round_to(x.reshape(m, k) / eff, fmt, rounding="stochastic", rand=rand.reshape(m, k))
    assert torch.equal(q1.values()[:m, :k], want)
    # the bits matter: a different draw rounds some elements the other way
    q3 = quantize(x, fmt, g, rounding="stochastic", rand=torch.rand(shape, generator=gen(3)))
    assert not torch.equal(q1.values(), q3.values())


def test_rand_zero_rounds_away_from_zero_and_rand_near_one_toward_zero():
    # Hand-built block with scale 1 (max 6 = fmax): each value's two E2M1 neighbours are known.
    t = torch.tensor([6.0, 0.2, -0.7, 1.2, -2.5, 3.1, -4.9, 5.5, 2.0, -0.0] + [0.0] * 22)[None, :]  # (1, 32)
    a = t.abs().numpy()[0]
    up = E2M1_GRID[np.searchsorted(E2M1_GRID, a, side="left")]  # smallest grid value >= |t|
    down = E2M1_GRID[np.searchsorted(E2M1_GRID, a, side="right") - 1]  # largest <= |t|
    sign = np.sign(t.numpy()[0])
    for r, want in ((0.0, up), (float(np.nextafter(np.float32(1), np.float32(0))), down)):
        q = quantize(t, "e2m1", mx(32), rounding="stochastic", rand=torch.full_like(t, r))
        assert q.scale.item() == 1.0
        np.testing.assert_array_equal(q.values().numpy()[0], sign * want)


def test_generator_reproduces_and_seeds_differ():
    x = torch.randn(16, 64, generator=gen(4))
    a = quantize(x, "e2m1", mx(32), rounding="stochastic", generator=gen(5)).values()
    b = quantize(x, "e2m1", mx(32), rounding="stochastic", generator=gen(5)).values()
    c = quantize(x, "e2m1", mx(32), rounding="stochastic", generator=gen(6)).values()
    assert torch.equal(a, b) and not torch.equal(a, c)


def test_mx_e2m1_stochastic_rounding_is_unbiased():
    # Blocks whose maximum is exactly 6 * 2^j, so the floor rule's scale is exactly 2^j and nothing
    # saturates: each scaled value t lies between E2M1 neighbours lo <= t <= hi, and one draw is
    # lo + (hi - lo) * Bernoulli(p), p = (t - lo) / (hi - lo).
    rows, n_draws = 8, 1000
    j = torch.arange(-3, rows - 3, dtype=torch.float32)[:, None]  # (8, 1): one binade per block
    t = torch.empty(rows, 32).uniform_(-6, 6, generator=gen(7))
    t[:, 0] = 6.0
    x = t * torch.exp2(j)  # (8, 32), exact
    q = quantize(x.repeat(n_draws, 1), "e2m1", mx(32), rounding="stochastic", generator=gen(8))
    assert torch.equal(q.scale.view(n_draws, rows), torch.exp2(j).T.expand(n_draws, rows))
    mean = q.dequantize().double().view(n_draws, rows, 32).mean(0)  # (8, 32)
    a = t.abs().double().numpy()
    hi = E2M1_GRID[np.searchsorted(E2M1_GRID, a, side="left")]
    lo = E2M1_GRID[np.searchsorted(E2M1_GRID, a, side="right") - 1]
    step = torch.from_numpy(np.where(hi > lo, hi - lo, 1.0)) * torch.exp2(j).double()  # grid step, x units
    z = ((mean - x.double()) / step).numpy()  # per element: mean of n_draws (B - p), signed by x
    # Hoeffding: P(|mean(B) - p| >= e) <= 2 exp(-2 N e^2). With failure probability 1e-9 per element,
    # e = sqrt(ln(2e9) / (2N)); for the average over all 256 elements' N draws, N -> 256 N.
    per_element = math.sqrt(math.log(2e9) / (2 * n_draws))
    pooled = math.sqrt(math.log(2e9) / (2 * n_draws * z.size))
    assert np.abs(z).max() <= per_element
    assert abs(z.mean()) <= pooled
    # Rounding to nearest would miss by up to half a step (z up to 0.5), far beyond per_element.
    assert per_element < 0.15
