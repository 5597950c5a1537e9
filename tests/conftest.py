"""Shared test fixtures. The helpers themselves live in ``tests/helpers.py`` so tests can import them."""
from __future__ import annotations

import pytest
import torch

from tests.helpers import SQNR_FLOORS, sqnr

# CI runs the suite as two pytest workers on two cores; torch's default of one thread per core would
# put four busy threads on two cores, and the many small element-wise kernels of emulated
# quantization slow down several-fold while the threads wait on each other.
torch.set_num_threads(1)


@pytest.fixture(name="sqnr")
def sqnr_fixture():
    """:func:`tests.helpers.sqnr`, for tests that prefer a fixture to an import."""
    return sqnr


@pytest.fixture(name="sqnr_floors")
def sqnr_floors_fixture() -> dict[str, float]:
    """A copy of :data:`tests.helpers.SQNR_FLOORS`, so a test cannot change the shared one."""
    return dict(SQNR_FLOORS)
