"""Evaluation is deterministic: under ``model.eval()`` or without gradients every cast rounds to
nearest, so a stochastic-rounding recipe (nvfp4's gradients; a recipe that rounds its forward
stochastically) gives the same output on every call, equal to the recipe with its roundings set to
nearest; training forwards still round stochastically."""
from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from lowprec import recipes as R
from tests.helpers import stochastic_forward_recipe
from tests.nn.common import make_linear, randn


def _nearest(recipe: R.Recipe) -> R.Recipe:
    def near(c: R.Cast) -> R.Cast:
        return replace(c, rounding="nearest")

    gemms = {g: replace(getattr(recipe, g), lhs=near(getattr(recipe, g).lhs), rhs=near(getattr(recipe, g).rhs))
             for g in ("fprop", "dgrad", "wgrad")}
    return replace(recipe, name=recipe.name + "-nearest", **gemms)


@pytest.mark.parametrize("name", ["sr-forward", "nvfp4"])
def test_eval_and_no_grad_forwards_round_to_nearest(name):
    recipe = stochastic_forward_recipe() if name == "sr-forward" else R.get(name)
    lin = make_linear(recipe, 128, 256)
    x = randn(64, 128, seed=3)
    stochastic_forward = recipe.fprop.lhs.stochastic  # nvfp4 rounds gradients only
    train_a, train_b = lin(x.requires_grad_()), lin(x)
    assert torch.equal(train_a, train_b) != stochastic_forward  # training draws its random bits anew
    ref = make_linear(_nearest(recipe), 128, 256)(x.detach())  # the same weights, nearest rounding
    with torch.no_grad():
        assert torch.equal(lin(x), lin(x)) and torch.equal(lin(x), ref)
    lin.eval()
    assert torch.equal(lin(x), lin(x)) and torch.equal(lin(x), ref)
    lin.train()
    assert torch.equal(lin(x), lin(x)) != stochastic_forward
