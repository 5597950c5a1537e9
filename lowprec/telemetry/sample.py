"""Sampling from Python: :func:`sample` around one step of any converted model, and :class:`Telemetry`
that says which steps of a run are sampled.

::

    with lowprec.telemetry.sample(model, step=step) as t:
        loss = loss_fn(model(x), y)
        loss.backward()
    t.records  # list[OperandStats], one per layer x GEMM x operand

A compiled model runs eagerly inside the region (see [Note: telemetry under torch.compile] in
``lowprec.telemetry.collect``); outside it nothing is computed and nothing is read.
"""
from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator
from dataclasses import dataclass, field

from torch import nn

from lowprec._checks import describe, fail
from lowprec.nn.casts import CastState
from lowprec.telemetry.collect import Collector, collecting
from lowprec.telemetry.experts import expert_name
from lowprec.telemetry.stats import OperandStats

_WRAPPERS = ("_orig_mod.", "module.", "_checkpoint_wrapped_module.")
"""Prefixes that wrappers (torch.compile, DDP, activation checkpointing) add to a layer's name."""


def layer_names(model: nn.Module) -> dict[int, str]:
    """id of each converted layer's cast state -> its name in ``model``, without wrappers' prefixes."""
    if not isinstance(model, nn.Module):
        fail("model", "a torch.nn.Module", describe(model), TypeError)
    names = {}
    for name, m in model.named_modules():
        state = getattr(m, "state", None)
        if isinstance(state, CastState):
            for prefix in _WRAPPERS:
                name = name.replace(prefix, "")
            names.setdefault(id(state), name)
            # a GroupedLinear's experts, each under its own name (see [Note: telemetry per expert])
            for e, expert in enumerate(getattr(m, "expert_states", ())):
                names.setdefault(id(expert), expert_name(name, e))
    return names


@dataclass(slots=True)
class Sample:
    """What a sampled region collected; ``records`` is filled when the region ends."""

    step: int
    records: list[OperandStats] = field(default_factory=list)


@contextlib.contextmanager
def sample(model: nn.Module, step: int = 0) -> Iterator[Sample]:
    """Collect the :class:`~lowprec.telemetry.OperandStats` of every cast the converted layers of
    ``model`` make in the region (forward and backward), labelled with ``step``. Their figures are
    computed as the casts are made, without host syncs, and read back once when the region ends."""
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        fail("step", "a non-negative int", describe(step))
    collector = Collector(layer_names(model), step)
    result = Sample(step)
    with collecting(collector):
        yield result
    result.records = collector.finish()


@dataclass(frozen=True, slots=True)
class Telemetry:
    """Which steps of a run are sampled: every ``every``-th (0: none)."""

    every: int = 100
    """Sample step ``s`` when ``s % every == 0``. The default keeps the cost under 3% of the step time:
    a sampled step costs a few eager steps (docs/telemetry.md has the measurements)."""

    def __post_init__(self) -> None:
        if isinstance(self.every, bool) or not isinstance(self.every, int) or self.every < 0:
            fail("every", "a non-negative int (0: off)", describe(self.every))

    def due(self, step: int) -> bool:
        return self.every > 0 and step % self.every == 0

    def region(self, model: nn.Module, step: int) -> contextlib.AbstractContextManager[Sample | None]:
        """:func:`sample` on a due step; a region that does nothing (and yields None) on the others."""
        return sample(model, step) if self.due(step) else contextlib.nullcontext(None)


class NothingToSample(UserWarning):
    """Telemetry is on but no layer of the model makes a low-precision cast: nothing will be sampled."""


def nothing_to_sample(model: nn.Module) -> str | None:
    """Why sampling ``model`` would record nothing (no converted layer runs its recipe's casts), or None."""
    plans = [m.plan() for m in model.modules() if isinstance(getattr(m, "state", None), CastState)]
    if any(p is not None and p.scaled for p in plans):
        return None
    if not plans:
        return "no linear was converted (the policy kept every one in high precision)"
    reasons = [p.hp_reason for p in plans if p is not None and p.hp_reason is not None]
    if not reasons:
        return "the recipe casts nothing to low precision"
    return f"all {len(plans)} converted linear(s) run in high precision here (the first: {reasons[0]})"


def warn_nothing_to_sample(model: nn.Module, telemetry: Telemetry, scaled: bool) -> None:
    """A :class:`NothingToSample` warning, said once at a run's start, when ``telemetry`` samples steps of
    ``model`` under a recipe that casts to low precision (``scaled``: the recipe's ``low_precision``) but no
    layer casts anything (so no figures and no ``telemetry.csv`` will come). A BF16 or FP16 run has nothing
    to sample by design: it is not warned about (``lowprec inspect`` says why its run has no telemetry)."""
    if telemetry.every == 0 or not scaled:
        return
    why = nothing_to_sample(model)
    if why is not None:
        warnings.warn(f"lowprec: telemetry has nothing to sample, so no telemetry.csv will be written: {why}",
                      NothingToSample, stacklevel=3)
