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
from lowprec.autocast import resolve
from lowprec.nn.delayed import DelayedState
from lowprec.nn.function import LinearFunction, cast_pair, fprop, output_dtype


def fallback_reason(in_features: int, out_features: int, recipe: R.Recipe) -> str | None:
    """Why a layer of this shape cannot take the recipe's low-precision GEMMs, or None."""
    m = recipe.required_multiple()
    bad = [f"{n}={v}" for n, v in (("in_features", in_features), ("out_features", out_features)) if v % m]
    if bad:
        return f"{' and '.join(bad)} not a multiple of {m} ({recipe.name})"
    return None


class Linear(nn.Linear):
    """``torch.nn.Linear`` with the same parameters, ``state_dict`` keys and initialisation, whose
    forward and backward GEMMs cast their operands as ``recipe`` says (None: plain high precision).

    The weight is cast at every forward and its cast dropped once the forward GEMM has run; backward
    casts weight.T for the data-gradient GEMM itself, so no weight copy is kept between them. Inside
    :func:`lowprec.nn.cached_weight_casts` (gradient accumulation) both casts are kept and reused
    until the weight changes. Delayed-scaling state, when the recipe uses it, is saved in
    ``state_dict`` as versioned extra state; see ``lowprec.nn.delayed``.
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = True, device=None, dtype=None,
                 *, recipe: str | R.Recipe | None = None) -> None:
        super().__init__(in_features, out_features, bias=bias, device=device, dtype=dtype)
        self._init_lowprec(recipe)

    def _init_lowprec(self, recipe) -> None:
        self.recipe: R.Recipe | None = R.get(recipe) if recipe is not None else None
        self.hp_reason: str | None = None
        """Why this layer runs in high precision although it has a recipe (set by ``convert``)."""
        self.delayed_state: DelayedState | None = None
        self._weight_cache: tuple | None = None
        self._cache_depth = 0
        """How many :func:`cached_weight_casts` regions hold this layer (0: cast at every forward)."""
        self._recipe_facts: tuple | None = None
        self._warned: set[str] = set()
        r = self.recipe
        if (r is not None and r.uses_delayed_scaling and not self.weight.is_meta
                and fallback_reason(self.in_features, self.out_features, r) is None):
            self._bind_delayed(r)
        self.register_state_dict_post_hook(_drop_empty_extra_state)

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

    # ---- forward ------------------------------------------------------------------------

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not isinstance(x, torch.Tensor) or not x.dtype.is_floating_point or x.dtype.itemsize < 2:
            fail("input", "a float32, bfloat16 or float16 tensor", describe(x), TypeError)
        if x.dim() == 0 or x.shape[-1] != self.in_features:
            fail("input", f"a last dimension of in_features={self.in_features}", describe(x))
        recipe = resolve(self.recipe)
        if recipe is None or x.numel() == 0:
            return nnf.linear(x, self.weight, self.bias)
        hp_dtype, reason, delayed = self._facts(recipe)
        if hp_dtype is not None:
            return self._unscaled(x, hp_dtype)
        if reason is not None:
            self._warn_once(reason)
            return nnf.linear(x, self.weight, self.bias)
        if delayed:
            self._bind_delayed(recipe)
        params = (self.weight, self.bias) if self.bias is not None else (self.weight,)
        if torch.is_grad_enabled() and (x.requires_grad or any(p.requires_grad for p in params)):
            return LinearFunction.apply(x, self.weight, self.bias, recipe, self)
        # inference: no transposed casts, and the delayed-scaling history is left as training made it
        return fprop(x, self.weight, self.bias, recipe, self, False, False, record=False)[0]

    def _bind_delayed(self, recipe: R.Recipe) -> None:
        """A delayed-scaling state for ``recipe`` on the weight's device. Made when the layer gets its
        recipe, so a compiled forward finds it (creating it inside a graph would end the graph)."""
        state = self.delayed_state
        if state is None or state.config != recipe.delayed:
            self.delayed_state = DelayedState(recipe.delayed, self.weight.device)
        elif state.history.device != self.weight.device:  # the module moved since
            state.to(self.weight.device)

    def _facts(self, recipe: R.Recipe) -> tuple[torch.dtype | None, str | None, bool]:
        """(unscaled dtype, why this layer runs in high precision, delayed scaling?) for ``recipe``,
        derived once per recipe object rather than on every forward."""
        memo = self._recipe_facts
        if memo is not None and memo[0] is recipe and memo[1] == self.hp_reason:
            return memo[2]
        reason = self.hp_reason or fallback_reason(self.in_features, self.out_features, recipe)
        facts = (recipe.hp_dtype, reason, recipe.uses_delayed_scaling)
        if not torch.compiler.is_compiling():
            self._recipe_facts = (recipe, self.hp_reason, facts)
        return facts

    def _unscaled(self, x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """bf16/fp16 recipes: operands cast to ``dtype``, output in the input / autocast dtype."""
        out = output_dtype(x)
        with torch.autocast(x.device.type, enabled=False):
            b = self.bias.to(dtype) if self.bias is not None else None
            return nnf.linear(x.to(dtype), self.weight.to(dtype), b).to(out)

    def _warn_once(self, reason: str) -> None:
        if reason not in self._warned:
            self._warned.add(reason)
            warnings.warn(f"lowprec: a Linear({self.in_features}, {self.out_features}) runs in high "
                          f"precision: {reason}", stacklevel=3)

    def weight_casts(self, weight: torch.Tensor, recipe: R.Recipe, need_transposed: bool, record: bool = True):
        """(weight cast for fprop, weight.T cast for dgrad or None): cast now, or inside
        :func:`cached_weight_casts` taken from the cache until the weight changes. ``record``: add the
        weight's amax to the delayed-scaling history (training forwards, not evaluation)."""
        caching = self._caching
        key = (weight._version, weight.data_ptr(), recipe) if caching else None
        cached = self._weight_cache
        hit = (caching and cached is not None and cached[0] == key and (cached[2] is not None or not need_transposed)
               and (cached[3] or not record))  # a training forward needs a cast whose amax was recorded
        if hit:
            if record and recipe.uses_delayed_scaling and self.delayed_state is not None:
                # every forward records the weight's amax, cached or not (and compiled code, which
                # holds no cache, does the same): the history spans the same steps either way
                self.delayed_state.record("weight", self.delayed_state.last("weight"))
            return cached[1], cached[2]
        w = weight.detach()
        qw, qw_t = cast_pair(w, recipe.fprop.rhs, recipe.dgrad.rhs if need_transposed else None,
                             self.delayed_state, "weight", record)
        if caching:
            self._weight_cache = (key, qw, qw_t, record)
        return qw, qw_t

    def defers_weight_t(self, recipe: R.Recipe) -> bool:
        """Whether backward casts weight.T itself rather than keeping forward's cast: outside
        :func:`cached_weight_casts`, for a deterministic cast (see [Note: what backward keeps] in
        ``lowprec.nn.function``)."""
        c = recipe.dgrad.rhs
        return not self._caching and c.quantized and c.rounding == "nearest"

    @property
    def _caching(self) -> bool:
        """Inside :func:`cached_weight_casts`, in eager code (a compiled graph holds no cache)."""
        return self._cache_depth > 0 and not torch.compiler.is_compiling()

    def clear_cache(self) -> None:
        """Drop the cached weight casts (see :func:`cached_weight_casts`)."""
        self._weight_cache = None

    # ---- state ----------------------------------------------------------------------------

    def get_extra_state(self):
        state = self.delayed_state
        # nothing recorded yet (a fresh layer): no entry, so the state_dict loads into nn.Linear
        return state.to_tensor() if state is not None and any(state.recorded) else None

    def set_extra_state(self, state) -> None:
        if state is None:
            return
        recipe = self.recipe
        if recipe is None or not recipe.uses_delayed_scaling:
            return  # saved under a delayed recipe, loaded under another: nothing to restore
        self.delayed_state = DelayedState(recipe.delayed, self.weight.device)
        self.delayed_state.load_tensor(state, f"Linear({self.in_features}, {self.out_features})")

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys,
                              unexpected_keys, error_msgs):
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys,
                                      unexpected_keys, error_msgs)
        key = prefix + "_extra_state"
        if key in missing_keys:  # never required: a missing history starts from current scaling
            missing_keys.remove(key)
        self._weight_cache = None

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
        m._cache_depth += 1
    try:
        yield model
    finally:
        for m in layers:
            m._cache_depth -= 1
            if m._cache_depth == 0:
                m._weight_cache = None


def _drop_empty_extra_state(module, state_dict, prefix, local_metadata) -> None:
    # A Linear without delayed state writes no extra-state entry, so its state_dict has exactly
    # torch.nn.Linear's keys and loads into a plain model.
    key = prefix + "_extra_state"
    if key in state_dict and state_dict[key] is None:
        del state_dict[key]
