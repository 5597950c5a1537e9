"""Loss scaling: multiply the loss before backward so small gradients survive FP16 (or FP8).

[Note: loss-scale dynamics]
The rules are those of ``torch.amp.GradScaler``, so a run moved from it behaves the same:

* a step whose gradients hold inf or NaN multiplies the scale by ``backoff_factor`` and restarts
  the count of good steps;
* a step with finite gradients adds one to the count; when it reaches ``growth_interval`` the scale
  is multiplied by ``growth_factor`` (unless that would overflow float32) and the count restarts.

The scale is held as a float32 value (GradScaler keeps a float32 tensor) but on the host, so
scaling and unscaling need no device synchronisation of their own. Products are formed in float64
and rounded to float32 once, as GradScaler's kernel does, so the two give the same scales even
for growth and backoff factors that are not powers of two.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from lowprec._checks import check_positive_int, describe, fail


def _f32(x: float) -> float:
    """``x`` rounded to float32 (inf beyond its range, which ``update`` then refuses)."""
    with np.errstate(over="ignore"):
        return float(np.float32(x))


def _check_positive_float(name: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not (0 < value < math.inf):
        fail(name, "a finite number > 0", describe(value))
    return float(value)


@dataclass(frozen=True, kw_only=True, slots=True)
class LossScaleConfig:
    """How the loss is scaled. The defaults are ``torch.amp.GradScaler``'s."""

    init_scale: float = 2.0**16
    """The scale of the first step."""
    dynamic: bool = True
    """Grow and back off the scale; ``False`` keeps ``init_scale`` for the whole run (a static scale)."""
    growth_factor: float = 2.0
    """Multiplies the scale after ``growth_interval`` consecutive steps with finite gradients."""
    backoff_factor: float = 0.5
    """Multiplies the scale after a step with non-finite gradients."""
    growth_interval: int = 2000
    """Consecutive steps with finite gradients before the scale grows."""

    def __post_init__(self) -> None:
        _check_positive_float("init_scale", self.init_scale)
        if not isinstance(self.dynamic, bool):
            fail("dynamic", "a bool", describe(self.dynamic), TypeError)
        if _check_positive_float("growth_factor", self.growth_factor) <= 1.0:
            fail("growth_factor", "a number > 1", describe(self.growth_factor))
        if not 0.0 < _check_positive_float("backoff_factor", self.backoff_factor) < 1.0:
            fail("backoff_factor", "a number in (0, 1)", describe(self.backoff_factor))
        check_positive_int("growth_interval", self.growth_interval)

    @staticmethod
    def parse(loss_scale: Any) -> LossScaleConfig | None:
        """``None`` (no scaling), ``"dynamic"``, a number (a static scale) or a config, as a config."""
        if loss_scale is None or isinstance(loss_scale, LossScaleConfig):
            return loss_scale
        if loss_scale == "dynamic":
            return LossScaleConfig()
        if isinstance(loss_scale, (int, float)) and not isinstance(loss_scale, bool):
            _check_positive_float("loss_scale", loss_scale)
            return LossScaleConfig(init_scale=float(loss_scale), dynamic=False)
        fail("loss_scale", "None, 'dynamic', a number > 0 or a LossScaleConfig", describe(loss_scale))


class LossScaler:
    """The current loss scale and the count of good steps since it last changed."""

    def __init__(self, config: LossScaleConfig) -> None:
        if not isinstance(config, LossScaleConfig):
            fail("config", "a LossScaleConfig", describe(config), TypeError)
        self.config = config
        self.scale = _f32(config.init_scale)
        self.growth_tracker = 0

    @property
    def inv_scale(self) -> float:
        """``1 / scale`` rounded to float32, the factor gradients are unscaled by."""
        return _f32(1.0 / self.scale)

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        # float32 first: a float16 loss times 2^16 would overflow before backward even starts
        return loss.float() * self.scale

    def update(self, found_inf: bool) -> None:
        """Adjust the scale after a step whose gradients were (``found_inf``) or were not finite."""
        c = self.config
        if not c.dynamic:
            return
        if found_inf:
            self.scale = _f32(self.scale * c.backoff_factor)
            self.growth_tracker = 0
            return
        self.growth_tracker += 1
        if self.growth_tracker == c.growth_interval:
            grown = _f32(self.scale * c.growth_factor)
            if math.isfinite(grown):
                self.scale = grown
            self.growth_tracker = 0

    def state_dict(self) -> dict[str, Any]:
        return {"scale": self.scale, "growth_tracker": self.growth_tracker}

    def load_state_dict(self, state: Any) -> None:
        if not isinstance(state, dict) or set(state) != {"scale", "growth_tracker"}:
            fail("state_dict['loss_scale']", "a dict with keys 'scale' and 'growth_tracker'", describe(state))
        self.scale = _f32(_check_positive_float("state_dict['loss_scale']['scale']", state["scale"]))
        tracker = state["growth_tracker"]
        if isinstance(tracker, bool) or not isinstance(tracker, int) or tracker < 0:
            fail("state_dict['loss_scale']['growth_tracker']", "an int >= 0", describe(tracker))
        self.growth_tracker = tracker
