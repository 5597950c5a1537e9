"""The step guard: measure the gradient norm, refuse non-finite steps, clip, watch for loss spikes.

[Note: one synchronisation per step]
Whether a step is taken must be known on the host: skipping by multiplying the update by zero would
still advance AdamW's step count and decay its moments. The guard therefore reads the gradient norm
and the loss in one device-to-host copy and decides there. A gradient holding inf or NaN makes the
norm non-finite, so the norm alone tells whether the gradients are finite. (A norm that overflows
float32 from finite gradients, above about 1.8e19, counts as non-finite too: such a step is no
better.) Clipping then follows ``torch.nn.utils.clip_grad_norm_``: gradients are multiplied by
``max_norm / (norm + 1e-6)`` when that is below one.
"""
from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import dataclass
from typing import Any

import torch

from lowprec._checks import describe, fail
from lowprec.optim.spike import SpikeDetector

NONFINITE_LOSS = "non-finite loss"
NONFINITE_GRADS = "non-finite gradients"


def by_device(tensors: list[torch.Tensor]) -> dict[torch.device, list[torch.Tensor]]:
    """``tensors`` split by device, in order: foreach ops take one device at a time."""
    groups: dict[torch.device, list[torch.Tensor]] = defaultdict(list)
    for t in tensors:
        groups[t.device].append(t)
    return groups


def grad_norm(grads: list[torch.Tensor]) -> torch.Tensor:
    """The L2 norm of all ``grads`` as one vector: a float32 scalar tensor on the first one's device."""
    if not grads:
        return torch.zeros(())
    first = grads[0].device
    norms = [n.to(first) for gs in by_device(grads).values() for n in torch._foreach_norm(gs)]
    return torch.linalg.vector_norm(torch.stack(norms))  # ()


def _check_loss(loss: Any) -> None:
    expected = "None, a number or a one-element real tensor"
    if isinstance(loss, torch.Tensor):
        if loss.numel() != 1 or loss.dtype.is_complex:
            fail("loss", expected, describe(loss))
    elif loss is not None and (isinstance(loss, bool) or not isinstance(loss, (int, float))):
        fail("loss", expected, describe(loss), TypeError)


@dataclass(frozen=True, slots=True)
class Verdict:
    """What the guard found about one step, before anything was changed."""

    grad_norm: float
    """The norm of the unscaled gradients before clipping (inf or NaN when they are not finite)."""
    loss: float | None
    grads_finite: bool
    reason: str | None
    """Why the step must be skipped (:data:`NONFINITE_LOSS`, :data:`NONFINITE_GRADS`); ``None`` to take it."""
    spike: bool


class StepGuard:
    """Clips, refuses non-finite steps and reports loss spikes; counts both."""

    def __init__(self, max_grad_norm: float | None, spike_window: int = 100, spike_factor: float = 3.0) -> None:
        if max_grad_norm is not None and (
            isinstance(max_grad_norm, bool) or not isinstance(max_grad_norm, (int, float))
            or not 0 < max_grad_norm < math.inf
        ):
            fail("max_grad_norm", "None or a finite number > 0", describe(max_grad_norm))
        self.max_grad_norm = None if max_grad_norm is None else float(max_grad_norm)
        self.spikes = SpikeDetector(spike_window, spike_factor)
        self.steps = 0
        self.skipped_steps = 0
        self.spike_count = 0

    def inspect(self, grads: list[torch.Tensor], loss: Any) -> tuple[Verdict, torch.Tensor]:
        """Judge a step from its unscaled ``grads`` and ``loss``; returns the verdict and the norm tensor."""
        _check_loss(loss)
        norm = grad_norm(grads)  # ()
        if isinstance(loss, torch.Tensor):
            loss_t = loss.detach().reshape(()).float().to(norm.device)  # ()
            norm_value, loss_value = torch.stack([norm, loss_t]).tolist()  # the one sync
        else:
            norm_value, loss_value = norm.item(), None if loss is None else float(loss)
        grads_finite = math.isfinite(norm_value)
        reason = None
        if loss_value is not None and not math.isfinite(loss_value):
            reason = NONFINITE_LOSS
        elif not grads_finite:
            reason = NONFINITE_GRADS
        spike = False if loss_value is None else self.spikes.observe(loss_value)
        self.steps += 1
        self.skipped_steps += reason is not None
        self.spike_count += spike
        return Verdict(norm_value, loss_value, grads_finite, reason, spike), norm

    @torch.no_grad()
    def clip_(self, grads: list[torch.Tensor], verdict: Verdict, norm: torch.Tensor) -> bool:
        """Scale ``grads`` in place to norm ``max_grad_norm`` if above it; whether they were scaled."""
        if self.max_grad_norm is None or self.max_grad_norm / (verdict.grad_norm + 1e-6) >= 1.0:
            return False
        coef = torch.clamp(self.max_grad_norm / (norm + 1e-6), max=1.0)  # float32, as torch computes it
        for device, gs in by_device(grads).items():
            torch._foreach_mul_(gs, coef.to(device))
        return True

    def state_dict(self) -> dict[str, Any]:
        return {"steps": self.steps, "skipped_steps": self.skipped_steps, "spikes": self.spike_count,
                "window": self.spikes.state_dict()}

    def load_state_dict(self, state: Any) -> None:
        keys = {"steps", "skipped_steps", "spikes", "window"}
        if not isinstance(state, dict) or set(state) != keys:
            fail("state_dict['guard']", "a dict with keys " + ", ".join(sorted(keys)), describe(state))
        for k in ("steps", "skipped_steps", "spikes"):
            if isinstance(state[k], bool) or not isinstance(state[k], int) or state[k] < 0:
                fail(f"state_dict['guard'][{k!r}]", "an int >= 0", describe(state[k]))
        self.spikes.load_state_dict(state["window"])
        self.steps, self.skipped_steps, self.spike_count = state["steps"], state["skipped_steps"], state["spikes"]
