"""The optimizer a training loop uses: any torch optimizer, wrapped with everything low precision needs.

[Note: the order of a step]
``backward`` scales the loss and runs autograd; low-precision gradients are folded into float32
buffers as they arrive (``accumulate``). ``step`` then: unscales the float32 gradients, reads the
gradient norm and the loss in one synchronisation (``guard``), and either skips the step -- params,
masters and inner optimizer state untouched -- or clips, runs the inner optimizer on the float32
masters (``master``) or on widened parameters rounded back stochastically (``stochastic``), and
copies masters into the model. Last it updates the loss scale (``loss_scale``) and drops all
gradients, whether the step was taken or not.

[Note: under DDP and FSDP2]
With a data-parallel group (found from torch.distributed, or given), ``step`` works on the reduced
gradients: DDP's ``param.grad`` after the syncing backward, FSDP2's sharded ``.grad`` (see [Note:
accumulating gradients that ranks reduce] in ``accumulate``); the guard's norm and skip decision
are the group's, from one all-reduce per step (see [Note: one decision for all ranks] in
``guard``). Masters of FSDP2 parameters are float32 DTensors sharded like them, so each rank keeps
and updates the masters and optimizer state of its own shard only. Every rank therefore applies
the same update, or skips the same step, and the replicas stay equal.

[Note: a torch.optim.Optimizer in name]
:class:`Optimizer` subclasses ``torch.optim.Optimizer`` only so that torch's LR schedulers (which
check ``isinstance``) accept it. It does not run the base class's ``__init__``: ``param_groups``,
``state`` and ``defaults`` are the inner optimizer's, so a scheduler changing ``lr`` changes what
the inner optimizer uses. The base class's step hooks are not supported.
"""
from __future__ import annotations

from collections.abc import Callable, Iterable
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any

import torch

from lowprec._checks import describe, fail
from lowprec.optim.accumulate import GradAccumulator
from lowprec.optim.guard import StepGuard, by_device
from lowprec.optim.loss_scale import LossScaleConfig, LossScaler
from lowprec.optim.master import MasterWeights, fp8_weight
from lowprec.optim.stochastic import StochasticRounding
from lowprec.ranks import data_parallel_group, is_dtensor, local, replicas

_PARAM_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_STATE_KEYS = {"optimizer", "master_weights", "loss_scale", "guard", "stochastic_rounding"}


@dataclass(frozen=True, slots=True)
class StepResult:
    """What :meth:`Optimizer.step` did."""

    skipped: bool
    """The step was not taken: params, masters and optimizer state are as they were."""
    reason: str | None
    """Why it was skipped: ``"non-finite loss"``, ``"non-finite gradients"`` or (``skip_spikes``) ``"loss
    spike"``; ``None`` when taken."""
    grad_norm: float
    """L2 norm of the unscaled gradients before clipping; inf or NaN when they were not finite. Under
    data parallelism, the norm of the whole reduced gradient (all shards), the same on every rank."""
    loss_scale: float | None
    """The scale this step's gradients carried (``None`` without loss scaling)."""
    spike: bool
    """The loss was a spike against the running window (the step is taken, unless ``skip_spikes``)."""
    loss: float | None = None
    """The loss passed to ``step``, as a float; under data parallelism the mean of the ranks' losses."""
    clipped: bool = False
    """The gradients were scaled down to ``max_grad_norm``."""


def _as_groups(params: Any) -> list[dict]:
    if isinstance(params, torch.Tensor):
        fail("params", "an iterable of tensors or of param-group dicts", describe(params), TypeError)
    groups = list(params)
    if not groups:
        fail("params", "at least one parameter", "an empty iterable")
    if not isinstance(groups[0], dict):
        groups = [{"params": groups}]
    for i, g in enumerate(groups):
        if not isinstance(g, dict) or "params" not in g:
            fail(f"params[{i}]", "a dict with a 'params' entry (every entry must be a group)", describe(g), TypeError)
    return groups


class Optimizer(torch.optim.Optimizer):
    """FP32 masters, loss scaling, FP32 gradient accumulation and the step guard around ``optimizer_cls``.

    ``params`` are the model's parameters (or param-group dicts), float32, bfloat16 or float16.
    Keyword arguments not named here go to ``optimizer_cls``, which is built over the float32
    masters (with ``master_weights``) in place of the low-precision parameters.
    ``loss_scale``: ``None``, ``"dynamic"``, a number (static) or a :class:`LossScaleConfig`.
    ``stochastic_rounding`` (only without masters) rounds updated BF16/FP16 weights stochastically,
    with random bits from generators seeded by ``seed``. ``skip_spikes`` skips a step whose loss is a
    spike (see [Note: what counts as a spike] in ``spike``) as it skips a non-finite one.
    ``data_parallel``: whether gradients are reduced across ranks (DDP or FSDP2); ``None`` decides
    from torch.distributed (initialized with more than one rank in ``group``). ``group``: the
    data-parallel process group, ``None`` for the default one.
    """

    def __init__(
        self,
        params: Iterable[torch.Tensor] | Iterable[dict],
        optimizer_cls: Callable[..., torch.optim.Optimizer],
        *,
        master_weights: bool = True,
        loss_scale: None | str | float | LossScaleConfig = None,
        max_grad_norm: float | None = None,
        spike_window: int = 100,
        spike_factor: float = 3.0,
        skip_spikes: bool = False,
        stochastic_rounding: bool = False,
        seed: int = 0,
        data_parallel: bool | None = None,
        group: Any = None,
        **optimizer_kwargs: Any,
    ) -> None:
        for name, flag in (("master_weights", master_weights), ("stochastic_rounding", stochastic_rounding)):
            if not isinstance(flag, bool):
                fail(name, "a bool", describe(flag), TypeError)
        if master_weights and stochastic_rounding:
            fail("stochastic_rounding", "False when master_weights=True (masters keep every update already)", True)
        if not callable(optimizer_cls):
            fail("optimizer_cls", "a torch optimizer class such as torch.optim.AdamW", describe(optimizer_cls),
                 TypeError)
        scale_config = LossScaleConfig.parse(loss_scale)
        self.group = data_parallel_group(data_parallel, group)
        """The data-parallel group the step agrees over; ``None`` in a single process."""
        if stochastic_rounding and self.group is not None:
            # widening param.data to float32 gives the parameter a new gradient accumulator, dropping the
            # hooks DDP reduces through; FSDP2 owns param.data outright
            fail("stochastic_rounding", "False under data parallelism (it swaps param.data for the step, which "
                 "DDP and FSDP2 rely on); use master_weights=True", True)
        self.guard = StepGuard(max_grad_norm, spike_window, spike_factor, skip_spikes)
        self.scaler = None if scale_config is None else LossScaler(scale_config)
        self._sr = StochasticRounding(seed) if stochastic_rounding else None
        self._masters = MasterWeights(master_weights)
        self._grads = GradAccumulator(replicated=self.group is not None)
        self._seen: set[int] = set()
        self.optimizer = optimizer_cls([self._adopt(g) for g in _as_groups(params)], **optimizer_kwargs)
        if not isinstance(self.optimizer, torch.optim.Optimizer):
            fail("optimizer_cls", "a callable returning a torch.optim.Optimizer", describe(self.optimizer),
                 TypeError)

    def _adopt(self, group: dict) -> dict:
        """Check a param group's tensors, start accumulating for them; the group the inner optimizer gets."""
        params = group["params"]
        params = [params] if isinstance(params, torch.Tensor) else list(params)
        for p in params:
            if not isinstance(p, torch.Tensor) or p.dtype not in _PARAM_DTYPES:
                fail("params", "float32, bfloat16 or float16 tensors", describe(p), TypeError)
            if not p.is_leaf:
                fail("params", "leaf tensors (parameters), not results of an operation", describe(p))
            if fp8_weight(p) is not None and (not self._masters.enabled or self._sr is not None):
                fail("master_weights", "True for FP8 weights (their codes cannot take an update; the FP32 master "
                     "does)", "False")
            if id(p) in self._seen:
                fail("params", "each parameter once", f"{describe(p)} twice")
            if is_dtensor(p) and self.group is None and p.device_mesh.size() > 1:
                fail("data_parallel", "True or None for DTensor (FSDP2) parameters sharded over several ranks",
                     "False")
            self._seen.add(id(p))
        self._grads.add(params)
        return {**group, "params": self._masters.add(params)}

    # -- what torch's LR schedulers and training loops read ------------------------------------
    @property
    def param_groups(self) -> list[dict]:  # type: ignore[override]
        return self.optimizer.param_groups

    @property
    def state(self) -> Any:  # type: ignore[override]
        return self.optimizer.state

    @property
    def defaults(self) -> dict:  # type: ignore[override]
        return self.optimizer.defaults

    @property
    def skipped_steps(self) -> int:
        return self.guard.skipped_steps

    @property
    def loss_scale(self) -> float | None:
        """The scale the next backward multiplies the loss by (``None`` without loss scaling)."""
        return None if self.scaler is None else self.scaler.scale

    @property
    def params(self) -> list[torch.Tensor]:
        """The model's parameters, in the order they were given."""
        return list(self._grads.params)

    @property
    def master_weights(self) -> list[torch.Tensor | None]:
        """Each parameter's float32 master (``None`` for float32 parameters and without masters)."""
        return list(self._masters.masters)

    def add_param_group(self, param_group: dict) -> None:
        self.optimizer.add_param_group(self._adopt(param_group))

    def remove_hooks(self) -> None:
        """Stop folding gradients into float32 buffers (call before reusing the model elsewhere)."""
        self._grads.remove_hooks()

    # -- the training step ---------------------------------------------------------------------
    def zero_grad(self, set_to_none: bool = True) -> None:
        """Drop all gradients: the float32 buffers, the masters' and the parameters' ``.grad``."""
        if set_to_none is not True:
            fail("set_to_none", "True (gradients are always freed; float32 buffers are made anew)", set_to_none)
        self._grads.zero()
        self._masters.clear_grads()

    def backward(self, loss: torch.Tensor, **kwargs: Any) -> None:
        """Scale ``loss`` (with loss scaling) and backpropagate; gradients accumulate in float32."""
        if not isinstance(loss, torch.Tensor) or loss.numel() != 1 or not loss.requires_grad:
            fail("loss", "a one-element tensor that requires grad", describe(loss), TypeError)
        (loss if self.scaler is None else self.scaler.scale_loss(loss)).backward(**kwargs)

    @torch.no_grad()
    def step(self, loss: Any = None) -> StepResult:  # type: ignore[override]
        """Unscale, check the loss and gradients are finite, clip, then step or skip; drops the gradients.

        ``loss`` (a number or one-element tensor, the unscaled loss of the whole batch) is checked
        for being finite and watched for spikes; ``None`` checks the gradients alone.
        """
        grads = self._grads.grads()
        present = [g for g in grads if g is not None]
        shards = [local(g) for g in present]  # a DTensor's local shard shares its storage
        scale = None if self.scaler is None else self.scaler.scale
        if scale is not None and scale != 1.0:
            for gs in by_device(shards).values():
                torch._foreach_mul_(gs, self.scaler.inv_scale)
        sharded = None if self.group is None else [replicas(g, self.group) for g in present]
        verdict, norm = self.guard.inspect(shards, loss, self.group, sharded)
        clipped = False
        if verdict.reason is None:
            clipped = self.guard.clip_(shards, verdict, norm)
            self._apply(grads)
        if self.scaler is not None:
            self.scaler.update(found_inf=not verdict.grads_finite)
        self.zero_grad()
        return StepResult(skipped=verdict.reason is not None, reason=verdict.reason, grad_norm=verdict.grad_norm,
                          loss_scale=scale, spike=verdict.spike, loss=verdict.loss, clipped=clipped)

    def _apply(self, grads: list[torch.Tensor | None]) -> None:
        stepped = [p for p, g in zip(self._grads.params, grads) if g is not None]
        with self._sr.widened(stepped) if self._sr is not None else nullcontext():
            self._masters.set_grads(grads)
            self.optimizer.step()
        self._masters.copy_to_params()

    # -- checkpoints ---------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """Everything needed to resume: plain tensors, numbers, lists and dicts (``weights_only`` loads it)."""
        return {
            "optimizer": self.optimizer.state_dict(),
            "master_weights": self._masters.state_dict(),
            "loss_scale": None if self.scaler is None else self.scaler.state_dict(),
            "guard": self.guard.state_dict(),
            "stochastic_rounding": None if self._sr is None else self._sr.state_dict(),
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore from :meth:`state_dict`; the low-precision parameters are set from the loaded masters."""
        if not isinstance(state_dict, dict) or set(state_dict) != _STATE_KEYS:
            got = sorted(state_dict) if isinstance(state_dict, dict) else describe(state_dict)
            fail("state_dict", "a dict with keys " + ", ".join(sorted(_STATE_KEYS)), got)
        for key, mine in (("loss_scale", self.scaler), ("stochastic_rounding", self._sr)):
            if (state_dict[key] is None) != (mine is None):
                want = "None (not enabled here)" if mine is None else "saved state (enabled here)"
                fail(f"state_dict[{key!r}]", want, describe(state_dict[key]))
        self._check_state(state_dict)
        # widened: optimizer state is cast to the parameters' dtype on load, and must stay float32
        with self._sr.widened(self._grads.params, stochastic=False) if self._sr is not None else nullcontext():
            self.optimizer.load_state_dict(state_dict["optimizer"])
        self._masters.load_state_dict(state_dict["master_weights"])
        if self.scaler is not None:
            self.scaler.load_state_dict(state_dict["loss_scale"])
        if self._sr is not None:
            self._sr.load_state_dict(state_dict["stochastic_rounding"])
        self.guard.load_state_dict(state_dict["guard"])

    def _check_state(self, state_dict: dict[str, Any]) -> None:
        """Raise before anything is changed if a part of ``state_dict`` does not fit (loading into copies)."""
        self._masters.check_state(state_dict["master_weights"])
        if self.scaler is not None:
            LossScaler(self.scaler.config).load_state_dict(state_dict["loss_scale"])
        if self._sr is not None:
            StochasticRounding(self._sr.seed).load_state_dict(state_dict["stochastic_rounding"])
        spikes = self.guard.spikes
        StepGuard(self.guard.max_grad_norm, spikes.window, spikes.factor).load_state_dict(state_dict["guard"])
