"""Stochastic rounding: unbiased in expectation, only the two neighbours, grid values fixed, and a
deterministic function of its random numbers.

[Note: the statistical bound]
Between grid neighbours lo < hi, x = lo + p * (hi - lo) rounds to hi with probability p, so one draw
is lo + (hi - lo) * B with B ~ Bernoulli(p), of variance (hi - lo)^2 * p * (1 - p). The mean of N
independent draws has standard error (hi - lo) * sqrt(p * (1 - p) / N); we demand |mean - x| <= 5
standard errors, which an unbiased rounding misses with probability about 6e-7 per value. The seed
is fixed, so the test is deterministic. A biased rounding (a fixed 1/2 chance, or the chance taken
from the distance to hi) moves the mean by |p - 1/2| or |1 - 2p| steps, many bounds for N = 20000.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

from lowprec import formats as F
from tests.formats._oracle import finite_grid

N_DRAWS = 20_000
FRACS = (0.0625, 0.375, 0.5, 0.8125)  # dyadic, so every x is exact in float32


def _cases(name: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(x, lo, hi) for values between neighbours in the first subnormal step, and in low, middle
    and high binades, at several fractions of the step, both signs."""
    g = finite_grid(name)
    g = g[g <= F.get(name).max]  # int8's -128 has no positive twin
    idx = np.unique(np.array([0, 1, len(g) // 3, len(g) // 2, len(g) - 3, len(g) - 2]))
    lo, hi = g[idx], g[idx + 1]
    p = np.array(FRACS)[:, None]
    x = (lo + p * (hi - lo)).ravel()
    lo, hi = np.broadcast_to(lo, (len(FRACS), lo.size)).ravel(), np.broadcast_to(hi, (len(FRACS), hi.size)).ravel()
    return np.concatenate([x, -x]), np.concatenate([lo, -lo]), np.concatenate([hi, -hi])


@pytest.mark.parametrize("name", ["e4m3", "e5m2", "e3m2", "e2m1", "bf16", "int8"])
def test_mean_is_x_and_only_neighbours_appear(name):
    x, lo, hi = _cases(name)
    assert np.array_equal(x.astype(np.float32), x)  # exact in float32: no bias from the input itself
    g = torch.Generator().manual_seed(11)
    draws = F.round_to(torch.from_numpy(x).float().expand(N_DRAWS, -1), name, "stochastic", generator=g)
    draws = draws.double().numpy()  # (N_DRAWS, k)
    up = draws == hi
    assert (up | (draws == lo)).all(), "a value other than the two neighbours appeared"
    p = (x - lo) / (hi - lo)
    assert (up.any(axis=0) & (~up).any(axis=0)).all()  # both neighbours do appear
    bound = 5 * np.abs(hi - lo) * np.sqrt(p * (1 - p) / N_DRAWS)
    err = np.abs(draws.mean(axis=0) - x)
    assert (err <= bound).all(), (x[err > bound], err[err > bound], bound[err > bound])


@pytest.mark.parametrize("name", ["e4m3", "e5m2", "e2m3", "e2m1", "e8m0", "int4"])
def test_grid_values_never_move(name):
    v = F.decode_table(name)
    v = v[torch.isfinite(v)].expand(64, -1)  # (64, codes)
    g = torch.Generator().manual_seed(12)
    got = F.round_to(v, name, "stochastic", generator=g)
    assert torch.equal(got.view(torch.int32), v.contiguous().view(torch.int32))  # -0 stays -0


def test_explicit_rand_rounds_away_exactly_when_rand_below_frac():
    # e2m1: 2.5 lies half way between 2 and 3; 0.75 half way between 0.5 and 1; 5 is 1/2 of 4 -> 6
    x = torch.tensor([2.5, 2.5, 2.5, -2.5, -2.5, 0.75, 0.75, 5.0, 5.0, 4.5])
    rand = torch.tensor([0.49, 0.5, 0.51, 0.49, 0.5, 0.0, 0.99, 0.4999, 0.5, 0.25])
    got = F.round_to(x, "e2m1", "stochastic", rand=rand)
    assert got.tolist() == [3.0, 2.0, 2.0, -3.0, -2.0, 1.0, 0.5, 6.0, 4.0, 4.0]


def test_explicit_rand_matches_an_independent_rule():
    rng = np.random.default_rng(13)
    grid = finite_grid("e4m3")
    a = np.concatenate([rng.uniform(0, 448, 40_000), np.exp2(rng.uniform(-12, 0, 10_000))]).astype(np.float32)
    x = a * rng.choice([-1, 1], a.size).astype(np.float32)
    rand = rng.random(a.size, dtype=np.float32)
    i = np.searchsorted(grid, a.astype(np.float64), side="right") - 1  # grid[i] <= |x| < grid[i + 1]
    lo, hi = grid[i], grid[np.minimum(i + 1, grid.size - 1)]
    frac = np.where(hi > lo, (a - lo) / np.where(hi > lo, hi - lo, 1), 0)
    ref = np.where(rand < frac, hi, lo) * np.sign(x)
    got = F.round_to(torch.from_numpy(x), "e4m3", "stochastic", rand=torch.from_numpy(rand)).numpy()
    assert np.array_equal(got, ref.astype(np.float32))


def test_same_seed_same_result_and_rand_equals_generator():
    x = torch.linspace(-400, 400, 10_001)
    runs = [F.round_to(x, "e4m3", "stochastic", generator=torch.Generator().manual_seed(s)) for s in (1, 1, 2)]
    assert torch.equal(runs[0], runs[1])
    assert not torch.equal(runs[0], runs[2])
    rand = torch.rand(x.shape, generator=torch.Generator().manual_seed(1))
    assert torch.equal(F.round_to(x, "e4m3", "stochastic", rand=rand), runs[0])  # the documented draw


def test_stochastic_saturation():
    x = torch.full((2000,), 460.0)  # between 448 and 480 (which e4m3 lacks)
    g = torch.Generator().manual_seed(14)
    assert (F.round_to(x, "e4m3", "stochastic", generator=g) == 448).all()
    got = F.round_to(x, "e4m3", "stochastic", saturate=False, generator=g)
    assert ((got == 448) | torch.isnan(got)).all() and torch.isnan(got).any()
    got = F.round_to(torch.full((2000,), 5.5), "e2m1", "stochastic", generator=g)
    assert set(got.tolist()) == {4.0, 6.0}


def test_stochastic_keeps_non_finite_rules():
    x = torch.tensor([float("inf"), float("-inf"), float("nan")])
    assert F.round_to(x, "e5m2", "stochastic", rand=torch.zeros(3))[:2].tolist() == [float("inf"), float("-inf")]
    assert torch.isnan(F.round_to(x, "e4m3", "stochastic", rand=torch.zeros(3))).all()
    with pytest.raises(ValueError, match="^x: expected finite values"):
        F.round_to(x, "e2m1", "stochastic", rand=torch.zeros(3))
