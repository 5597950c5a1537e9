import importlib
import math
from dataclasses import replace

import pytest
import torch

from lowprec.train.compare import compare, parse_recipes
from lowprec.train.config import TrainConfig
from lowprec.train.data import load_data
from lowprec.train.result import RunResult


def test_parse_recipes_puts_the_baseline_first_and_refuses_bad_lists():
    assert parse_recipes("mxfp8, fp8-current") == ["bf16", "mxfp8", "fp8-current"]
    assert parse_recipes("nvfp4,bf16") == ["bf16", "nvfp4"]
    with pytest.raises(ValueError, match="recipe: expected one of bf16"):
        parse_recipes("bf16,fp3")
    with pytest.raises(ValueError, match="recipes: expected each recipe once"):
        parse_recipes("mxfp8,mxfp8")
    with pytest.raises(ValueError, match="recipes: expected a comma-separated list"):
        parse_recipes(" , ")


def test_every_recipe_starts_from_the_same_weights_with_the_same_settings(monkeypatch, tmp_path):
    seen = []

    def fake_train(model, data, cfg, **kw):
        seen.append(({k: v.clone() for k, v in model.state_dict().items()}, cfg, kw))
        with torch.no_grad():  # a real run changes its model: the next recipe must not see that
            for p in model.parameters():
                p.add_(1.0)
        history = ({"step": 1, "loss": 2.0, "val_loss": 2.0, "lr": 1e-3, "skipped": False},)
        return RunResult(recipe=cfg.recipe, history=history, tokens_per_s=1.0, peak_memory_bytes=None,
                         diverged=False, conversion="")

    # the module, not the function of the same name that lowprec.train exports
    monkeypatch.setattr(importlib.import_module("lowprec.train.compare"), "train", fake_train)
    cfg = TrainConfig(steps=1, seed=7, tensorboard=False, progress=False)
    report = compare("tiny", "mxfp4,fp8-current", cfg, load_data(), out_dir=tmp_path)
    assert [s[1].recipe for s in seen] == ["bf16", "mxfp4", "fp8-current"]
    first = seen[0][0]
    for state, run_cfg, kw in seen[1:]:
        assert state.keys() == first.keys() and all(torch.equal(state[k], first[k]) for k in first)
        assert replace(run_cfg, recipe="bf16") == replace(cfg, recipe="bf16")
        assert kw["out_dir"].parent == tmp_path / "runs" and kw["checkpoints"] is False
    assert [r["verdict"] for r in report.rows()] == ["PASS"] * 3
    assert report.context["data"]["fingerprint"] == load_data().fingerprint
    assert (tmp_path / "report.html").is_file()
    assert math.isfinite(report.rows()[1]["gap_to_baseline"])
