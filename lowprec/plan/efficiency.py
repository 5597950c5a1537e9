"""How much of its peaks a GPU reaches in each part of a compiled training step, as measured.

[Note: measured efficiencies]
The planner's step time (``lowprec.plan.step_time``) adds up the parts of a step, each at a fraction of the
peak it is bound by. The fractions are measured on one H200 (BENCHMARKS.md and benchmarks/HISTORY.md, the
run named beside each), from profiles of whole compiled steps and from the layer benchmarks, never from the
whole-step speeds the model is then held against (``tests/plan/test_plan_step_time.py``):

* ``gemm``: dense GEMMs (cuBLAS) at 70% of the BF16 peak: 116.3 ms of GEMM kernels for 8.07e13 FLOPs in the
  1B step, 385.6 ms for 2.67e14 in the 3B step (runs 9 and 11, ``bench_profile.py``: 694 and 692 TFLOP/s);
  FP8 per tensor at 66% of the FP8 peak (run 9: 57 ms for the 1B step's 7.42e13 FP8 FLOPs; its BF16 LM head
  is the other 8 ms of its 64.8). FP32 GEMMs (emulation off the tensor cores) are taken at BF16's fraction of
  their own peak, not measured; other low-precision formats (MX, NVFP4 where native) at FP8's.
* ``attention``: FlashAttention at 68.7% of the BF16 peak at sequence 2048 and 75.9% at 4096 (the same
  profiles: 19.4 and 85.5 ms), on the planner's attention FLOPs (the causal mask not credited).
* ``grouped``: the routed experts of one block, fwd+bwd, SwiGLU included, compiled with CUDA graphs: BF16's
  ``torch._grouped_mm`` at 35.7% of the peak where one expert's GEMM is 2.15e9 FLOPs (``moe-1b``: 32
  experts of 512, 2048 rows each; 1.75 ms) and 63.4% at 4.81e11 (Mixtral-8x7B's shapes, 4096 rows of
  4096 x 14336; 55.2 ms), runs 85-86, ``bench_moe.py``. Between the two the fraction follows the logarithm
  of the FLOPs; beyond them it stays at the nearer one.
* ``grouped_recipes``: lowprec's experts in a recipe, as a speed relative to BF16's at the same shapes,
  casts and amaxes included (runs 75-92): fp8-current 0.83x at ``moe-1b``'s shapes and 1.22x at Mixtral's,
  fp8-delayed 0.72x, fp8-rowwise 0.64x, fp8-blockwise 0.63x and 0.82x, mxfp8 0.46x and 0.89x, mxfp4 0.45x;
  nvfp4 0.149x, measured eager only (21.7 ms against ``torch._grouped_mm``'s 3.23, run 92, its casts in one
  Triton pass, its GEMMs emulated: the best evidence there is, and a pessimistic one). A recipe measured at one
  shape is taken as that ratio at every shape. A recipe not listed (fp16, a user's) is modelled as its dense
  linears are (its GEMM path at the grouped fraction, plus its casts' traffic), and the part says so.
* ``hbm``: memory-bound passes at 70% of the HBM bandwidth: the fused AdamW step at 68% (7.6 ms for the 1B
  model's 0.89B FP32 parameters moving 28 bytes each, 23.8 ms for 3B's 2.81B: run 11) and lowprec's FP8
  casts at 72% (run 9: 16.4 ms of casts and the amaxes fused into inductor's kernels, for the 56.7 GB that
  separate per-tensor casts move in the 1B step).
* ``elementwise``: everything else a step runs (the norms, SwiGLU, residual additions, rotary embeddings, the
  loss, the routing's gathers and scatters, copies) takes as long as moving 9.6 times the bytes a block saves
  for backward (``lowprec.plan.activations``, BF16, no recomputation) at the full HBM bandwidth: 9.7 for the
  1B step (37.7 ms), 9.5 for the 3B step (80.6 ms).

A GPU without a measured row is planned with the H200's fractions of its own peaks and bandwidth; the
plan says so. Communication is not in the model.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from lowprec._checks import fail

MEASURED_ON = "h200"
"""The GPU the fractions were measured on."""


@dataclass(frozen=True, slots=True)
class Curve:
    """A fraction measured at a few sizes: linear in the logarithm of the size between two measured points,
    the nearer point's value beyond them."""

    points: tuple[tuple[float, float], ...]
    """``(size, value)`` pairs, sizes increasing."""

    def __post_init__(self) -> None:
        sizes = [s for s, _ in self.points]
        if not self.points or any(s <= 0 for s in sizes) or sizes != sorted(set(sizes)) \
                or any(v <= 0 for _, v in self.points):
            fail("points", "(size, value) pairs with increasing positive sizes and positive values", self.points)

    def at(self, size: float) -> float:
        pts = self.points
        if size <= pts[0][0]:
            return pts[0][1]
        for (s0, v0), (s1, v1) in zip(pts, pts[1:]):
            if size <= s1:
                t = math.log(size / s0) / math.log(s1 / s0)
                return v0 + t * (v1 - v0)
        return pts[-1][1]


@dataclass(frozen=True, kw_only=True, slots=True)
class Efficiency:
    """The fractions of [Note: measured efficiencies] for one GPU."""

    gpu: str
    """The GPU they were measured on."""
    gemm: tuple[tuple[str, float], ...]
    """Dense GEMMs: ``(format, fraction of that format's peak)``; a format not listed takes ``gemm_other``."""
    gemm_other: float
    """Dense GEMMs in a low-precision format with no measured fraction (MX and NVFP4 where native)."""
    attention: Curve
    """Fraction of the BF16 peak by sequence length."""
    grouped: Curve
    """BF16 grouped experts: fraction of the BF16 peak by the FLOPs of one expert's GEMM."""
    grouped_recipes: tuple[tuple[str, Curve], ...]
    """Recipe name -> speed of its experts relative to BF16's, by the FLOPs of one expert's GEMM."""
    hbm: float
    """Fraction of the HBM bandwidth the optimizer step and the casts reach."""
    elementwise: float
    """Bytes moved at the full HBM bandwidth per byte a block saves for backward: the other kernels."""
    source: str

    def gemm_fraction(self, fmt: str) -> float:
        return dict(self.gemm).get(fmt, self.gemm_other)

    def grouped_relative(self, recipe: str) -> Curve | None:
        """The measured speed of ``recipe``'s experts relative to BF16's, or None where not measured."""
        return dict(self.grouped_recipes).get(recipe)


_MOE_1B, _MIXTRAL = 2.15e9, 4.81e11
"""FLOPs of one expert's GEMM at ``moe-1b``'s shapes and at Mixtral-8x7B's (bench_moe's two shapes)."""

H200 = Efficiency(
    gpu=MEASURED_ON,
    gemm=(("bf16", 0.70), ("fp16", 0.70), ("fp32", 0.70), ("fp8", 0.66)),
    gemm_other=0.66,
    attention=Curve(((2048, 0.687), (4096, 0.759))),
    grouped=Curve(((_MOE_1B, 0.357), (_MIXTRAL, 0.634))),
    grouped_recipes=(
        ("bf16", Curve(((1.0, 1.0),))),
        ("fp8-current", Curve(((_MOE_1B, 0.83), (_MIXTRAL, 1.22)))),
        ("fp8-delayed", Curve(((_MOE_1B, 0.72),))),
        ("fp8-rowwise", Curve(((_MOE_1B, 0.64),))),
        ("fp8-blockwise", Curve(((_MOE_1B, 0.63), (_MIXTRAL, 0.82)))),
        ("mxfp8", Curve(((_MOE_1B, 0.46), (_MIXTRAL, 0.89)))),
        ("mxfp4", Curve(((_MOE_1B, 0.45),))),
        ("nvfp4", Curve(((_MOE_1B, 0.149),))),
    ),
    hbm=0.70,
    elementwise=9.6,
    source="one H200, compiled steps and layers (BENCHMARKS.md runs 9, 11, 75-87)",
)

MEASURED: dict[str, Efficiency] = {H200.gpu: H200}
"""The GPUs with measured fractions, by the accelerator table's key."""


def efficiency_for(gpu_key: str) -> tuple[Efficiency, bool]:
    """``(fractions, measured)``: the GPU's own where measured, else the H200's (``measured`` False)."""
    if gpu_key in MEASURED:
        return MEASURED[gpu_key], True
    return H200, False
