"""A framework's torch optimizer, taken in by ``lowprec.optim.Optimizer`` as its inner optimizer.

[Note: adopting an optimizer]
Lightning and Fabric hand a precision plugin the user's torch optimizer, and their loops, LR schedulers
and checkpoints go on referring to it: the plugin cannot put another object in its place. So
``lowprec.optim.Optimizer`` is built around it: the optimizer becomes its inner optimizer, and each of its
param groups keeps its hyperparameters while its ``params`` are replaced, in place, by the tensors
lowprec updates (each parameter itself, or the parameter's FP32 master). A scheduler changing ``lr``
changes the groups the step reads, and the framework's checkpoint of the optimizer holds the masters'
moments in float32. State the optimizer already holds (it stepped, or a checkpoint was loaded into it)
moves to each parameter's master, widened to float32.

[Note: gradients made before adopting]
``lowprec.optim.Optimizer`` folds the gradients of BF16/FP16 parameters into float32 buffers from hooks
it registers on them (see [Note: why accumulate in float32] in ``lowprec.optim.accumulate``); a backward
before it existed left them in ``param.grad``, where its step would not look. Fabric shows a plugin the
optimizer only at its first step, after that step's backward; those gradients are handed to the hooks
by a backward through the parameters themselves (autograd accumulates the given gradient into a leaf and
runs its hooks), so the first step sees them as every later one does (but that, with gradient
accumulation, autograd summed its micro-batches in BF16/FP16 before the plugin saw them). Under DDP they stay in
``param.grad``, which is where the step reads a reduced gradient; FSDP2's sharded parameters are refused.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from lowprec._checks import describe, fail
from lowprec.optim import LossScaleConfig, Optimizer
from lowprec.optim.accumulate import is_low_precision
from lowprec.ranks import data_parallel_group, is_dtensor


@dataclass(frozen=True, kw_only=True, slots=True)
class StepSettings:
    """How an adopted optimizer steps: the arguments of ``lowprec.optim.Optimizer`` a plugin passes on."""

    master_weights: bool
    """FP32 masters for BF16/FP16 parameters."""
    loss_scale: LossScaleConfig | None
    """Loss scaling (None: none)."""
    max_grad_norm: float | None
    """Clip the unscaled gradients to this norm (None: never)."""
    skip_spikes: bool
    """Skip a step whose loss is a spike, as a non-finite one."""


def adopt(optimizer: Any, settings: StepSettings, *, after_backward: bool = False) -> Optimizer:
    """``lowprec.optim.Optimizer`` around ``optimizer`` (see [Note: adopting an optimizer]).
    ``after_backward``: a backward may have run already (see [Note: gradients made before adopting])."""
    if isinstance(optimizer, Optimizer) or not isinstance(optimizer, torch.optim.Optimizer):
        fail("optimizer", "a torch.optim.Optimizer (the plugin wraps it in lowprec.optim.Optimizer itself)",
             describe(optimizer), TypeError)
    pending = _take_early_grads(optimizer) if after_backward else []
    groups = [{"params": list(g["params"])} for g in optimizer.param_groups]
    adopted = Optimizer(groups, _inner(optimizer), master_weights=settings.master_weights,
                        loss_scale=settings.loss_scale, max_grad_norm=settings.max_grad_norm,
                        skip_spikes=settings.skip_spikes)
    if pending:
        torch.autograd.backward([p for p, _ in pending], [g for _, g in pending])
    return adopted


def _inner(optimizer: torch.optim.Optimizer):
    """The ``optimizer_cls`` that gives ``lowprec.optim.Optimizer`` the adopted optimizer, its groups now
    holding what lowprec updates."""
    def build(groups: list[dict], **_: Any) -> torch.optim.Optimizer:
        for mine, new in zip(optimizer.param_groups, groups):
            for p, target in zip(mine["params"], new["params"]):
                if target is not p and p in optimizer.state:
                    optimizer.state[target] = _widened(optimizer.state.pop(p))
            mine["params"] = list(new["params"])
        return optimizer

    return build


def _widened(state: dict[str, Any]) -> dict[str, Any]:
    """A parameter's optimizer state for its float32 master: floating tensors in float32 (a step count too)."""
    return {k: v.float() if isinstance(v, torch.Tensor) and v.is_floating_point() else v for k, v in state.items()}


def _take_early_grads(optimizer: torch.optim.Optimizer) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The gradients of low-precision parameters already in ``param.grad``, taken out to be handed to the
    float32 hooks (see [Note: gradients made before adopting])."""
    group = data_parallel_group()
    taken = []
    for g in optimizer.param_groups:
        for p in g["params"]:
            if p.grad is None or not is_low_precision(p):
                continue
            if group is not None:
                if is_dtensor(p):
                    fail("optimizer", "a first step under FSDP2 with float32 parameters (a BF16/FP16 shard's "
                         "gradient cannot be handed to lowprec's float32 accumulation after its backward)",
                         describe(p))
                continue  # DDP's reduced gradient: the step reads it from param.grad
            taken.append((p, p.grad))
            p.grad = None
    return taken
