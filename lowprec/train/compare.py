"""Compare recipes against BF16: the same model, initialisation and data order for every recipe.

One model is built and initialised once; each recipe gets a fresh copy of that state dict before
it is converted, and :meth:`TokenData.train_batch` gives every run the same batches. So the loss
curves differ only by the recipe (and by the random draws of stochastic rounding it makes).
"""
from __future__ import annotations

import copy
import platform
from collections.abc import Callable, Sequence
from dataclasses import replace
from pathlib import Path

import torch

import lowprec
from lowprec import recipes
from lowprec._checks import fail
from lowprec.distributed.launch import Ranks
from lowprec.train.config import TrainConfig
from lowprec.train.data import TokenData
from lowprec.train.loop import train
from lowprec.train.models import load_model
from lowprec.train.report import CompareReport, Thresholds
from lowprec.train.result import RunResult

BASELINE = "bf16"


def parse_recipes(text: str | Sequence[str]) -> list[str]:
    """Recipe names from ``"bf16,fp8-current"`` or a list; the baseline is put first, added if missing."""
    names = [n.strip() for n in text.split(",")] if isinstance(text, str) else list(text)
    names = [n for n in names if n]
    if not names:
        fail("recipes", "a comma-separated list of recipe names", repr(text))
    for n in names:
        recipes.get(n)  # refuses an unknown name, listing the presets
    if len(set(names)) != len(names):
        fail("recipes", "each recipe once", repr(text))
    return [BASELINE] + [n for n in names if n != BASELINE]


def compare(model_spec: str, recipe_names: str | Sequence[str], cfg: TrainConfig, data: TokenData, *,
            out_dir: str | Path | None = None, thresholds: Thresholds | None = None,
            on_result: Callable[[RunResult], None] | None = None) -> CompareReport:
    """Train ``model_spec`` once per recipe from one initialisation; the report (written to ``out_dir``).

    Under ``cfg.parallel`` every rank calls this; every rank gets the report, rank 0 writes it.
    """
    names = parse_recipes(recipe_names)
    base, spec = load_model(model_spec, vocab_size=data.vocab_size, seed=cfg.seed)
    init_state = copy.deepcopy(base.state_dict())
    results = []
    for name in names:
        model = copy.deepcopy(base)
        model.load_state_dict(init_state)
        run_dir = Path(out_dir) / "runs" / name if out_dir is not None else None
        result = train(model, data, replace(cfg, recipe=name), out_dir=run_dir, checkpoints=False)
        results.append(result)
        if on_result is not None:
            on_result(result)
        del model
    context = {
        "model": {"name": spec.name, "params": spec.n_params, "config": spec.config},
        "data": {"source": data.source, "fingerprint": data.fingerprint},
        "train": {k: v for k, v in cfg.to_dict().items() if k not in ("recipe", "progress")},
        "device": cfg.device, "lowprec_version": lowprec.__version__, "torch_version": torch.__version__,
        "python_version": platform.python_version(),
    }
    report = CompareReport(results=tuple(results), baseline=BASELINE, context=context,
                           thresholds=thresholds or Thresholds())
    if out_dir is not None and Ranks.of(cfg.parallel).is_main:
        report.write(out_dir)
    return report
