"""``convert(model, recipe, policy)``: swap a model's linears for ``lowprec.nn.Linear`` and report."""
from __future__ import annotations

import enum
import json
import math
import warnings
from dataclasses import asdict, dataclass, field

import torch
import torch.nn as nn

from lowprec import recipes as R
from lowprec._checks import describe, fail
from lowprec._table import format_table
from lowprec.kernels import capability, gemm_path
from lowprec.nn import Linear, RMSNorm, SwiGLU
from lowprec.nn.casts import InputShare
from lowprec.nn.fp8_weight import check_fp8_weights, store_fp8
from lowprec.nn.plan import fallback_reason, layer_plan
from lowprec.policy import Policy, UnmatchedPatternWarning, find_blocks, policy_reason, share_groups, unmatched_patterns


class Kept(str, enum.Enum):
    """Why a linear stays in high precision, by what would change it."""

    POLICY = "policy"
    """The policy keeps it (head, router, kept blocks, include/exclude, ``skip_small=True``)."""
    SMALL = "small"
    """Too small to gain where the recipe runs natively (``Policy.skip_small`` None)."""
    SHAPE = "shape"
    """A shape the recipe's GEMMs cannot take."""


@dataclass(frozen=True, slots=True)
class LayerReport:
    name: str
    in_features: int
    out_features: int
    converted: bool
    """True when the layer runs the recipe's low-precision GEMMs."""
    reason: str
    """What it became, or why it stays in high precision."""
    params: int = 0
    """The layer's parameters (weight and bias)."""
    kept: Kept | None = None
    """Why it stays in high precision; None when converted."""


@dataclass(frozen=True, slots=True)
class Coverage:
    """How much of a model's linears run the recipe: what a verdict on the recipe rests on."""

    converted: int
    linears: int
    converted_params: int
    params: int
    """Parameters of every linear (weights and biases)."""
    kept: tuple[tuple[Kept, int], ...] = ()
    """How many linears stay in high precision for each reason, most first."""

    @property
    def fraction(self) -> float:
        """The converted linears' share of the linear parameters; NaN for a model without linears."""
        return self.converted_params / self.params if self.params else math.nan

    @property
    def share(self) -> str:
        """``fraction`` as a percentage rounded down, so that 100% means every parameter and 0% none."""
        if not self.params:
            return "n/a"
        share = f"{math.floor(self.fraction * 100)}%"
        return "<1%" if share == "0%" and self.converted_params else share

    def __str__(self) -> str:
        return f"{self.converted} of {self.linears} linears converted ({self.share} of linear parameters)"

    def to_dict(self) -> dict:
        return {"converted": self.converted, "linears": self.linears, "converted_params": self.converted_params,
                "params": self.params, "fraction": self.fraction if self.params else None,
                "kept": {k.value: n for k, n in self.kept}}


@dataclass
class ConversionReport:
    """Every linear of the model: what it became and why. ``str(report)`` prints the table."""

    recipe: R.Recipe
    device: str
    layers: list[LayerReport] = field(default_factory=list)
    gemm_paths: dict[str, str] = field(default_factory=dict)
    """``fprop``/``dgrad``/``wgrad`` -> ``cublas`` (native), ``emulated`` or ``hp`` on this device."""
    small_elsewhere: list[str] = field(default_factory=list)
    """Converted layers that would run in high precision on a device where the recipe runs natively
    (too small to gain there: see ``Policy.skip_small``); empty where this device is such a one."""
    min_features: int | None = None
    shared_inputs: list[tuple[str, ...]] = field(default_factory=list)
    """Groups of converted layers that read one input and share its casts (``Policy.share_inputs``)."""
    fp8_weights: list[str] = field(default_factory=list)
    """Converted layers whose weight is stored in FP8 (``convert(..., fp8_weights=True)``)."""
    fp8_decoded: list[str] = field(default_factory=list)
    """Of those, the layers whose recipe casts weights to another format: decoded, then cast."""
    saved_activations: list[str] = field(default_factory=list)
    """Norms and SwiGLUs that keep their inputs for backward in FP8 (``Policy.saved_activations``)."""
    activations: str | None = None
    """How they keep them (``e4m3 block1x128``, ...); None: in the model's dtype."""

    @property
    def converted(self) -> list[LayerReport]:
        return [lr for lr in self.layers if lr.converted]

    @property
    def kept(self) -> list[LayerReport]:
        return [lr for lr in self.layers if not lr.converted]

    def coverage(self) -> Coverage:
        """How many linears, and what share of their parameters, run the recipe (the summary's count)."""
        kept: dict[Kept, int] = {}
        for lr in self.kept:
            kept[lr.kept or Kept.POLICY] = kept.get(lr.kept or Kept.POLICY, 0) + 1
        return Coverage(len(self.converted), len(self.layers), sum(lr.params for lr in self.converted),
                        sum(lr.params for lr in self.layers),
                        tuple(sorted(kept.items(), key=lambda kv: -kv[1])))

    def to_table(self, markdown: bool = False) -> str:
        rows = [(lr.name, f"{lr.in_features}x{lr.out_features}", "yes" if lr.converted else "no", lr.reason)
                for lr in self.layers]
        return format_table(["layer", "shape", "low precision", "reason"], rows, markdown=markdown)

    def summary(self) -> str:
        paths = ", ".join(f"{g} {p}" for g, p in self.gemm_paths.items())
        return (f"recipe {self.recipe.name}: {self.coverage()}, {len(self.kept)} kept in high precision; "
                f"GEMMs on {self.device}: {paths}")

    def notes(self) -> list[str]:
        """What the table alone does not say: layers whose precision depends on the device."""
        out = []
        if self.shared_inputs:
            leaves = sorted({"/".join(n.rsplit(".", 1)[-1] for n in g) for g in self.shared_inputs})
            out.append(f"{len(self.shared_inputs)} group(s) of layers share their input's casts ({', '.join(leaves)})")
        if self.saved_activations:
            out.append(f"{len(self.saved_activations)} norm/SwiGLU module(s) save their inputs for backward as "
                       f"{self.activations} (Policy.saved_activations)")
        if self.small_elsewhere:
            out.append(f"{len(self.small_elsewhere)} converted linear(s) have a dimension under {self.min_features}: "
                       f"where {self.recipe.name} runs natively they stay in high precision, too small to gain "
                       "(Policy(skip_small=False) converts them there too)")
        if self.fp8_weights:
            how = (f", {len(self.fp8_decoded)} of them decoded and cast again at each forward"
                   if self.fp8_decoded else ", read by the GEMMs as stored")
            out.append(f"{len(self.fp8_weights)} weight(s) stored in FP8 with their FP32 masters in the optimizer{how}")
        return out

    def to_dict(self) -> dict:
        return {"recipe": self.recipe.name, "device": self.device, "gemm_paths": self.gemm_paths,
                "layers": [asdict(lr) for lr in self.layers], "coverage": self.coverage().to_dict(),
                "small_elsewhere": self.small_elsewhere,
                "shared_inputs": [list(g) for g in self.shared_inputs],
                "fp8_weights": self.fp8_weights, "fp8_decoded": self.fp8_decoded,
                "saved_activations": self.saved_activations, "activations": self.activations}

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2)

    def __str__(self) -> str:
        return "\n".join([self.summary(), *self.notes(), self.to_table()])


def recipe_paths(recipe: R.Recipe, device: torch.device | str | None = None) -> dict[str, str]:
    """For each GEMM: ``cublas`` (native tensor cores), ``emulated`` (exact values, high-precision
    GEMM) or ``hp`` (no low-precision operands), on ``device``."""
    cap = capability(device)
    out = {}
    for name in ("fprop", "dgrad", "wgrad"):
        g: R.Gemm = getattr(recipe, name)
        if not g.low_precision:
            out[name] = "hp"
        else:
            out[name] = gemm_path(g.lhs.format, g.lhs.granularity, g.rhs.format, g.rhs.granularity, cap)
    return out


def _model_device(model: nn.Module) -> torch.device:
    for p in model.parameters():
        return p.device
    return torch.device("cpu")


def _set_module(model: nn.Module, name: str, new: nn.Module) -> None:
    parent_name, _, leaf = name.rpartition(".")
    parent = model.get_submodule(parent_name) if parent_name else model
    setattr(parent, leaf, new)


def convert(model: nn.Module, recipe: str | R.Recipe, policy: Policy | None = None, *,
            fp8_weights: bool = False) -> ConversionReport:
    """Swap every ``nn.Linear`` of ``model`` in place for a ``lowprec.nn.Linear`` bound to ``recipe``
    (sharing its parameters), except those ``policy`` keeps in high precision, and return a report of
    every linear. Layers whose shape the recipe's GEMMs cannot take are converted but run in high
    precision; the report and a warning say so, as they say when GEMMs are emulated on this device.

    ``fp8_weights``: the weights of the layers that run the recipe are stored as E4M3 codes with FP32
    scales and no high-precision copy, their FP32 masters kept by ``lowprec.optim.Optimizer`` alone
    (see [Note: FP8 primary weights] in ``lowprec.nn.fp8_weight``); the model must be BF16 or FP16.
    """
    if not isinstance(model, nn.Module):
        fail("model", "a torch.nn.Module", describe(model), TypeError)
    recipe = R.get(recipe)
    policy = policy if policy is not None else Policy()
    if not isinstance(policy, Policy):
        fail("policy", "a lowprec.Policy or None", describe(policy), TypeError)
    if not isinstance(fp8_weights, bool):
        fail("fp8_weights", "a bool", describe(fp8_weights), TypeError)
    if fp8_weights:
        check_fp8_weights(recipe, model)
    device = _model_device(model)
    report = ConversionReport(recipe, str(device), gemm_paths=recipe_paths(recipe, device),
                              min_features=policy.small_rule)
    embeddings = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
    mha = {id(c) for m in model.modules() if isinstance(m, nn.MultiheadAttention) for c in m.modules()}
    blocks = find_blocks(model)
    linears = [(n, m) for n, m in model.named_modules() if isinstance(m, nn.Linear)]
    if (unmatched := unmatched_patterns(policy, [n for n, _ in linears])) is not None:
        warnings.warn(UnmatchedPatternWarning(f"lowprec: {unmatched}"), stacklevel=2)  # a typo does less than asked
    converted: dict[str, Linear] = {}
    for name, lin in linears:
        reason = policy_reason(policy, name, lin, embeddings=embeddings, mha_children=mha, blocks=blocks,
                               last_fraction=recipe.hp_last_fraction)
        if reason is not None:
            if isinstance(lin, Linear):  # converted before: back to high precision
                lin.set_recipe(None)
            report.layers.append(LayerReport(name, lin.in_features, lin.out_features, False, reason,
                                             _params(lin), Kept.POLICY))
            continue
        new = lin if isinstance(lin, Linear) else Linear.from_linear(lin, None)
        new.set_recipe(recipe, min_features=policy.small_rule, recast_input=policy.recasts_inputs)
        if new is not lin:
            _set_module(model, name, new)
        converted[name] = new
        report.layers.append(_layer_report(name, new, recipe, device, policy))
        if policy.small_rule is not None and recipe.low_precision and report.layers[-1].converted \
                and min(new.in_features, new.out_features) < policy.small_rule:
            report.small_elsewhere.append(name)
    for group in share_groups(policy, list(converted)):
        report.shared_inputs.append(group)
        share = InputShare(group)
        for name in group:
            converted[name].state.share = share
    if fp8_weights:
        _store_fp8(converted, report)
    _bind_activations(model, policy, report)
    _warn(report, converted)
    return report


def _store_fp8(converted: dict[str, Linear], report: ConversionReport) -> None:
    """FP8 weights for the converted layers that run the recipe here; a warning where they are decoded."""
    ran = {lr.name for lr in report.converted}
    for name, lin in converted.items():
        if name in ran:
            report.fp8_weights.append(name)
            if not store_fp8(lin):
                report.fp8_decoded.append(name)
    if report.fp8_decoded:
        warnings.warn(f"lowprec: {len(report.fp8_decoded)} FP8 weight(s) are stored as E4M3 128x128 blocks, which "
                      f"{report.recipe.name} does not cast weights to: each forward decodes them and casts them "
                      "again (two roundings); fp8-current, fp8-delayed and fp8-blockwise read the codes directly",
                      stacklevel=3)


def _bind_activations(model: nn.Module, policy: Policy, report: ConversionReport) -> None:
    """Give every ``lowprec.nn`` norm and SwiGLU the policy's saved-activation format; with one set,
    swap a ``torch.nn.RMSNorm`` over the last dimension for ``lowprec.nn.RMSNorm`` (sharing its weight)."""
    saved = policy.saved_activations
    for name, m in list(model.named_modules()):
        if saved is not None and type(m) is nn.RMSNorm and len(m.normalized_shape) == 1:
            m = RMSNorm.from_torch(m)
            _set_module(model, name, m)
        if isinstance(m, (RMSNorm, SwiGLU)):
            m.saved = saved
            if saved is not None:
                report.saved_activations.append(name)
    report.activations = str(saved) if saved is not None else None


def _layer_report(name: str, lin: Linear, recipe: R.Recipe, device: torch.device, policy: Policy) -> LayerReport:
    """What the layer does on ``device`` and, where the small-layer rule differs elsewhere, there."""
    plan = layer_plan(recipe, device, lin.in_features, lin.out_features, None, policy.small_rule)
    if plan.hp_reason is not None:
        kept = Kept.SHAPE if fallback_reason(lin.in_features, lin.out_features, recipe) else Kept.SMALL
        return LayerReport(name, lin.in_features, lin.out_features, False, f"high precision: {plan.hp_reason}",
                           _params(lin), kept)
    return LayerReport(name, lin.in_features, lin.out_features, True, recipe.name, _params(lin))


def _params(lin: nn.Linear) -> int:
    return lin.in_features * lin.out_features + (lin.out_features if lin.bias is not None else 0)


class SmallLayersWarning(UserWarning):
    """The one warning for the linears kept in high precision as too small to gain from the recipe (where
    it runs natively, or everywhere with ``Policy(skip_small=True)``), with its counts, so that a command
    can say it in its own words (``lowprec train`` names its option)."""

    def __init__(self, message: str, kept: int, linears: int, device: str, recipe: str,
                 min_features: int | None) -> None:
        super().__init__(message)
        self.kept, self.linears, self.device, self.recipe, self.min_features = (
            kept, linears, device, recipe, min_features)


def _warn(report: ConversionReport, converted: dict[str, Linear]) -> None:
    def names(layers):
        return ", ".join(lr.name for lr in layers[:5]) + (" ..." if len(layers) > 5 else "")

    hp = [lr for lr in report.kept if lr.reason.startswith("high precision")]
    # by the device's rule or the policy's; a bf16 or fp16 recipe has nothing to gain
    small = [lr for lr in report.kept if "too small to gain" in lr.reason] if report.recipe.low_precision else []
    shapes = [lr for lr in hp if lr not in small]
    if shapes:
        warnings.warn(f"lowprec: {len(shapes)} linear(s) run in high precision because the {report.recipe.name} "
                      f"GEMMs cannot take their shape: {names(shapes)} (see the conversion report)", stacklevel=3)
    if small:
        warnings.warn(SmallLayersWarning(
            f"lowprec: {len(small)} linear(s) run in high precision on {report.device}, too small to gain from "
            f"{report.recipe.name}: {names(small)} (see the conversion report; Policy(skip_small=False) converts "
            "them)", len(small), len(report.layers), report.device, report.recipe.name, report.min_features),
            stacklevel=3)
    for lr in hp:  # said here once for the model: not again by each layer at its first forward
        plan = converted[lr.name].plan()
        if plan is not None and plan.hp_reason is not None:
            converted[lr.name]._warned.add(plan.hp_reason)
    emulated = [g for g, p in report.gemm_paths.items() if p == "emulated"]
    if emulated and report.converted:
        warnings.warn(f"lowprec: {report.recipe.name} {'/'.join(emulated)} GEMMs are emulated on {report.device} "
                      "(exact quantized values, high-precision GEMMs): the numerics of native hardware, not its speed",
                      stacklevel=3)
