"""A converted layer's weight as the recipe's forward GEMM used it, and whether the layer ran quantized at all.

[Note: the trained weight]
What a layer computed with is its fprop weight cast: the weight cast along ``in`` by the layer's evaluation
plan (every cast rounded to nearest; weights round to nearest in every preset anyway), through the same
function the forward calls (``lowprec.nn.casts.weight_casts``), with the layer's delayed scale where the
recipe scales by delay and the stored codes where the layer holds an FP8 primary weight. Nothing is
recorded and no cache is filled. A cast taken after a Hadamard transform is not the weight's (its codes
are of ``H W``), so it is not offered as the trained weight.

A layer is *kept* when it did not run quantized: no recipe bound (the policy kept it, or it was never
converted), or its plan runs it in high precision (a shape the recipe's GEMMs cannot take, too small to
gain on its device). A BF16 or FP16 recipe runs every converted layer unscaled: those layers are not kept,
but have no trained quantized weight either.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from lowprec.nn import GroupedLinear, Linear
from lowprec.nn.casts import cast_operand, weight_casts
from lowprec.nn.fp8_weight import stored_codes
from lowprec.nn.plan import LayerPlan, layer_plan, too_small
from lowprec.nn.stored_codes import stored_operand
from lowprec.quant import QuantizedTensor


@dataclass(frozen=True, slots=True)
class Trained:
    """How one layer trained: the reason it stayed in high precision (None: it ran the recipe) and its
    forward weight cast (None where there is none to offer)."""

    kept: str | None
    weights: tuple[QuantizedTensor | None, ...] = ()
    """The fprop weight cast: one for a linear, one per expert for a ``GroupedLinear``."""
    recipe: str | None = None
    note: str = ""
    """Why a layer that ran quantized offers no cast (a Hadamard-transformed weight)."""


NOT_CONVERTED = "not converted (the conversion policy keeps it in high precision)"


def _plan(layer: Linear | GroupedLinear, device: torch.device | None) -> tuple[LayerPlan | None, str | None]:
    """The layer's evaluation plan on the training device (``device``; None: where the weight is), and a
    note where that device's small-layer rule cannot be known here (see :func:`trained`)."""
    here = layer.weight.device
    if device is None or device.type == here.type or isinstance(layer, GroupedLinear):
        return layer.plan(nearest=True), None
    if device.type == "cpu" or (device.type == "cuda" and torch.cuda.is_available()):
        codes = stored_codes(layer.weight)
        return layer_plan(layer.recipe, device, layer.in_features, layer.out_features, layer.policy_reason,
                          layer.min_features, True, codes.granularity if codes is not None else None,
                          layer.recast_input), None
    # another machine's device: where its GEMMs ran natively, a layer this small stayed in high precision
    plan = layer.plan(nearest=True)
    if plan.scaled and layer.min_features is not None and too_small(layer.in_features, layer.out_features,
                                                                     layer.min_features):
        return plan, (f"possibly kept on {device.type} by the small-layer rule (a dimension under "
                      f"{layer.min_features}): written in high precision to be safe")
    return plan, None


def linear_weight(layer: Linear, plan: LayerPlan) -> QuantizedTensor | None:
    """``layer``'s fprop weight cast under ``plan`` (see [Note: the trained weight]), or None."""
    codes = stored_codes(layer.weight)
    w = layer.weight
    stored = (stored_operand(codes.data, codes.scale, codes.granularity, w.shape, w.dtype)
              if codes is not None else None)
    if stored is not None and plan.stored_weight:
        return stored
    qw, _ = weight_casts(w, plan.weight, layer.state, False, False, stored)
    return qw if isinstance(qw, QuantizedTensor) else None


def _expert_weights(layer: GroupedLinear, plan: LayerPlan) -> tuple[QuantizedTensor | None, ...]:
    out = []
    for w in layer.weight.detach().unbind(0):  # (out, in) each
        qw, _ = cast_operand(w, plan.weight, True, False, None, False)
        out.append(qw if isinstance(qw, QuantizedTensor) else None)
    return tuple(out)


@torch.no_grad()
def trained(layer: nn.Module, device: torch.device | None = None) -> Trained:
    """How ``layer`` (an ``nn.Linear``, a ``lowprec.nn.Linear`` or ``GroupedLinear``) trained, judged by its
    plan on ``device``, the device it trained on (None: where its weight is now). When that device is a GPU
    this machine lacks, the small-layer rule there cannot be evaluated: a layer it may have kept is kept."""
    if not isinstance(layer, (Linear, GroupedLinear)) or layer.recipe is None:
        return Trained(NOT_CONVERTED)
    plan, guess = _plan(layer, device)
    if plan.hp_reason is not None:
        return Trained(f"high precision: {plan.hp_reason}")
    if guess is not None:
        return Trained(guess)
    name = layer.recipe.name
    if not plan.scaled:  # bf16, fp16: unscaled GEMMs, no quantized weight
        return Trained(None, recipe=name)
    if plan.weight.cast_k.hadamard:
        return Trained(None, recipe=name, note="the forward weight cast is Hadamard-transformed")
    if isinstance(layer, GroupedLinear):
        return Trained(None, _expert_weights(layer, plan), name)
    return Trained(None, (linear_weight(layer, plan),), name)
