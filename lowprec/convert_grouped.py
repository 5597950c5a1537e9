"""``convert``'s part for the experts of a mixture of experts: binding the recipe to every
``lowprec.nn.GroupedLinear`` of a model, and each one's row of the conversion report.

[Note: converting experts]
A ``GroupedLinear`` is converted in place (it is already lowprec's module): the policy's include and
exclude patterns, its ``keep_first_blocks`` / ``keep_last_blocks`` (by the block index in its name) and
``skip_small=True`` apply to it as to a linear. The head and router rules do not: experts are neither
(a router is one [E, hidden] matrix, an ``nn.Linear`` the router rule keeps), and an expert projection
may well be named ``gate``. The device's small-layer rule (``Policy.skip_small`` None) does not apply
either: every expert runs the recipe whatever its size. Under delayed scaling each expert keeps an amax
history of its own, a row of the model's banks beside the linears' (``lowprec.nn.delayed_bank``). The
report has one row per ``GroupedLinear``,
``E experts x out x in``, with all its parameters, so the coverage counts them with the linears'.
Hugging Face experts (fused 3-D parameters) are first replaced by a module that runs them through two
``GroupedLinear`` (``lowprec.convert_hf_moe``); those are converted as above, their rows named after the
weights (``model.layers.0.mlp.experts.gate_up_proj``), and the router beside them has a row of its own,
kept in high precision.
"""
from __future__ import annotations

from dataclasses import replace

import torch
import torch.nn as nn

from lowprec import recipes as R
from lowprec.conversion_report import ConversionReport, LayerReport
from lowprec.convert_hf_moe import hf_moe_layers, router_row, swap_hf_experts
from lowprec.nn import GroupedLinear
from lowprec.nn.plan import Kept, layer_plan
from lowprec.policy import Policy, policy_keeps

__all__ = ["convert_grouped", "grouped_layers"]


def grouped_layers(model: nn.Module) -> list[tuple[str, nn.Module | nn.Parameter]]:
    """What :func:`convert_grouped` reports, by row name: each ``GroupedLinear``, and of the Hugging Face
    experts it converts each projection's weight and each router (see ``lowprec.convert_hf_moe``).
    ``convert`` takes their names for the policy's patterns, and them as reported (not unseen)."""
    return [(n, m) for n, m in model.named_modules() if isinstance(m, GroupedLinear)] + hf_moe_layers(model)


def convert_grouped(model: nn.Module, recipe: R.Recipe, policy: Policy, blocks: tuple[str, int] | None,
                    report: ConversionReport, device: torch.device) -> dict[str, GroupedLinear]:
    """Bind ``recipe`` to every ``GroupedLinear`` of ``model`` the policy converts (see [Note: converting
    experts]), one row each in ``report``, after replacing Hugging Face experts by modules that run
    theirs (see [Note: Hugging Face experts] in ``lowprec.convert_hf_moe``); returns them by row name."""
    experts_policy = replace(policy, keep_head=False, keep_routers=False)  # experts are neither
    out: dict[str, GroupedLinear] = {}
    for name, g in _grouped(model, policy):
        if isinstance(g, LayerReport):  # a Hugging Face router: kept
            report.layers.append(g)
            continue
        keep = policy_keeps(experts_policy, name, g, embeddings=set(), mha_children=set(), blocks=blocks,
                            last_fraction=recipe.hp_last_fraction)
        if keep is not None:
            g.set_recipe(None)
            report.layers.append(_row(name, g, False, keep.reason, Kept.POLICY))
        else:
            g.set_recipe(recipe)
            out[name] = g
            plan = layer_plan(recipe, device, g.in_features, g.out_features)
            report.layers.append(_row(name, g, True, recipe.name) if plan.hp_reason is None else
                                 _row(name, g, False, f"high precision: {plan.hp_reason}", plan.hp_kind))
    return out


def _grouped(model: nn.Module, policy: Policy) -> list[tuple[str, GroupedLinear | LayerReport]]:
    """Every ``GroupedLinear`` of ``model``, then those of its Hugging Face experts (replaced now) under
    their weights' names, each block's followed by its router's row."""
    out: list[tuple[str, GroupedLinear | LayerReport]] = [
        (n, m) for n, m in model.named_modules() if isinstance(m, GroupedLinear)]
    for moe in swap_hf_experts(model):
        out += [(f"{moe.name}.{p.weight}", g) for p, g in zip(moe.experts.projections, moe.experts.grouped())]
        if moe.router is not None:
            out.append((moe.router[0], router_row(*moe.router, policy)))
    return out


def _row(name: str, g: GroupedLinear, converted: bool, reason: str, kept: Kept | None = None) -> LayerReport:
    params = g.weight.numel() + (g.bias.numel() if g.bias is not None else 0)
    return LayerReport(name, g.in_features, g.out_features, converted, reason, params, kept, g.num_experts)
