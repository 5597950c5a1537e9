"""Automatic precision control: layers (or one of their GEMMs) moved to a wider recipe when their
numerics go wrong, and back when they settle; the last steps of a run in BF16 on a schedule.

[Note: how the controller decides]
Each converted layer's three GEMMs (``fprop``, ``dgrad``, ``wgrad``) have a *level* on a ladder of
recipes, 0 being the run's recipe and each level up a wider one (``nvfp4``/``mxfp4`` -> ``mxfp8`` ->
``bf16``, ``fp8-*`` -> ``bf16``; derived from the recipes' formats, so a user's recipe has one too: see
[Note: the ladder] in ``lowprec.telemetry.ladder``). A layer runs, for each GEMM, that GEMM's casts from the
recipe of its level (:func:`mixed_recipe`). At a sampled step the telemetry's records (one per layer,
GEMM and operand: SQNR, saturated and flushed-to-zero fractions) are reduced to the worst figure per
layer and GEMM, over operands and over ranks (one all-reduce, so every rank switches alike), then:

* *trouble* (SQNR under ``sqnr_floor_db``, saturation over ``saturation_ceiling`` or underflow over
  ``underflow_ceiling``): the GEMM goes one level up, and its hold starts;
* *unsettled* (not trouble, but within the hysteresis band: SQNR under ``floor + hysteresis_db``, or
  saturation or underflow over half their ceilings): the hold starts again;
* at a sampled step, a GEMM above level 0 whose last unsettled step is ``settle_steps * 2^(strikes - 1)``
  steps past goes one level down (``strikes``: how often it was widened). A fault that returns each time
  the GEMM goes back down is thus retried ever more rarely rather than flapping. Only a sampled step lets
  a GEMM back: between samples nothing says it settled (with ``telemetry_every`` above ``settle_steps``
  the hold would otherwise end before any figure was seen).

``spikes_to_widen`` loss spikes within ``spike_window`` steps move every converted GEMM of the model one
level up (a spike names no layer), held and released as above. With ``hp_final_fraction`` the last
steps run every converted layer in BF16, whatever the levels say. Every change is a :class:`Switch`,
kept in the controller's state, which a checkpoint saves: a resumed run restores the levels before
the model's state (a layer's delayed-scaling history loads under the recipe it ran) and makes the same
choices from there. A layer whose recipe changes starts a fresh delayed-scaling history, since the old
one was recorded for other casts (see ``lowprec.nn.linear.Linear.set_recipe``).
"""
from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field, replace
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from lowprec import recipes as R
from lowprec._checks import check_positive_int, describe, fail
from lowprec.nn import Linear
from lowprec.ranks import agree
from lowprec.telemetry.ladder import ladder

GEMMS = R.GEMMS
FINAL_RECIPE = "bf16"
"""What the last ``hp_final_fraction`` of the steps run in (the NVFP4 paper's appendix)."""
SWITCH_FIELDS = ("step", "layer", "gemm", "from_recipe", "to_recipe", "reason")


@dataclass(frozen=True, slots=True, kw_only=True)
class ControlConfig:
    """When the controller widens a GEMM and when it lets it back (see [Note: how the controller decides])."""

    auto: bool = False
    """Widen on telemetry and loss spikes; off by default (``hp_final_fraction`` works without it)."""
    sqnr_floor_db: float = 8.0
    """A quantized operand with a lower SQNR (dB) is trouble. FP4 casts of Gaussian data give about 13-18 dB."""
    saturation_ceiling: float = 1e-3
    """A larger fraction of an operand's elements clipped by its scale is trouble."""
    underflow_ceiling: float = 0.5
    """A larger fraction of an operand's non-zero elements flushed to zero is trouble."""
    hysteresis_db: float = 3.0
    """A GEMM settles only when its SQNR is this much above the floor (and its fractions under half their ceilings)."""
    settle_steps: int = 20
    """Steps a widened GEMM must stay settled before it goes one level down (doubled at each new strike)."""
    spikes_to_widen: int = 3
    """This many loss spikes within ``spike_window`` steps widen every converted GEMM one level."""
    spike_window: int = 50
    hp_final_fraction: float = 0.0
    """The last this fraction of the steps run every converted layer in BF16 (0: none)."""

    def __post_init__(self) -> None:
        if not isinstance(self.auto, bool):
            fail("auto", "a bool", describe(self.auto), TypeError)
        for name in ("sqnr_floor_db", "hysteresis_db", "saturation_ceiling", "underflow_ceiling"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0:
                fail(name, "a finite number >= 0", describe(v))
        for name in ("settle_steps", "spikes_to_widen", "spike_window"):
            check_positive_int(name, getattr(self, name))
        f = self.hp_final_fraction
        if isinstance(f, bool) or not isinstance(f, (int, float)) or not 0 <= f < 1:
            fail("hp_final_fraction", "a fraction in [0, 1)", describe(f))

    @property
    def enabled(self) -> bool:
        return self.auto or self.hp_final_fraction > 0


@dataclass(frozen=True, slots=True)
class Switch:
    """One change of one layer's GEMM (``gemm`` "all" for every GEMM of the layer)."""

    step: int
    layer: str
    gemm: str
    from_recipe: str
    to_recipe: str
    reason: str


def _name(x: Any) -> str:
    """A role or GEMM given as a string or an enum, lower-case."""
    return (x if isinstance(x, str) else getattr(x, "name", str(x))).lower()


def mixed_recipe(base: R.Recipe, per_gemm: dict[str, R.Recipe]) -> R.Recipe:
    """``base`` with each GEMM named in ``per_gemm`` taken from that recipe; named after what changed."""
    if not per_gemm:
        return base
    names = {g: r.name for g, r in per_gemm.items() if r.name != base.name}
    if not names:
        return base
    if set(names) == set(GEMMS) and len(set(names.values())) == 1:
        return per_gemm["fprop"]
    gemms = {g: getattr(per_gemm.get(g, base), g) for g in GEMMS}
    label = base.name + "".join(f"+{g}:{n}" for g, n in sorted(names.items()))
    return replace(base, name=label, **gemms)


@dataclass
class _Gemm:
    """One layer's GEMM: its level, how often it was widened, the last step it was not settled."""

    level: int = 0
    strikes: int = 0
    unsettled_at: int = 0


@dataclass
class PrecisionController:
    """Moves converted layers' GEMMs along the recipe's ladder; see [Note: how the controller decides].

    ``model``: the converted model (unwrapped); ``total_steps``: the run's last step (the schedule's end);
    ``group``: the data-parallel group the figures are reduced over (None: one process)."""

    model: nn.Module
    recipe: R.Recipe
    config: ControlConfig
    total_steps: int
    group: Any = None
    switches: list[Switch] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.layers = {n: m for n, m in self.model.named_modules()
                       if isinstance(m, Linear) and m.recipe is not None and m.plan() is not None
                       and m.plan().scaled}
        """The layers the controller may move: those running the run's scaled recipe."""
        self.ladder = ladder(self.recipe)
        self.gemms = {(n, g): _Gemm() for n in self.layers for g in GEMMS}
        self.spike_steps: list[int] = []
        self.final = False

    # ---- decisions ------------------------------------------------------------------------

    def before_step(self, step: int) -> list[Switch]:
        """The schedule: from the first of the last ``hp_final_fraction`` steps, every layer in BF16."""
        frac = self.config.hp_final_fraction
        final = frac > 0 and step > self.total_steps - round(frac * self.total_steps)
        if final == self.final:
            return []
        self.final = final
        out = [Switch(step, n, "all", self._recipe_of(n).name if final else FINAL_RECIPE,
                      FINAL_RECIPE if final else self._recipe_of(n).name, "schedule") for n in self.layers]
        return self._record(out)

    def observe(self, step: int, records: Iterable[Any] | None, spike: bool = False) -> list[Switch]:
        """After step ``step``: its telemetry ``records`` (None on an unsampled step) and whether its
        loss was a spike (the same on every rank); returns the switches made."""
        if not self.config.auto or self.final:  # the schedule's BF16 steps are not judged
            return []
        out: list[Switch] = []
        if records is not None:
            for key, (sqnr, sat, under) in self._worst(records).items():
                out += self._judge(step, key, sqnr, sat, under)
        if spike:
            self.spike_steps = [s for s in self.spike_steps if s > step - self.config.spike_window] + [step]
            if len(self.spike_steps) >= self.config.spikes_to_widen:
                self.spike_steps = []
                out += [s for key in self.gemms for s in self._move(step, key, +1, "loss spikes")]
        if records is None:  # a GEMM goes back down on a sampled step's evidence only, not on elapsed time
            return self._record(out)
        for key, g in self.gemms.items():
            hold = self.config.settle_steps * 2 ** max(g.strikes - 1, 0)
            if g.level > 0 and step - g.unsettled_at >= hold:
                out += self._move(step, key, -1, f"settled for {step - g.unsettled_at} steps")
        return self._record(out)

    def _worst(self, records: Iterable[Any]) -> dict[tuple[str, str], tuple[float, float, float]]:
        """Per (layer, GEMM) the lowest SQNR and largest saturation and underflow over operands and ranks."""
        worst: dict[tuple[str, str], list[float]] = {}
        for r in records:
            key = (r.layer, _name(r.gemm))
            if key not in self.gemms:
                continue
            sqnr = r.sqnr_db if r.sqnr_db is not None and not math.isnan(r.sqnr_db) else math.inf
            w = worst.setdefault(key, [-math.inf, 0.0, 0.0])
            w[0], w[1], w[2] = max(w[0], -sqnr), max(w[1], r.saturation), max(w[2], r.underflow)
        keys = sorted(worst)
        if not keys:
            return {}
        # one collective: MAX of (-sqnr, saturation, underflow) per key; every rank samples the same keys
        flat = agree([v for k in keys for v in worst[k]], self.group, op=dist.ReduceOp.MAX,
                     device=torch.device("cpu") if self.group is None else None).tolist()
        return {k: (-flat[3 * i], flat[3 * i + 1], flat[3 * i + 2]) for i, k in enumerate(keys)}

    def _judge(self, step: int, key: tuple[str, str], sqnr: float, sat: float, under: float) -> list[Switch]:
        c = self.config
        trouble = []
        if sqnr < c.sqnr_floor_db:
            trouble.append(f"SQNR {sqnr:.1f} dB < {c.sqnr_floor_db:g}")
        if sat > c.saturation_ceiling:
            trouble.append(f"saturation {sat:.2e} > {c.saturation_ceiling:g}")
        if under > c.underflow_ceiling:
            trouble.append(f"underflow {under:.2e} > {c.underflow_ceiling:g}")
        band = (sqnr < c.sqnr_floor_db + c.hysteresis_db or sat > c.saturation_ceiling / 2
                or under > c.underflow_ceiling / 2)
        if trouble or band:
            self.gemms[key].unsettled_at = step
        return self._move(step, key, +1, ", ".join(trouble)) if trouble else []

    def _move(self, step: int, key: tuple[str, str], by: int, reason: str) -> list[Switch]:
        g = self.gemms[key]
        level = g.level + by
        if not 0 <= level < len(self.ladder):
            return []
        before = self.ladder[g.level].name
        g.level = level
        if by > 0:
            g.strikes += 1
            g.unsettled_at = step
        return [Switch(step, key[0], key[1], before, self.ladder[level].name, reason)]

    # ---- the model ------------------------------------------------------------------------

    def _recipe_of(self, layer: str) -> R.Recipe:
        per_gemm = {g: self.ladder[self.gemms[(layer, g)].level] for g in GEMMS}
        return mixed_recipe(self.recipe, per_gemm)

    def _record(self, switches: list[Switch]) -> list[Switch]:
        if switches:
            self.switches += switches
            self.apply({s.layer for s in switches})
        return switches

    def apply(self, names: Iterable[str] | None = None) -> None:
        """Bind each layer (of ``names``, default all) to the recipe its levels (or the schedule) say."""
        for name in self.layers if names is None else names:
            layer = self.layers[name]
            recipe = R.get(FINAL_RECIPE) if self.final else self._recipe_of(name)
            if layer.recipe == recipe:
                continue
            layer.state.delayed = None  # recorded for other casts: the new recipe starts its own
            layer.set_recipe(recipe, policy_reason=layer.policy_reason, min_features=layer.min_features,
                             share=layer.state.share, recast_input=layer.recast_input)

    def levels(self) -> dict[str, str]:
        """Each moved layer's recipe now (layers at the run's recipe are left out)."""
        out = {n: (FINAL_RECIPE if self.final else self._recipe_of(n).name) for n in self.layers}
        return {n: r for n, r in out.items() if r != self.recipe.name}

    # ---- checkpoints ----------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        return {"gemms": {f"{n}|{g}": [s.level, s.strikes, s.unsettled_at]
                          for (n, g), s in self.gemms.items() if s.level or s.strikes},
                "spike_steps": list(self.spike_steps), "final": self.final,
                "switches": [asdict(s) for s in self.switches]}

    def load_state_dict(self, state: Any) -> None:
        """Restore the levels and history, and bind the layers (before their state is loaded)."""
        try:
            gemms = {tuple(k.split("|")): _Gemm(*map(int, v)) for k, v in state["gemms"].items()}
            switches = [Switch(**s) for s in state["switches"]]
            spikes, final = [int(s) for s in state["spike_steps"]], bool(state["final"])
        except (KeyError, TypeError, ValueError, AttributeError) as e:
            fail("state_dict['control']", "a precision controller's state", repr(e))
        unknown = [k for k in gemms if k not in self.gemms]
        if unknown:
            fail("state_dict['control']", "levels of this model's converted layers", f"{unknown[0]} unknown")
        for g in gemms.values():
            if g.level >= len(self.ladder):
                fail("state_dict['control']", f"levels below {len(self.ladder)} for {self.recipe.name}", g.level)
        self.gemms = {k: gemms.get(k, _Gemm()) for k in self.gemms}
        self.switches, self.spike_steps, self.final = switches, spikes, final
        self.apply()
