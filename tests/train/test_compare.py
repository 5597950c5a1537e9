import importlib
import math
import warnings
from dataclasses import replace

import pytest
import torch

from lowprec import recipes as R
from lowprec.train.compare import compare, parse_recipes, quality_config, run_dir_name
from lowprec.train.config import TrainConfig
from lowprec.train.data import load_data
from lowprec.train.logs import read_log
from lowprec.train.loop import train
from lowprec.train.models import load_model
from lowprec.train.result import RunResult
from tests.small_rule import native_small_rule  # noqa: F401 (a fixture)


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
        assert replace(run_cfg, recipe="bf16") == replace(quality_config(cfg), recipe="bf16")
        assert run_cfg.policy == {"skip_small": False}  # a quality question converts small layers too
        assert kw["out_dir"].parent == tmp_path / "runs" and kw["checkpoints"] is False
    assert [r["verdict"] for r in report.rows()] == ["PASS"] * 3
    assert report.context["data"]["fingerprint"] == load_data().fingerprint
    assert (tmp_path / "report.html").is_file()
    assert math.isfinite(report.rows()[1]["gap_to_baseline"])


def _mine(name: str) -> R.Recipe:
    return replace(R.fp8_current(), name=name, doc="")


def test_a_user_recipe_trains_under_a_file_system_safe_directory(tmp_path):
    # it crashed after training bf16: "unsupported operand type(s) for /: 'PosixPath' and 'Recipe'"
    mine = _mine("My FP8/current recipe")
    cfg = TrainConfig(steps=2, batch_size=2, seq_len=16, val_batches=1, eval_every=2, tensorboard=False,
                      progress=False)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "GEMMs are emulated on cpu"
        report = compare("tiny", [mine], cfg, load_data(), out_dir=tmp_path)
    assert [r["recipe"] for r in report.rows()] == ["bf16", "My FP8/current recipe"]
    assert sorted(p.name for p in (tmp_path / "runs").iterdir()) == ["bf16", "my-fp8-current-recipe"]
    rows = read_log(tmp_path / "runs" / "my-fp8-current-recipe" / "log.csv")
    assert [r["step"] for r in rows] == ["1", "2"]
    assert "My FP8/current recipe" in (tmp_path / "report.md").read_text()
    assert math.isfinite(report.rows()[1]["final_val_loss"])


@pytest.mark.parametrize("name, slug", [
    ("fp8-current", "fp8-current"), ("My FP8/current recipe", "my-fp8-current-recipe"), ("../../etc", "etc"),
    ("..", "recipe"), ("Ünïcode ☃ name", "n-code-name"), ("a" * 300, "a" * 100),
])
def test_run_directory_names_are_safe(name, slug):
    assert run_dir_name(name if name in R.names() else _mine(name)) == slug


def test_user_recipes_need_names_of_their_own():
    mine = _mine("mine")
    assert parse_recipes(["mxfp8", mine]) == ["bf16", "mxfp8", mine]
    assert parse_recipes([R.fp8_current(), "mxfp8"]) == ["bf16", R.fp8_current(), "mxfp8"]  # a preset as it is
    with pytest.raises(ValueError, match=r"recipes: expected a user recipe named other than the preset "
                                         r"'fp8-current', got 'fp8-current'"):
        parse_recipes([replace(R.fp8_current(), name="fp8-current", hp_last_fraction=0.5)])
    with pytest.raises(ValueError, match=r"recipes: expected each recipe once, got \['mine', 'mine'\]"):
        parse_recipes([mine, _mine("mine")])
    with pytest.raises(ValueError, match=r"recipes: expected names that differ as directory names, got 'My Run' "
                                         r"and 'my-run' \(both runs/my-run\)"):
        parse_recipes([_mine("My Run"), _mine("my-run")])


def test_every_step_of_every_recipe_reports_the_comparison_s_progress(monkeypatch):
    def fake_train(model, data, cfg, on_step=None, **kw):
        history = tuple({"step": s, "loss": 2.0, "val_loss": None, "lr": 1e-3, "skipped": False,
                         "tokens_per_s": 10.0 * s} for s in range(1, cfg.steps + 1))
        for row in history:
            on_step(row)
        return RunResult(recipe=cfg.recipe, history=history, tokens_per_s=1.0, peak_memory_bytes=None,
                         diverged=False, conversion="")

    monkeypatch.setattr(importlib.import_module("lowprec.train.compare"), "train", fake_train)
    seen = []
    compare("tiny", ["mxfp8", _mine("mine")], TrainConfig(steps=3, tensorboard=False, progress=False), load_data(),
            on_step=seen.append)
    assert [(p.recipe, p.index, p.row["step"], p.done, p.total, p.seed) for p in seen] == [
        (name, i, s, 3 * i + s, 9, 0) for i, name in enumerate(["bf16", "mxfp8", "mine"]) for s in (1, 2, 3)]
    seen.clear()
    compare("tiny", ["mxfp8"], TrainConfig(steps=2, seed=4, tensorboard=False, progress=False), load_data(),
            seeds=3, recipe_seeds=2, on_step=seen.append)
    assert [(p.recipe, p.seed, p.index, p.done, p.total) for p in seen if p.row["step"] == 2] == [
        ("bf16", 4, 0, 2, 10), ("mxfp8", 4, 1, 4, 10), ("bf16", 5, 2, 6, 10), ("mxfp8", 5, 3, 8, 10),
        ("bf16", 6, 4, 10, 10)]


def _fake_val(losses):
    """A train() that gives each (recipe, seed) the final validation loss ``losses`` names, and records
    what it was given."""
    calls = []

    def fake_train(model, data, cfg, out_dir=None, **kw):
        calls.append((cfg.recipe, cfg.seed, out_dir, next(iter(model.state_dict().values())).clone()))
        val = losses[(cfg.recipe, cfg.seed)]
        history = ({"step": 1, "loss": val, "val_loss": val, "lr": 1e-3, "skipped": False},)
        return RunResult(recipe=cfg.recipe, history=history, tokens_per_s=1.0, peak_memory_bytes=None,
                         diverged=False, conversion="")

    return fake_train, calls


def test_seeds_train_the_baseline_k_times_and_each_recipe_on_the_first_m(monkeypatch, tmp_path):
    losses = {("bf16", 3): 2.0, ("bf16", 4): 2.2, ("bf16", 5): 2.1, ("mxfp8", 3): 2.15, ("mxfp8", 4): 2.35,
              ("nvfp4", 3): 2.5, ("nvfp4", 4): 2.6}
    fake, calls = _fake_val(losses)
    monkeypatch.setattr(importlib.import_module("lowprec.train.compare"), "train", fake)
    cfg = TrainConfig(steps=1, seed=3, tensorboard=False, progress=False)
    report = compare("tiny", "mxfp8,nvfp4", cfg, load_data(), seeds=3, recipe_seeds=2, out_dir=tmp_path)
    assert [(c[0], c[1]) for c in calls] == [("bf16", 3), ("mxfp8", 3), ("nvfp4", 3), ("bf16", 4), ("mxfp8", 4),
                                             ("nvfp4", 4), ("bf16", 5)]
    assert [c[2] for c in calls[:2]] == [tmp_path / "runs" / "bf16" / "seed-3", tmp_path / "runs" / "mxfp8" / "seed-3"]
    # a seed's recipes start from one initialisation, and another seed from another
    assert torch.equal(calls[0][3], calls[2][3]) and not torch.equal(calls[0][3], calls[3][3])
    rows = {r["recipe"]: r for r in report.rows()}
    assert rows["bf16"]["seeds"] == [3, 4, 5] and rows["mxfp8"]["val_losses"] == [2.15, 2.35]
    # pooled over bf16 (mean 2.1, squares 0.02) and mxfp8 (mean 2.25, squares 0.02): s^2 = 0.04 / 3
    noise = 2 * math.sqrt(0.04 / 3) * math.sqrt(1 / 2 + 1 / 3) / 2.1
    assert rows["mxfp8"]["gap_to_baseline"] == pytest.approx(0.15 / 2.1)
    assert rows["mxfp8"]["noise"] == pytest.approx(noise)
    # +7.1% within the noise of ±10.0%; nvfp4's +21.4% beyond 5% + its noise (7.9%)
    assert (rows["mxfp8"]["label"], rows["nvfp4"]["verdict"]) == ("WARN (within noise)", "FAIL")
    assert report.context["seeds"] == {"baseline": [3, 4, 5], "recipes": [3, 4]}
    assert "bf16 over 3 seeds" in (tmp_path / "report.md").read_text()


@pytest.mark.parametrize("seeds, recipe_seeds, message", [
    (0, 1, r"seeds: expected a whole number of seeds >= 1, got 0 \(int\)"),
    (2.0, 1, r"seeds: expected a whole number of seeds >= 1, got 2.0 \(float\)"),
    (2, 3, r"recipe_seeds: expected a whole number from 1 to seeds \(2\), got 3 \(int\)"),
    (2, 0, r"recipe_seeds: expected a whole number from 1 to seeds \(2\), got 0 \(int\)"),
])
def test_bad_seed_counts_are_refused_before_anything_trains(seeds, recipe_seeds, message):
    with pytest.raises(ValueError, match=message):
        compare("tiny", "mxfp8", TrainConfig(steps=1), load_data(), seeds=seeds, recipe_seeds=recipe_seeds)


_SHORT = TrainConfig(steps=1, batch_size=2, seq_len=16, val_batches=1, eval_every=1, tensorboard=False,
                     progress=False)


@pytest.mark.usefixtures("native_small_rule")
def test_compare_converts_the_small_layers_a_native_device_keeps_for_speed(data):
    # the GPU's rule is on: train with the default policy keeps every linear of the tiny model (all under
    # 1024 features) in BF16, as `compare --model small` on the H200 did, and then said PASS
    model, _ = load_model("tiny", vocab_size=data.vocab_size, seed=0)
    kept = train(model, data, replace(_SHORT, recipe="fp8-current"), checkpoints=False)
    assert (kept.coverage.converted, kept.coverage.linears) == (0, 29)
    assert "too small to gain on cpu" in kept.conversion
    report = compare("tiny", "fp8-current", _SHORT, data)
    fp8 = report.rows()[1]
    # every linear but the LM head runs the recipe, and the report says so
    assert fp8["converted"] == "28 of 29 linears converted (96% of linear parameters)"
    assert fp8["coverage"]["kept"] == {"policy": 1} and fp8["verdict"] != "NOT TESTED"
    assert report.context["train"]["policy"] == {"skip_small": False}


@pytest.mark.usefixtures("native_small_rule")
def test_a_policy_s_own_skip_small_wins_and_its_other_fields_are_kept(data):
    report = compare("tiny", "fp8-current", replace(_SHORT, policy={"skip_small": True}), data)
    fp8 = report.rows()[1]
    assert fp8["verdict"] == "NOT TESTED" and fp8["coverage"]["converted"] == 0
    assert fp8["reason"].startswith("0 of 29 linears converted (0% of linear parameters): no linear ran it")
    assert quality_config(replace(_SHORT, policy={"exclude": ["layers.0.*"]})).policy == {
        "exclude": ["layers.0.*"], "skip_small": False}
    assert quality_config(replace(_SHORT, policy={"skip_small": None})).policy == {"skip_small": False}
