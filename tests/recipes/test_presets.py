"""The named presets: each GEMM operand's cast as the design's recipe table says, and the
properties the other layers read from a recipe."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from lowprec import recipes as R
from lowprec.quant import blockwise, mx, nvfp4, rowwise, tensorwise
from lowprec.recipes import Cast, Scaling

ROLES = ("fprop.input", "fprop.weight", "dgrad.grad_output", "dgrad.weight", "wgrad.grad_output", "wgrad.input")


def _fp8(scaling: Scaling) -> dict[str, Cast]:
    e4m3 = Cast(format="e4m3", granularity=tensorwise(), scaling=scaling)
    e5m2 = Cast(format="e5m2", granularity=tensorwise(), scaling=scaling)
    return dict(zip(ROLES, (e4m3, e4m3, e5m2, e4m3, e5m2, e4m3)))


def _nvfp4() -> dict[str, Cast]:
    act, w = Cast(format="e2m1", granularity=nvfp4(16)), Cast(format="e2m1", granularity=nvfp4(16, two_d=True))
    grad = Cast(format="e2m1", granularity=nvfp4(16), rounding="stochastic")
    return dict(zip(ROLES, (act, w, grad, w, dataclasses.replace(grad, hadamard=True),
                            dataclasses.replace(act, hadamard=True))))


def _mxfp4() -> dict[str, Cast]:
    fwd = Cast(format="e2m1", granularity=mx(32, "ceil"))
    bwd = Cast(format="e4m3", granularity=mx(32, "ceil"))
    return dict(zip(ROLES, (fwd, fwd, bwd, bwd, bwd, bwd)))


def _fp8_blockwise() -> dict[str, Cast]:
    act, w = Cast(format="e4m3", granularity=blockwise(1, 128)), Cast(format="e4m3", granularity=blockwise(128, 128))
    return dict(zip(ROLES, (act, w, act, w, act, act)))


EXPECTED: dict[str, dict[str, Cast]] = {
    "bf16": dict.fromkeys(ROLES, Cast(format="bf16")),
    "fp16": dict.fromkeys(ROLES, Cast(format="fp16")),
    "fp8-delayed": _fp8(Scaling.DELAYED),
    "fp8-current": _fp8(Scaling.CURRENT),
    "fp8-rowwise": dict.fromkeys(ROLES, Cast(format="e4m3", granularity=rowwise())),
    "fp8-blockwise": _fp8_blockwise(),
    "mxfp8": dict.fromkeys(ROLES, Cast(format="e4m3", granularity=mx(32, "ceil"))),
    "mxfp4": _mxfp4(),
    "nvfp4": _nvfp4(),
}


def test_the_nine_presets_in_order():
    assert R.names() == list(EXPECTED)


@pytest.mark.parametrize("name", list(EXPECTED))
def test_each_operand_is_cast_as_the_recipe_table_says(name):
    recipe = R.get(name)
    assert recipe.name == name and recipe.casts() == EXPECTED[name]
    assert recipe.doc.strip(), "every preset says what it is and where it comes from"


@pytest.mark.parametrize("name", list(EXPECTED))
def test_the_properties_other_layers_read(name):
    r = R.get(name)
    assert r.low_precision == (name not in ("bf16", "fp16"))
    assert r.hp_dtype == {"bf16": torch.bfloat16, "fp16": torch.float16}.get(name)
    assert r.uses_delayed_scaling == (name == "fp8-delayed")
    assert r.loss_scaling == (name == "fp16")
    assert r.hp_last_fraction == (0.15 if name == "nvfp4" else 0.0)
    assert r.fprop.fast_accum == (name in ("fp8-delayed", "fp8-current", "fp8-rowwise"))
    assert not r.dgrad.fast_accum and not r.wgrad.fast_accum  # gradients accumulate in FP32
    for role in ROLES:
        assert f"{role}=" in r.summary()


def test_delayed_scaling_defaults_are_transformer_engines():
    assert R.fp8_delayed().delayed == R.DelayedScaling(history_len=1024, algo="max", margin=0)


def test_a_preset_is_a_fresh_equal_frozen_value():
    a, b = R.get("mxfp8"), R.get("mxfp8")
    assert a == b and hash(a) == hash(b)
    with pytest.raises(dataclasses.FrozenInstanceError):
        a.name = "other"


def test_get_returns_a_user_recipe_as_it_is():
    mine = dataclasses.replace(R.mxfp8(), name="my-mxfp8")
    assert R.get(mine) is mine


def test_cast_describe_names_format_granularity_and_options():
    casts = R.get("nvfp4").casts()
    assert casts["wgrad.grad_output"].describe() == "e2m1/nvfp4-16 SR RHT"
    assert casts["fprop.weight"].describe() == "e2m1/nvfp4-16x16"
    assert R.get("fp8-delayed").casts()["fprop.input"].describe() == "e4m3/tensor delayed"
    assert Cast(format="bf16").describe() == "bf16" and Cast(format=None).describe() == "hp"
