"""``convert`` binds the recipe to every ``lowprec.nn.GroupedLinear`` as it does to a linear: the policy's
patterns and kept blocks apply, a recipe the experts refuse keeps them in high precision with the reason,
and the report has one row of ``E experts x out x in`` whose parameters the coverage counts."""
from __future__ import annotations

import json
import warnings

import pytest
import torch
import torch.nn as nn

import lowprec
from lowprec.nn import GroupedLinear
from lowprec.nn.plan import Kept
from lowprec.policy import Policy

E, H, D = 4, 128, 256  # experts, hidden, expert width


class Block(nn.Module):
    def __init__(self, experts_name: str = "experts") -> None:
        super().__init__()
        self.attn = nn.Linear(H, H, bias=False)
        self.router = nn.Linear(H, E, bias=False)
        setattr(self, experts_name, GroupedLinear(E, H, D))


class Model(nn.Module):
    def __init__(self, n: int = 3, experts_name: str = "experts") -> None:
        super().__init__()
        self.layers = nn.ModuleList(Block(experts_name) for _ in range(n))
        self.experts_name = experts_name

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Each block's experts on its attention's output, the rows split evenly but for expert 1 (none)."""
        n = x.shape[0]
        offsets = torch.tensor([n // 2, n // 2, 3 * n // 4, n])
        return sum(getattr(b, self.experts_name)(b.attn(x), offsets).sum() for b in self.layers)


def convert(model, recipe="fp8-current", policy=None):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        report = lowprec.convert(model, recipe, policy)
    return report, [str(w.message) for w in caught]


def rows(report):
    return {lr.name: lr for lr in report.layers}


def test_every_grouped_linear_gets_the_recipe_and_one_row_of_its_experts():
    model = Model()
    report, said = convert(model)
    for i in range(3):
        assert model.layers[i].experts.recipe == lowprec.recipes.get("fp8-current")
        row = rows(report)[f"layers.{i}.experts"]
        assert (row.converted, row.reason, row.kept, row.experts) == (True, "fp8-current", None, E)
        assert row.shape_text == "4 experts x 256 x 128" and row.params == E * D * H
        assert rows(report)[f"layers.{i}.router"].reason == "MoE router / gate (kept by policy)"
    assert report.unseen == [] and not any("cannot see into" in s for s in said)
    c = report.coverage()
    assert (c.converted, c.linears) == (6, 9)  # 3 attention linears, 3 groups of experts; routers kept
    assert c.converted_params == 3 * (H * H + E * D * H) and c.params == c.converted_params + 3 * H * E
    assert "layers.0.experts  4 experts x 256 x 128  yes" in " ".join(report.to_table().split("|"))


def test_the_converted_experts_compute_what_experts_bound_by_hand_compute():
    torch.manual_seed(0)
    model = Model(1)
    by_hand = GroupedLinear(E, H, D, recipe="fp8-current")
    by_hand.weight.data.copy_(model.layers[0].experts.weight.data)
    convert(model)
    x, offsets = torch.randn(40, H), torch.tensor([10, 10, 25, 40])
    # the same casts and GEMMs in the same order on the same values: equal bit for bit
    assert torch.equal(model.layers[0].experts(x, offsets), by_hand(x, offsets))
    assert not torch.equal(by_hand(x, offsets), GroupedLinear(E, H, D)(x, offsets))  # the recipe ran


def test_the_json_row_of_experts_says_how_many_and_a_linears_row_is_unchanged():
    report, _ = convert(Model(1))
    layers = {r["name"]: r for r in json.loads(report.to_json())["layers"]}
    assert layers["layers.0.experts"]["experts"] == E and layers["layers.0.experts"]["params"] == E * D * H
    assert "experts" not in layers["layers.0.attn"]


def test_include_and_exclude_patterns_and_kept_blocks_apply_to_experts():
    model = Model()
    report, said = convert(model, policy=Policy(exclude=("layers.1.experts",), keep_first_blocks=1,
                                                keep_last_blocks=0))
    r = rows(report)
    assert r["layers.0.experts"].reason == "block 0 of the first 1 (kept by policy)"
    assert r["layers.1.experts"].reason == "excluded by policy.exclude"
    assert r["layers.2.experts"].converted and model.layers[2].experts.recipe is not None
    assert model.layers[0].experts.recipe is None and model.layers[1].experts.recipe is None
    assert r["layers.1.experts"].kept is Kept.POLICY and not any("pattern" in s for s in said)
    report, said = convert(model, policy=Policy(include=("*.experts",), keep_last_blocks=1))
    r = rows(report)  # a pattern matching experts alone matches something; reconverting unbinds
    assert not any("matching none" in s for s in said)
    assert [r[f"layers.{i}.experts"].converted for i in range(3)] == [True, True, False]
    assert model.layers[2].experts.recipe is None and not r["layers.0.attn"].converted


def test_experts_named_gate_are_not_taken_for_a_router():
    model = Model(1, experts_name="gate")
    report, _ = convert(model)
    assert rows(report)["layers.0.gate"].converted and model.layers[0].gate.recipe is not None


def test_delayed_scaling_converts_the_experts_with_a_history_each_in_the_models_banks():
    """Under fp8-delayed each expert keeps an amax history, a row of the model's banks beside the linears',
    folded by the model's forward; a training step records every expert that had tokens, and the
    data-parallel reduction and the outlier count see the experts' states."""
    from lowprec.distributed.amax import delayed_states
    from lowprec.nn.delayed import amax_outliers

    model = Model(2)
    report, said = convert(model, "fp8-delayed", Policy(keep_last_blocks=0))
    r = rows(report)
    assert r["layers.0.experts"].converted and r["layers.1.experts"].converted and r["layers.0.attn"].converted
    experts = model.layers[0].experts
    banks = model.layers[0].attn.delayed_state.banks
    assert banks.by_hook and all(s.banks is banks for _, s in experts.delayed_states())
    assert len(delayed_states(model)) == 2 + 2 * E  # two linears, and E experts in each of two layers
    x = torch.randn(8, H, requires_grad=True)
    model(x).backward()
    assert [s.recorded for _, s in experts.delayed_states()] == [[1, 1, 1], [0, 0, 0], [1, 1, 1], [1, 1, 1]]
    assert amax_outliers(model) == 0


def test_experts_whose_shape_the_recipe_cannot_take_are_said_once_at_conversion():
    model = nn.ModuleDict({"experts": GroupedLinear(E, 64, 96), "proj": nn.Linear(96, 64)})
    report, said = convert(model, "fp8-blockwise")
    row = rows(report)["experts"]
    assert not row.converted and row.kept is Kept.SHAPE and row.reason.startswith("high precision: ")
    assert sum("run in high precision because the fp8-blockwise GEMMs cannot take their shape" in s
               for s in said) == 1
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # said at conversion: not again at the first forward
        model["experts"](torch.randn(6, 64), torch.tensor([1, 2, 3, 6]))


@pytest.mark.parametrize("recipe", ["bf16", "mxfp8", "nvfp4"])
def test_every_current_scaled_recipe_binds_to_the_experts(recipe):
    model = Model(1)
    report, _ = convert(model, recipe, Policy(keep_last_blocks=0))
    assert rows(report)["layers.0.experts"].converted and rows(report)["layers.0.experts"].reason == recipe
    assert model.layers[0].experts.recipe == lowprec.recipes.get(recipe)
