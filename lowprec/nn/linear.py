"""``lowprec.nn.Linear``: a drop-in ``torch.nn.Linear`` whose GEMMs run as a recipe says."""
from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator

import torch
import torch.nn as nn
import torch.nn.functional as nnf

from lowprec import recipes as R
from lowprec._checks import describe, fail
from lowprec.autocast import records_amax, resolve
from lowprec.nn.casts import CastState, InputShare
from lowprec.nn.delayed import DelayedState
from lowprec.nn.delayed_bank import DelayedBanks
from lowprec.nn.fp8_weight import stored_codes
from lowprec.nn.function import LinearFunction, fprop, output_dtype
from lowprec.nn.plan import LayerPlan, fallback_reason, layer_plan, memo_serves
from lowprec.nn.record import record_amaxes
from lowprec.nn.stored_codes import StoredCodes
from lowprec.ranks import local


class OptionalExtraState(nn.Module):
    """A module whose extra state (delayed-scaling histories) is never required: a ``state_dict`` without it
    loads, the histories starting from current scaling. Pair with :func:`drop_empty_extra_state`."""

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys,
                              unexpected_keys, error_msgs):
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys,
                                      unexpected_keys, error_msgs)
        key = prefix + "_extra_state"
        if key in missing_keys:  # never required: a missing history starts from current scaling
            missing_keys.remove(key)

    def _restoring(self, state):
        """The bound recipe where a saved extra ``state`` is to be restored (a delayed one); None where
        there is nothing to restore: no state, or a layer bound to a recipe without delayed scaling (saved
        under a delayed recipe, loaded under another)."""
        recipe = getattr(self, "recipe", None)
        return recipe if state is not None and recipe is not None and recipe.uses_delayed_scaling else None


class Linear(OptionalExtraState, nn.Linear):
    """``torch.nn.Linear`` with the same parameters, ``state_dict`` keys and initialisation, whose
    forward and backward GEMMs cast their operands as ``recipe`` says (None: plain high precision).

    What the layer does with its recipe on its device is a frozen :class:`~lowprec.nn.plan.LayerPlan`,
    made when the layer gets the recipe or moves (see [Note: the layer plan]). The weight is cast at
    every forward and its cast dropped once the forward GEMM has run; backward casts weight.T for the
    data-gradient GEMM itself, so no weight copy is kept between them. Inside
    :func:`lowprec.nn.cached_weight_casts` (gradient accumulation) both casts are kept and reused
    until the weight changes. Delayed-scaling state, when the recipe uses it, is saved in
    ``state_dict`` as versioned extra state; see ``lowprec.nn.delayed``.
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = True, device=None, dtype=None,
                 *, recipe: str | R.Recipe | None = None) -> None:
        super().__init__(in_features, out_features, bias=bias, device=device, dtype=dtype)
        self._init_lowprec(recipe)

    def _init_lowprec(self, recipe) -> None:
        self.state = CastState()
        self._banks: DelayedBanks | None = None
        """The banks of the converted model holding the layer (see [Note: the delayed-scaling bank] in
        ``lowprec.nn.delayed_bank``); None: the layer's delayed state has banks of its own."""
        self._codes: StoredCodes | None = stored_codes(self.weight)
        """An FP8 primary weight's codes as plain tensors, for the autograd function (None: a plain weight)."""
        self._plans: tuple[LayerPlan | None, LayerPlan | None] = (None, None)
        """The plans made last, for training [0] and for evaluation [1] (every cast to nearest)."""
        self._warned: set[str] = set()
        self.policy_reason: str | None = None
        """Why the conversion policy keeps this layer in high precision although it has a recipe."""
        self.min_features: int | None = None
        """Where the recipe runs natively, a layer with a dimension under this stays in high precision
        (set by ``convert`` from the policy; see :func:`lowprec.nn.plan.small_reason`)."""
        self.recast_input = False
        """Under ``torch.compile``, backward makes the input's transposed cast again rather than keep it
        (set by ``convert`` from ``Policy.recast_inputs``; see :attr:`lowprec.nn.plan.LayerPlan.recast_input`)."""
        self.set_recipe(R.get(recipe) if recipe is not None else None)
        self.register_state_dict_post_hook(drop_empty_extra_state)

    @classmethod
    def from_linear(cls, linear: nn.Linear, recipe: str | R.Recipe | None) -> Linear:
        """A lowprec Linear sharing ``linear``'s parameters (so optimizers holding them still work)."""
        new = cls.__new__(cls)
        nn.Module.__init__(new)
        new.in_features, new.out_features = linear.in_features, linear.out_features
        new.weight, new.bias = linear.weight, linear.bias
        new._init_lowprec(recipe)
        new.train(linear.training)
        return new

    # ---- the recipe and its plan --------------------------------------------------------------

    def set_recipe(self, recipe: R.Recipe | None, *, policy_reason: str | None = None,
                   min_features: int | None = None, share: InputShare | None = None,
                   recast_input: bool = False) -> None:
        """Bind ``recipe`` (None: high precision), with the policy's decisions; makes the plan for the
        weight's device and the delayed-scaling state it needs, outside any compiled graph."""
        self.recipe: R.Recipe | None = recipe
        self.policy_reason, self.min_features, self.recast_input = policy_reason, min_features, recast_input
        self.state.share = share
        self.clear_cache()
        self._plans = (None, None)
        if recipe is not None and not self.weight.is_meta:
            self._prepare(recipe)

    @property
    def delayed_state(self) -> DelayedState | None:
        return self.state.delayed

    def named_delayed_states(self) -> list[tuple[str, DelayedState]]:
        """``(suffix, state)`` of each delayed-scaling state the layer holds: its own, under no suffix."""
        return [("", self.state.delayed)] if self.state.delayed is not None else []

    @property
    def hp_reason(self) -> str | None:
        """Why the layer runs its bound recipe in high precision on its device (None: it does not)."""
        plan = self.plan()
        return plan.hp_reason if plan is not None else None

    def plan(self, recipe: R.Recipe | None = None, nearest: bool = False) -> LayerPlan | None:
        """The plan for ``recipe`` (default: the bound one) on the weight's device; ``nearest``: the
        evaluation plan, every cast rounded to nearest (see [Note: evaluation is deterministic])."""
        recipe = recipe if recipe is not None else self.recipe
        if recipe is None:
            return None
        i = 1 if nearest else 0
        memo = self._plans[i]
        storage = self._codes.granularity if self._codes is not None else None
        if memo_serves(memo, recipe, self.weight.device) and memo.weight_storage == storage:
            return memo
        plan = layer_plan(recipe, self.weight.device, self.in_features, self.out_features, self.policy_reason,
                          self.min_features, nearest, storage, self.recast_input)
        if not torch.compiler.is_compiling():
            self._plans = (plan, self._plans[1]) if i == 0 else (self._plans[0], plan)
        return plan

    def _prepare(self, recipe: R.Recipe) -> LayerPlan:
        """The plan, and a delayed-scaling state for it on the weight's device: made before a compiled
        forward needs them (creating them inside a graph would end the graph)."""
        plan = self.plan(recipe)
        self.plan(recipe, nearest=True)  # the evaluation plan too: a compiled validation would trace it
        if plan.delayed:
            state = self.state.delayed
            if state is None or state.config != recipe.delayed:
                self.state.delayed = DelayedState(recipe.delayed, self.weight.device, self._banks)
            elif state.device != self.weight.device:  # the module moved since
                state.to(self.weight.device)
        return plan

    def use_banks(self, banks: DelayedBanks) -> None:
        """Keep the delayed-scaling state in ``banks``, a converted model's, folded by its forward's
        pre-hook (``lowprec.nn.delayed_bank.bank_layers``), now and for every state made later."""
        self._banks = banks
        if self.state.delayed is not None:
            self.state.delayed.rebank(banks)

    def _fold_own(self) -> None:
        # a layer outside a converted model folds its own bank, before it reads a scale
        state = self.state.delayed
        if state is not None and not state.banks.by_hook:
            state.banks.fold()

    def _apply(self, fn, recurse: bool = True):
        # .to(), .cuda(), .half(), to_empty(): the plan and the delayed state follow the weight, now
        # rather than at the first (perhaps compiled) forward on the new device
        out = super()._apply(fn, recurse)
        if hasattr(self, "state"):
            self.hold_weight()
        return out

    def hold_weight(self) -> None:
        """Take the weight the layer holds now (moved, decoded, or stored in FP8 by ``convert``): keep
        an FP8 weight's codes and make the plans for it, outside any compiled graph."""
        self._codes = stored_codes(self.weight)
        recipe = getattr(self, "recipe", None)
        if recipe is not None and not self.weight.is_meta:
            self._prepare(recipe)

    # ---- forward --------------------------------------------------------------------------

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not isinstance(x, torch.Tensor) or not x.dtype.is_floating_point or x.dtype.itemsize < 2:
            fail("input", "a float32, bfloat16 or float16 tensor", describe(x), TypeError)
        if x.dim() == 0 or x.shape[-1] != self.in_features:
            fail("input", f"a last dimension of in_features={self.in_features}", describe(x))
        recipe = resolve(self.recipe)
        # a tensor-parallel shard (a DTensor) computes on its local part: lowprec.distributed.tensor_parallel
        weight, bias = local(self.weight), None if self.bias is None else local(self.bias)
        if x.numel() == 0:
            return nnf.linear(x, weight, bias)
        if recipe is None:
            return self._recorded(x, nnf.linear(x, weight, bias))
        if not torch.compiler.is_compiling():
            self._check_weight()
        training = self.training and torch.is_grad_enabled()
        plan = self.plan(recipe, nearest=not training)  # evaluation rounds every cast to nearest
        if plan.hp_dtype is not None:
            return self._recorded(x, self._unscaled(x, plan.hp_dtype, weight, bias))
        if plan.hp_reason is not None:
            if not torch.compiler.is_compiling():  # a warning would end a graph; eager code said it
                self._warn_once(plan.hp_reason)
            return nnf.linear(x, weight, bias)
        if plan.delayed:
            self._prepare(recipe)  # nothing to do unless the recipe changed (autocast) or the module moved
            self._fold_own()
        # Compiled code without delayed scaling needs none of the layer's state (no cache, no sharing):
        # one stateless object for every layer, so that blocks compiled one by one (FSDP2) share one
        # graph instead of recompiling per layer on the identity of its state
        # (a tensor-parallel layer keeps its own: the group it agrees scales over)
        state = self.state if plan.delayed or self.state.group is not None or not torch.compiler.is_compiling() \
            else _STATELESS
        codes = self._stored()
        if self._builds_graph(x):
            return LinearFunction.apply(x, weight, bias, plan, state, *codes)
        # inference: no transposed casts, and the delayed-scaling history is left as training made it
        return fprop(x, weight, bias, plan, state, False, False, False, codes)[0]

    def _stored(self) -> tuple:
        """(codes, scales, amax) of an FP8 primary weight, as plain tensors; () for a plain weight."""
        codes = self._codes
        return () if codes is None else (codes.data, codes.scale, codes.amax)

    def _check_weight(self) -> None:
        # eager code notices a weight assigned since the layer took its last one (compiled code takes
        # what eager code or .to() left: it cannot ask the weight subclass)
        held, now = self._codes, stored_codes(self.weight)
        if (held is None) != (now is None) or (held is not None and held.data is not now.data):
            self.hold_weight()

    def _builds_graph(self, x: torch.Tensor) -> bool:
        """The forward is differentiated (training): the autograd function runs, and delayed layers record."""
        params = (self.weight, self.bias) if self.bias is not None else (self.weight,)
        return torch.is_grad_enabled() and (x.requires_grad or any(p.requires_grad for p in params))

    @staticmethod
    def _unscaled(x: torch.Tensor, dtype: torch.dtype, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """bf16/fp16 recipes: operands cast to ``dtype``, output in the input / autocast dtype."""
        out = output_dtype(x)
        with torch.autocast(x.device.type, enabled=False):
            b = bias.to(dtype) if bias is not None else None
            return nnf.linear(x.to(dtype), weight.to(dtype), b).to(out)

    def _recorded(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """``y``, the layer's output in high precision under an autocast region; where the region
        records amaxes and the bound recipe scales by delay, its amaxes recorded as a step of that recipe
        records them (see [Note: lazy scale initialisation] in ``lowprec.nn.record``)."""
        bound = self.recipe
        if not records_amax() or bound is None or not bound.uses_delayed_scaling:
            return y
        if not self._builds_graph(x):
            return y  # inference: a delayed layer records nothing either
        plan = self._prepare(bound)  # its history exists unless an override replaced it since
        if plan.delayed:  # not a layer the policy or its shape keeps in high precision
            self._fold_own()
            record_amaxes(x, local(self.weight), y, plan, self.state.delayed)
        return y

    def _warn_once(self, reason: str) -> None:
        if reason not in self._warned:
            self._warned.add(reason)
            warnings.warn(f"lowprec: a Linear({self.in_features}, {self.out_features}) runs in high "
                          f"precision: {reason}", stacklevel=3)

    def clear_cache(self) -> None:
        """Drop the cached weight casts (see :func:`cached_weight_casts`)."""
        self.state.weight_cache = None

    # ---- state ----------------------------------------------------------------------------

    def get_extra_state(self):
        state = self.state.delayed
        # nothing recorded yet (a fresh layer): no entry, so the state_dict loads into nn.Linear
        return state.to_tensor() if state is not None and any(state.recorded) else None

    def set_extra_state(self, state) -> None:
        recipe = self._restoring(state)
        if recipe is None:
            return
        self.state.delayed = DelayedState(recipe.delayed, self.weight.device, self._banks)
        self.state.delayed.load_tensor(state, f"Linear({self.in_features}, {self.out_features})")

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys,
                              unexpected_keys, error_msgs):
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys,
                                      unexpected_keys, error_msgs)
        self.clear_cache()

    def extra_repr(self) -> str:
        r = self.recipe.name if self.recipe is not None else None
        hp = f", hp_reason={self.hp_reason!r}" if self.hp_reason else ""
        return super().extra_repr() + f", recipe={r}{hp}"


@contextlib.contextmanager
def cached_weight_casts(model: nn.Module) -> Iterator[nn.Module]:
    """Within the region, every converted layer of ``model`` casts its weight once and reuses both
    casts (forward and transposed) for each forward until the weight changes: the micro-batches of
    gradient accumulation cast each weight once per optimizer step. On exit the casts are dropped.

    The cache is keyed on the parameter's version counter, which every in-place write through the
    parameter bumps (an optimizer step, ``copy_``, ``load_state_dict``); a write through
    ``weight.data`` does not, so call ``clear_cache()`` on the layers after one inside the region.
    Outside any region a layer casts at every forward and keeps only what backward needs."""
    layers = [m for m in model.modules() if isinstance(m, Linear)]
    for m in layers:
        m.state.cache_depth += 1
    try:
        yield model
    finally:
        for m in layers:
            m.state.cache_depth -= 1
            if m.state.cache_depth == 0:
                m.clear_cache()


_STATELESS = CastState()
"""The state compiled code passes for layers without delayed scaling (it is never written)."""


def drop_empty_extra_state(module, state_dict, prefix, local_metadata) -> None:
    """A ``state_dict`` post-hook: a layer without delayed state writes no extra-state entry, so its state_dict
    has exactly the plain module's keys (torch.nn.Linear's, a Hugging Face experts module's) and loads into a
    plain model."""
    key = prefix + "_extra_state"
    if key in state_dict and state_dict[key] is None:
        del state_dict[key]


__all__ = ["Linear", "OptionalExtraState", "cached_weight_casts", "drop_empty_extra_state", "fallback_reason"]
