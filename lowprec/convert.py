"""``convert(model, recipe, policy)``: swap a model's linears for ``lowprec.nn.Linear`` and report.

The report itself (what each linear became, the counts, the table and JSON) is
:mod:`lowprec.conversion_report`; its names are importable from here too.
"""
from __future__ import annotations

import warnings

import torch
import torch.nn as nn

from lowprec import recipes as R
from lowprec._checks import describe, fail
from lowprec.conversion_report import ConversionReport, Coverage, Kept, LayerReport, UnseenWeight
from lowprec.convert_grouped import convert_grouped, grouped_layers
from lowprec.kernels import GemmPath
from lowprec.nn import GroupedLinear, Linear, RMSNorm, SwiGLU
from lowprec.nn.casts import InputShare
from lowprec.nn.delayed_bank import bank_layers
from lowprec.nn.fp8_convert import check_fp8_weights, store_fp8
from lowprec.nn.plan import gemm_plan, layer_plan, too_small
from lowprec.policy import Policy, UnmatchedPatternWarning, find_blocks, policy_keeps, share_groups, unmatched_patterns
from lowprec.unseen import UnseenWeightsWarning, find_unseen, warn_unseen

__all__ = ["ConversionReport", "Coverage", "Kept", "LayerReport", "SmallLayersWarning", "UnseenWeight",
           "UnseenWeightsWarning", "convert", "recipe_paths"]


def recipe_paths(recipe: R.Recipe, device: torch.device | str | None = None) -> dict[str, GemmPath]:
    """For each GEMM: ``cublas`` (native tensor cores), ``emulated`` (exact values, high-precision
    GEMM) or ``hp`` (no low-precision operands), on ``device`` (default: the current CUDA device if
    there is one, else the CPU): the paths its layers' plans take."""
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    return {name: gemm_plan(getattr(recipe, name), torch.device(device)).path for name in R.GEMMS}


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
    (sharing its parameters), except those ``policy`` keeps in high precision, bind ``recipe`` to every
    ``lowprec.nn.GroupedLinear`` (experts) likewise (see [Note: converting experts] in
    ``lowprec.convert_grouped``), and return a report of every linear and every group of experts.
    Layers whose shape the recipe's GEMMs cannot take are converted but run in high precision; the
    report and a warning say so, as they say when GEMMs are emulated on this device.
    The fused 3-D experts of the Hugging Face mixtures of experts that ``lowprec.convert_hf_moe`` knows
    (Mixtral, Qwen2/3-MoE, DeepSeek-V3, GPT-OSS) run through ``GroupedLinear`` too. Other matrices used
    other than through an ``nn.Linear`` (experts of a layout lowprec does not know, a module's own
    ``F.linear``) are not converted: the report names them, one warning says so, and its coverage counts
    them (see [Note: weights lowprec cannot see into] in ``lowprec.unseen``).

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
    grouped = grouped_layers(model)
    if (unmatched := unmatched_patterns(policy, [n for n, _ in linears + grouped])) is not None:
        warnings.warn(UnmatchedPatternWarning(f"lowprec: {unmatched}"), stacklevel=2)  # a typo does less than asked
    converted, small = _convert_linears(model, linears, recipe, policy, report, device, embeddings=embeddings,
                                        mha_children=mha, blocks=blocks)
    experts = convert_grouped(model, recipe, policy, blocks, report, device)
    if recipe.uses_delayed_scaling:  # one bank per device, folded once per forward of the model
        bank_layers(model, [*converted.values(), *experts.values()])
    layers = {**converted, **experts}  # experts' projections reading one input share its casts too
    for group in share_groups(policy, list(layers)):
        report.shared_inputs.append(group)
        share = InputShare(group)
        for name in group:
            layers[name].state.share = share
    if fp8_weights:
        _store_fp8(converted, report)
    _bind_activations(model, policy, report)
    report.unseen = find_unseen(model, mha | {id(g) for _, g in grouped})
    _warn(report, {**converted, **experts}, small)
    warn_unseen(report.unseen, report.coverage(), stacklevel=2)
    return report


def _convert_linears(model: nn.Module, linears: list[tuple[str, nn.Linear]], recipe: R.Recipe, policy: Policy,
                     report: ConversionReport, device: torch.device, **where) -> tuple[dict[str, Linear], set[str]]:
    """Bind ``recipe`` to each linear the policy does not keep (swapping an ``nn.Linear`` for a
    ``lowprec.nn.Linear``), each with its report row; ``where``: what ``policy_keeps`` needs of the model.
    Returns the converted layers by name and the names the policy keeps as too small."""
    converted: dict[str, Linear] = {}
    small: set[str] = set()
    for name, lin in linears:
        keep = policy_keeps(policy, name, lin, last_fraction=recipe.hp_last_fraction, **where)
        if keep is not None:
            if isinstance(lin, Linear):  # converted before: back to high precision
                lin.set_recipe(None)
            report.layers.append(LayerReport(name, lin.in_features, lin.out_features, False, keep.reason,
                                             _params(lin), Kept.POLICY))
            if keep.small:
                small.add(name)
            continue
        new = lin if isinstance(lin, Linear) else Linear.from_linear(lin, None)
        new.set_recipe(recipe, min_features=policy.small_rule, recast_input=policy.recasts_inputs)
        if new is not lin:
            _set_module(model, name, new)
        converted[name] = new
        report.layers.append(_layer_report(name, new, recipe, device, policy))
        if policy.small_rule is not None and recipe.low_precision and report.layers[-1].converted \
                and too_small(new.in_features, new.out_features, policy.small_rule):
            report.small_elsewhere.append(name)
    return converted, small


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
        return LayerReport(name, lin.in_features, lin.out_features, False, f"high precision: {plan.hp_reason}",
                           _params(lin), plan.hp_kind)
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


def _warn(report: ConversionReport, converted: dict[str, Linear | GroupedLinear], policy_small: set[str]) -> None:
    def names(layers):
        return ", ".join(lr.name for lr in layers[:5]) + (" ..." if len(layers) > 5 else "")

    hp = [lr for lr in report.kept if lr.kept in (Kept.SHAPE, Kept.SMALL)]  # the layer's own plan keeps it
    # by the device's rule or the policy's; a bf16 or fp16 recipe has nothing to gain
    small = [lr for lr in report.kept if lr.kept is Kept.SMALL or lr.name in policy_small] \
        if report.recipe.low_precision else []
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
    folded = [g for g, p in report.gemm_paths.items() if p == GemmPath.FOLDED]
    if folded and report.converted:
        warnings.warn(f"lowprec: {report.recipe.name} {'/'.join(folded)} GEMMs run on FP8 tensor cores with each row's "
                      f"MX blocks folded to one power-of-two scale (checked against the emulation on first use; "
                      "elements under 2^-13 of their row's largest are rounded, by at most 2^-16 of it; see "
                      "docs/kernels.md)", stacklevel=3)
    emulated = [g for g, p in report.gemm_paths.items() if p == GemmPath.EMULATED]
    if emulated and report.converted:
        warnings.warn(f"lowprec: {report.recipe.name} {'/'.join(emulated)} GEMMs are emulated on {report.device} "
                      "(exact quantized values, high-precision GEMMs): the numerics of native hardware, not its speed",
                      stacklevel=3)
