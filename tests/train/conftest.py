"""Fixtures every training test shares: the embedded corpus, and quiet warnings."""
from __future__ import annotations

import warnings

import pytest

from lowprec.train.data import load_data


@pytest.fixture(scope="session")
def data():
    """The embedded default corpus, loaded once."""
    return load_data()


@pytest.fixture(autouse=True)
def _quiet():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "emulated on cpu" is expected here
        yield
