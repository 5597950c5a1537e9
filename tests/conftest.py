"""Shared test fixtures. The helpers themselves live in ``tests/helpers.py`` so tests can import them."""
from __future__ import annotations

import pytest

from tests.helpers import SQNR_FLOORS, sqnr


@pytest.fixture(name="sqnr")
def sqnr_fixture():
    """:func:`tests.helpers.sqnr`, for tests that prefer a fixture to an import."""
    return sqnr


@pytest.fixture(name="sqnr_floors")
def sqnr_floors_fixture() -> dict[str, float]:
    """A copy of :data:`tests.helpers.SQNR_FLOORS`, so a test cannot change the shared one."""
    return dict(SQNR_FLOORS)
