"""The operand-cast plan: what a layer does with its recipe on its device, decided once.

[Note: the layer plan]
A recipe says how each operand of each GEMM is cast; a :class:`LayerPlan` says how a layer of a
given shape does it on a given device: for each operand (input, weight, grad_output) the routes of
its casts (fused or separate, and on which backend: ``lowprec.kernels.route``), whether its scale is
delayed, whether layers reading the same input may share its casts; for each GEMM its path (cuBLAS,
emulated or high precision); and whether the layer runs in high precision at all, and why. Plans are
frozen and built per (recipe, device, shape, policy) once, outside any compiled graph; the autograd
function follows its plan and never looks at the module (see ``lowprec.nn.function``).
"""
from __future__ import annotations

import enum
import functools
from dataclasses import dataclass, field, replace

import torch

from lowprec import formats as F
from lowprec import recipes as R
from lowprec.kernels import (
    Backend,
    Capability,
    CastRoute,
    CastSpec,
    GemmPath,
    capability,
    folds_at_cast,
    gemm_path,
    route,
)
from lowprec.quant import Granularity, GranularityKind
from lowprec.quant.hadamard import RHT_SEED

E4M3 = F.get("e4m3")
HP = GemmPath.HP
"""The path of a GEMM whose operands are not both quantized: a high-precision matmul."""


class Kept(str, enum.Enum):
    """Why a linear stays in high precision, by what would change it."""

    POLICY = "policy"
    """The policy keeps it (head, router, kept blocks, include/exclude, ``skip_small=True``)."""
    SMALL = "small"
    """Too small to gain where the recipe runs natively (``Policy.skip_small`` None)."""
    SHAPE = "shape"
    """A shape the recipe's GEMMs cannot take."""
    UNSUPPORTED = "unsupported"
    """A module lowprec cannot convert, whatever the policy (a Hugging Face router, which applies its own weight)."""

# [Note: evaluation is deterministic]
# Stochastic rounding is for training: it keeps the expected value of small updates. A forward in
# evaluation (``model.eval()``, or without gradients) rounds every operand to nearest, so the same input
# gives the same output on every call; its layers take the recipe's plan with every side's rounding
# NEAREST (``layer_plan(..., nearest=True)``), and nothing else changes.


@dataclass(frozen=True, slots=True)
class OperandPlan:
    """How a layer casts one high-precision operand for the two GEMMs that read it: along K for one
    (``along_k``) and transposed for the other (``transposed``)."""

    role: R.Role
    cast_k: R.Cast
    cast_t: R.Cast
    """The recipe's casts of the two sides (a side that is not quantized is kept or cast to a
    16-bit dtype outside any route)."""
    both: CastRoute | None
    """The quantized sides when both GEMMs run (training); None when neither is quantized."""
    along_k: CastRoute | None
    """Only the cast along K (evaluation; a frozen input's backward needs no dgrad); None unless quantized."""
    transposed: CastRoute | None
    """Only the transposed cast (backward's weight.T; a frozen input's grad_output); None unless quantized."""
    delayed: bool
    """Some side takes its scale from the amax history of ``role``."""
    shareable: bool
    """Deterministic and not delayed: layers reading the same tensor may share these casts."""
    recast: CastRoute | None = None
    """The transposed side alone, to make again in backward from the high-precision tensor with
    forward's bits (see [Note: recasting the input in backward] in ``lowprec.nn.function``); its scale,
    where it is one per tensor, is given: forward's along-K scale. None where the side cannot be made
    again alike (stochastic rounding; a per-tensor scale of another format than along K's)."""

    @property
    def transposed_takes_k_scale(self) -> bool:
        """The transposed side is scaled per tensor with the along-K side's scale: the same format and
        granularity, no Hadamard transform (so :attr:`recast` exists and gives its scale)."""
        return self.recast is not None and self.recast.transposed.granularity.per_tensor


@dataclass(frozen=True, slots=True)
class GemmPlan:
    path: GemmPath
    """``CUBLAS`` (native), ``EMULATED`` (exact values, high-precision GEMM) or ``HP``."""
    fast_accum: bool


class WeightKind(enum.IntEnum):
    """What a layer's weight parameter is, for what forward keeps of it for backward."""

    PLAIN = 0
    """A high-precision parameter, cast at every forward (or taken from ``cached_weight_casts``)."""
    STORED = 1
    """An FP8 primary weight held by its layer: its codes reach the function as plain tensors (see
    [Note: FP8 primary weights under torch.compile] in ``lowprec.nn.fp8_weight``)."""
    RESIDENT = 2
    """A quantized parameter alive until backward: an FP8 primary weight not held by a layer."""
    GATHERED = 3
    """A quantized parameter freed between forward and backward: FSDP2's FP8 all-gather."""


class WeightT(enum.Enum):
    """Where backward takes dgrad's operand, weight.T's cast, from."""

    KEPT = "kept"
    """Forward's cast, kept from forward."""
    PARAMETER = "parameter"
    """Cast again from the parameter (a quantized parameter's own transposed codes where they serve)."""
    CODES = "codes"
    """From the FP8 primary weight's codes, kept: transposed where they serve, else decoded and cast."""


@dataclass(frozen=True, slots=True)
class SavePlan:
    """What a layer's forward keeps for backward, for one kind of weight (see [Note: what backward
    keeps] and [Note: recasting the input in backward] in ``lowprec.nn.function``)."""

    direct: bool
    """The weight's own codes are the GEMM operands, as they are (no cast)."""
    weight_t: WeightT
    """Where dgrad's operand comes from (when dgrad runs)."""
    scale_t: bool
    """Backward casts weight.T again with forward's delayed scale, which forward keeps."""
    input_recast: bool
    """Forward keeps the input itself and backward casts x.T again (compiled code only), rather than
    keep forward's x.T cast."""
    input_scale: bool
    """With ``input_recast``: backward's cast takes forward's per-tensor scale, which forward keeps."""


def _save_plan(plan: LayerPlan, kind: WeightKind, serves: bool, caching: bool, compiled: bool) -> SavePlan:
    """The rule behind :meth:`LayerPlan.save` (see [Note: what backward keeps] in ``lowprec.nn.function``):
    weight.T is cast again in backward rather than kept where the weight stays alive and its own codes
    serve (no copy), or where the plan says a cast made again has forward's bits (and no cache holds it)."""
    direct = serves and kind is not WeightKind.PLAIN
    resident = kind in (WeightKind.STORED, WeightKind.RESIDENT)
    recast = resident if direct else plan.recast_weight_t and not caching
    weight_t = WeightT.KEPT if not recast else WeightT.CODES if kind is WeightKind.STORED else WeightT.PARAMETER
    w_t = plan.weight.transposed
    # forward's own scale, taken before it recorded the weight's amax: the plan recasts a delayed
    # weight.T only in forward's format (see [Note: delayed scaling under torch.compile] in lowprec.nn.delayed)
    scale_t = recast and not direct and w_t is not None and w_t.transposed.delayed
    input_recast = compiled and plan.recast_input
    return SavePlan(direct, weight_t, scale_t, input_recast,
                    input_recast and plan.input.recast.transposed.delayed)


def _save_index(kind: WeightKind, serves: bool, caching: bool, compiled: bool) -> int:
    return ((int(kind) * 2 + serves) * 2 + caching) * 2 + compiled


@dataclass(frozen=True, slots=True)
class LayerPlan:
    """What a converted layer of one shape does with ``recipe`` on ``device`` (see [Note: the layer plan])."""

    recipe: R.Recipe
    device: torch.device
    hp_reason: str | None
    """Why the layer runs in high precision although it has a recipe; None when it runs the recipe."""
    hp_kind: Kept | None
    """The kind of ``hp_reason``, for code to act on (never its text)."""
    hp_dtype: torch.dtype | None
    """For unscaled recipes (bf16, fp16): the dtype every operand is cast to."""
    input: OperandPlan | None = None
    weight: OperandPlan | None = None
    grad_output: OperandPlan | None = None
    fprop: GemmPlan | None = None
    dgrad: GemmPlan | None = None
    wgrad: GemmPlan | None = None
    recast_weight_t: bool = False
    """Backward casts weight.T again from the parameter rather than keep forward's cast (deterministic
    casts only; see [Note: what backward keeps] in ``lowprec.nn.function``)."""
    recast_input: bool = False
    """Under ``torch.compile``, backward makes the input's transposed cast again rather than keep it
    (``input.recast``; see [Note: recasting the input in backward] in ``lowprec.nn.function``)."""
    weight_storage: Granularity | None = None
    """The granularity of the layer's FP8 primary weight's E4M3 codes, None for a plain weight (see
    ``lowprec.nn.fp8_weight``): a plan is made for the weight the layer holds."""
    stored_weight: bool = False
    """The GEMMs take the FP8 weight's stored codes as they are (:func:`codes_serve`), decided here and
    not at each forward, so that a compiled forward asks the weight subclass nothing."""
    saves: tuple[SavePlan, ...] = field(default=(), compare=False, repr=False)
    """Every :class:`SavePlan` of a scaled layer, made with the plan: read through :meth:`save`."""

    def save(self, kind: WeightKind, serves: bool, caching: bool, compiled: bool) -> SavePlan:
        """What forward keeps for backward with a weight of ``kind`` (``serves``: its codes are the
        recipe's weight casts), inside ``cached_weight_casts`` or not, in compiled code or not."""
        return self.saves[_save_index(kind, serves, caching, compiled)]

    @property
    def scaled(self) -> bool:
        """The layer runs the recipe's scaled low-precision casts."""
        return self.hp_reason is None and self.hp_dtype is None

    @property
    def delayed(self) -> bool:
        return self.scaled and any(op.delayed for op in (self.input, self.weight, self.grad_output))


def codes_serve(granularity: Granularity, op: OperandPlan | None) -> bool:
    """Whether E4M3 codes stored with ``granularity`` are exactly the operands of ``op``'s two weight
    casts: E4M3, deterministic, the same granularity on both sides, no Hadamard transform."""
    if op is None or op.both is None:
        return False
    sides = (op.both.along_k, op.both.transposed)
    square = granularity.kind is GranularityKind.TENSOR or granularity.block_rows == granularity.block_cols
    return square and all(s is not None and s.fmt is E4M3 and s.granularity == granularity and not s.stochastic
                          and s.hadamard_seed is None for s in sides)


def _spec(c: R.Cast, nearest: bool, folded: bool = False) -> CastSpec | None:
    if not c.quantized:
        return None
    rounding = F.Rounding.NEAREST if nearest else F.as_rounding(c.rounding)
    return CastSpec(c.fmt, c.granularity, rounding, RHT_SEED if c.hadamard else None,
                    c.scaling is R.Scaling.DELAYED, folded)


def _recast_route(a: CastSpec | None, b: CastSpec | None, device: torch.device) -> CastRoute | None:
    """The route of :attr:`OperandPlan.recast` (None where there is none): the reference's, always,
    since only compiled code takes it, and the compiler must see its operations to fuse them with what
    rebuilds the input (see [Note: recasting the input in backward] in ``lowprec.nn.function``)."""
    if b is None or b.stochastic:
        return None
    if not b.granularity.per_tensor:
        return route(None, b, device, Backend.TORCH)  # its scales come from the tensor alone
    # one scale per tensor: along K's, which holds for the transposed side in the same format only
    if a is None or a.fmt is not b.fmt or a.granularity != b.granularity or a.hadamard_seed is not None \
            or b.hadamard_seed is not None:
        return None
    return route(None, replace(b, delayed=True), device, Backend.TORCH)


@functools.lru_cache(maxsize=512)
def operand_plan(role: R.Role, along_k: R.Cast, transposed: R.Cast, device: torch.device,
                 nearest: bool = False, folded: tuple[bool, bool] = (False, False)) -> OperandPlan:
    """The routes of one operand's casts on ``device`` (shared by every layer with the same casts, so
    that layers can compare them by identity); ``nearest``: every side rounds to nearest; ``folded``:
    which sides are cast straight to the folded operands of a folded GEMM (see :func:`folded_sides`)."""
    a, b = _spec(along_k, nearest, folded[0]), _spec(transposed, nearest, folded[1])
    specs = [s for s in (a, b) if s is not None]
    return OperandPlan(
        role, along_k, transposed,
        both=route(a, b, device) if specs else None,
        along_k=route(a, None, device) if a is not None else None,
        transposed=route(None, b, device) if b is not None else None,
        delayed=any(s.delayed for s in specs),
        shareable=all(not s.delayed and not s.stochastic for s in specs),
        recast=_recast_route(a, b, device),
    )


def folded_sides(role: R.Role, paths: dict[str, GemmPath], device: torch.device) -> tuple[bool, bool]:
    """Which of ``role``'s two casts (along K, transposed) are folded as they are cast: those read by a
    GEMM whose path is ``FOLDED`` (both its operands MX), where the device's first-use check of folded
    GEMMs passed. The cast writes the FP8 codes and row scales the GEMM multiplies in its own passes
    (``CastSpec.folded``), rather than MX codes that a second pass folds at the GEMM: the same bits."""
    if GemmPath.FOLDED not in paths.values() or not folds_at_cast(device):
        return False, False
    (g_k, _), (g_t, _) = R.SIDES[role]
    return paths[g_k] is GemmPath.FOLDED, paths[g_t] is GemmPath.FOLDED


def gemm_plan(g: R.Gemm, device: torch.device) -> GemmPlan:
    return gemm_plan_on(g, capability(device))


def gemm_plan_on(g: R.Gemm, cap: Capability) -> GemmPlan:
    """:func:`gemm_plan` on a capability (a device's, or one the planner describes)."""
    if not g.low_precision:
        return GemmPlan(HP, g.fast_accum)
    return GemmPlan(gemm_path(g.lhs.fmt, g.lhs.granularity, g.rhs.fmt, g.rhs.granularity, cap), g.fast_accum)


def fallback_reason(in_features: int, out_features: int, recipe: R.Recipe) -> str | None:
    """Why a layer of this shape cannot take the recipe's low-precision GEMMs, or None."""
    m = recipe.required_multiple()
    bad = [f"{n}={v}" for n, v in (("in_features", in_features), ("out_features", out_features)) if v % m]
    if bad:
        return f"{' and '.join(bad)} not a multiple of {m} ({recipe.name})"
    return None


def too_small(in_features: int, out_features: int, min_features: int) -> bool:
    """The small-layer rule, wherever it applies (the device's rule here, ``Policy(skip_small=True)``
    everywhere, the conversion report's note on other devices): a dimension under ``min_features``."""
    return min(in_features, out_features) < min_features


def small_rule_applies(recipe: R.Recipe, cap: Capability) -> bool:
    """The device's small-layer rule applies to ``recipe`` on ``cap``'s device (a
    capability): one of its GEMMs runs on the tensor cores (natively or folded), where a
    small layer's casts cost more time than its GEMM saves. Where every GEMM is emulated, speed is not the
    question. The planner asks the same of the GPU it plans for."""
    if not recipe.low_precision:
        return False
    paths = [gemm_plan_on(getattr(recipe, g), cap).path for g in R.GEMMS]
    return GemmPath.CUBLAS in paths or GemmPath.FOLDED in paths


def small_reason(in_features: int, out_features: int, min_features: int | None, device: torch.device,
                 recipe: R.Recipe) -> str | None:
    """Why a layer this small stays in high precision on ``device``: where the recipe's GEMMs run
    natively, a GEMM with a dimension under ``min_features`` gains less than its casts cost. Elsewhere
    (emulation) speed is not the question, and every layer takes the recipe. None: convert."""
    if min_features is None or not small_rule_applies(recipe, capability(device)) \
            or not too_small(in_features, out_features, min_features):
        return None
    return (f"too small to gain on {device.type} ({in_features}x{out_features}: a dimension under "
            f"{min_features}; Policy(skip_small=False) converts it)")


def recasts_weight_t(recipe: R.Recipe, nearest: bool = False) -> bool:
    """Backward casts weight.T again from the weight rather than keep forward's cast (see [Note: what
    backward keeps] in ``lowprec.nn.function``): where a second cast gives the same bits, i.e. it rounds
    to nearest, and its scale is one forward makes for its own cast: current, or delayed and forward's
    (the sides scaled alike), since compiled code must not recompute a delayed scale in backward (see
    [Note: delayed scaling under torch.compile] in ``lowprec.nn.delayed``). The planner reads this too."""
    a, b = (_spec(c, nearest) for c in recipe.sides(R.Role.WEIGHT))
    return b is not None and not b.stochastic and (not b.delayed or (a is not None and a.scaled_like(b)))


def memo_serves(memo: LayerPlan | None, recipe: R.Recipe, device: torch.device) -> bool:
    """Whether a layer's memoized plan ``memo`` is the plan of ``recipe`` on ``device`` (a layer keeps its
    last eager plans so that compiled calls read them rather than trace :func:`layer_plan`). Compiled code
    compares the recipe by value: Dynamo does not keep a frozen dataclass's identity."""
    if memo is None or memo.device != device:
        return False
    return memo.recipe == recipe if torch.compiler.is_compiling() else memo.recipe is recipe


@functools.lru_cache(maxsize=1024)
def layer_plan(recipe: R.Recipe, device: torch.device, in_features: int, out_features: int,
               policy_reason: str | None = None, min_features: int | None = None,
               nearest: bool = False, weight_storage: Granularity | None = None,
               recast_input: bool = False) -> LayerPlan:
    """The plan of a layer of this shape with ``recipe`` on ``device``; ``policy_reason``: why the
    conversion keeps it in high precision (or None); ``min_features``: see :func:`small_reason`;
    ``nearest``: every cast rounds to nearest (evaluation: see [Note: evaluation is deterministic]);
    ``weight_storage``: the granularity of the layer's FP8 primary weight (None: a plain weight);
    ``recast_input``: backward under ``torch.compile`` makes the input's transposed cast again where it
    can (:attr:`LayerPlan.recast_input`)."""
    device = torch.device(device)
    kind, reason = Kept.POLICY, policy_reason
    if reason is None:
        kind, reason = Kept.SHAPE, fallback_reason(in_features, out_features, recipe)
    if reason is None:
        kind, reason = Kept.SMALL, small_reason(in_features, out_features, min_features, device, recipe)
    if reason is not None or recipe.hp_dtype is not None:
        return LayerPlan(recipe, device, reason, kind if reason is not None else None,
                         recipe.hp_dtype if reason is None else None, weight_storage=weight_storage)
    r = recipe
    gemms = {g: gemm_plan(getattr(r, g), device) for g in R.GEMMS}
    paths = {g: p.path for g, p in gemms.items()}

    def operand(role: R.Role) -> OperandPlan:
        return operand_plan(role, *r.sides(role), device, nearest, folded_sides(role, paths, device))

    weight, inp = operand(R.Role.WEIGHT), operand(R.Role.INPUT)
    plan = LayerPlan(
        recipe, device, None, None, None,
        input=inp,
        weight=weight,
        grad_output=operand(R.Role.GRAD_OUTPUT),
        fprop=gemms["fprop"], dgrad=gemms["dgrad"], wgrad=gemms["wgrad"],
        recast_weight_t=recasts_weight_t(recipe, nearest),
        recast_input=recast_input and inp.recast is not None,
        weight_storage=weight_storage,
        stored_weight=weight_storage is not None and codes_serve(weight_storage, weight),
    )
    keys = [(k, s, c, p) for k in WeightKind for s in (False, True) for c in (False, True) for p in (False, True)]
    return replace(plan, saves=tuple(_save_plan(plan, *key) for key in keys))
