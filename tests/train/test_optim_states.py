"""Training with low-precision optimizer states: the loss gap to FP32 moments, exact resumes, the compare
workflow's runs, and the settings refused."""
from __future__ import annotations

from dataclasses import replace

import pytest

from lowprec import recipes
from lowprec.optim import AdamWLP
from lowprec.train.compare import compare_runs, optimizer_suffix
from lowprec.train.config import TrainConfig
from tests.train.runs import CFG, Stop, run, stop_at

TRAIN = replace(CFG, steps=30, eval_every=30, warmup_steps=3, val_batches=2, dtype="bfloat16")


@pytest.fixture(scope="module")
def fp32_states(data):
    return run(data, TRAIN)


@pytest.mark.parametrize(("states", "masters"), [("bf16", True), ("fp8", True), ("int8", True), ("fp8", False)])
def test_a_tiny_model_trains_to_within_a_small_gap_of_fp32_moments(data, fp32_states, states, masters):
    result = run(data, replace(TRAIN, optim_states=states, master_weights=masters))
    start, ref = fp32_states.history[0]["loss"], fp32_states.final_val_loss
    assert ref < start - 1.0  # the reference learned
    gap = (result.final_val_loss - ref) / ref
    assert abs(gap) <= 0.02, gap


@pytest.mark.parametrize(("states", "masters"), [("fp8", True), ("int8", False)])
def test_resume_repeats_the_curve_bit_for_bit(data, tmp_path, states, masters):
    cfg = replace(CFG, steps=4, save_every=2, eval_every=2, dtype="bfloat16", optim_states=states,
                  master_weights=masters)
    whole = run(data, cfg, out_dir=tmp_path / "whole")
    with pytest.raises(Stop):
        run(data, cfg, out_dir=tmp_path / "cut", on_step=stop_at(3))  # stopped after step 3, saved at 2
    resumed = run(data, cfg, out_dir=tmp_path / "cut", resume=True)
    curve = lambda r: [(row["loss"], row["val_loss"], row["grad_norm"]) for row in r.history]  # noqa: E731
    assert curve(resumed) == curve(whole)


def test_resume_refuses_other_optimizer_states(data, tmp_path):
    cfg = replace(CFG, optim_states="fp8")
    run(data, cfg, out_dir=tmp_path)
    with pytest.raises(ValueError, match="optim_states: expected 'fp8' as in the checkpoint being resumed, got 'int8'"):
        run(data, replace(cfg, steps=3, optim_states="int8"), out_dir=tmp_path, resume=True)


def test_the_optimizer_built_holds_the_chosen_states(data):
    from lowprec.train.loop import build_optimizer
    from lowprec.train.model import build_model
    from tests.train.runs import MICRO

    opt = build_optimizer(build_model(MICRO), replace(CFG, optim_states="int8"), recipes.get("bf16"))
    assert isinstance(opt.optimizer, AdamWLP) and opt.optimizer.states.value == "int8"


def test_compare_runs_each_recipe_with_fp32_moments_beside_the_chosen_ones():
    cfg = replace(CFG, optim_states="fp8", master_weights=False, dtype="bfloat16")
    runs = compare_runs(["bf16", "fp8-current"], cfg)
    assert [label for label, _ in runs] == ["bf16", "bf16+fp8-states+sr-weights", "fp8-current",
                                            "fp8-current+fp8-states+sr-weights"]
    assert [(c.recipe, c.optim_states, c.master_weights) for _, c in runs] == [
        ("bf16", "fp32", True), ("bf16", "fp8", False), ("fp8-current", "fp32", True),
        ("fp8-current", "fp8", False)]
    assert optimizer_suffix(CFG) == "" and [label for label, _ in compare_runs(["bf16"], CFG)] == ["bf16"]


def test_settings_refused():
    with pytest.raises(ValueError, match="optim_states: expected one of 'fp32', 'bf16', 'fp8', 'int8', got 'fp16'"):
        TrainConfig(optim_states="fp16")
    for states in ("bf16", "fp8", "int8"):  # elementwise, or groups inside rows under FSDP2: all reshard
        assert TrainConfig(optim_states=states, parallel="fsdp2").optim_states == states
    with pytest.raises(ValueError, match="master_weights: expected True for float32 parameters"):
        TrainConfig(master_weights=False)
    with pytest.raises(ValueError, match=r"master_weights: expected True under ddp/fsdp2"):
        TrainConfig(master_weights=False, dtype="bfloat16", parallel="ddp")
    with pytest.raises(TypeError, match="master_weights: expected a bool, got 'no'"):
        TrainConfig(master_weights="no", dtype="bfloat16")
