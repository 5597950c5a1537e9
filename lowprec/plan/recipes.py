"""What each training recipe stores and which GEMM format it runs, for the memory and time accounting.

This is the planner's own small table, kept apart from ``lowprec.recipes`` (which says how to
quantize) so planning needs nothing but shapes. Its names are the recipe presets' names.

[Note: bytes per element]
A block-scaled operand costs ``element bytes + scale bytes / elements per scale``: MXFP8 is
1 + 1/32 (one E8M0 per 32), MXFP4 0.5 + 1/32, NVFP4 0.5 + 1/16 (one E4M3 per 16; its one FP32
global scale per tensor is negligible), FP8 row-wise 1 + 4/K (one FP32 per row of K elements),
FP8 per-tensor 1 + 4/numel.
"""
from __future__ import annotations

from dataclasses import dataclass

from lowprec._checks import check_choice, fail

TENSOR = "tensor"
"""One scale per tensor."""
ROW = "row"
"""One scale per row of the reduction dimension K (a linear's ``d_in``)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Storage:
    """How one operand is stored: elements of ``elem_bytes`` sharing scales of ``scale_bytes``."""

    elem_bytes: float
    scale_bytes: float = 0.0
    scale_every: int | str = TENSOR
    """Elements per scale: a block size, :data:`ROW` or :data:`TENSOR`."""

    def __post_init__(self) -> None:
        if self.elem_bytes <= 0 or self.scale_bytes < 0:
            fail("storage", "positive element bytes and non-negative scale bytes",
                 (self.elem_bytes, self.scale_bytes))
        if not isinstance(self.scale_every, int) and self.scale_every not in (TENSOR, ROW):
            fail("storage.scale_every", f"a block size, {ROW!r} or {TENSOR!r}", repr(self.scale_every))

    def bytes_per_element(self, row: int, numel: int) -> float:
        """Bytes per element of a ``numel``-element operand whose rows hold ``row`` elements."""
        if not self.scale_bytes:
            return self.elem_bytes
        every = {TENSOR: numel, ROW: row}.get(self.scale_every, self.scale_every)
        return self.elem_bytes + self.scale_bytes / every


BF16 = Storage(elem_bytes=2)
FP8_TENSOR = Storage(elem_bytes=1, scale_bytes=4, scale_every=TENSOR)
FP8_ROW = Storage(elem_bytes=1, scale_bytes=4, scale_every=ROW)
MXFP8 = Storage(elem_bytes=1, scale_bytes=1, scale_every=32)
MXFP4 = Storage(elem_bytes=0.5, scale_bytes=1, scale_every=32)
NVFP4 = Storage(elem_bytes=0.5, scale_bytes=1, scale_every=16)


@dataclass(frozen=True, kw_only=True, slots=True)
class RecipeCost:
    name: str
    weight: Storage | None
    """The low-precision copy of each quantized weight; None when the GEMMs read the BF16 weight."""
    saved_input: Storage
    """How a quantized linear saves its input for the weight-gradient GEMM (no transposed copy kept)."""
    gemms: tuple[str, str, str]
    """GEMM format of fprop, dgrad and wgrad (keys of the accelerator table's peaks)."""
    note: str

    @property
    def quantizes(self) -> bool:
        return self.weight is not None


RECIPES: dict[str, RecipeCost] = {r.name: r for r in (
    RecipeCost(name="bf16", weight=None, saved_input=BF16, gemms=("bf16",) * 3,
               note="the baseline: BF16 weights, inputs and GEMMs"),
    RecipeCost(name="fp16", weight=None, saved_input=BF16, gemms=("fp16",) * 3,
               note="FP16 weights and GEMMs (2 bytes like BF16) with loss scaling"),
    RecipeCost(name="fp8-delayed", weight=FP8_TENSOR, saved_input=FP8_TENSOR, gemms=("fp8",) * 3,
               note="E4M3 forward, E5M2 gradients, per-tensor scales from an amax history"),
    RecipeCost(name="fp8-current", weight=FP8_TENSOR, saved_input=FP8_TENSOR, gemms=("fp8",) * 3,
               note="E4M3 forward, E5M2 gradients, per-tensor scales from the current amax"),
    RecipeCost(name="fp8-rowwise", weight=FP8_ROW, saved_input=FP8_ROW, gemms=("fp8",) * 3,
               note="E4M3, one FP32 scale per row"),
    RecipeCost(name="fp8-blockwise", weight=Storage(elem_bytes=1, scale_bytes=4, scale_every=128 * 128),
               saved_input=Storage(elem_bytes=1, scale_bytes=4, scale_every=128), gemms=("fp8",) * 3,
               note="E4M3, FP32 scales per 128x128 weight block and 1x128 activation block (DeepSeek-V3)"),
    RecipeCost(name="mxfp8", weight=MXFP8, saved_input=MXFP8, gemms=("mxfp8",) * 3,
               note="MXFP8 E4M3 everywhere, E8M0 scale per 32"),
    RecipeCost(name="mxfp4", weight=MXFP4, saved_input=MXFP4, gemms=("mxfp4", "mxfp8", "mxfp8"),
               note="MXFP4 forward, MXFP8 backward GEMMs; the FP4 copies are what is stored"),
    RecipeCost(name="nvfp4", weight=NVFP4, saved_input=NVFP4, gemms=("nvfp4",) * 3,
               note="NVFP4 E2M1 with an E4M3 scale per 16 in all three GEMMs"),
)}


def get_recipe(name: str | RecipeCost) -> RecipeCost:
    if isinstance(name, RecipeCost):
        return name
    return RECIPES[check_choice("recipe", name, RECIPES)]


@dataclass(frozen=True, kw_only=True, slots=True)
class OptimizerCost:
    name: str
    moment_bytes: float
    """Bytes per parameter of the first and second moments together."""
    note: str


OPTIMIZERS: dict[str, OptimizerCost] = {o.name: o for o in (
    OptimizerCost(name="adamw", moment_bytes=8, note="FP32 m and v"),
    OptimizerCost(name="adamw-8bit", moment_bytes=2,
                  note="8-bit m and v; their block scales (one FP32 per 2048 values, +0.2%) not counted"),
)}

GRAD_BYTES: dict[str, int] = {"bf16": 2, "fp32": 4}
"""Bytes per parameter of the gradient, by the dtype gradients are reduced and accumulated in."""

MASTER_BYTES = 4
"""FP32 master weights, kept for every recipe: the optimizer updates these, not the BF16 copy."""

HP_BYTES = 2
"""The model's own (BF16) weights and the activations that are not linear inputs."""
