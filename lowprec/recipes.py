"""Recipes: for each operand of each GEMM of a linear layer, how it is cast.

[Note: the three GEMMs]
A linear layer ``y = x @ w.T`` runs three GEMMs, each ``lhs (M, K) @ rhs (N, K).T`` reducing over K:

=======  ========================  =======================  ===================
GEMM     computes                  lhs (quantized along K)  rhs (along K)
=======  ========================  =======================  ===================
fprop    y  = x @ w.T              input  (tokens, in)      weight   (out, in)
dgrad    dx = dy @ w               grad_output (tokens,out) weight.T (in, out)
wgrad    dw = dy.T @ x             grad_output.T (out, tok) input.T  (in, tokens)
=======  ========================  =======================  ===================

Every operand is quantized along the GEMM's reduction dimension, in its own 2-D view: a granularity
of ``rowwise()`` for wgrad's lhs means one scale per output channel over the tokens. So a recipe is
six casts, and a user-defined recipe is as good as a preset: build a ``Recipe`` and pass it wherever
a recipe name is accepted.
"""
from __future__ import annotations

import enum
import math
from collections.abc import Callable
from dataclasses import dataclass, field, replace

import torch

from lowprec import formats as F
from lowprec._checks import check_choice, describe, fail
from lowprec.quant import Granularity, ScaleRule, blockwise, mx, nvfp4, rowwise, tensorwise


class Role(enum.IntEnum):
    """The three operands of a linear layer; the value indexes per-role state (amax histories)."""

    INPUT = 0
    WEIGHT = 1
    GRAD_OUTPUT = 2


GEMMS = ("fprop", "dgrad", "wgrad")
"""The three GEMMs of a linear layer, in the order every table lists them (see [Note: the three GEMMs])."""

SIDES: dict[Role, tuple[tuple[str, str], tuple[str, str]]] = {
    Role.INPUT: (("fprop", "lhs"), ("wgrad", "rhs")),
    Role.WEIGHT: (("fprop", "rhs"), ("dgrad", "rhs")),
    Role.GRAD_OUTPUT: (("dgrad", "lhs"), ("wgrad", "lhs")),
}
"""Which GEMM reads each operand, and as which of its operands: first along K (as the tensor is),
then transposed. The one table of [Note: the three GEMMs]; ``Recipe.sides`` and ``Recipe.casts`` read it."""


class Scaling(enum.Enum):
    CURRENT = "current"
    """The scale is computed from the tensor being cast."""
    DELAYED = "delayed"
    """The scale comes from a history of past amaxes (Transformer Engine's DelayedScaling)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Cast:
    """How one operand of one GEMM is cast."""

    format: str | None
    """Element format name (``"e4m3"``, ``"e2m1"``, ...); None keeps the operand in high precision."""
    granularity: Granularity | None = None
    """Which elements share a scale; None for an unscaled cast (``"bf16"``, ``"fp16"``)."""
    scaling: Scaling = Scaling.CURRENT
    """Current or delayed scaling (delayed only for per-tensor FP32 scales)."""
    rounding: F.Rounding | str = F.Rounding.NEAREST
    """``Rounding.NEAREST`` (half to even) or ``Rounding.STOCHASTIC`` (or their names)."""
    hadamard: bool = False
    """Apply the 16-point random Hadamard transform along the reduction dimension first (wgrad only)."""
    fmt: F.Format | None = field(init=False, repr=False, compare=False)
    """The element format ``format`` names, looked up once here (None with ``format``); code reads this,
    never the name. Not compared or hashed: ``format`` decides it."""

    def __post_init__(self) -> None:
        if self.granularity is not None and not isinstance(self.granularity, Granularity):
            fail("granularity", "a lowprec.quant.Granularity (tensorwise(), mx(32), ...) or None",
                 describe(self.granularity), TypeError)
        f = None if self.format is None else F.get(self.format)
        object.__setattr__(self, "fmt", f)  # derived from a field, not a change of one
        if f is not None:
            if f.kind is F.Kind.EXPONENT:
                fail("format", "an element format (e8m0 is a scale format)", repr(self.format))
            if self.granularity is not None and self.granularity.rule is not ScaleRule.AMAX \
                    and f.kind is not F.Kind.FLOAT:
                fail("format", f"a floating-point format for {self.granularity} scales", repr(self.format))
        F.as_rounding(self.rounding)
        if not isinstance(self.scaling, Scaling):
            fail("scaling", "a lowprec.recipes.Scaling", describe(self.scaling), TypeError)
        if f is not None and self.granularity is None and f.bits <= 8:
            fail("granularity", f"a scaling granularity for the {self.format} format", "None")
        if self.hadamard and not self.quantized:
            fail("hadamard", "False for a cast that is not scaled (the transform must cancel in the GEMM)", True)
        if self.scaling is Scaling.DELAYED and (
            self.granularity is None or not self.granularity.per_tensor
        ):
            fail("scaling", "delayed scaling only with a tensorwise() granularity", str(self.granularity))

    @property
    def quantized(self) -> bool:
        """True when the operand goes onto a scaled low-precision grid."""
        return self.format is not None and self.granularity is not None

    @property
    def stochastic(self) -> bool:
        return F.as_rounding(self.rounding) is F.Rounding.STOCHASTIC

    def describe(self) -> str:
        if self.format is None:
            return "hp"
        if self.granularity is None:
            return self.format
        extra = "".join([" delayed" if self.scaling is Scaling.DELAYED else "",
                         " SR" if self.stochastic else "", " RHT" if self.hadamard else ""])
        return f"{self.format}/{self.granularity}{extra}"


@dataclass(frozen=True, slots=True, kw_only=True)
class Gemm:
    """One GEMM: its two operands' casts and its accumulation."""

    lhs: Cast
    rhs: Cast
    fast_accum: bool = False
    """FP8 tensor cores' fast (reduced-precision) accumulation; FP32 accumulation otherwise."""

    def __post_init__(self) -> None:
        for name in ("lhs", "rhs"):
            if not isinstance(getattr(self, name), Cast):
                fail(name, "a lowprec.recipes.Cast", describe(getattr(self, name)), TypeError)

    @property
    def low_precision(self) -> bool:
        return self.lhs.quantized and self.rhs.quantized


class DelayedAlgo(str, enum.Enum):
    """How a delayed scale reduces its amax history (see [Note: delayed scaling] in ``lowprec.nn.delayed``).
    A ``str`` enum: it equals its name's string, and prints as it, so a recipe's repr evaluates back."""

    MAX = "max"
    """The largest amax of the history (Transformer Engine's default)."""
    MOST_RECENT = "most_recent"
    """The amax recorded last."""
    EMA = "ema"
    """The exponential moving average of the history, oldest to newest (see [Note: the EMA of a history])."""

    def __repr__(self) -> str:
        return repr(self.value)


@dataclass(frozen=True, slots=True)
class DelayedScaling:
    """Settings of delayed scaling's amax history."""

    history_len: int = 1024
    """How many past amaxes are kept."""
    algo: DelayedAlgo | str = DelayedAlgo.MAX
    """``"max"`` of the history, the ``"most_recent"`` amax, or ``"ema"``: their exponential moving
    average, oldest to newest, with weight ``ema_coeff`` on each newer amax (see [Note: delayed scaling]
    in ``lowprec.nn.delayed``). A :class:`DelayedAlgo` or its name; always the enum once built."""
    ema_coeff: float = 0.1
    """With ``algo="ema"``: ``e = (1 - ema_coeff) * e + ema_coeff * amax`` per recorded amax, in (0, 1]
    (1 is ``most_recent``)."""
    margin: int = 0
    """The scale is multiplied by ``2^margin`` for headroom."""
    outlier_bits: int | None = 8
    """An amax more than ``2^outlier_bits`` times the largest in its history (256 times by default) is
    an outlier -- one stray value such as 1e30 in a batch, which would otherwise hold the scale up for
    ``history_len`` steps and quantize every later tensor to zero. It is recorded capped at that bound
    and counted (``DelayedState.outliers``), so it costs at most ``outlier_bits`` bits of headroom, and
    a real change of range is followed within a few steps. None records every amax as it is."""

    def __post_init__(self) -> None:
        if isinstance(self.history_len, bool) or not isinstance(self.history_len, int) or self.history_len < 1:
            fail("history_len", "a positive int", describe(self.history_len))
        check_choice("algo", self.algo, tuple(a.value for a in DelayedAlgo))
        # the name given becomes its enum, so that code compares members, never strings (equal either way)
        object.__setattr__(self, "algo", DelayedAlgo(self.algo))
        c = self.ema_coeff
        if isinstance(c, bool) or not isinstance(c, (int, float)) or not 0 < c <= 1:
            fail("ema_coeff", "a number in (0, 1] (the weight of each newer amax)", describe(c))
        if isinstance(self.margin, bool) or not isinstance(self.margin, int) or self.margin < 0:
            fail("margin", "a non-negative int (the scale is multiplied by 2^margin)", describe(self.margin))
        bits = self.outlier_bits
        if bits is not None and (isinstance(bits, bool) or not isinstance(bits, int) or not 1 <= bits <= 64):
            fail("outlier_bits", "an int in [1, 64] (an amax above 2^outlier_bits times the history's is an "
                 "outlier) or None", describe(bits))


@dataclass(frozen=True, slots=True, kw_only=True)
class Recipe:
    """The casts of the three GEMMs of every converted linear layer (see [Note: the three GEMMs])."""

    name: str
    fprop: Gemm
    dgrad: Gemm
    wgrad: Gemm
    delayed: DelayedScaling = field(default_factory=DelayedScaling)
    """History settings for casts with delayed scaling."""
    loss_scaling: bool = False
    """Whether training should use dynamic loss scaling (FP16's narrow range needs it)."""
    hp_last_fraction: float = 0.0
    """Fraction of the last transformer blocks the default policy keeps in high precision."""
    doc: str = ""
    """What the recipe is and where it comes from."""

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            fail("name", "a non-empty str", describe(self.name), TypeError)
        if not isinstance(self.delayed, DelayedScaling):
            fail("delayed", "a lowprec.recipes.DelayedScaling", describe(self.delayed), TypeError)
        for name in GEMMS:
            if not isinstance(getattr(self, name), Gemm):
                fail(name, "a lowprec.recipes.Gemm", describe(getattr(self, name)), TypeError)
        for name, cast in self.casts().items():
            if cast.hadamard and not name.startswith("wgrad"):
                fail(f"{name}.hadamard", "False (the Hadamard transform applies to wgrad operands only)", True)
        if self.wgrad.lhs.hadamard != self.wgrad.rhs.hadamard:
            fail("wgrad.hadamard", "the same on both wgrad operands (the transform must cancel)",
                 f"lhs={self.wgrad.lhs.hadamard}, rhs={self.wgrad.rhs.hadamard}")
        if not 0.0 <= self.hp_last_fraction < 1.0:
            fail("hp_last_fraction", "a fraction in [0, 1)", self.hp_last_fraction)

    def sides(self, role: Role) -> tuple[Cast, Cast]:
        """``role``'s two casts: along K, for the GEMM that reads it as it is, and transposed (:data:`SIDES`)."""
        (g_k, o_k), (g_t, o_t) = SIDES[role]
        return getattr(getattr(self, g_k), o_k), getattr(getattr(self, g_t), o_t)

    def casts(self) -> dict[str, Cast]:
        """The six casts by ``<gemm>.<role>`` name, GEMM by GEMM, each GEMM's lhs first."""
        named = {(g, o): role.name.lower() for role, sides in SIDES.items() for g, o in sides}
        return {f"{g}.{named[(g, o)]}": getattr(getattr(self, g), o) for g in GEMMS for o in ("lhs", "rhs")}

    @property
    def low_precision(self) -> bool:
        """True when any operand of any GEMM is quantized onto a scaled low-precision grid."""
        return any(c.quantized for c in self.casts().values())

    @property
    def hp_dtype(self) -> torch.dtype | None:
        """For unscaled recipes (bf16, fp16): the dtype every operand is cast to."""
        fmts = {c.fmt for c in self.casts().values()}
        if self.low_precision or len(fmts) != 1 or None in fmts:
            return None
        return fmts.pop().torch_dtype

    @property
    def uses_delayed_scaling(self) -> bool:
        return any(c.scaling is Scaling.DELAYED for c in self.casts().values())

    def required_multiple(self) -> int:
        """Both feature dimensions of a layer must be multiples of this for the low-precision GEMMs
        (16 for FP8 tensor cores, and every block size along a feature dimension)."""
        sizes = [b for c in self.casts().values() if c.granularity is not None
                 for b in (c.granularity.block_rows, c.granularity.block_cols) if b]
        return math.lcm(16, *sizes) if self.low_precision else 1

    def summary(self) -> str:
        return "; ".join(f"{k}={v.describe()}" for k, v in self.casts().items())


# --------------------------------------------------------------------------------------------
# presets


def _uniform(name: str, cast: Cast, **kw) -> Recipe:
    g = Gemm(lhs=cast, rhs=cast)
    return Recipe(name=name, fprop=g, dgrad=g, wgrad=g, **kw)


def _fp8_tensorwise(name: str, scaling: Scaling, doc: str) -> Recipe:
    fwd = Cast(format="e4m3", granularity=tensorwise(), scaling=scaling)
    grad = Cast(format="e5m2", granularity=tensorwise(), scaling=scaling)
    return Recipe(
        name=name, doc=doc,
        fprop=Gemm(lhs=fwd, rhs=fwd, fast_accum=True),
        dgrad=Gemm(lhs=grad, rhs=fwd),
        wgrad=Gemm(lhs=grad, rhs=fwd),
    )


def bf16() -> Recipe:
    """BF16 operands, FP32 accumulation: the baseline every other recipe is compared with."""
    return _uniform("bf16", Cast(format="bf16"), doc=bf16.__doc__)


def fp16() -> Recipe:
    """FP16 operands with dynamic loss scaling (Micikevicius et al., Mixed Precision Training, 2018)."""
    return _uniform("fp16", Cast(format="fp16"), loss_scaling=True, doc=fp16.__doc__)


def fp8_delayed() -> Recipe:
    """FP8 per-tensor delayed scaling: E4M3 forward, E5M2 gradients, amax history of 1024 with
    ``max`` (Transformer Engine's DelayedScaling, Format.HYBRID; arXiv 2209.05433)."""
    return _fp8_tensorwise("fp8-delayed", Scaling.DELAYED, fp8_delayed.__doc__)


def fp8_current() -> Recipe:
    """FP8 per-tensor current scaling: E4M3 forward, E5M2 gradients, scales from each tensor's own
    amax (Transformer Engine's Float8CurrentScaling; torchao float8 tensorwise)."""
    return _fp8_tensorwise("fp8-current", Scaling.CURRENT, fp8_current.__doc__)


def fp8_rowwise() -> Recipe:
    """FP8 E4M3 for every operand with one scale per row of each operand along the reduction
    dimension (torchao float8 rowwise)."""
    c = Cast(format="e4m3", granularity=rowwise())
    return Recipe(name="fp8-rowwise", doc=fp8_rowwise.__doc__,
                  fprop=Gemm(lhs=c, rhs=c, fast_accum=True), dgrad=Gemm(lhs=c, rhs=c), wgrad=Gemm(lhs=c, rhs=c))


def fp8_blockwise() -> Recipe:
    """FP8 E4M3 with FP32 block scales: activations and gradients 1x128, weights 128x128, current
    scaling (DeepSeek-V3, arXiv 2412.19437)."""
    act = Cast(format="e4m3", granularity=blockwise(1, 128))
    w = Cast(format="e4m3", granularity=blockwise(128, 128))
    return Recipe(name="fp8-blockwise", doc=fp8_blockwise.__doc__,
                  fprop=Gemm(lhs=act, rhs=w), dgrad=Gemm(lhs=act, rhs=w), wgrad=Gemm(lhs=act, rhs=act))


def mxfp8() -> Recipe:
    """MXFP8: E4M3 elements in blocks of 32 with E8M0 scales rounded up, for every tensor
    (arXiv 2506.08027; OCP MX v1.0)."""
    return _uniform("mxfp8", Cast(format="e4m3", granularity=mx(32, "ceil")), doc=mxfp8.__doc__)


def mxfp4() -> Recipe:
    """MXFP4 forward (E2M1 in blocks of 32, E8M0 scales rounded up so that no element saturates,
    rounded to nearest), MXFP8 E4M3 backward (OCP MX v1.0). Stochastic rounding is for gradients, where
    an unbiased estimate matters; in the forward it only adds error (3.6 dB less SQNR on the forward
    GEMM's output); the FP4 training papers round their forward to nearest too (arXiv 2505.19115, 2509.25149)."""
    fwd = Cast(format="e2m1", granularity=mx(32, "ceil"))
    bwd = Cast(format="e4m3", granularity=mx(32, "ceil"))
    return Recipe(name="mxfp4", doc=mxfp4.__doc__,
                  fprop=Gemm(lhs=fwd, rhs=fwd), dgrad=Gemm(lhs=bwd, rhs=bwd), wgrad=Gemm(lhs=bwd, rhs=bwd))


def nvfp4_recipe() -> Recipe:
    """NVFP4 for all three GEMMs: E2M1 in blocks of 16 with E4M3 scales and an FP32 global scale,
    weights in 16x16 blocks, stochastic rounding of gradients, a random Hadamard transform on the
    weight-gradient GEMM's operands, the last blocks kept in BF16 (arXiv 2509.25149)."""
    act = Cast(format="e2m1", granularity=nvfp4(16))
    w = Cast(format="e2m1", granularity=nvfp4(16, two_d=True))
    grad = Cast(format="e2m1", granularity=nvfp4(16), rounding="stochastic")
    return Recipe(
        name="nvfp4", doc=nvfp4_recipe.__doc__, hp_last_fraction=0.15,
        fprop=Gemm(lhs=act, rhs=w), dgrad=Gemm(lhs=grad, rhs=w),
        wgrad=Gemm(lhs=replace(grad, hadamard=True), rhs=replace(act, hadamard=True)),
    )


PRESETS: dict[str, Callable[[], Recipe]] = {
    "bf16": bf16, "fp16": fp16, "fp8-delayed": fp8_delayed, "fp8-current": fp8_current,
    "fp8-rowwise": fp8_rowwise, "fp8-blockwise": fp8_blockwise, "mxfp8": mxfp8, "mxfp4": mxfp4,
    "nvfp4": nvfp4_recipe,
}


def get(recipe: str | Recipe) -> Recipe:
    """A preset by name, or a user-defined ``Recipe`` as it is."""
    if isinstance(recipe, Recipe):
        return recipe
    if not isinstance(recipe, str):
        fail("recipe", "a recipe name or lowprec.recipes.Recipe", describe(recipe), TypeError)
    if recipe not in PRESETS:
        fail("recipe", "one of " + ", ".join(PRESETS) + " (or a lowprec.recipes.Recipe)", repr(recipe))
    return PRESETS[recipe]()


def names() -> list[str]:
    return list(PRESETS)
