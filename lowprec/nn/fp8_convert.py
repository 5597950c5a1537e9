"""Putting FP8 primary weights into converted layers: which storage a layer takes, the checks made
before anything changes, and the swap (see [Note: FP8 primary weights] in ``lowprec.nn.fp8_weight``)."""
from __future__ import annotations

import torch

from lowprec._checks import fail
from lowprec.nn.fp8_state_dict import decoded_state
from lowprec.nn.fp8_weight import FP8Weight
from lowprec.nn.plan import OperandPlan, codes_serve
from lowprec.quant import Granularity, blockwise, tensorwise

BLOCK = 128
"""The side of the square blocks of the blockwise storage (DeepSeek-V3's weight blocks)."""


def storage_for(op: OperandPlan) -> tuple[Granularity, bool]:
    """``(granularity, direct)``: how a layer whose weight casts are ``op`` stores its FP8 weight, and
    whether the GEMMs take the stored codes as they are (see [Note: FP8 primary weights])."""
    if codes_serve(tensorwise(), op):
        return tensorwise(), True
    block = blockwise(BLOCK, BLOCK)
    return block, codes_serve(block, op)


def fp8_weights(module: torch.nn.Module) -> list[FP8Weight]:
    """The :class:`FP8Weight` parameters of ``module``, in order."""
    return [p for p in module.parameters() if isinstance(p, FP8Weight)]


def check_fp8_weights(recipe, model: torch.nn.Module) -> None:
    """Refuse, before anything changes, a recipe that casts no weight or weights that have no master to drop."""
    if not recipe.fprop.rhs.quantized:
        fail("fp8_weights", "a recipe that casts weights to a scaled low-precision format (fp8-current, "
             "fp8-delayed, fp8-blockwise store what the GEMMs read)", f"{recipe.name}, whose GEMMs read the "
             "weights in high precision")
    for name, m in model.named_modules():
        p = m.weight if isinstance(m, torch.nn.Linear) else None
        if p is not None and p.dtype not in (torch.bfloat16, torch.float16):
            fail("fp8_weights", "bfloat16 or float16 parameters (their FP32 masters move into the optimizer; "
                 "float32 ones have none to drop, and 1-byte codes beside a 4-byte master would add memory)",
                 f"a {p.dtype} weight in {name!r}; cast the model first, e.g. model.to(torch.bfloat16)")


def store_fp8(layer) -> bool:
    """Replace ``layer``'s weight (a :class:`lowprec.nn.Linear` running its recipe) by an
    :class:`FP8Weight` in the storage its plan takes; True when the GEMMs read the codes directly."""
    plan = layer.plan()
    granularity, direct = storage_for(plan.weight)
    w = layer.weight
    if not isinstance(w, FP8Weight):
        fp8 = FP8Weight.of(w, granularity, amax=plan.weight.delayed)
        layer.weight = torch.nn.Parameter(fp8, requires_grad=w.requires_grad)
        layer.register_state_dict_post_hook(decoded_state)
        layer.hold_weight()
    return direct
