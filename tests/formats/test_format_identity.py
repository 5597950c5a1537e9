"""A table format comes back from pickling and copying as the table's own object: code tells formats apart
by identity (``fmt is E4M3``), so a copied recipe or a pickled plan must not hold a look-alike."""
from __future__ import annotations

import copy
import dataclasses
import pickle

import pytest

from lowprec import formats as F


@pytest.mark.parametrize("name", list(F.FORMATS))
def test_a_table_format_survives_pickling_and_copying_as_itself(name):
    f = F.FORMATS[name]
    assert pickle.loads(pickle.dumps(f)) is f
    assert copy.deepcopy(f) is f


def test_a_format_not_in_the_table_round_trips_by_value():
    mine = dataclasses.replace(F.get("e4m3"), max=240.0)
    back = pickle.loads(pickle.dumps(mine))
    assert back == mine and back.max == 240.0 and back is not F.get("e4m3")
