"""The save plan: what a layer's forward keeps for backward, decided with the layer plan, and followed."""
from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from lowprec import recipes as R
from lowprec.nn import Linear, cached_weight_casts
from lowprec.nn.plan import WeightKind, WeightT, layer_plan
from lowprec.quant import tensorwise

CPU = torch.device("cpu")


def _stochastic_weight_t(name: str) -> R.Recipe:
    """``name`` with dgrad's weight cast rounded stochastically: a second cast would draw again."""
    r = R.get(name)
    return replace(r, name=f"{name}-sr", dgrad=replace(r.dgrad, rhs=replace(r.dgrad.rhs, rounding="stochastic")))


@pytest.mark.parametrize("name", [n for n in R.names() if R.get(n).low_precision])
def test_a_plain_weight_is_cast_again_in_backward_unless_a_cache_holds_its_cast(name):
    plan = layer_plan(R.get(name), CPU, 256, 256)
    assert plan.save(WeightKind.PLAIN, False, False, False).weight_t is WeightT.PARAMETER
    assert plan.save(WeightKind.PLAIN, False, True, False).weight_t is WeightT.KEPT
    assert not plan.save(WeightKind.PLAIN, False, False, False).direct


def test_a_stochastically_rounded_weight_t_is_kept_since_a_second_draw_would_differ():
    plan = layer_plan(_stochastic_weight_t("fp8-current"), CPU, 256, 256)
    assert plan.save(WeightKind.PLAIN, False, False, False).weight_t is WeightT.KEPT


def test_fp8_primary_weights_give_their_codes_and_gathered_weights_keep_theirs():
    plan = layer_plan(R.get("fp8-current"), CPU, 256, 256, weight_storage=tensorwise())
    assert plan.stored_weight
    stored = plan.save(WeightKind.STORED, True, False, False)
    assert stored.direct and stored.weight_t is WeightT.CODES and not stored.scale_t
    gathered = plan.save(WeightKind.GATHERED, True, False, False)
    assert gathered.direct and gathered.weight_t is WeightT.KEPT  # freed before backward: its transposed codes kept
    # codes that do not serve the recipe are decoded and cast as a plain weight is, then taken from the codes
    blocks = layer_plan(R.get("fp8-rowwise"), CPU, 256, 256, weight_storage=tensorwise())
    assert not blocks.stored_weight
    decoded = blocks.save(WeightKind.STORED, False, False, False)
    assert not decoded.direct and decoded.weight_t is WeightT.CODES


def test_delayed_weight_t_takes_forwards_scale_and_recast_inputs_only_compiled():
    delayed = layer_plan(R.get("fp8-delayed"), CPU, 256, 256)
    assert delayed.save(WeightKind.PLAIN, False, False, False).scale_t
    assert not layer_plan(R.get("fp8-current"), CPU, 256, 256).save(WeightKind.PLAIN, False, False, False).scale_t
    recast = layer_plan(R.get("fp8-current"), CPU, 256, 256, recast_input=True)
    assert recast.save(WeightKind.PLAIN, False, False, True).input_recast
    assert recast.save(WeightKind.PLAIN, False, False, True).input_scale  # per tensor: forward's scale
    assert not recast.save(WeightKind.PLAIN, False, False, False).input_recast  # eager keeps the cast


def _saved(layer: Linear, x: torch.Tensor) -> list[torch.Tensor]:
    kept = []

    def pack(t):
        kept.append(t)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        layer(x).sum().backward()
    return kept


@pytest.mark.parametrize(("recipe", "weight_kept"), [("fp8-current", "parameter"), ("fp8-current-sr", "cast")])
def test_backward_keeps_what_the_plan_says(recipe, weight_kept):
    """The parameter itself (no copy) where the plan casts weight.T again; an FP8 copy where it keeps it."""
    r = _stochastic_weight_t("fp8-current") if recipe.endswith("-sr") else R.get(recipe)
    torch.manual_seed(0)
    layer = Linear(64, 32, recipe=r)
    x = torch.randn(8, 64, requires_grad=True)
    saved = _saved(layer, x)
    fp8 = [t for t in saved if t.dtype == torch.float8_e4m3fn]
    has_param = any(t is layer.weight for t in saved)
    if weight_kept == "parameter":
        assert has_param and [t.shape for t in fp8] == [torch.Size([64, 8])]  # x.T's codes alone
    else:
        assert not has_param and sorted(t.shape for t in fp8) == [torch.Size([64, 8]), torch.Size([64, 32])]
    with cached_weight_casts(layer):  # the cache holds weight.T's cast: kept, not made again
        cached = _saved(layer, x)
    assert not any(t is layer.weight for t in cached)
    assert sorted(t.shape for t in cached if t.dtype == torch.float8_e4m3fn) == [torch.Size([64, 8]),
                                                                              torch.Size([64, 32])]
