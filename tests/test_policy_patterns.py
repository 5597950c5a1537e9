"""A policy pattern that names no linear of the model (a typo) is said in one line: a warning from
``lowprec.convert``, an error from ``lowprec train``; it was accepted in silence."""
from __future__ import annotations

import warnings

import pytest
from torch import nn

import lowprec
from lowprec.policy import Policy, UnmatchedPatternWarning, unmatched_patterns


class Two(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.ModuleDict({"wq": nn.Linear(32, 32), "w1": nn.Linear(32, 64)})
                                    for _ in range(2))
        self.output = nn.Linear(32, 64)


def test_convert_warns_once_naming_every_pattern_that_matches_no_linear():
    policy = Policy(include=("layers.*", "layer.*.wq"), exclude=("layers.*.atention.*", "layers.0.w1"))
    with pytest.warns(UnmatchedPatternWarning) as caught:
        report = lowprec.convert(Two(), "bf16", policy)
    [w] = [w for w in caught if w.category is UnmatchedPatternWarning]
    assert str(w.message) == (
        "lowprec: policy: expected include/exclude patterns that each match a linear layer's name such as "
        "'layers.0.wq', got include 'layer.*.wq', exclude 'layers.*.atention.*' matching none of the model's "
        "5 linears")
    assert {lr.name: lr.reason for lr in report.layers}["layers.0.w1"] == "excluded by policy.exclude"


@pytest.mark.parametrize("policy", [
    Policy(), Policy(include=("layers.*",), exclude=("*.w1", "output")),
    Policy(exclude=lambda name, module: "atention" in name),  # a predicate is not judged
])
def test_patterns_that_each_match_a_linear_warn_nothing(policy):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        lowprec.convert(Two(), "bf16", policy)
    assert not [w for w in caught if w.category is UnmatchedPatternWarning]
    assert unmatched_patterns(policy, ["layers.0.wq", "layers.0.w1", "output"]) is None
