"""The step guard: measure the gradient norm, refuse non-finite steps, clip, watch for loss spikes.

[Note: one synchronisation per step]
Whether a step is taken must be known on the host: skipping by multiplying the update by zero would
still advance AdamW's step count and decay its moments. The guard therefore reads the gradient norm
and the loss in one device-to-host copy and decides there. A gradient holding inf or NaN makes the
norm non-finite, so the norm alone tells whether the gradients are finite. (A norm that overflows
float32 from finite gradients, above about 1.8e19, counts as non-finite too: such a step is no
better.) Clipping then follows ``torch.nn.utils.clip_grad_norm_``: gradients are multiplied by
``max_norm / (norm + 1e-6)`` when that is below one.

[Note: one decision for all ranks]
Under data parallelism the verdict must be the group's, or one rank steps while another skips and
the replicas part for good (see [Note: ranks agree] in ``lowprec.ranks``). The
synchronisation above becomes one all-reduce (SUM) of four float32 numbers, then one host read:

* the squared norm of this rank's *sharded* gradients (FSDP2's DTensor shards): summed over ranks,
  the square of the norm of the whole gradient; inf or NaN on any rank stays so in the sum. Parts that
  several ranks hold alike (tensor-parallel shards, held by every data-parallel replica) count once:
  divided by how many hold each (``lowprec.ranks.replicas``);
* a flag, 1 when the norm of the *replicated* gradients (DDP's, equal on every rank once reduced)
  is not finite here: replicated norms are not summed, which would count them once per rank;
* this rank's loss and 1 (or 0 and 0 without a loss): their sums give the mean loss of the global
  batch, NaN if any rank's loss is NaN.

The global norm is ``hypot(sqrt(sharded sum), replicated norm)``, the same float on every rank, and
equal to the single-process formula when nothing is sharded. Every rank then skips or steps,
clips by the same factor, backs the loss scale off or not, and feeds the same mean loss to the
spike detector: the guard's state stays identical across ranks.
"""
from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import dataclass
from typing import Any

import torch

from lowprec._checks import describe, fail
from lowprec.optim.spike import SpikeDetector
from lowprec.ranks import agree, collective_device

NONFINITE_LOSS = "non-finite loss"
NONFINITE_GRADS = "non-finite gradients"
LOSS_SPIKE = "loss spike"
"""The reason of a step skipped for its loss spike (``skip_spikes``)."""


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


def _sum_of_squares(grads: list[torch.Tensor], device: torch.device) -> torch.Tensor:
    """The sum of the squared per-tensor norms of ``grads`` (float32, on ``device``; 0 for none).

    Squared in float32 like the norm itself, so it overflows where the norm stops being finite."""
    if not grads:
        return torch.zeros((), device=device)
    norms = [n.to(device) for gs in by_device(grads).values() for n in torch._foreach_norm(gs)]
    return torch.stack(norms).square().sum()  # ()


def agreed_norm_and_loss(grads: list[torch.Tensor], sharded: list[int], loss: Any,
                         group) -> tuple[torch.Tensor, float, float | None]:
    """The group's gradient norm (tensor and float) and mean loss, from one all-reduce and one host
    read; ``grads`` are this rank's local tensors, ``sharded`` says which are parts of a larger one: 0
    for a whole tensor, else how many ranks hold each part (``lowprec.ranks.replicas``; True counts as
    1). See [Note: one decision for all ranks]."""
    if grads:
        device = grads[0].device
    elif isinstance(loss, torch.Tensor):
        device = loss.device
    else:
        device = collective_device(group)
    replicated = grad_norm([g for g, s in zip(grads, sharded) if not s]).to(device)  # ()
    shard_sq = torch.zeros((), device=device)
    for r in sorted({int(s) for s in sharded if s}):  # each part's square once over the group
        shard_sq = shard_sq + _sum_of_squares([g for g, s in zip(grads, sharded) if int(s) == r], device) / r
    if isinstance(loss, torch.Tensor):
        loss_sum, count = loss.detach().reshape(()).float(), 1.0
    else:
        loss_sum, count = (0.0, 0.0) if loss is None else (float(loss), 1.0)
    bad = (~torch.isfinite(replicated)).float()  # ()
    total = agree([shard_sq, bad, loss_sum, count], group, device=device)  # (4,)
    norm = torch.hypot(total[0].sqrt(), replicated)  # ()
    norm_value, any_bad, loss_total, n_loss = torch.cat([norm.reshape(1), total[1:]]).tolist()  # the one sync
    if any_bad > 0 and math.isfinite(norm_value):
        norm_value = math.inf  # not finite on some rank: skip everywhere
    return norm, norm_value, None if n_loss == 0 else loss_total / n_loss


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

    def __init__(self, max_grad_norm: float | None, spike_window: int = 100, spike_factor: float = 3.0,
                 skip_spikes: bool = False) -> None:
        if max_grad_norm is not None and (
            isinstance(max_grad_norm, bool) or not isinstance(max_grad_norm, (int, float))
            or not 0 < max_grad_norm < math.inf
        ):
            fail("max_grad_norm", "None or a finite number > 0", describe(max_grad_norm))
        self.max_grad_norm = None if max_grad_norm is None else float(max_grad_norm)
        self.spikes = SpikeDetector(spike_window, spike_factor)
        if not isinstance(skip_spikes, bool):
            fail("skip_spikes", "a bool", describe(skip_spikes), TypeError)
        self.skip_spikes = skip_spikes
        """Skip a step whose loss is a spike, as a non-finite one (its loss still joins the window, so a
        lasting change of level is skipped only until the window has caught up with it)."""
        self.steps = 0
        self.skipped_steps = 0
        self.spike_count = 0

    def inspect(self, grads: list[torch.Tensor], loss: Any, group=None,
                sharded: list[int] | None = None) -> tuple[Verdict, torch.Tensor]:
        """Judge a step from its unscaled ``grads`` and ``loss``; returns the verdict and the norm tensor.

        With a data-parallel ``group`` the verdict is the group's (``grads`` are this rank's local
        tensors, ``sharded`` marks DTensor shards); see [Note: one decision for all ranks].
        """
        _check_loss(loss)
        if group is not None:
            norm, norm_value, loss_value = agreed_norm_and_loss(grads, sharded or [0] * len(grads), loss, group)
            return self._judge(norm_value, loss_value), norm
        norm = grad_norm(grads)  # ()
        if isinstance(loss, torch.Tensor):
            loss_t = loss.detach().reshape(()).float().to(norm.device)  # ()
            norm_value, loss_value = torch.stack([norm, loss_t]).tolist()  # the one sync
        else:
            norm_value, loss_value = norm.item(), None if loss is None else float(loss)
        return self._judge(norm_value, loss_value), norm

    def _judge(self, norm_value: float, loss_value: float | None) -> Verdict:
        grads_finite = math.isfinite(norm_value)
        reason = None
        if loss_value is not None and not math.isfinite(loss_value):
            reason = NONFINITE_LOSS
        elif not grads_finite:
            reason = NONFINITE_GRADS
        spike = False if loss_value is None else self.spikes.observe(loss_value)
        if spike and reason is None and self.skip_spikes:
            reason = LOSS_SPIKE
        self.steps += 1
        self.skipped_steps += reason is not None
        self.spike_count += spike
        return Verdict(norm_value, loss_value, grads_finite, reason, spike)

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
