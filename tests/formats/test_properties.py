"""Properties of round-to-nearest that hold for any input in range, checked with hypothesis: the
error is at most half the local grid step, grid values are fixed points, rounding is monotonic."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from lowprec import formats as F
from tests.formats._oracle import finite_grid

NAMES = ["e4m3", "e5m2", "e3m2", "e2m3", "e2m1", "bf16", "fp16", "int8", "int4"]
GRIDS = {name: finite_grid(name)[finite_grid(name) <= F.get(name).max] for name in NAMES}  # int8: not 128
PROFILE = settings(max_examples=40, deadline=None, derandomize=True)


def _in_range(name: str):
    top = float(np.float32(F.get(name).max))
    return st.floats(-top, top, width=32, allow_nan=False, allow_subnormal=True)


def _rn(values, name):
    return F.round_to(torch.tensor(values, dtype=torch.float32), name).double().numpy()


@pytest.mark.parametrize("name", NAMES)
def test_error_is_at_most_half_the_local_step(name):
    grid = GRIDS[name]

    @PROFILE
    @given(st.lists(_in_range(name), min_size=1, max_size=32))
    def check(xs):
        x = np.array(xs, np.float64)
        y = _rn(xs, name)
        a = np.abs(x)
        i = np.clip(np.searchsorted(grid, a, side="right") - 1, 0, grid.size - 2)  # grid[i] <= |x|
        lo, hi = grid[i], grid[i + 1]
        assert (np.abs(y - x) <= (hi - lo) / 2).all()
        assert ((np.abs(y) == lo) | (np.abs(y) == hi)).all()  # one of the two neighbours

    check()


@pytest.mark.parametrize("name", NAMES)
def test_grid_values_are_fixed_points(name):
    grid = GRIDS[name]
    values = st.sampled_from(np.concatenate([grid, -grid]).tolist())

    @PROFILE
    @given(st.lists(values, min_size=1, max_size=32))
    def check(xs):
        assert np.array_equal(_rn(xs, name), np.array(xs))

    check()


@pytest.mark.parametrize("name", NAMES)
def test_rounding_is_monotonic(name):
    @PROFILE
    @given(st.lists(_in_range(name), min_size=2, max_size=32))
    def check(xs):
        x = np.sort(np.array(xs, np.float32))
        assert (np.diff(_rn(x.tolist(), name)) >= 0).all()

    check()


@PROFILE
@given(st.lists(st.floats(width=32, allow_nan=False, allow_infinity=False), min_size=2, max_size=32))
def test_saturating_rounding_is_monotonic_over_all_float32(xs):
    x = np.sort(np.array(xs, np.float32))
    y = _rn(x.tolist(), "e4m3")
    assert (np.diff(y) >= 0).all() and (np.abs(y) <= 448).all()
