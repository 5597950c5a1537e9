"""The precision controller: a GEMM widened on bad figures (its layer's plan rebuilt), held, let back
after it settles with a hold that doubles per strike, spikes widening everything, the BF16 schedule,
and a state that a fresh controller restores to the same layers and choices."""
from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
from torch import nn

import lowprec
from lowprec import recipes as R
from lowprec.telemetry.control import ControlConfig, PrecisionController, mixed_recipe


@dataclass(frozen=True)
class Rec:
    """What the controller reads of a telemetry record (``lowprec.telemetry.OperandStats``)."""

    layer: str
    gemm: str
    operand: str
    saturation: float = 0.0
    underflow: float = 0.0
    sqnr_db: float = 30.0


def _model(recipe: str = "nvfp4") -> nn.Module:
    model = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 64))
    lowprec.convert(model, recipe, lowprec.Policy(keep_head=False, keep_last_blocks=0))
    return model


def _ctl(model, recipe="nvfp4", **kw) -> PrecisionController:
    kw.setdefault("auto", True)
    return PrecisionController(model, R.get(recipe), ControlConfig(**kw), total_steps=100)


def test_a_saturating_fprop_operand_moves_that_gemm_of_that_layer_one_level_up():
    model = _model()
    ctl = _ctl(model, settle_steps=5)
    switches = ctl.observe(1, [Rec("0", "fprop", "input", saturation=0.02), Rec("2", "fprop", "input")])
    assert [(s.layer, s.gemm, s.from_recipe, s.to_recipe) for s in switches] == [("0", "fprop", "nvfp4", "mxfp8")]
    assert "saturation 2.00e-02" in switches[0].reason
    want = mixed_recipe(R.nvfp4_recipe(), {"fprop": R.mxfp8()})
    assert model[0].recipe == want and model[0].recipe.name == "nvfp4+fprop:mxfp8"
    assert model[0].plan().recipe is model[0].recipe  # the plan was made again for the new casts
    assert model[0].recipe.fprop == R.mxfp8().fprop and model[0].recipe.wgrad == R.nvfp4_recipe().wgrad
    assert model[2].recipe == R.nvfp4_recipe()
    x = torch.randn(8, 64)
    assert torch.isfinite(model(x)).all()  # the mixed recipe runs
    assert ctl.levels() == {"0": "nvfp4+fprop:mxfp8"}


def test_hysteresis_a_widened_gemm_goes_back_after_settling_and_the_hold_doubles_per_strike():
    model = _ctl_model = _model()
    ctl = _ctl(_ctl_model, settle_steps=4, sqnr_floor_db=8.0, hysteresis_db=3.0)
    bad, band, good = Rec("0", "dgrad", "grad_output", sqnr_db=5.0), Rec("0", "dgrad", "grad_output", sqnr_db=9.0), \
        Rec("0", "dgrad", "grad_output", sqnr_db=20.0)
    assert len(ctl.observe(10, [bad])) == 1
    assert ctl.observe(12, [band]) == []  # above the floor but within the band: held, clock restarts at 12
    assert ctl.observe(15, [good]) == []  # 3 steps settled < 4
    assert ctl.observe(16, None) == []  # an unsampled step lets nothing back
    back = ctl.observe(16, [good])  # 4 steps since 12: one level down
    assert [(s.from_recipe, s.to_recipe) for s in back] == [("mxfp8", "nvfp4")] and model[0].recipe == R.nvfp4_recipe()
    assert len(ctl.observe(17, [bad])) == 1  # the second strike: held 8 steps now
    assert ctl.observe(24, [good]) == [] and len(ctl.observe(25, [good])) == 1


def test_trouble_at_the_wider_level_climbs_the_ladder_to_bf16_and_stops_there():
    model = _model()
    ctl = _ctl(model)
    for step in (1, 2, 3):
        ctl.observe(step, [Rec("2", g, "input", sqnr_db=1.0) for g in ("fprop", "dgrad", "wgrad")])
    assert model[2].recipe.name == "bf16" and ctl.levels() == {"2": "bf16"}
    assert len(ctl.switches) == 6  # nvfp4 -> mxfp8 -> bf16 for each GEMM, nothing beyond bf16


def test_repeated_loss_spikes_widen_every_gemm_of_every_layer():
    model = _model("fp8-delayed")
    ctl = _ctl(model, "fp8-delayed", spikes_to_widen=2, spike_window=10)
    assert ctl.observe(3, None, spike=True) == []
    assert ctl.observe(20, None, spike=True) == []  # the first spike left the window
    switches = ctl.observe(25, None, spike=True)
    assert len(switches) == 6 and {s.reason for s in switches} == {"loss spikes"}
    assert model[0].recipe.name == model[2].recipe.name == "bf16"
    assert model[0].delayed_state is None  # no delayed casts left: the history went with them


def test_the_final_fraction_runs_in_bf16_without_auto():
    model = _model("mxfp8")
    ctl = PrecisionController(model, R.mxfp8(), ControlConfig(hp_final_fraction=0.1), total_steps=100)
    assert ctl.before_step(90) == [] and model[0].recipe.name == "mxfp8"
    switches = ctl.before_step(91)
    assert {(s.layer, s.to_recipe, s.reason) for s in switches} == {("0", "bf16", "schedule"),
                                                                   ("2", "bf16", "schedule")}
    assert model[0].recipe.name == "bf16" and ctl.before_step(92) == []
    assert ctl.observe(92, [Rec("0", "fprop", "input", sqnr_db=0.0)]) == []  # auto is off


def test_a_restored_controller_binds_the_same_recipes_and_decides_the_same():
    a_model, b_model = _model(), _model()
    a = _ctl(a_model, settle_steps=3)
    a.observe(1, [Rec("0", "wgrad", "input", underflow=0.9)])
    b = _ctl(b_model, settle_steps=3)
    b.load_state_dict(a.state_dict())
    assert b_model[0].recipe == a_model[0].recipe and b.switches == a.switches
    assert [s.to_recipe for s in a.observe(4, [])] == [s.to_recipe for s in b.observe(4, [])] == ["nvfp4"]


def test_a_state_naming_another_models_layer_is_refused():
    ctl = _ctl(_model())
    state = ctl.state_dict() | {"gemms": {"7|fprop": [1, 1, 0]}}
    with pytest.raises(ValueError, match=r"^state_dict\['control'\]: expected levels of this model's converted"):
        ctl.load_state_dict(state)


@pytest.mark.parametrize(("field", "value"), [("hp_final_fraction", 1.0), ("settle_steps", 0), ("auto", 1),
                                              ("saturation_ceiling", -1.0)])
def test_bad_settings_are_refused_naming_them(field, value):
    with pytest.raises((ValueError, TypeError), match=f"^{field}: expected"):
        ControlConfig(**{field: value})
