"""``TrainConfig(fp8_weights=True)``: the same curve as BF16 weights with FP32 masters, resumed exactly."""
from __future__ import annotations

import warnings
from dataclasses import replace

import pytest

from lowprec.train.config import TrainConfig
from lowprec.train.data import load_data
from tests.train.runs import CFG, run

FP8 = replace(CFG, recipe="fp8-current", dtype="bfloat16", steps=3, save_every=2, eval_every=3)


@pytest.fixture(autouse=True)
def _quiet():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "emulated on cpu" is expected here
        yield


def _curve(result):
    return [(r["step"], r["loss"], r["grad_norm"], r["val_loss"]) for r in result.history]


class _Stop(Exception):
    pass


def _stop_after_3(row):
    if row["step"] == 3:
        raise _Stop


def test_fp8_weights_train_as_bf16_weights_and_resume_bit_for_bit(tmp_path):
    data = load_data()
    bf16_weights = run(data, FP8)
    whole = run(data, replace(FP8, fp8_weights=True), out_dir=tmp_path / "whole")
    assert _curve(whole) == _curve(bf16_weights)  # the forward sees the same codes: see the Note
    assert "weight(s) stored in FP8" in whole.conversion
    with pytest.raises(_Stop):  # saved after step 2, stopped after step 3
        run(data, replace(FP8, fp8_weights=True), out_dir=tmp_path / "cut", on_step=_stop_after_3)
    resumed = run(data, replace(FP8, fp8_weights=True), out_dir=tmp_path / "cut", resume=True)
    assert _curve(resumed) == _curve(whole)


def test_fp8_weights_need_low_precision_parameters_in_one_process():
    with pytest.raises(ValueError, match="^fp8_weights: expected dtype bfloat16 or float16 .* got dtype float32"):
        TrainConfig(fp8_weights=True)
    with pytest.raises(ValueError, match="^fp8_weights: expected parallel 'none'"):
        TrainConfig(fp8_weights=True, dtype="bfloat16", parallel="ddp")
