"""The controller's ladder is derived from the recipes' formats: today's presets keep the ladder their
table gave them, and a user's recipe or a new preset gets one by the same rule."""
from __future__ import annotations

import pytest
import torch
from torch import nn

import lowprec
from lowprec import recipes as R
from lowprec.quant import mx, rowwise
from lowprec.recipes import Cast, Gemm, Recipe
from lowprec.telemetry.control import ControlConfig, PrecisionController
from lowprec.telemetry.ladder import ladder, next_wider, width

OLD_TABLE = {"nvfp4": "mxfp8", "mxfp4": "mxfp8", "mxfp8": "bf16", "fp8-delayed": "bf16",
             "fp8-current": "bf16", "fp8-rowwise": "bf16", "fp8-blockwise": "bf16"}
"""Each preset's next wider recipe as the controller's table had it (bf16 and fp16: the top)."""


def _uniform(name: str, cast: Cast) -> Recipe:
    g = Gemm(lhs=cast, rhs=cast)
    return Recipe(name=name, fprop=g, dgrad=g, wgrad=g)


MXFP6 = _uniform("my-mxfp6", Cast(format="e3m2", granularity=mx(32, "ceil")))


@pytest.mark.parametrize("name", R.names())
def test_every_preset_keeps_the_ladder_of_the_old_table(name):
    want = [name]
    while want[-1] in OLD_TABLE:
        want.append(OLD_TABLE[want[-1]])
    assert [r.name for r in ladder(R.get(name))] == want
    up = next_wider(R.get(name))
    assert (up.name if up else None) == OLD_TABLE.get(name)


def test_a_users_recipe_gets_a_ladder_by_its_narrowest_format():
    assert width(MXFP6) == 6
    assert [r.name for r in ladder(MXFP6)] == ["my-mxfp6", "mxfp8", "bf16"]
    fp8 = Cast(format="e4m3", granularity=rowwise())
    bf16 = Cast(format="bf16")
    forward_only = Recipe(name="fp8-forward-only", fprop=Gemm(lhs=fp8, rhs=fp8), dgrad=Gemm(lhs=bf16, rhs=bf16),
                          wgrad=Gemm(lhs=bf16, rhs=bf16))
    assert [r.name for r in ladder(forward_only)] == ["fp8-forward-only", "bf16"]
    assert [r.name for r in ladder(_uniform("mine", Cast(format=None)))] == ["mine"]  # kept as it is: the top


def test_a_new_preset_gets_a_ladder_and_is_a_rung_of_the_narrower(monkeypatch):
    monkeypatch.setitem(R.PRESETS, "mxfp6", lambda: MXFP6)
    assert [r.name for r in ladder(MXFP6)] == ["my-mxfp6", "mxfp8", "bf16"]
    assert [r.name for r in ladder(R.get("nvfp4"))] == ["nvfp4", "my-mxfp6", "mxfp8", "bf16"]


def test_the_controller_widens_a_users_recipe():
    model = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 64))
    lowprec.convert(model, MXFP6, lowprec.Policy(keep_head=False, keep_last_blocks=0))
    ctl = PrecisionController(model, MXFP6, ControlConfig(auto=True), total_steps=100)

    class Rec:
        layer, gemm, operand, saturation, underflow, sqnr_db = "0", "wgrad", "input", 0.02, 0.0, 30.0

    switches = ctl.observe(1, [Rec()])
    assert [(s.from_recipe, s.to_recipe) for s in switches] == [("my-mxfp6", "mxfp8")]
    assert model[0].recipe.wgrad == R.mxfp8().wgrad
    assert torch.isfinite(model(torch.randn(8, 64))).all()
