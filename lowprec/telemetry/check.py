"""Forward-only validation of a recipe on a model before training: each converted layer's output
against the same layer in BF16, fed the same input.

[Note: what the check measures]
The model is converted twice, to the recipe and to ``bf16`` (the baseline every recipe is judged
against), with the same policy and weights: the policy a quality question converts with
(:func:`lowprec.policy.quality_policy`: small layers too, on every device, unless the policy sets
``skip_small``), and both run in evaluation mode (every cast rounded to
nearest). For each batch, the converted model runs; every converted layer's input and output are
caught by a forward hook, and the BF16 model's layer of the same name is run on that same input (a
``GroupedLinear`` of MoE experts with the same offsets: one figure for all its experts' outputs). So
a layer's figure is the error of its own casts, not the error the layers before it passed on:

    SQNR (dB) = 10 log10( sum ref^2 / sum (ref - out)^2 )   over every batch, in float64

with ``ref`` the BF16 layer's output and ``out`` the converted one's. The whole models are also run
each on the batch alone: the final logits' SQNR and the difference of their cross-entropy losses
say what the errors add up to. Layers under ``floor_db`` are flagged; the suggested policy is the
policy given (or the default one, which keeps small layers in BF16 where the recipe runs natively, for
speed) with the flagged layers excluded (kept in high precision).
"""
from __future__ import annotations

import copy
import math
from collections.abc import Iterable
from dataclasses import dataclass, field, replace
from typing import Any

import torch
import torch.nn.functional as nnf
from torch import nn

from lowprec import recipes as R
from lowprec._checks import describe, fail
from lowprec._table import format_table
from lowprec.convert import Coverage, convert
from lowprec.nn import GroupedLinear, Linear
from lowprec.policy import Policy, quality_policy

DEFAULT_FLOOR_DB = 10.0
"""A layer whose output SQNR is under this is flagged: about three bits of agreement. FP8 layers give
25-35 dB, MXFP8 20-30, FP4 recipes 10-18 on the tiny model."""


@dataclass(frozen=True, slots=True)
class LayerCheck:
    name: str
    shape: str
    sqnr_db: float
    """Output SQNR against the BF16 layer fed the same input, over every batch."""
    flagged: bool


@dataclass
class CheckReport:
    """What :func:`check` found; ``str(report)`` prints the table."""

    recipe: str
    floor_db: float
    batches: int
    layers: list[LayerCheck] = field(default_factory=list)
    logits_sqnr_db: float = math.nan
    loss_bf16: float = math.nan
    loss_recipe: float = math.nan
    policy: Policy = field(default_factory=Policy)
    """The suggested policy: the one given (or the default), with the flagged layers excluded."""
    coverage: Coverage | None = None
    """How many linears ran the recipe in the check."""

    @property
    def flagged(self) -> list[str]:
        return [lc.name for lc in self.layers if lc.flagged]

    def to_table(self) -> str:
        rows = [(lc.name, lc.shape, f"{lc.sqnr_db:.1f}", "FLAGGED" if lc.flagged else "")
                for lc in sorted(self.layers, key=lambda lc: lc.sqnr_db)]
        return format_table(["layer", "shape", "output SQNR (dB)", f"under {self.floor_db:g} dB"], rows)

    def summary(self) -> str:
        ran = f"{self.coverage}; " if self.coverage is not None else ""
        return (f"recipe {self.recipe} on {self.batches} batch(es): {ran}{len(self.flagged)} of {len(self.layers)} "
                f"converted layers under {self.floor_db:g} dB; logits SQNR {self.logits_sqnr_db:.1f} dB; loss "
                f"{self.loss_recipe:.4f} against {self.loss_bf16:.4f} in bf16 "
                f"({self.loss_recipe - self.loss_bf16:+.4f})")

    def __str__(self) -> str:
        excluded = ", ".join(self.flagged) if self.flagged else "none"
        return f"{self.to_table()}\n\n{self.summary()}\nsuggested policy: exclude {excluded}"


class _Energy:
    """Sums of ``ref^2`` and ``(ref - out)^2`` in float64, across batches."""

    def __init__(self) -> None:
        self.signal = 0.0
        self.noise = 0.0

    def add(self, ref: torch.Tensor, out: torch.Tensor) -> None:
        ref64, out64 = ref.detach().double(), out.detach().double()
        self.signal += ref64.square().sum().item()
        self.noise += (ref64 - out64).square().sum().item()

    @property
    def sqnr_db(self) -> float:
        if self.noise == 0.0:
            return math.inf
        if self.signal == 0.0:
            return -math.inf
        return 10.0 * math.log10(self.signal / self.noise)


def _scaled_layers(model: nn.Module) -> dict[str, Linear | GroupedLinear]:
    """The layers that run the recipe's scaled casts (not those the policy or their shape keep): linears,
    and MoE experts (a ``GroupedLinear``, measured whole: all its experts' outputs together)."""
    return {n: m for n, m in model.named_modules()
            if isinstance(m, (Linear, GroupedLinear)) and m.plan() is not None and m.plan().scaled}


def _shape(m: Linear | GroupedLinear) -> str:
    shape = f"{m.in_features}x{m.out_features}"
    return f"{m.num_experts} experts x {shape}" if isinstance(m, GroupedLinear) else shape


def _pair(batch: Any, i: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Batch ``i`` as ``(tokens, targets)``: two integer tensors of one shape. A bare tensor of tokens would
    otherwise unpack along its first dimension, and a batch of two rows be taken for a pair."""
    if (not isinstance(batch, (tuple, list)) or len(batch) != 2
            or not all(isinstance(t, torch.Tensor) and not t.is_floating_point() for t in batch)
            or batch[0].shape != batch[1].shape):
        fail(f"batches[{i}]", "a pair (tokens, targets) of integer tensors of one shape (B, T)",
             describe(batch) if not isinstance(batch, (tuple, list))
             else f"a {type(batch).__name__} of " + ", ".join(describe(t) for t in batch), TypeError)
    return batch[0], batch[1]


@torch.no_grad()
def check(model: nn.Module, recipe: str | R.Recipe, batches: Iterable[tuple[torch.Tensor, torch.Tensor]], *,
          policy: Policy | None = None, floor_db: float = DEFAULT_FLOOR_DB) -> CheckReport:
    """Validate ``recipe`` on ``model`` (high precision, unconverted; left as it is) on ``batches`` of
    ``(tokens, targets)``: see [Note: what the check measures]."""
    if not isinstance(model, nn.Module):
        fail("model", "a torch.nn.Module", describe(model), TypeError)
    if isinstance(floor_db, bool) or not isinstance(floor_db, (int, float)) or not math.isfinite(floor_db):
        fail("floor_db", "a finite number of dB", describe(floor_db))
    recipe = R.get(recipe)
    policy = policy if policy is not None else Policy()
    measured = quality_policy(policy)
    lp, ref = copy.deepcopy(model).eval(), copy.deepcopy(model).eval()
    coverage = convert(lp, recipe, measured).coverage()
    convert(ref, "bf16", measured)
    layers = _scaled_layers(lp)
    ref_layers = dict(ref.named_modules())
    energy = {n: _Energy() for n in layers}
    logits_energy, losses, n_batches = _Energy(), [0.0, 0.0], 0

    def hook(name):
        def fn(module, args, out):
            energy[name].add(ref_layers[name](*args), out)  # a GroupedLinear's offsets too
        return fn

    handles = [m.register_forward_hook(hook(n)) for n, m in layers.items()]
    try:
        for batch in batches:
            tokens, targets = _pair(batch, n_batches)
            n_batches += 1
            out = lp(tokens)  # (B, T, vocab); the hooks compare every layer on the way
            want = ref(tokens)
            logits_energy.add(want, out)
            for i, logits in enumerate((want, out)):
                losses[i] += nnf.cross_entropy(logits.float().flatten(0, 1), targets.flatten()).item()
    finally:
        for h in handles:
            h.remove()
    if n_batches == 0:
        fail("batches", "at least one (tokens, targets) batch", "none")
    checks = [LayerCheck(n, _shape(m), energy[n].sqnr_db, energy[n].sqnr_db < floor_db) for n, m in layers.items()]
    flagged = tuple(c.name for c in checks if c.flagged)
    return CheckReport(recipe=recipe.name, floor_db=float(floor_db), batches=n_batches, layers=checks,
                       logits_sqnr_db=logits_energy.sqnr_db, loss_bf16=losses[0] / n_batches,
                       loss_recipe=losses[1] / n_batches, policy=suggested_policy(policy, flagged),
                       coverage=coverage)


def suggested_policy(policy: Policy, flagged: tuple[str, ...]) -> Policy:
    """``policy`` with ``flagged`` layers excluded as well (by name; a predicate exclude is kept and
    widened with the names)."""
    if not flagged:
        return policy
    old = policy.exclude
    if old is None:
        return replace(policy, exclude=flagged)
    if isinstance(old, tuple):
        return replace(policy, exclude=old + tuple(n for n in flagged if n not in old))
    names = set(flagged)
    return replace(policy, exclude=lambda name, module: name in names or old(name, module))
