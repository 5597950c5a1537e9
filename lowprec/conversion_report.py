"""What ``convert`` did to a model, layer by layer: the report it returns, its counts and its renderings
(table, summary, notes, JSON), with the weights it could not see into (:mod:`lowprec.unseen`)."""
from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field

from lowprec import recipes as R
from lowprec._checks import describe, fail
from lowprec._table import format_table
from lowprec.nn.plan import Kept


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
    experts: int | None = None
    """A ``GroupedLinear``'s number of experts, each ``in_features`` -> ``out_features``; None for a linear."""

    @property
    def shape_text(self) -> str:
        """``in x out`` for a linear; ``E experts x out x in`` for experts (their weight's shape)."""
        if self.experts is None:
            return f"{self.in_features}x{self.out_features}"
        return f"{self.experts} experts x {self.out_features} x {self.in_features}"

    def to_dict(self) -> dict:
        """Plain JSON; ``experts`` only for experts, so that a linear's row reads as it always has."""
        out = asdict(self)
        if self.experts is None:
            del out["experts"]
        return out


@dataclass(frozen=True, slots=True)
class UnseenWeight:
    """A matrix the model multiplies tokens by that ``convert`` cannot see into (a fused 3-D expert
    weight, the weight of a module it does not know): not converted, it runs in the model's precision."""

    name: str
    """The parameter's name in the model (``layers.0.mlp.experts.gate_up_proj``)."""
    shape: tuple[int, ...]
    module: str
    """The type of the module holding it (``MixtralExperts``)."""
    params: int

    @property
    def where(self) -> str:
        return f"{self.module}.{self.name.rpartition('.')[2]}"

    @property
    def shape_text(self) -> str:
        return "x".join(map(str, self.shape))

    @property
    def reason(self) -> str:
        return (f"not converted: lowprec cannot see into {self.where} (shape {self.shape_text}): it runs in the "
                "model's precision")


def _share(part: int, whole: int) -> str:
    """``part / whole`` as a percentage rounded down, so that 100% means all and 0% none."""
    if not whole:
        return "n/a"
    share = f"{math.floor(part / whole * 100)}%"
    return "<1%" if share == "0%" and part else share


@dataclass(frozen=True, slots=True)
class Coverage:
    """How much of a model's linears run the recipe: what a verdict on the recipe rests on."""

    converted: int
    linears: int
    converted_params: int
    params: int
    """Parameters of every linear (weights and biases) and of every weight lowprec cannot see into: the
    matrix parameters a verdict on the recipe rests on."""
    kept: tuple[tuple[Kept, int], ...] = ()
    """How many linears stay in high precision for each reason, most first."""
    unseen: int = 0
    """Weights lowprec cannot see into (:class:`UnseenWeight`): never converted, whatever the recipe."""
    unseen_params: int = 0
    """Their parameters, counted in ``params``."""

    def __post_init__(self) -> None:
        if not 0 <= self.unseen_params <= self.params - self.converted_params:
            fail("unseen_params", f"a count within the {self.params - self.converted_params} parameters not "
                 "converted (params counts them)", describe(self.unseen_params))

    @property
    def fraction(self) -> float:
        """The converted linears' share of the matrix parameters (the linears' and the unseen weights');
        NaN for a model without any."""
        return self.converted_params / self.params if self.params else math.nan

    @property
    def share(self) -> str:
        """``fraction`` as a percentage rounded down, so that 100% means every parameter and 0% none."""
        return _share(self.converted_params, self.params)

    def __str__(self) -> str:
        if not self.unseen:
            return f"{self.converted} of {self.linears} linears converted ({self.share} of linear parameters)"
        weights = f"{self.unseen} weight{'s' if self.unseen > 1 else ''}"
        return (f"{self.converted} of {self.linears} linears converted ({self.share} of matrix parameters; "
                f"{_share(self.unseen_params, self.params)} in {weights} lowprec cannot see into)")

    def to_dict(self) -> dict:
        """Plain JSON; ``unseen`` and ``unseen_params`` only where there are such weights, so that the
        coverage of a model without any reads as it always has."""
        unseen = {"unseen": self.unseen, "unseen_params": self.unseen_params} if self.unseen else {}
        return {"converted": self.converted, "linears": self.linears, "converted_params": self.converted_params,
                "params": self.params, "fraction": self.fraction if self.params else None,
                "kept": {k.value: n for k, n in self.kept}, **unseen}


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
    unseen: list[UnseenWeight] = field(default_factory=list)
    """Matrices the model multiplies tokens by that lowprec cannot see into: not converted, never skipped."""

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
        unseen = sum(u.params for u in self.unseen)
        return Coverage(len(self.converted), len(self.layers), sum(lr.params for lr in self.converted),
                        sum(lr.params for lr in self.layers) + unseen,
                        tuple(sorted(kept.items(), key=lambda kv: -kv[1])), len(self.unseen), unseen)

    def to_table(self, markdown: bool = False) -> str:
        rows = [(lr.name, lr.shape_text, "yes" if lr.converted else "no", lr.reason)
                for lr in self.layers]
        rows += [(u.name, u.shape_text, "no", u.reason) for u in self.unseen]
        return format_table(["layer", "shape", "low precision", "reason"], rows, markdown=markdown)

    def summary(self) -> str:
        paths = ", ".join(f"{g} {p}" for g, p in self.gemm_paths.items())
        return (f"recipe {self.recipe.name}: {self.coverage()}, {len(self.kept)} kept in high precision; "
                f"GEMMs on {self.device}: {paths}")

    def notes(self) -> list[str]:
        """What the table alone does not say: the weights lowprec cannot see into, one line for each kind
        (however many layers hold one), and layers whose precision depends on the device."""
        out = []
        kinds: dict[str, int] = {}
        for u in self.unseen:
            kinds[u.reason] = kinds.get(u.reason, 0) + 1
        out += [reason + (f" ({n} weights)" if n > 1 else "") for reason, n in kinds.items()]
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
                "layers": [lr.to_dict() for lr in self.layers], "coverage": self.coverage().to_dict(),
                "small_elsewhere": self.small_elsewhere,
                "shared_inputs": [list(g) for g in self.shared_inputs],
                "fp8_weights": self.fp8_weights, "fp8_decoded": self.fp8_decoded,
                "saved_activations": self.saved_activations, "activations": self.activations,
                "unseen": [{**asdict(u), "shape": list(u.shape), "reason": u.reason} for u in self.unseen]}

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2)

    def __str__(self) -> str:
        return "\n".join([self.summary(), *self.notes(), self.to_table()])
