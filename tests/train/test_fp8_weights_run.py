"""``TrainConfig(fp8_weights=True)``: the same curve as BF16 weights with FP32 masters, resumed exactly."""
from __future__ import annotations

from dataclasses import replace

import pytest

from lowprec.train.config import TrainConfig
from tests.train.runs import CFG, Stop, run, stop_at

FP8 = replace(CFG, recipe="fp8-current", dtype="bfloat16", steps=3, save_every=2, eval_every=3)


def _curve(result):
    return [(r["step"], r["loss"], r["grad_norm"], r["val_loss"]) for r in result.history]


def test_fp8_weights_train_as_bf16_weights_and_resume_bit_for_bit(tmp_path, data):
    bf16_weights = run(data, FP8)
    whole = run(data, replace(FP8, fp8_weights=True), out_dir=tmp_path / "whole")
    assert _curve(whole) == _curve(bf16_weights)  # the forward sees the same codes: see the Note
    assert "weight(s) stored in FP8" in whole.conversion
    with pytest.raises(Stop):  # saved after step 2, stopped after step 3
        run(data, replace(FP8, fp8_weights=True), out_dir=tmp_path / "cut", on_step=stop_at(3))
    resumed = run(data, replace(FP8, fp8_weights=True), out_dir=tmp_path / "cut", resume=True)
    assert _curve(resumed) == _curve(whole)


def test_fp8_weights_need_low_precision_parameters_and_run_under_ddp_and_fsdp2():
    with pytest.raises(ValueError, match="^fp8_weights: expected dtype bfloat16 or float16 .* got dtype float32"):
        TrainConfig(fp8_weights=True)
    for parallel in ("ddp", "fsdp2"):
        assert TrainConfig(fp8_weights=True, dtype="bfloat16", parallel=parallel, recipe="mxfp8").fp8_weights
