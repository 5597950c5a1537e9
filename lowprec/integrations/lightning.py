"""Lightning: :class:`LowprecPrecision` for the Trainer and :class:`LowprecFabricPrecision` for Fabric.

::

    trainer = lightning.pytorch.Trainer(plugins=[LowprecPrecision("mxfp8")])
    fabric = lightning.fabric.Fabric(plugins=[LowprecFabricPrecision("mxfp8")])

The plugin converts the model (``lowprec.convert`` with the recipe and policy; the report is logged and kept
as ``plugin.report``) and steps each optimizer through ``lowprec.optim.Optimizer``: the step guard (clip,
skip a non-finite step leaving weights and optimizer state as they were), loss scaling, FP32 gradient
accumulation for BF16/FP16 weights and, when asked, their FP32 masters (see [Note: adopting an optimizer]
in ``lowprec.integrations.adopt``).

[Note: one plugin per Lightning front end]
The Trainer's ``Precision`` subclasses Fabric's, but the two call it differently: the Trainer passes the
LightningModule and a closure that runs the training step, and runs its hooks from the plugin; Fabric
passes a plain module and only the optimizer, at its step. One class cannot answer both, so, as with
Lightning's own plugins, :class:`LowprecFabricPrecision` holds what both share (conversion, the adopted
optimizers, the step, the state) and :class:`LowprecPrecision` adds the Trainer's side. The Trainer shows
the plugin its optimizers before the first backward (``connect``); Fabric only at their first step, which
:mod:`lowprec.integrations.adopt` provides for.

[Note: what the plugin saves]
Delayed-scaling histories travel in the module's ``state_dict`` (``lowprec.nn.Linear``'s extra state),
which is how Fabric saves them. The Trainer restores a checkpoint's ``state_dict`` into the LightningModule
before the plugin converts it, and an unconverted module has no place for them, so the Trainer's plugin
moves them from the checkpoint's ``state_dict`` into its own entry and puts them back once the module is
converted: the checkpoint's weights stay loadable into the plain module. The plugin's entry also holds,
for each optimizer, the rest of ``lowprec.optim.Optimizer``'s state (masters, loss scale, the guard's
counts and spike window); the Trainer saves the optimizer's own state itself, Fabric does not, so
Fabric's entry holds it too.
"""
from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn

from lowprec import recipes as R
from lowprec._checks import describe, fail
from lowprec.conversion_report import ConversionReport
from lowprec.distributed.amax import sync_amaxes
from lowprec.integrations.adopt import StepSettings, adopt
from lowprec.integrations.conversion import convert_checked
from lowprec.nn.delayed_bank import DelayedBanks, bank_layers
from lowprec.optim import LossScaleConfig, LossScaler, Optimizer, StepGuard, StepResult
from lowprec.policy import Policy

try:
    from lightning.fabric.plugins import Precision as FabricPrecision
    from lightning.fabric.utilities.rank_zero import rank_zero_info, rank_zero_warn
    from lightning.pytorch.plugins.precision import Precision
    from lightning.pytorch.utilities import GradClipAlgorithmType
    from lightning_utilities import apply_to_collection
except ImportError as e:  # pragma: no cover - the integrations extra installs it
    raise ImportError("lowprec.integrations.lightning needs lightning: pip install 'lowprec[integrations]'") from e

__all__ = ["LowprecFabricPrecision", "LowprecPrecision"]

_DTYPES = {None: "32-true", torch.float32: "32-true", torch.bfloat16: "bf16-true", torch.float16: "16-true"}
"""The weights' dtype the plugin casts the module to -> Lightning's name for that precision."""
_STATE_KEYS = {"optimizers", "delayed"}
_DELAYED = "_extra_state"


class LowprecFabricPrecision(FabricPrecision):
    """Fabric's precision plugin for a lowprec ``recipe``; see the module's docstring.

    ``policy``: which linears ``lowprec.convert`` converts (default: ``lowprec.Policy()``).
    ``dtype``: cast the module's parameters to this before converting (``torch.bfloat16``: BF16 weights);
    None leaves them as they are. ``master_weights``: keep FP32 masters of BF16/FP16 parameters in the
    optimizer. ``step_guard``: step through ``lowprec.optim.Optimizer`` (False: the optimizer steps as
    plain Lightning steps it, and the arguments below are refused). ``max_grad_norm``: the guard clips to it
    (in place of ``Trainer(gradient_clip_val)`` / ``fabric.clip_gradients``, which are refused).
    ``loss_scale``: ``"auto"`` (dynamic where the recipe or an FP16 ``dtype`` needs it), None, ``"dynamic"``,
    a number or a ``LossScaleConfig``. ``skip_spikes``: skip a step whose loss is a spike.
    """

    def __init__(self, recipe: str | R.Recipe, policy: Policy | None = None, *, dtype: torch.dtype | None = None,
                 master_weights: bool = False, step_guard: bool = True, max_grad_norm: float | None = None,
                 loss_scale: Any = "auto", skip_spikes: bool = False) -> None:
        self.recipe = R.get(recipe)
        if policy is not None and not isinstance(policy, Policy):
            fail("policy", "a lowprec.Policy or None", describe(policy), TypeError)
        if dtype is not None and (not isinstance(dtype, torch.dtype) or dtype not in _DTYPES):
            fail("dtype", "None, torch.float32, torch.bfloat16 or torch.float16", describe(dtype))
        for name, flag in (("master_weights", master_weights), ("step_guard", step_guard),
                           ("skip_spikes", skip_spikes)):
            if not isinstance(flag, bool):
                fail(name, "a bool", describe(flag), TypeError)
        self.policy = policy
        self.dtype = dtype
        self.precision = _DTYPES[dtype]
        self.settings = _settings(self.recipe, dtype, step_guard, master_weights, max_grad_norm, loss_scale,
                                  skip_spikes)
        """How the adopted optimizers step; None without the step guard."""
        self.report: ConversionReport | None = None
        """What the conversion did, layer by layer (None before the module is converted)."""
        self.last_step: StepResult | None = None
        """What the last optimizer step did (taken or skipped, why, the gradient norm)."""
        self._module: nn.Module | None = None
        self._banks: DelayedBanks | None = None
        """The converted module's delayed-scaling banks (None: its recipe does not scale by delay)."""
        self._adopted: list[tuple[torch.optim.Optimizer, Optimizer]] = []
        self._pending: list[dict[str, Any]] = []
        """Loaded states of the optimizers not adopted yet, in the order they will be (each loaded once)."""
        self._loss: torch.Tensor | None = None
        """The losses backpropagated since the last step, summed: what the guard checks and watches."""

    # ---- the module ----------------------------------------------------------------------------
    def convert_module(self, module: nn.Module) -> nn.Module:
        """Cast to ``dtype`` (scaling state made after it stays float32), then ``lowprec.convert`` in place;
        the report is logged once. A module this plugin converted already is left as it is."""
        if module is self._module:
            return module
        if self.dtype is not None:
            module.to(dtype=self.dtype)
        self.report = convert_checked(module, self.recipe, self.policy, type(self).__name__)
        rank_zero_info(f"lowprec: {type(self).__name__} converted the model:\n{self.report}")
        self._module = module
        self._banks = bank_layers(module, []) if self.recipe.uses_delayed_scaling else None
        return module

    @contextlib.contextmanager
    def forward_context(self) -> Iterator[None]:
        """Fold the delayed-scaling banks before the step: ``lowprec.convert`` folds them from a forward
        pre-hook on the module it converted, and a LightningModule's ``training_step`` calls its submodules
        rather than its own forward (see [Note: the delayed-scaling bank] in ``lowprec.nn.delayed_bank``;
        a second fold by the hook adds nothing)."""
        if self._banks is not None:
            self._banks.fold()
        yield

    def convert_input(self, data: Any) -> Any:
        """Floating-point inputs in the weights' ``dtype`` (token ids are left as they are)."""
        if self.dtype is None:
            return data
        return apply_to_collection(data, torch.Tensor, _to_dtype, self.dtype)

    # ---- backward and step (Fabric) ------------------------------------------------------------
    def backward(self, tensor: torch.Tensor, model: nn.Module | None, *args: Any, **kwargs: Any) -> None:
        (self._before_backward(tensor) if self.settings is not None else tensor).backward(*args, **kwargs)

    def optimizer_step(self, optimizer: Any, **kwargs: Any) -> Any:
        """The step of ``optimizer`` through ``lowprec.optim.Optimizer`` (adopted at its first step)."""
        if self.settings is None:
            return super().optimizer_step(optimizer, **kwargs)
        closure = kwargs.pop("closure", None)
        if kwargs:
            fail("optimizer.step", "no arguments but a closure (lowprec's step takes the loss from backward)",
                 sorted(kwargs))
        out = closure() if closure is not None else None
        self._step(self._lowprec_optimizer(optimizer, after_backward=True))
        return out

    def unscale_gradients(self, optimizer: Any) -> None:
        if self.settings is not None:
            fail("clip_gradients", f"no clipping outside the step guard with {type(self).__name__}, which clips "
                 "the unscaled float32 gradients at the step: pass max_grad_norm to the plugin", "a call")

    # ---- what the Trainer and Fabric share -------------------------------------------------------
    def _before_backward(self, loss: torch.Tensor) -> torch.Tensor:
        """Note ``loss`` for the guard; the loss to backpropagate (scaled, with loss scaling)."""
        if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
            fail("loss", "a one-element tensor", describe(loss), TypeError)
        detached = loss.detach().float().reshape(())  # ()
        self._loss = detached if self._loss is None else self._loss + detached
        scaler = self._scaler()
        return loss if scaler is None else scaler.scale_loss(loss)

    def _scaler(self) -> LossScaler | None:
        """The loss scale the next backward uses: the adopted optimizer's, or before it is adopted (Fabric's
        first step), the one it will start from."""
        if self.settings is None or self.settings.loss_scale is None:
            return None
        if self._adopted:
            return self._adopted[0][1].scaler
        early = LossScaler(self.settings.loss_scale)
        if self._pending:
            early.load_state_dict(self._pending[0]["loss_scale"])
        return early

    def _lowprec_optimizer(self, optimizer: Any, *, after_backward: bool) -> Optimizer:
        """The ``lowprec.optim.Optimizer`` around ``optimizer``, adopting it the first time; loaded state
        waiting for it is loaded into it."""
        for mine, adopted in self._adopted:
            if mine is optimizer:
                return adopted
        if self._adopted and self.settings.loss_scale is not None:
            fail("optimizer", f"one optimizer with loss scaling ({type(self).__name__} scales each backward "
                 "by one optimizer's scale)", f"a second one, {type(optimizer).__name__}")
        adopted = adopt(optimizer, self.settings, after_backward=after_backward)
        self._adopted.append((optimizer, adopted))
        if self._pending:
            self._load_optimizer(adopted, self._pending.pop(0))
        return adopted

    def _step(self, optimizer: Optimizer) -> StepResult:
        """Agree delayed scales across ranks, then the guarded step, judged on the losses since the last one
        (with several optimizers, on their gradients alone)."""
        if self.recipe.uses_delayed_scaling and self._module is not None:
            sync_amaxes(self._module)  # every rank's next scales from the same amaxes (nothing in one process)
        loss, self._loss = self._loss, None
        result = optimizer.step(loss=loss if len(self._adopted) == 1 else None)
        self.last_step = result
        if result.skipped:
            rank_zero_warn(f"lowprec: optimizer step {optimizer.guard.steps} skipped ({result.reason}): the weights "
                           "and the optimizer state are as they were")
        return result

    # ---- state ---------------------------------------------------------------------------------
    def _optimizer_state(self, optimizer: Optimizer) -> dict[str, Any]:
        """What the plugin saves of an adopted optimizer (Fabric: all of it)."""
        return optimizer.state_dict()

    def _load_optimizer(self, optimizer: Optimizer, state: dict[str, Any]) -> None:
        optimizer.load_state_dict(state)

    def state_dict(self) -> dict[str, Any]:
        """Each optimizer's ``lowprec.optim.Optimizer`` state (loaded ones not adopted yet as loaded)."""
        saved = [self._optimizer_state(adopted) for _, adopted in self._adopted]
        return {"optimizers": saved + self._pending, "delayed": {}}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load into the optimizers adopted so far; the rest waits for theirs."""
        if not isinstance(state_dict, dict) or set(state_dict) != _STATE_KEYS \
                or not isinstance(state_dict["optimizers"], list):
            fail("state_dict", "a dict with 'optimizers' (a list) and 'delayed', from the plugin's state_dict()",
                 describe(state_dict))
        saved = state_dict["optimizers"]
        if self._adopted and len(saved) != len(self._adopted):
            fail("state_dict['optimizers']", f"{len(self._adopted)} entries (one per optimizer)", len(saved))
        for (_, adopted), state in zip(self._adopted, saved):
            self._load_optimizer(adopted, state)
        self._pending = list(saved[len(self._adopted):])

    def teardown(self) -> None:
        """Stop folding gradients into the adopted optimizers' float32 buffers."""
        for _, adopted in self._adopted:
            adopted.remove_hooks()


class LowprecPrecision(Precision, LowprecFabricPrecision):
    """The Trainer's precision plugin for a lowprec ``recipe``: ``Trainer(plugins=[LowprecPrecision(...)])``.
    The arguments are :class:`LowprecFabricPrecision`'s. The optimizers come from ``configure_optimizers``
    (one with loss scaling); under automatic optimization the guard judges the losses the training steps
    returned since the last step; the Trainer's own ``gradient_clip_val`` is refused (``max_grad_norm``)."""

    def connect(self, model: nn.Module, optimizers: list[Any], lr_schedulers: list[Any]) -> tuple:
        """Adopt the Trainer's optimizers before any backward runs."""
        self._adopted = []
        if self.settings is not None:
            for optimizer in optimizers:
                self._lowprec_optimizer(optimizer, after_backward=False)
        return model, optimizers, lr_schedulers

    def pre_backward(self, tensor: torch.Tensor, module: Any) -> torch.Tensor:
        if self.settings is not None:
            tensor = self._before_backward(tensor)
        return super().pre_backward(tensor, module)

    def optimizer_step(self, optimizer: Any, model: Any, closure: Callable[[], Any], **kwargs: Any) -> Any:
        """Run the closure (training step and backward), the Trainer's hooks, then the guarded step; a
        training step that returned None (no backward) drops the gradients and takes no step."""
        if self.settings is None:
            return super().optimizer_step(optimizer, model=model, closure=closure, **kwargs)
        if kwargs:
            fail("optimizer.step", "no arguments but the Trainer's closure", sorted(kwargs))
        closure_result = closure()
        self._after_closure(model, optimizer)
        adopted = self._lowprec_optimizer(optimizer, after_backward=False)
        if closure_result is None and model.automatic_optimization:
            adopted.zero_grad()
            self._loss = None
            return closure_result
        self._step(adopted)
        return closure_result

    def clip_gradients(self, optimizer: Any, clip_val: int | float = 0.0,
                       gradient_clip_algorithm: GradClipAlgorithmType = GradClipAlgorithmType.NORM) -> None:
        if self.settings is not None and clip_val is not None and clip_val > 0:
            fail("Trainer(gradient_clip_val)", "None with LowprecPrecision, whose step guard clips the unscaled "
                 "float32 gradients at the step: pass max_grad_norm to the plugin", clip_val)
        super().clip_gradients(optimizer, clip_val, gradient_clip_algorithm)

    # ---- state: see [Note: what the plugin saves] ----------------------------------------------
    def _optimizer_state(self, optimizer: Optimizer) -> dict[str, Any]:
        return {**optimizer.state_dict(), "optimizer": None}  # the Trainer saves the optimizer's own state

    def _load_optimizer(self, optimizer: Optimizer, state: dict[str, Any]) -> None:
        if not isinstance(state, dict):
            fail("state_dict['optimizers']", "a dict per optimizer", describe(state))
        # the optimizer's own state is the Trainer's to restore, after this: load it as it is meanwhile
        optimizer.load_state_dict({**state, "optimizer": optimizer.optimizer.state_dict()})

    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(), "delayed": _delayed_states(self._module)}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        super().load_state_dict(state_dict)
        delayed = state_dict["delayed"]
        if delayed and self._module is None:
            fail("state_dict['delayed']", "a module converted by the plugin to load delayed-scaling state into",
                 f"{len(delayed)} layers' state")
        if delayed:
            unexpected = self._module.load_state_dict(delayed, strict=False).unexpected_keys
            if unexpected:
                fail("state_dict['delayed']", "the delayed-scaling state of the module's converted layers",
                     f"keys it does not have: {', '.join(unexpected[:3])}")

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        """Move the delayed-scaling histories out of the module's ``state_dict`` (the plugin's entry holds
        them): the checkpoint then loads into the unconverted module."""
        weights = checkpoint.get("state_dict")
        if isinstance(weights, dict):
            for key in _delayed_states(self._module):
                weights.pop(key, None)


def _settings(recipe: R.Recipe, dtype: torch.dtype | None, step_guard: bool, master_weights: bool,
              max_grad_norm: Any, loss_scale: Any, skip_spikes: bool) -> StepSettings | None:
    """The step settings the plugin's arguments ask for; None without the guard (the others refused then)."""
    if not step_guard:
        asked = [name for name, on in (("master_weights", master_weights), ("max_grad_norm", max_grad_norm),
                                       ("loss_scale", loss_scale not in ("auto", None)), ("skip_spikes", skip_spikes))
                 if on]
        if asked:
            fail("step_guard", f"True for {', '.join(asked)} (the step guard's settings)", False)
        return None
    if loss_scale == "auto":
        needs = recipe.loss_scaling or dtype == torch.float16
        scale = LossScaleConfig() if needs else None
    else:
        scale = LossScaleConfig.parse(loss_scale)
    StepGuard(max_grad_norm)  # refuses a bad max_grad_norm now rather than at the first step
    return StepSettings(master_weights=master_weights, loss_scale=scale, max_grad_norm=max_grad_norm,
                        skip_spikes=skip_spikes)


def _to_dtype(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return t.to(dtype) if t.is_floating_point() else t


def _delayed_states(module: nn.Module | None) -> dict[str, torch.Tensor]:
    """The delayed-scaling histories of each converted layer of ``module`` that has any (a linear's, a grouped
    layer's experts'), by its ``state_dict`` key."""
    if module is None:
        return {}
    out = {}
    for name, m in module.named_modules():
        if hasattr(m, "named_delayed_states") and (state := m.get_extra_state()) is not None:
            out[f"{name}.{_DELAYED}" if name else _DELAYED] = state
    return out
