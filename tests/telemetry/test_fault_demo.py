"""Issue #14's demonstration, end to end through ``lowprec.train``: from step 10 one input channel of the
attention's output projection ``wo``, in both blocks, is scaled in training by 1e7 (an outlier channel, as LLM
activations grow them), and the weight column that reads it divided by 1e7, so that in exact arithmetic nothing changes:
a BF16 run trains as without the fault, and any difference is the casts'. Under per-tensor FP8 the outlier sets
the scale and every other channel of that input is flushed to zero (and the column of the weight with it), so
the attention contributes nothing; the telemetry names the layers and the operand, the controller moves those
layers' GEMMs that read the input to BF16, and the run ends near BF16, far from the run without control."""
from __future__ import annotations

import csv
from dataclasses import replace

import pytest
import torch
from torch import nn
from torch.nn.utils import parametrize

from lowprec.telemetry.control import ControlConfig
from lowprec.train.config import TrainConfig
from lowprec.train.data import load_data
from lowprec.train.loop import train
from lowprec.train.model import build_model
from tests.train.runs import MICRO

pytestmark = pytest.mark.slow

LAYERS, FAULT_STEP, FACTOR = ("layers.0.attention.wo", "layers.1.attention.wo"), 10, 1e7
CFG = TrainConfig(recipe="fp8-current", steps=150, batch_size=4, seq_len=32, eval_every=150, val_batches=8,
                  warmup_steps=4, lr=3e-3, tensorboard=False, progress=False, telemetry_every=1,
                  policy={"skip_small": False})
# held until the run ends: a layer in BF16 reports no figures, so with the default hold the controller
# would try FP8 again after 20 steps, find the fault, and widen again (tested in test_control.py)
AUTO = ControlConfig(auto=True, settle_steps=1000)
RECOVERED = 0.25
"""The controlled run's gap to BF16, at most this fraction of the uncontrolled run's (the controller recovers three
quarters of it or more). Measured, final validation loss over 8 batches at PyTorch's default dispatch level: BF16
2.908, without control 4.094, with control 3.001 (a fraction of 0.08); BF16 2.868 and without control 4.488 at AVX2.
The rounding of another CPU moves BF16 by a few hundredths over 150 steps and the uncontrolled run by tenths;
the controlled run's gap (0.09) is a third of its bound (0.30)."""


class _Compensated(nn.Module):
    """The weight as the faulty layer reads it: the outlier channel's column divided by ``FACTOR`` while the
    fault is on, so that the product (and the parameter's gradient) is, in exact arithmetic, what it was."""

    def __init__(self):
        super().__init__()
        self.on = False

    def forward(self, weight: torch.Tensor) -> torch.Tensor:  # (out, in)
        if not self.on:
            return weight
        scale = torch.ones_like(weight[0])
        scale[0] = 1 / FACTOR
        return weight * scale


def _faulty_run(data, cfg, out):
    model = build_model(MICRO, seed=0)
    seen = {"step": 0}

    def outlier_channel(module, args):
        # in training only: validation reads clean activations, so it measures what training left in the weights
        module.parametrizations.weight[0].on = on = module.training and seen["step"] >= FAULT_STEP
        if on:
            x = args[0].clone()
            x[..., 0] *= FACTOR
            return (x,)
        return None

    def on_step(row):
        seen["step"] = row["step"]
        if row["step"] == 1:  # converted in place by now: fault the modules that run
            for name in LAYERS:
                layer = dict(model.named_modules())[name]
                parametrize.register_parametrization(layer, "weight", _Compensated())
                layer.register_forward_pre_hook(outlier_channel)

    return train(model, data, cfg, out_dir=out, checkpoints=False, on_step=on_step)


def _rows(path):
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def test_an_outlier_channel_is_seen_widened_and_the_loss_recovers(tmp_path):
    data = load_data()
    bf16 = _faulty_run(data, replace(CFG, recipe="bf16"), tmp_path / "bf16")
    plain = _faulty_run(data, CFG, tmp_path / "plain")
    auto = _faulty_run(data, replace(CFG, control=AUTO), tmp_path / "auto")

    # the telemetry of the first faulty step names the layers and the operand: all of the input but the
    # outlier flushed to zero, while the SQNR, dominated by the outlier's energy, looks healthy
    step = [r for r in _rows(tmp_path / "plain" / "telemetry.csv") if int(r["step"]) == FAULT_STEP + 1]
    flushed = {(r["layer"], r["gemm"]) for r in step if r["operand"] == "input" and float(r["underflow"]) > 0.9}
    assert flushed == {(name, gemm) for name in LAYERS for gemm in ("fprop", "wgrad")}
    assert all(float(r["sqnr_db"]) > 25 for r in step if (r["layer"], r["gemm"]) in flushed)
    # the controller widened exactly the GEMMs that read that input, at that step, and nothing else
    switches = _rows(tmp_path / "auto" / "switches.csv")
    assert {(s["step"], s["layer"], s["gemm"], s["to_recipe"]) for s in switches} == {
        (str(FAULT_STEP + 1), name, gemm, "bf16") for name in LAYERS for gemm in ("fprop", "wgrad")}
    assert not (tmp_path / "plain" / "switches.csv").exists()
    # and the run ends near BF16 under the same fault, the run without control far from it
    gap_plain = plain.final_val_loss - bf16.final_val_loss
    gap_auto = auto.final_val_loss - bf16.final_val_loss
    assert gap_plain > 0 and abs(gap_auto) < RECOVERED * gap_plain, (bf16.final_val_loss, plain.final_val_loss,
                                                                    auto.final_val_loss)
