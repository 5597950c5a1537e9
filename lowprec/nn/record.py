"""Lazy scale initialisation: high-precision steps that fill a delayed recipe's amax histories.

[Note: lazy scale initialisation]
A delayed scale comes from the amaxes recorded before (see [Note: delayed scaling]); a role with none
yet scales by the tensor's own amax, so a run that starts in BF16 (``lowprec train --hp-start-steps``)
and then switches to a delayed recipe would take its first delayed step by current scaling and fill
the history only from there. Instead, the BF16 steps record: inside ``lowprec.autocast("bf16",
record_amax=True)`` (or ``enabled=False, record_amax=True``) a layer bound to a delayed recipe computes
as the region says, and records what a step of its bound recipe would have recorded, into the same
history: the amaxes of its input and weight in forward, of its output's gradient (``grad_output``) in
backward, for each role whose casts the recipe scales by delay, through :meth:`DelayedState.record`
(a non-finite amax as 0, an outlier capped and counted). The first delayed step after the region then
takes its scales from the history, as every later one does. (Transformer Engine's ``fp8_autocast``
with ``calibrating=True`` collects its amaxes the same way.)

Recording changes nothing that is computed: forward reads the amaxes of tensors it reads anyway, and
backward reads the gradient through a tensor hook on the output that returns nothing, so the
gradients are bit for bit those of the region without recording. It records where a delayed step
records: in a forward that builds a graph (never in evaluation under ``no_grad``), and in backward
when the input or the weight needs a gradient. It is tensor operations only, as ``DelayedState.record``
is, so a compiled model records inside its graph, with no host sync.
"""
from __future__ import annotations

import torch

from lowprec.nn.casts import QuantizedWeight, record_weight_amax
from lowprec.nn.delayed import DelayedState
from lowprec.nn.plan import LayerPlan


def _amax(t: torch.Tensor) -> torch.Tensor:
    # as the delayed cast computes it (``lowprec.kernels.cast``): in the tensor's dtype, exact
    return t.detach().abs().amax()


def _record_forward(x: torch.Tensor, weight_amax: torch.Tensor, plan: LayerPlan, state: DelayedState) -> None:
    if plan.input.delayed:
        state.record(plan.input.role, _amax(x))
    if plan.weight.delayed:
        record_weight_amax(state, plan.weight, weight_amax)


def record_amaxes(x: torch.Tensor, weight: torch.Tensor, y: torch.Tensor, plan: LayerPlan,
                  state: DelayedState) -> None:
    """Record the amaxes of ``x`` (the layer's input) and ``weight`` now, and of ``y``'s gradient when
    backward passes through it, into ``state`` for the roles ``plan`` (the layer's plan for its bound
    delayed recipe) scales by delay; see [Note: lazy scale initialisation]. Changes no value."""
    # an FP8-all-gathered weight arrives quantized and carries its high-precision amax
    _record_forward(x, weight.amax if isinstance(weight, QuantizedWeight) else _amax(weight), plan, state)
    if plan.grad_output.delayed and (x.requires_grad or weight.requires_grad):
        role = plan.grad_output.role
        y.register_hook(lambda dy: state.record(role, _amax(dy)))  # returns None: the gradient is unchanged


def record_expert_amaxes(x: torch.Tensor, weight: torch.Tensor, y: torch.Tensor, plan: LayerPlan,
                         experts: list[tuple[int, DelayedState, slice]]) -> None:
    """:func:`record_amaxes` for experts (``lowprec.nn.GroupedLinear``, ``weight`` ``(E, out, in)``): each
    ``(e, state, rows)`` of ``experts``, an expert with tokens, its state and its rows of ``x`` and ``y``,
    records what a delayed step of a Linear of ``weight[e]`` records on those rows (an expert without tokens,
    left out, records nothing, as in a delayed step). Changes no value."""
    amaxes = weight.detach().abs().amax(dim=(1, 2))  # (E,): exact in the weights' dtype
    for e, state, rows in experts:
        _record_forward(x[rows], amaxes[e], plan, state)
    if plan.grad_output.delayed and (x.requires_grad or weight.requires_grad):
        role = plan.grad_output.role

        def hook(dy: torch.Tensor) -> None:  # returns None: the gradient is unchanged
            for _, state, rows in experts:
                state.record(role, _amax(dy[rows]))

        y.register_hook(hook)
