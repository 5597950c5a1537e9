"""Bad recipe input is refused when the recipe is built, naming the argument, what was expected and
what was received."""
from __future__ import annotations

import dataclasses

import pytest

from lowprec import recipes as R
from lowprec.quant import blockwise, mx, rowwise, tensorwise
from lowprec.recipes import Cast, DelayedScaling, Gemm, Recipe, Scaling

E4M3 = Cast(format="e4m3", granularity=tensorwise())


def recipe(**kw) -> Recipe:
    g = Gemm(lhs=E4M3, rhs=E4M3)
    return Recipe(**{"name": "mine", "fprop": g, "dgrad": g, "wgrad": g, **kw})


@pytest.mark.parametrize(("make", "exc", "message"), [
    (lambda: R.get("fp9"), ValueError, r"recipe: expected one of bf16, fp16, fp8-delayed, .*, nvfp4 "
                                       r"\(or a lowprec.recipes.Recipe\), got 'fp9'"),
    (lambda: R.get("FP8-current"), ValueError, r"recipe: .* got 'FP8-current'"),
    (lambda: R.get(None), TypeError, r"recipe: expected a recipe name or lowprec.recipes.Recipe, got None"),
    (lambda: Cast(format="e9m9"), ValueError, r"fmt: expected one of .*e4m3.*, got 'e9m9'"),
    (lambda: Cast(format="e4m3"), ValueError,
     r"granularity: expected a scaling granularity for the e4m3 format, got None"),
    (lambda: Cast(format="e4m3", granularity=tensorwise(), rounding="up"), ValueError,
     r"rounding: expected one of 'nearest', 'stochastic', got 'up'"),
    (lambda: Cast(format="e4m3", granularity=tensorwise(), scaling="delayed"), TypeError,
     r"scaling: expected a lowprec.recipes.Scaling, got 'delayed' \(str\)"),
    (lambda: Cast(format="e4m3", granularity=rowwise(), scaling=Scaling.DELAYED), ValueError,
     r"scaling: expected delayed scaling only with a tensorwise\(\) granularity, got row"),
    (lambda: Cast(format="e4m3", granularity=mx(32), scaling=Scaling.DELAYED), ValueError,
     r"scaling: .*got mx32-floor"),
    (lambda: Cast(format="e4m3", granularity=blockwise(1, 128), scaling=Scaling.DELAYED), ValueError,
     r"scaling: .*got block1x128"),
    (lambda: recipe(fprop="e4m3"), TypeError, r"fprop: expected a lowprec.recipes.Gemm, got 'e4m3' \(str\)"),
    (lambda: recipe(fprop=Gemm(lhs=dataclasses.replace(E4M3, hadamard=True), rhs=E4M3)), ValueError,
     r"fprop.input.hadamard: expected False \(the Hadamard transform applies to wgrad operands only\), got True"),
    (lambda: recipe(wgrad=Gemm(lhs=dataclasses.replace(E4M3, hadamard=True), rhs=E4M3)), ValueError,
     r"wgrad.hadamard: expected the same on both wgrad operands .*got lhs=True, rhs=False"),
    (lambda: recipe(hp_last_fraction=1.0), ValueError, r"hp_last_fraction: expected a fraction in \[0, 1\), got 1.0"),
    (lambda: DelayedScaling(history_len=0), ValueError, r"history_len: expected a positive int, got 0"),
    (lambda: DelayedScaling(history_len=True), ValueError, r"history_len: expected a positive int, got True"),
    (lambda: DelayedScaling(algo="mean"), ValueError, r"algo: expected one of 'max', 'most_recent', 'ema', got 'mean'"),
], ids=["unknown-name", "name-case", "none", "format", "no-granularity", "rounding", "scaling-str",
        "delayed-rowwise", "delayed-mx", "delayed-block", "gemm-type", "hadamard-fprop", "hadamard-mismatch",
        "hp-fraction", "history-0", "history-bool", "algo"])
def test_bad_recipe_input_is_refused_with_a_named_message(make, exc, message):
    with pytest.raises(exc, match=message):
        make()


@pytest.mark.parametrize("make", [
    lambda: Cast(format="e4m3", granularity="tensor"),
    lambda: Cast(format="e8m0", granularity=tensorwise()),
    lambda: Cast(format="int8", granularity=mx(32)),
    lambda: Gemm(lhs="e4m3", rhs=None),
    lambda: DelayedScaling(margin=-1.5),
    lambda: recipe(name=3),
], ids=["granularity-str", "scale-format-as-element", "int-with-mx", "gemm-operands", "margin-float", "name-int"])
def test_recipe_input_that_cannot_work_is_refused_when_built(make):
    with pytest.raises((TypeError, ValueError)):
        make()
