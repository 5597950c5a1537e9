"""``convert`` names the weights it cannot see into (fused 3-D experts, a module's own ``F.linear``),
warns once, and counts them in the coverage a verdict rests on; norms, embeddings and plain models
have none."""
from __future__ import annotations

import json
import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import lowprec
from lowprec.conversion_report import Coverage
from lowprec.nn import GroupedLinear
from lowprec.train.model import PRESETS, build_model
from lowprec.train.verdict import untested

E, H, D = 4, 64, 128  # experts, hidden, expert width


class Experts(nn.Module):
    """Hugging Face's fused experts (transformers 5): one 3-D parameter per projection, applied with bmm."""

    def __init__(self) -> None:
        super().__init__()
        self.gate_up_proj = nn.Parameter(torch.randn(E, 2 * D, H) / H**0.5)
        self.down_proj = nn.Parameter(torch.randn(E, H, D) / D**0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x (E, T, H): each expert's tokens
        gate, up = torch.bmm(x, self.gate_up_proj.transpose(1, 2)).chunk(2, dim=-1)  # (E, T, D) each
        return torch.einsum("eti,ehi->eth", F.silu(gate) * up, self.down_proj)  # (E, T, H)


class MoE(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(32, H)
        self.norm = nn.RMSNorm(H)
        self.q_proj, self.o_proj = nn.Linear(H, H, bias=False), nn.Linear(H, H, bias=False)
        self.router = nn.Linear(H, E, bias=False)
        self.experts = Experts()

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:  # tokens (T,)
        h = self.o_proj(self.q_proj(self.norm(self.emb(tokens))))  # (T, H)
        weights = self.router(h).softmax(-1)  # (T, E): every token to every expert, weighted
        out = self.experts(h.expand(E, *h.shape))  # (E, T, H)
        return h + torch.einsum("te,eth->th", weights, out)


class OwnLinear(nn.Module):
    """A module of its own: a 2-D weight applied with F.linear, beside a gain and a position table."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(96, H))
        self.bias = nn.Parameter(torch.zeros(96))
        self.gain = nn.Parameter(torch.ones(H))
        self.pos_embed = nn.Parameter(torch.zeros(1, 16, H))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x * self.gain, self.weight, self.bias)


def convert_recording(model: nn.Module, recipe: str = "fp8-current"):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        report = lowprec.convert(model, recipe)
    return report, [w for w in caught if "cannot see into" in str(w.message)]


def test_the_fused_experts_are_named_with_their_shapes_and_warned_of_once():
    model = MoE()
    report, said = convert_recording(model)
    assert [(u.name, u.shape, u.module, u.params) for u in report.unseen] == [
        ("experts.gate_up_proj", (E, 2 * D, H), "Experts", E * 2 * D * H),
        ("experts.down_proj", (E, H, D), "Experts", E * H * D)]
    assert len(said) == 1 and said[0].filename == __file__  # points at the caller, as convert's others do
    # the experts hold 98,304 of the 106,752 matrix parameters (q, o: 4,096 each; the router 256)
    assert str(said[0].message) == (
        "lowprec: 2 weight(s) holding 92% of the matrix parameters are not converted: lowprec cannot see into "
        "them (fused 3-D experts, modules it does not know), so they run in the model's precision: "
        "experts.gate_up_proj, experts.down_proj (see the conversion report)")
    assert model.experts.gate_up_proj.dtype == torch.float32  # untouched
    model(torch.arange(8)).sum().backward()  # and the model still runs


def test_the_coverage_counts_the_experts_as_not_converted():
    report, _ = convert_recording(MoE())
    c = report.coverage()
    linears = 2 * H * H + H * E
    assert (c.converted, c.linears, c.converted_params) == (2, 3, 2 * H * H)  # the router is kept by policy
    assert (c.unseen, c.unseen_params, c.params) == (2, 3 * E * D * H, linears + 3 * E * D * H)
    assert c.fraction == 2 * H * H / (linears + 3 * E * D * H)
    assert str(c) == "2 of 3 linears converted (7% of matrix parameters; 92% in 2 weights lowprec cannot see into)"
    assert report.summary().startswith(f"recipe fp8-current: {c}, 1 kept in high precision; ")


def test_the_table_notes_and_json_name_them():
    report, _ = convert_recording(MoE())
    reason = ("not converted: lowprec cannot see into Experts.gate_up_proj (shape 4x256x64): it runs in the "
              "model's precision")
    assert reason in report.notes()
    row = report.to_table().splitlines()[-2].split()
    assert row[:3] == ["experts.gate_up_proj", "4x256x64", "no"]
    assert reason in str(report)
    data = json.loads(report.to_json())
    assert data["unseen"][1] == {"name": "experts.down_proj", "shape": [E, H, D], "module": "Experts",
                                 "params": E * H * D, "reason": report.unseen[1].reason}
    assert (data["coverage"]["unseen"], data["coverage"]["unseen_params"]) == (2, 3 * E * D * H)


def test_one_note_for_each_kind_of_weight_however_many_layers_hold_it():
    model = nn.ModuleList([MoE(), MoE()])
    report, said = convert_recording(model)
    assert len(report.unseen) == 4 and len(said) == 1
    assert [n for n in report.notes() if "cannot see into" in n] == [
        r + " (2 weights)" for r in (report.unseen[0].reason, report.unseen[1].reason)]


def test_a_module_of_its_own_applying_a_2d_weight_is_named_its_gains_and_tables_are_not():
    model = nn.Sequential(nn.Linear(H, H), OwnLinear())
    report, said = convert_recording(model)
    assert [(u.name, u.shape, u.module) for u in report.unseen] == [("1.weight", (96, H), "OwnLinear")]
    assert len(said) == 1 and report.coverage().unseen_params == 96 * H


def test_a_llama_style_model_norms_embeddings_and_tied_heads_have_nothing_unseen():
    report, said = convert_recording(build_model(PRESETS["tiny"]))
    assert report.unseen == [] and said == []
    c = report.coverage()
    assert str(c).endswith("of linear parameters)") and "unseen" not in c.to_dict()
    tied = nn.Sequential(nn.Embedding(32, H), nn.LayerNorm(H), nn.Linear(H, 32, bias=False))
    tied[2].weight = tied[0].weight
    assert convert_recording(tied)[0].unseen == []


def test_a_grouped_linear_is_converted_never_named_as_unseen():
    from lowprec.unseen import find_unseen

    model = nn.ModuleDict({"experts": GroupedLinear(E, H, D), "proj": nn.Linear(D, H)})
    assert [u.name for u in find_unseen(model, set())] == ["experts.weight"]  # no recipe: a weight unseen
    report, said = convert_recording(model)
    assert report.unseen == [] and said == [] and model["experts"].recipe is not None


def test_a_verdict_on_a_model_whose_experts_never_ran_the_recipe_is_not_earned():
    c = convert_recording(MoE())[0].coverage()
    why = untested(c)
    assert why.startswith(f"{c}: under 50% of the matrix parameters, so the gap mostly measures the baseline; ")
    assert "2 not converted: weights lowprec cannot see into (fused 3-D experts" in why
    # every linear converted is not "100% of linear parameters" while the experts stayed in high precision
    all_linears = Coverage(3, 3, 100, 1000, unseen=2, unseen_params=900)
    assert str(all_linears) == ("3 of 3 linears converted (10% of matrix parameters; 90% in 2 weights lowprec "
                                "cannot see into)")
    assert untested(all_linears) is not None


def test_the_coverage_refuses_unseen_parameters_it_cannot_hold():
    with pytest.raises(ValueError, match=r"^unseen_params: expected a count within the 10 parameters not converted"):
        Coverage(1, 1, 90, 100, unseen=1, unseen_params=11)
