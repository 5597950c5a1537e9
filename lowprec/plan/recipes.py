"""What each training recipe stores and which GEMM format it runs, derived from ``lowprec.recipes``.

The planner reads the same ``Recipe`` a converted layer runs, so a preset and a user-defined recipe
are planned alike and the plan cannot drift from what training does. What a converted linear keeps
(see [Note: what backward keeps] in ``lowprec.nn.function``): the input's ``wgrad.rhs`` cast, saved
for the weight-gradient GEMM. Its weight's casts (``fprop.rhs``, and ``dgrad.rhs`` of weight.T) are
made from the parameter when a GEMM needs them and dropped after it, except under gradient
accumulation, which keeps both for the step, and for a stochastically rounded weight.T cast, which
is saved for backward; ``lowprec.plan.memory`` counts them ([Note: the weight casts] there).

[Note: bytes per element]
An operand costs ``element bytes + scale bytes / elements per scale``. Element bytes are the format's
bits / 8: ideal packing, as hardware stores FP4 (two per byte) and FP6 (four in three bytes).
lowprec's emulation keeps FP4/FP6 codes one per byte in memory; the plan counts what the target
hardware stores. Scale bytes follow the scale format: FP32 4, E8M0 1, E4M3 1. So MXFP8 is 1 + 1/32,
MXFP4 0.5 + 1/32, NVFP4 0.5 + 1/16 (its one FP32 global scale per tensor is not counted), FP8
row-wise 1 + 4/K (one FP32 per row of K elements), FP8 per-tensor 1 + 4/numel.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace

import torch

from lowprec import formats as F
from lowprec import recipes as R
from lowprec._checks import describe, fail
from lowprec.kernels import Capability
from lowprec.nn.fp8_convert import storage_for
from lowprec.nn.plan import operand_plan, recasts_weight_t, small_rule_applies
from lowprec.nn.saved import SavedActivations
from lowprec.policy import Policy
from lowprec.quant import Granularity, ScaleRule

TENSOR = "tensor"
"""One scale per tensor."""
ROW = "row"
"""One scale per row of the reduction dimension K (a linear's ``d_in``)."""
COLUMN = "column"
"""One scale per column: ``numel / K`` elements share it."""

HP_BYTES = 2
"""The model's own (BF16) weights and the activations that are not linear inputs."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Storage:
    """How one operand is stored: elements of ``elem_bytes`` sharing scales of ``scale_bytes``."""

    elem_bytes: float
    scale_bytes: float = 0.0
    scale_every: int | str = TENSOR
    """Elements per scale: a block size, :data:`ROW`, :data:`COLUMN` or :data:`TENSOR`."""

    def __post_init__(self) -> None:
        if self.elem_bytes <= 0 or self.scale_bytes < 0:
            fail("storage", "positive element bytes and non-negative scale bytes",
                 (self.elem_bytes, self.scale_bytes))
        if not isinstance(self.scale_every, int) and self.scale_every not in (TENSOR, ROW, COLUMN):
            fail("storage.scale_every", f"a block size, {ROW!r}, {COLUMN!r} or {TENSOR!r}", repr(self.scale_every))

    @property
    def scaled(self) -> bool:
        """True for a scaled low-precision operand; False for a plain BF16/FP16 one."""
        return self.scale_bytes > 0

    def bytes_per_element(self, row: int, numel: float) -> float:
        """Bytes per element of a ``numel``-element operand whose rows hold ``row`` elements."""
        if not self.scale_bytes:
            return self.elem_bytes
        every = {TENSOR: numel, ROW: row, COLUMN: numel / row}.get(self.scale_every, self.scale_every)
        return self.elem_bytes + self.scale_bytes / every


BF16 = Storage(elem_bytes=HP_BYTES)


def _scale_every(g: Granularity) -> int | str:
    r, c = g.block_rows, g.block_cols
    if r is None and c is None:
        return TENSOR
    # A block that spans a whole dimension is counted as one scale per row (column): at most
    # r (c) times its real scales, which are a few bytes per thousands of elements either way.
    if c is None:
        return ROW
    if r is None:
        return COLUMN
    return r * c


def _scale_bytes(g: Granularity) -> int:
    """Bytes of one of ``g``'s scales, from its format's bits (FP32 4, E8M0 and E4M3 1)."""
    return g.scale_format.bits // 8


def storage_of(cast: R.Cast) -> Storage:
    """How the operand ``cast`` produces is stored; BF16 when the cast keeps high precision."""
    if cast.fmt is None:
        return BF16
    elem = cast.fmt.bits / 8
    g = cast.granularity
    if g is None:  # unscaled bf16/fp16 cast
        return Storage(elem_bytes=elem)
    return Storage(elem_bytes=elem, scale_bytes=_scale_bytes(g), scale_every=_scale_every(g))


def saved_storage(saved: SavedActivations | None) -> Storage:
    """How norms and SwiGLU save their inputs (``lowprec.nn.saved``): BF16, or FP8 with FP32 scales."""
    if saved is None:
        return BF16
    g = saved.granularity
    return Storage(elem_bytes=F.get(saved.fmt).bits / 8, scale_bytes=_scale_bytes(g),
                   scale_every=_scale_every(g))


_MX_GEMM = {8: "mxfp8", 6: "mxfp6", 4: "mxfp4"}
"""Block-scaled (E8M0) GEMM format by element bits."""

_GEMM_BITS = {"nvfp4": 4, "mxfp4": 4, "mxfp6": 6, "mxfp8": 8, "fp8": 8}


def _operand_gemm(cast: R.Cast) -> str:
    """The GEMM format a quantized operand needs (keys of ``lowprec.plan.gpus.GEMM_FORMATS``)."""
    f = cast.fmt
    rule = cast.granularity.rule
    if f.bits > 8:  # a wide format with scales still runs a high-precision GEMM
        return "fp16" if f.name == "fp16" else "bf16"
    if rule is ScaleRule.AMAX:  # FP32 scales: FP8 tensor cores (narrower elements fit E4M3 exactly)
        return "fp8"
    if rule is ScaleRule.NVFP4 and f.bits == 4:
        return "nvfp4"
    return _MX_GEMM[f.bits]


def gemm_format(g: R.Gemm) -> str:
    """The format ``g`` runs in. Low precision only when both operands are quantized (as
    ``lowprec.nn.function.gemm`` runs it); operands of different formats run at the wider one,
    the slower of the two (the left operand's on a tie)."""
    if not g.low_precision:  # the quantized side, if any, is dequantized to the other's dtype
        hp = [c.format for c in (g.lhs, g.rhs) if not c.quantized]
        return "fp16" if hp and all(f == "fp16" for f in hp) else "bf16"
    lhs, rhs = _operand_gemm(g.lhs), _operand_gemm(g.rhs)
    if "bf16" in (lhs, rhs) or "fp16" in (lhs, rhs):
        return "bf16" if "bf16" in (lhs, rhs) else "fp16"
    return max((lhs, rhs), key=_GEMM_BITS.__getitem__)


@dataclass(frozen=True, kw_only=True, slots=True)
class RecipeCost:
    name: str
    weight: Storage | None
    """The weight's cast for the forward GEMM (``fprop.rhs``); None when the GEMMs read the BF16 weight."""
    weight_t: Storage | None = None
    """The transposed weight's cast for the data-gradient GEMM (``dgrad.rhs``); None when not quantized."""
    weight_t_saved: bool = False
    """True when the Linear saves the weight.T cast from forward for backward: a stochastically
    rounded cast, which a second draw would change. False when backward casts weight.T again from
    the parameter and drops it after the GEMM."""
    saved_input: Storage
    """How a converted linear saves its input for the weight-gradient GEMM (its ``wgrad.rhs`` cast)."""
    gemms: tuple[str, str, str]
    """GEMM format of fprop, dgrad and wgrad (keys of the accelerator table's peaks)."""
    note: str
    fp8_weight: Storage | None = None
    """How ``convert(..., fp8_weights=True)`` stores a quantized weight: E4M3 per tensor or in 128x128
    blocks (``lowprec.nn.fp8_convert.storage_for``); None when the recipe casts no weight."""
    fp8_weight_direct: bool = False
    """The GEMMs read the stored FP8 codes as they are (no weight casts); else they are decoded and cast."""
    recipe: R.Recipe | None = None
    """The recipe itself, whose GEMMs the planner asks the kernels about (``lowprec.plan.gemm_paths``)."""
    operands: tuple[tuple[Storage, Storage], ...] = ()
    """How fprop's, dgrad's and wgrad's ``(lhs, rhs)`` casts are stored: an emulated GEMM's cast traffic."""
    hp_last_fraction: float = 0.0
    """Fraction of the last blocks the default policy keeps in BF16 (``Recipe.hp_last_fraction``)."""
    min_features: int | None = None
    """The default policy's small-layer rule on the planned GPU (:func:`on_gpu`): a linear with a
    dimension under it stays in BF16; None where the rule does not apply (every GEMM emulated there)."""

    def hp_blocks(self, n_layers: int) -> int:
        """How many of ``n_layers`` last blocks the default policy keeps in BF16 for this recipe, as
        ``lowprec.policy`` rounds it (up); none for a recipe that quantizes nothing."""
        return math.ceil(self.hp_last_fraction * n_layers) if self.quantizes else 0

    @property
    def quantizes(self) -> bool:
        """True when the recipe casts the weight to low precision or saves a quantized input."""
        return self.weight is not None or self.saved_input.scaled


def _note(recipe: R.Recipe) -> str:
    """The docstring's first paragraph on one line; the casts where the recipe has no doc."""
    para = recipe.doc.strip().split("\n\n")[0]
    return " ".join(para.split()) or recipe.summary()


def _fp8_weight(recipe: R.Recipe) -> tuple[Storage | None, bool]:
    """(storage, direct) of FP8 primary weights: what ``lowprec.nn.fp8_convert.storage_for`` decides for
    the recipe's weight casts."""
    if not (recipe.low_precision and recipe.fprop.rhs.quantized):
        return None, False
    g, direct = storage_for(operand_plan(R.Role.WEIGHT, *recipe.sides(R.Role.WEIGHT), torch.device("cpu")))
    return Storage(elem_bytes=1, scale_bytes=4, scale_every=TENSOR if g.per_tensor else g.block_rows * g.block_cols), \
        direct


def cost_of(recipe: R.Recipe) -> RecipeCost:
    """What ``recipe`` stores and which GEMM formats it runs."""
    if not isinstance(recipe, R.Recipe):
        fail("recipe", "a lowprec.recipes.Recipe", describe(recipe), TypeError)
    w, w_t = recipe.fprop.rhs, recipe.dgrad.rhs
    t_quantized = recipe.low_precision and w_t.quantized
    return RecipeCost(
        name=recipe.name,
        # a weight cast that is not quantized is the BF16 weight itself: no copy
        weight=storage_of(w) if recipe.low_precision and w.quantized else None,
        weight_t=storage_of(w_t) if t_quantized else None,
        # as the layer plan decides (lowprec.nn.plan.recasts_weight_t): else backward casts weight.T again
        weight_t_saved=t_quantized and not recasts_weight_t(recipe),
        saved_input=storage_of(recipe.wgrad.rhs),
        gemms=(gemm_format(recipe.fprop), gemm_format(recipe.dgrad), gemm_format(recipe.wgrad)),
        note=_note(recipe),
        fp8_weight=_fp8_weight(recipe)[0], fp8_weight_direct=_fp8_weight(recipe)[1],
        recipe=recipe,
        operands=tuple((storage_of(g.lhs), storage_of(g.rhs)) for g in (recipe.fprop, recipe.dgrad, recipe.wgrad)),
        hp_last_fraction=recipe.hp_last_fraction,
    )


def on_gpu(cost: RecipeCost, cap: Capability) -> RecipeCost:
    """``cost`` as the default policy converts a model on a device of capability ``cap``: with the small-layer
    rule (``lowprec.policy.Policy.min_features``) where it applies there (``lowprec.nn.plan.small_rule_applies``)."""
    applies = cost.recipe is not None and cost.quantizes and small_rule_applies(cost.recipe, cap)
    return replace(cost, min_features=Policy().min_features if applies else None)


def get_recipe(recipe: str | R.Recipe | RecipeCost) -> RecipeCost:
    """The cost of a preset by name (``lowprec.recipes.names()``) or of a user-defined ``Recipe``."""
    if isinstance(recipe, RecipeCost):
        return recipe
    return cost_of(R.get(recipe))


RECIPES: dict[str, RecipeCost] = {name: cost_of(R.get(name)) for name in R.names()}
"""Every preset's cost, by name."""


@dataclass(frozen=True, kw_only=True, slots=True)
class OptimizerCost:
    name: str
    moment_bytes: float
    """Bytes per parameter of the first and second moments together."""
    note: str


OPTIMIZERS: dict[str, OptimizerCost] = {o.name: o for o in (
    OptimizerCost(name="adamw", moment_bytes=8, note="FP32 m and v (fewer bits: Training.optim_states)"),
)}

GRAD_BYTES: dict[str, int] = {"bf16": 2, "fp32": 4}
"""Bytes per parameter of the gradient, by the dtype gradients are reduced and accumulated in."""

MASTER_BYTES = 4
"""FP32 master weights, kept for every recipe: the optimizer updates these, not the BF16 copy."""
