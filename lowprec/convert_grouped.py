"""``convert``'s part for the experts of a mixture of experts: binding the recipe to every
``lowprec.nn.GroupedLinear`` of a model, and each one's row of the conversion report.

[Note: converting experts]
A ``GroupedLinear`` is converted in place (it is already lowprec's module): the policy's include and
exclude patterns, its ``keep_first_blocks`` / ``keep_last_blocks`` (by the block index in its name) and
``skip_small=True`` apply to it as to a linear. The head and router rules do not: experts are neither
(a router is one [E, hidden] matrix, an ``nn.Linear`` the router rule keeps), and an expert projection
may well be named ``gate``. The device's small-layer rule (``Policy.skip_small`` None) does not apply
either: every expert runs the recipe whatever its size. A recipe the layer refuses (delayed scaling:
it keeps no amax history per expert) leaves it in high precision with the reason in its row
(``Kept.REFUSED``) and in one warning. The report has one row per ``GroupedLinear``,
``E experts x out x in``, with all its parameters, so the coverage counts them with the linears'.
"""
from __future__ import annotations

import warnings
from dataclasses import replace

import torch
import torch.nn as nn

from lowprec import recipes as R
from lowprec.conversion_report import ConversionReport, LayerReport
from lowprec.nn import GroupedLinear
from lowprec.nn.plan import Kept, layer_plan
from lowprec.policy import Policy, policy_keeps

__all__ = ["REFUSED_DELAYED", "convert_grouped", "grouped_layers"]

REFUSED_DELAYED = ("high precision: GroupedLinear refuses delayed scaling (it keeps no amax history per expert; "
                   "fp8-current scales each expert by its own amax)")


def grouped_layers(model: nn.Module) -> list[tuple[str, GroupedLinear]]:
    return [(n, m) for n, m in model.named_modules() if isinstance(m, GroupedLinear)]


def convert_grouped(model: nn.Module, recipe: R.Recipe, policy: Policy, blocks: tuple[str, int] | None,
                    report: ConversionReport, device: torch.device) -> dict[str, GroupedLinear]:
    """Bind ``recipe`` to every ``GroupedLinear`` of ``model`` the policy converts (see [Note: converting
    experts]), one row each in ``report``; returns them by name."""
    experts_policy = replace(policy, keep_head=False, keep_routers=False)  # experts are neither
    out: dict[str, GroupedLinear] = {}
    refused = []
    for name, g in grouped_layers(model):
        keep = policy_keeps(experts_policy, name, g, embeddings=set(), mha_children=set(), blocks=blocks,
                            last_fraction=recipe.hp_last_fraction)
        if keep is not None:
            g.set_recipe(None)
            report.layers.append(_row(name, g, False, keep.reason, Kept.POLICY))
        elif recipe.uses_delayed_scaling:
            g.set_recipe(None)
            report.layers.append(_row(name, g, False, REFUSED_DELAYED, Kept.REFUSED))
            refused.append(name)
        else:
            g.set_recipe(recipe)
            out[name] = g
            plan = layer_plan(recipe, device, g.in_features, g.out_features)
            report.layers.append(_row(name, g, True, recipe.name) if plan.hp_reason is None else
                                 _row(name, g, False, f"high precision: {plan.hp_reason}", plan.hp_kind))
    if refused:
        names = ", ".join(refused[:5]) + (" ..." if len(refused) > 5 else "")
        warnings.warn(f"lowprec: {len(refused)} GroupedLinear(s) run in high precision because they refuse "
                      f"{recipe.name}'s delayed scaling (no amax history per expert): {names} (see the "
                      "conversion report)", stacklevel=4)
    return out


def _row(name: str, g: GroupedLinear, converted: bool, reason: str, kept: Kept | None = None) -> LayerReport:
    params = g.weight.numel() + (g.bias.numel() if g.bias is not None else 0)
    return LayerReport(name, g.in_features, g.out_features, converted, reason, params, kept, g.num_experts)
