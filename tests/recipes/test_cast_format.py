"""A cast holds its element format from the table (``Cast.fmt``), so code reads the format, not its name."""
from __future__ import annotations

import dataclasses
import pickle

import pytest

from lowprec import formats as F
from lowprec import recipes as R
from lowprec.plan.recipes import cost_of
from lowprec.quant import mx, tensorwise
from lowprec.recipes import Cast, Gemm, Recipe


@pytest.mark.parametrize(("name", "fmt"), [("e4m3", "e4m3"), ("float8_e4m3fn", "e4m3"), ("fp4", "e2m1"),
                                           ("bfloat16", "bf16")])
def test_a_cast_holds_the_table_format_its_name_names(name, fmt):
    c = Cast(format=name, granularity=None if fmt == "bf16" else mx(32))
    assert c.fmt is F.FORMATS[fmt]
    assert c.format == name  # the name as given: reprs and descriptions are unchanged
    assert Cast(format=None).fmt is None


def test_the_format_leaves_equality_hash_repr_and_pickling_as_they_were():
    a, b = Cast(format="e4m3", granularity=tensorwise()), Cast(format="e4m3", granularity=tensorwise())
    assert a == b and hash(a) == hash(b)  # layer plans are cached on recipes
    assert "fmt" not in repr(a)
    assert repr(a).startswith("Cast(format='e4m3', granularity=")
    assert dataclasses.replace(a, format="e5m2").fmt is F.FORMATS["e5m2"]
    back = pickle.loads(pickle.dumps(a))
    assert back == a and back.fmt is F.FORMATS["e4m3"]


def test_the_planner_reads_a_format_named_by_an_alias_as_the_format():
    """FP8 weights stored as the GEMMs read them: decided by the E4M3 format, whatever name the recipe used
    (the planner compared the name with "e4m3", so an alias planned a second, blocked weight copy)."""
    fwd = Cast(format="float8_e4m3fn", granularity=tensorwise())
    grad = Cast(format="e5m2", granularity=tensorwise())
    mine = Recipe(name="mine", fprop=Gemm(lhs=fwd, rhs=fwd), dgrad=Gemm(lhs=grad, rhs=fwd),
                  wgrad=Gemm(lhs=grad, rhs=fwd))
    ref = cost_of(R.get("fp8-current"))
    assert ref.fp8_weight_direct
    assert (cost_of(mine).fp8_weight, cost_of(mine).fp8_weight_direct) == (ref.fp8_weight, True)
