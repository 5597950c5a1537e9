"""Compare recipes against BF16: the same model, initialisation and data order for every recipe.

For each seed, one model is built and initialised once; each recipe trained with that seed gets a
fresh copy of that state dict before it is converted, and :meth:`TokenData.train_batch` gives every
run of the seed the same batches. So a seed's loss curves differ only by the recipe (and by the random
draws of stochastic rounding it makes). The baseline trains with ``seeds`` seeds, the other recipes
with the first ``recipe_seeds`` of them; the spread of the baseline's runs is the noise the verdicts
weigh each gap against (see :mod:`lowprec.train.verdict`).

A comparison asks a quality question, so it converts every linear the recipe can take on every device
(:func:`quality_config`): a GPU's rule that keeps small layers in BF16 for speed would have it compare
BF16 with BF16. Speed is reported beside the verdict, never traded for it.
"""
from __future__ import annotations

import copy
import platform
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch

import lowprec
from lowprec import recipes
from lowprec._checks import describe, fail
from lowprec.distributed.launch import Ranks
from lowprec.policy import quality_policy
from lowprec.policy_file import policy_to_dict
from lowprec.train.config import TrainConfig
from lowprec.train.data import TokenData
from lowprec.train.loop import train
from lowprec.train.models import load_model
from lowprec.train.report import CompareReport, RecipeRuns
from lowprec.train.result import RunResult
from lowprec.train.verdict import Family, Thresholds

BASELINE = "bf16"
RecipeLike = str | recipes.Recipe
"""A preset's name or a user's :class:`lowprec.recipes.Recipe`."""


def recipe_label(recipe: RecipeLike) -> str:
    """The name a recipe goes by in a comparison: a preset's name, or a user recipe's ``name``."""
    return recipe if isinstance(recipe, str) else recipe.name


def run_dir_name(recipe: RecipeLike) -> str:
    """A file-system-safe directory name for a recipe's run: a preset's name as it is, a user recipe's
    name lower-cased with every run of other characters than ``a-z 0-9 . _ -`` made one ``-``."""
    slug = re.sub(r"[^a-z0-9._-]+", "-", recipe_label(recipe).lower()).strip("-.")[:100]
    return slug or "recipe"


def _entries(text: str | Sequence[RecipeLike]) -> list[RecipeLike]:
    if isinstance(text, str):
        return [n.strip() for n in text.split(",") if n.strip()]
    if not isinstance(text, Sequence):
        fail("recipes", "a comma-separated str or a list of recipe names and lowprec.recipes.Recipe",
             describe(text), TypeError)
    return [n.strip() if isinstance(n, str) else n for n in text if not isinstance(n, str) or n.strip()]


def parse_recipes(text: str | Sequence[RecipeLike]) -> list[RecipeLike]:
    """Recipes from ``"bf16,fp8-current"`` or a list of names and user ``Recipe`` objects; the baseline is
    put first, added if missing. Each must have its own name, and its own run directory name."""
    entries = _entries(text)
    if not entries:
        fail("recipes", "a comma-separated list of recipe names", repr(text))
    for n in entries:
        r = recipes.get(n)  # refuses an unknown name, listing the presets
        if not isinstance(n, str) and r.name in recipes.PRESETS and r != recipes.get(r.name):
            fail("recipes", f"a user recipe named other than the preset {r.name!r}", repr(r.name))
    labels = [recipe_label(n) for n in entries]
    if len(set(labels)) != len(labels):
        fail("recipes", "each recipe once", repr(labels))
    dirs: dict[str, str] = {}
    for label, n in zip(labels, entries):
        other = dirs.setdefault(run_dir_name(n), label)
        if other != label:
            fail("recipes", "names that differ as directory names", f"{other!r} and {label!r} (both "
                 f"runs/{run_dir_name(n)})")
    return [BASELINE] + [n for n, label in zip(entries, labels) if label != BASELINE]


def check_seeds(seeds: int, recipe_seeds: int) -> None:
    """``seeds`` (the baseline's runs) at least 1, ``recipe_seeds`` (every other recipe's) from 1 to ``seeds``."""
    if isinstance(seeds, bool) or not isinstance(seeds, int) or seeds < 1:
        fail("seeds", "a whole number of seeds >= 1", describe(seeds))
    if isinstance(recipe_seeds, bool) or not isinstance(recipe_seeds, int) or not 1 <= recipe_seeds <= seeds:
        fail("recipe_seeds", f"a whole number from 1 to seeds ({seeds})", describe(recipe_seeds))


@dataclass(frozen=True, slots=True)
class Plan:
    """Which recipe trains with which seed, in the order the runs are made: seed by seed, the baseline
    first in each, so every recipe's first run comes before any of the baseline's extra seeds."""

    entries: tuple[RecipeLike, ...]
    seeds: tuple[int, ...]
    """The baseline's seeds: ``seed, seed + 1, ...``."""
    recipe_seeds: int
    """How many of them (the first) every other recipe trains with."""

    def recipes_of(self, seed: int) -> list[RecipeLike]:
        """The recipes that train with ``seed``."""
        first = self.seeds.index(seed) < self.recipe_seeds
        return [r for r in self.entries if first or recipe_label(r) == BASELINE]

    @property
    def n_runs(self) -> int:
        return sum(len(self.recipes_of(s)) for s in self.seeds)

    def run_dir(self, out_dir: str | Path | None, seed: int, recipe: RecipeLike) -> Path | None:
        """``runs/<recipe>`` with one seed, ``runs/<recipe>/seed-<seed>`` with several."""
        if out_dir is None:
            return None
        d = Path(out_dir) / "runs" / run_dir_name(recipe)
        return d / f"seed-{seed}" if len(self.seeds) > 1 else d
def quality_config(cfg: TrainConfig) -> TrainConfig:
    """``cfg`` with the policy a comparison converts with (:func:`lowprec.policy.quality_policy`): small
    layers converted too, unless ``cfg``'s policy sets ``skip_small`` itself."""
    return replace(cfg, policy=policy_to_dict(quality_policy(cfg.policy_object())))


def optimizer_suffix(cfg: TrainConfig) -> str:
    """The label suffix of a run with ``cfg``'s optimizer memory options: ``""`` with FP32 moments and
    masters, else e.g. ``"+fp8-states"`` or ``"+int8-states+sr-weights"`` (no master weights)."""
    parts = [f"+{cfg.optim_states}-states"] if cfg.optim_states != "fp32" else []
    return "".join(parts + ([] if cfg.master_weights else ["+sr-weights"]))


def compare_runs(entries: Sequence[RecipeLike], cfg: TrainConfig) -> list[tuple[str, TrainConfig]]:
    """Each run of a comparison, its label and settings. [Note: comparing optimizer states] With low-precision
    moments or without master weights, each recipe runs twice: as it is, with FP32 moments and masters (under
    its own name, the baseline ``bf16`` included), and with ``cfg``'s options (its name plus
    :func:`optimizer_suffix`); so ``bf16+fp8-states``'s gap to ``bf16`` is the loss the FP8 moments cost."""
    suffix = optimizer_suffix(cfg)
    reference = replace(cfg, optim_states="fp32", master_weights=True)
    runs = []
    for recipe in entries:
        label = recipe_label(recipe)
        if suffix:
            runs.append((label, replace(reference, recipe=recipe)))
        runs.append((label + suffix, replace(cfg, recipe=recipe)))
    return runs


def compare_plan(recipe_names: str | Sequence[RecipeLike], cfg: TrainConfig, seeds: int = 1,
                 recipe_seeds: int = 1) -> tuple[Plan, dict[str, TrainConfig]]:
    """The runs of a comparison: which label trains with which seed (:class:`Plan`), and each label's
    settings (:func:`compare_runs`: with optimizer memory options, every recipe twice)."""
    check_seeds(seeds, recipe_seeds)
    configs = dict(compare_runs(parse_recipes(recipe_names), quality_config(cfg)))
    return Plan(tuple(configs), tuple(cfg.seed + i for i in range(seeds)), recipe_seeds), configs


@dataclass(frozen=True, slots=True)
class Progress:
    """Where a comparison is: handed to ``on_step`` after every step of every run."""

    recipe: str
    """The recipe being trained (:func:`recipe_label`)."""
    index: int
    """The run's place among the comparison's runs, from 0."""
    n_runs: int
    """Runs in the comparison: every recipe's seeds."""
    steps: int
    """Steps per run."""
    row: dict[str, Any]
    """The step's log row (``step``, ``loss``, ``tokens_per_s``, ...)."""
    seed: int = 0

    @property
    def done(self) -> int:
        """Steps finished over all runs."""
        return self.index * self.steps + self.row["step"]

    @property
    def total(self) -> int:
        return self.n_runs * self.steps


def compare(model_spec: str, recipe_names: str | Sequence[RecipeLike], cfg: TrainConfig, data: TokenData, *,
            seeds: int = 1, recipe_seeds: int = 1, out_dir: str | Path | None = None,
            thresholds: Thresholds | None = None, on_result: Callable[[RunResult], None] | None = None,
            on_step: Callable[[Progress], None] | None = None) -> CompareReport:
    """Train ``model_spec`` per recipe and seed, each seed's recipes from one initialisation; the report
    (written to ``out_dir``).

    ``recipe_names``: names and user :class:`lowprec.recipes.Recipe` objects (see :func:`parse_recipes`).
    The baseline trains with ``seeds`` seeds (``cfg.seed`` and the next ones), every other recipe with the
    first ``recipe_seeds`` of them (see :class:`Plan`); each run's log goes to
    ``out_dir/runs/<run_dir_name(recipe)>``, in ``seed-<seed>`` under it with several seeds. ``on_step``
    sees every step's :class:`Progress`, ``on_result`` every run's result. Under
    ``cfg.parallel`` every rank calls this; every rank gets the report, rank 0 writes it. Every run converts
    with :func:`quality_config`'s policy.
    """
    cfg = quality_config(cfg)
    plan, configs = compare_plan(recipe_names, cfg, seeds, recipe_seeds)
    done: dict[str, list[tuple[int, RunResult]]] = {label: [] for label in plan.entries}
    index = 0
    for seed in plan.seeds:
        # one initialisation per seed, shared by every recipe that trains with it
        base, spec = load_model(model_spec, vocab_size=data.vocab_size, seed=seed)
        init_state = copy.deepcopy(base.state_dict())
        for label in plan.recipes_of(seed):
            model = copy.deepcopy(base)
            model.load_state_dict(init_state)
            hook = None
            if on_step is not None:
                def hook(row: dict[str, Any], label: str = label, index: int = index, seed: int = seed) -> None:
                    on_step(Progress(label, index, plan.n_runs, cfg.steps, row, seed))
            run_cfg = configs[label]
            # FP8 weights where the recipe casts weights; the BF16 baseline keeps its own
            fp8 = run_cfg.fp8_weights and recipes.get(run_cfg.recipe).fprop.rhs.quantized
            result = train(model, data, replace(run_cfg, seed=seed, fp8_weights=fp8), checkpoints=False,
                           on_step=hook, out_dir=plan.run_dir(out_dir, seed, label))
            result = replace(result, recipe=label)  # the report and its verdicts go by name
            done[label].append((seed, result))
            if on_result is not None:
                on_result(result)
            del model
            index += 1
    context = {
        "model": {"name": spec.name, "params": spec.n_params, "config": spec.config},
        "data": {"source": data.source, "fingerprint": data.fingerprint},
        "train": {k: v for k, v in cfg.to_dict().items() if k not in ("recipe", "progress")},
        "seeds": {"baseline": list(plan.seeds), "recipes": list(plan.seeds[:recipe_seeds])},
        "device": cfg.device, "lowprec_version": lowprec.__version__, "torch_version": torch.__version__,
        "python_version": platform.python_version(),
    }
    runs = tuple(RecipeRuns(label, Family.of(configs[label].recipe), *map(tuple, zip(*done[label])))
                 for label in plan.entries)
    report = CompareReport(runs=runs, baseline=BASELINE, context=context, thresholds=thresholds or Thresholds())
    if out_dir is not None and Ranks.of(cfg.parallel).is_main:
        report.write(out_dir)
    return report
