"""Verdicts that know their noise: a recipe's gap to BF16 judged beside BF16's spread over seeds.

[Note: what a seed changes]
A comparison's seed (``TrainConfig.seed``) fixes everything random in a run: the model's
initialisation (:func:`lowprec.train.model.init_weights` draws from a generator of its own seeded
with it), the data order (the batch of step ``s`` is drawn from ``(seed, s)`` alone, see
:meth:`lowprec.train.data.TokenData.train_batch`) and the random bits of stochastic rounding (torch's
generators, seeded by :func:`lowprec.train.loop.train`). The validation batches are the same fixed
windows whatever the seed, so two seeds differ by how the model trained, not by what it was
measured on. With ``seeds=K`` the baseline trains with seeds ``seed, seed+1, .., seed+K-1``; a recipe
with ``recipe_seeds=M`` trains with the first ``M`` of them. Evaluation rounds to nearest, so a
finished run's validation loss is a function of its seed alone.

[Note: verdicts]
The gap of a recipe is ``(mean val - mean val_bf16) / mean val_bf16``: the means of the final
validation losses over the recipe's ``M`` seeds and the baseline's ``K`` seeds. Its noise is
``noise_z`` (2) standard errors of that difference, ``noise_z * s * sqrt(1/M + 1/K)`` with ``s`` the
seed-to-seed standard deviation, relative to the baseline's mean (pooled over the baseline's and the
recipe's seeds, as a two-sample comparison pools them). With one seed of each, there is no ``s``,
and the noise is unknown. Then, with ``tol`` the tolerance of the recipe's family (:class:`Family`):

* FAIL: a non-finite loss or a diverged run at any seed, or a baseline without a finite loss.
* PASS: ``gap <= tol``; written ``PASS (within noise)`` when also ``|gap| <= noise``, i.e. the runs
  tell the recipe from BF16 no better than they tell two BF16 seeds apart.
* WARN: ``tol < gap <= max(warn_factor * tol, tol + noise)``: beyond the tolerance, but by less
  than the warn margin or than the noise, so more seeds or steps could still bring it within
  (``WARN (within noise)`` when ``gap <= noise``).
* FAIL: beyond that: the gap exceeds the tolerance by more than the noise and the warn margin.

Beside the verdict, the report gives the *paired* gap (:func:`paired_gap`): each recipe run against
the baseline's run of the same seed, which shares its initialisation and data order, averaged over
the recipe's seeds. It removes most of what a seed moves, so it tells a recipe from BF16 more finely
than the noise band; the verdict does not use it, since with one baseline run per seed its own spread
is unknown.

So a FAIL is never a gap the noise explains, and a verdict that flips between two seeds' runs is a
gap that moved by about the noise across a boundary. Two standard errors from three seeds are a
band, not a significance test: the spread of three runs is itself uncertain by about half.

[Note: tolerances and where they come from]
Large runs set the anchors. DeepSeek-V3 (arXiv 2412.19437) trains with FP8 block scaling and keeps
the loss within 0.25% of BF16. The MXFP8 recipe (arXiv 2506.08027) matches BF16 pre-training an 8B
model. NVFP4 (arXiv 2509.25149) stays within about 1% of its 8-bit baseline training a 12B model
on 10T tokens. Those are gaps after billions of tokens, where the loss curve is flat. The default
tolerances are for the short runs a comparison makes before the big one (the tiny model's default
100 steps see 26k tokens): the loss is still falling fast at the end, so a recipe that learns a step
or two slower shows a gap of a percent or two, and runs that differ only in rounding already end a
few percent apart (the tiny model's 120-step comparison on seed 0 had fp8-current end 2.3% *below*
BF16). So the
defaults are the anchors widened about eightfold for 8-bit elements (0.25% -> 2%) and fivefold for
4-bit ones (1% -> 5%). A comparison at the scale of the real run should use tolerances near the
anchors: ``Thresholds.at_scale()`` (FP8 and MXFP8 within 0.5%, FP4 within 2%).
"""
from __future__ import annotations

import enum
import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass

from lowprec import recipes
from lowprec._checks import describe, fail
from lowprec.convert import Coverage, Kept
from lowprec.policy_file import CONVERT_SMALL
from lowprec.quant.granularity import GranularityKind


class Level(str, enum.Enum):
    """How bad a verdict is, in order: a recipe that was not tested is no better than one that warns
    (``--fail-on warn`` stops on it), but no failure either (see :func:`untested`)."""

    PASS = "PASS"
    WARN = "WARN"
    NOT_TESTED = "NOT TESTED"
    FAIL = "FAIL"


class Family(enum.Enum):
    """Which tolerance a recipe is held to (see [Note: tolerances and where they come from])."""

    FP8 = "fp8"
    """8-bit or wider elements with FP32 scales (per tensor, row or block), or unscaled FP16/BF16."""
    MX8 = "mx8"
    """8-bit elements in blocks with E8M0 (MX) scales: ``mxfp8``."""
    FP4 = "fp4"
    """Some operand in 4 or 6 bits: ``mxfp4``, ``nvfp4``, MXFP6."""

    @classmethod
    def of(cls, recipe: str | recipes.Recipe) -> Family:
        """The family of a preset's name or a :class:`lowprec.recipes.Recipe`, from its narrowest operand."""
        casts = [c for c in recipes.get(recipe).casts().values() if c.quantized]
        if any(c.fmt.bits < 8 for c in casts):
            return cls.FP4
        if any(c.granularity.kind is GranularityKind.MX for c in casts):
            return cls.MX8
        return cls.FP8

    @property
    def title(self) -> str:
        return _TITLES[self]

    @property
    def source(self) -> str:
        """Where the family's tolerance is anchored (see [Note: tolerances and where they come from])."""
        return _SOURCES[self]


_TITLES = {Family.FP8: "FP8/FP16", Family.MX8: "MXFP8", Family.FP4: "FP4/FP6"}
_SOURCES = {
    Family.FP8: "DeepSeek-V3 (arXiv 2412.19437): FP8 training within 0.25% of BF16's loss",
    Family.MX8: "MXFP8 recipe (arXiv 2506.08027): MXFP8 matches BF16 (8B model, 15T tokens)",
    Family.FP4: "NVFP4 (arXiv 2509.25149): within about 1% of FP8 (12B model, 10T tokens)",
}


@dataclass(frozen=True, kw_only=True, slots=True)
class Thresholds:
    """Tolerances on the relative gap of the final validation loss to the baseline's, per :class:`Family`."""

    fp8: float = 0.02
    """FP8 with FP32 scales, FP16 (DeepSeek-V3's 0.25% widened for short runs)."""
    mx8: float = 0.02
    """MXFP8 (arXiv 2506.08027 matches BF16; widened alike)."""
    fp4: float = 0.05
    """MXFP4, NVFP4, MXFP6 (NVFP4's ~1% at 12B, widened for short runs)."""
    warn_factor: float = 2.0
    """A gap up to this many tolerances is WARN rather than FAIL."""
    noise_z: float = 2.0
    """The noise of a gap is this many of its standard errors."""

    def __post_init__(self) -> None:
        for family in Family:
            value = getattr(self, family.value)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < 1:
                fail(family.value, "a relative gap in (0, 1)", describe(value))
        if not isinstance(self.warn_factor, (int, float)) or not self.warn_factor >= 1:
            fail("warn_factor", "a number >= 1", self.warn_factor)
        if not isinstance(self.noise_z, (int, float)) or not 0 < self.noise_z < math.inf:
            fail("noise_z", "a positive finite number", self.noise_z)

    @classmethod
    def at_scale(cls) -> Thresholds:
        """For a comparison at the scale of the real run (issue targets near the papers' gaps)."""
        return cls(fp8=0.005, mx8=0.005, fp4=0.02)

    def tolerance(self, family: Family) -> float:
        return getattr(self, family.value)


@dataclass(frozen=True, slots=True)
class SeedBand:
    """The final validation losses of one recipe's runs, one per seed: their mean and spread."""

    seeds: tuple[int, ...]
    values: tuple[float, ...]

    def __post_init__(self) -> None:
        if not self.values or len(self.seeds) != len(self.values):
            fail("values", f"one value per seed of {list(self.seeds)}", list(self.values))

    @property
    def finite(self) -> bool:
        return all(math.isfinite(v) for v in self.values)

    @property
    def mean(self) -> float:
        return statistics.fmean(self.values) if self.finite else math.nan

    @property
    def std(self) -> float:
        """Sample standard deviation over the seeds (n - 1); NaN for one seed."""
        return statistics.stdev(self.values) if self.finite and len(self.values) > 1 else math.nan

    @property
    def lo(self) -> float:
        return min(self.values) if self.finite else math.nan

    @property
    def hi(self) -> float:
        return max(self.values) if self.finite else math.nan

    def relative(self) -> dict[str, float]:
        """Spread relative to the mean: ``std``, and ``lo``/``hi`` as deviations of the extremes."""
        m = self.mean
        return {"std": self.std / m, "lo": (self.lo - m) / m, "hi": (self.hi - m) / m}

    def to_json(self) -> dict[str, object]:
        return {"seeds": list(self.seeds), "val_losses": list(self.values), "mean": self.mean, "std": self.std,
                "min": self.lo, "max": self.hi, "relative": self.relative()}


def pooled_std(*bands: SeedBand) -> float:
    """The seed-to-seed standard deviation pooled over bands (each about its own mean); NaN without
    two seeds of some band."""
    dof = sum(len(b.values) - 1 for b in bands)
    if dof == 0 or not all(b.finite for b in bands):
        return math.nan
    return math.sqrt(sum((v - b.mean) ** 2 for b in bands for v in b.values) / dof)


def gap_and_noise(recipe: SeedBand, baseline: SeedBand, z: float) -> tuple[float, float]:
    """The relative gap of ``recipe``'s mean to ``baseline``'s, and its noise (see [Note: verdicts])."""
    base = baseline.mean
    if not math.isfinite(base) or base <= 0:
        return math.nan, math.nan
    gap = (recipe.mean - base) / base
    if recipe is baseline:
        return gap, z * baseline.std / base  # the baseline's own band: one run's deviation
    s = pooled_std(recipe, baseline)
    return gap, z * s * math.sqrt(1 / len(recipe.values) + 1 / len(baseline.values)) / base


def paired_gap(recipe: SeedBand, baseline: SeedBand) -> float:
    """The mean over ``recipe``'s seeds of its relative gap to ``baseline``'s run of the same seed: the
    same initialisation and data order (see [Note: what a seed changes]), so the seed-to-seed spread
    that the noise of :func:`gap_and_noise` allows for mostly cancels. NaN where the baseline has no
    run of one of the seeds or a loss is not finite. Reported beside the verdict, not judged."""
    base = dict(zip(baseline.seeds, baseline.values))
    if not all(s in base and math.isfinite(base[s]) and base[s] > 0 for s in recipe.seeds) or not recipe.finite:
        return math.nan
    return statistics.fmean((v - base[s]) / base[s] for s, v in zip(recipe.seeds, recipe.values))


@dataclass(frozen=True, slots=True)
class Verdict:
    level: Level
    gap: float
    """Relative gap of the final validation loss to the baseline's (NaN where there is none)."""
    noise: float
    """Half-width of the gap's noise band; NaN when unknown (one seed of each)."""
    tolerance: float
    reason: str

    @property
    def within_noise(self) -> bool | None:
        """``|gap| <= noise``; None when the noise (or the gap) is unknown."""
        if not (math.isfinite(self.noise) and math.isfinite(self.gap)):
            return None
        return abs(self.gap) <= self.noise

    @property
    def label(self) -> str:
        """The level, with ``(within noise)`` when the runs cannot tell the recipe from the baseline."""
        judged = self.level in (Level.PASS, Level.WARN)
        return f"{self.level.value} (within noise)" if judged and self.within_noise else self.level.value


def pct(x: float) -> str:
    """A relative gap as a percentage with two decimals, trailing zeros dropped (``2%``, ``4.6%``)."""
    return f"{x * 100:.2f}".rstrip("0").rstrip(".") + "%"


def judge(gap: float, noise: float, tolerance: float, thresholds: Thresholds,
          failure: str | None = None) -> Verdict:
    """The verdict on a gap with its noise against a tolerance (see [Note: verdicts]); ``failure`` (a
    non-finite loss, a diverged run) makes it FAIL whatever the gap."""
    if failure is not None or not math.isfinite(gap):
        return Verdict(Level.FAIL, gap, noise, tolerance, failure or "no finite gap")
    known = math.isfinite(noise)
    tol = pct(tolerance)
    if gap <= tolerance:
        if not known:
            why = f"within tolerance {tol}; noise unknown (one seed)"
        elif abs(gap) <= noise:
            why = f"within noise ±{pct(noise)}"
        elif gap < 0:
            why = f"better than the baseline by more than the noise ±{pct(noise)}"
        else:
            why = f"within tolerance {tol}, beyond the noise ±{pct(noise)}"
        return Verdict(Level.PASS, gap, noise, tolerance, why)
    by_warn = tolerance * thresholds.warn_factor
    by_noise = tolerance + noise if known else -math.inf
    limit = max(by_warn, by_noise)
    if gap <= limit:
        if not known:
            why = f"beyond tolerance {tol}, within the warn margin {pct(by_warn)}; noise unknown (one seed)"
        elif gap <= noise:
            why = f"beyond tolerance {tol} but within noise ±{pct(noise)}"
        elif by_noise >= by_warn:
            why = f"beyond tolerance {tol} by less than the noise ±{pct(noise)}"
        else:
            why = f"beyond tolerance {tol} by more than the noise ±{pct(noise)}, within the warn margin {pct(by_warn)}"
        return Verdict(Level.WARN, gap, noise, tolerance, why)
    if not known:
        return Verdict(Level.FAIL, gap, noise, tolerance,
                       f"beyond the warn margin {pct(by_warn)} (tolerance {tol}); noise unknown (one seed)")
    return Verdict(Level.FAIL, gap, noise, tolerance, f"beyond tolerance {tol} by more than the noise "
                   f"±{pct(noise)} and beyond the warn margin {pct(by_warn)}")


MIN_COVERAGE = 0.5
"""A recipe whose converted linears hold under this share of the linear parameters (and of the weights
lowprec cannot see into, such as fused experts: never converted) is not tested: the gap would mostly
measure the baseline against itself."""

_KEPT_HINTS = {
    Kept.POLICY: "the policy keeps them (--policy: its include, exclude, keep_* and skip_small fields)",
    Kept.SMALL: f"too small to gain where the recipe runs natively (a --policy file holding {CONVERT_SMALL} "
                "converts them)",
    Kept.SHAPE: "shapes the recipe's GEMMs cannot take (a --model whose widths are multiples of what the "
                "conversion report names)",
    Kept.UNSUPPORTED: "modules lowprec cannot convert (Hugging Face routers, which apply their own weight): they "
                      "run in the model's precision whatever the policy",
}


_UNSEEN_HINT = ("weights lowprec cannot see into (fused 3-D experts, modules it does not know) run in the model's "
                "precision whatever the recipe (the conversion report names them)")


def untested(coverage: Coverage | None) -> str | None:
    """Why a recipe's runs cannot earn a verdict: it converted no linear, or linears holding under
    :data:`MIN_COVERAGE` of the linear parameters and the weights lowprec cannot see into; with what kept
    the others and the option that changes it. None where they can, or where the coverage is unknown."""
    if coverage is None or (coverage.converted and coverage.fraction >= MIN_COVERAGE):
        return None
    kept = "; ".join([f"{n} kept: {_KEPT_HINTS[k]}" for k, n in coverage.kept]
                     + ([f"{coverage.unseen} not converted: {_UNSEEN_HINT}"] if coverage.unseen else []))
    matrices = "matrix" if coverage.unseen else "linear"
    what = ("no linear ran it, so the gap compares the baseline with itself" if not coverage.converted else
            f"under {MIN_COVERAGE:.0%} of the {matrices} parameters, so the gap mostly measures the baseline")
    return f"{coverage}: {what}" + (f"; {kept}" if kept else "")


def worst(levels: Sequence[Level | str]) -> Level:
    """The worst of some verdicts: what a script gating on a comparison looks at."""
    order = list(Level)
    return max((Level(v) for v in levels), key=order.index)
