"""The issue's demonstration: one layer's input scaled by 1e4 from step K on, under fp8-delayed. The
telemetry names the layer and the operand that saturated, the controller widens that layer's GEMMs
that read it (switches.csv names them) and lets them back once they settle, and the loss after the
fault stays with the run that had none.

The fault multiplies the input of ``layers.0.feed_forward.w2`` by 1e4 and its output by 1e-4 (forward
hooks installed after the conversion): in exact arithmetic the model is unchanged, so any difference
from the no-fault run is the casts' doing. Delayed scaling casts step K's input with the scale of the
steps before, so nearly every element saturates; its amax history then follows the jump by at most
2^8 per step (``DelayedScaling.outlier_bits``), so without control step K+1 saturates too."""
from __future__ import annotations

import csv
import warnings
from dataclasses import replace

import pytest

from lowprec.telemetry.control import ControlConfig
from lowprec.telemetry.records import read_records
from lowprec.telemetry.trouble import TROUBLE_THRESHOLD, rank_layers
from tests.train.runs import CFG, MICRO, build_model, run

K = 6
LAYER = "layers.0.feed_forward.w2"
# judge saturation alone: fp8-delayed's early gradients lose SQNR in every layer without any fault
CONTROL = ControlConfig(auto=True, sqnr_floor_db=0.0, saturation_ceiling=0.1, settle_steps=4)
DEMO = replace(CFG, recipe="fp8-delayed", steps=14, eval_every=14, warmup_steps=3, batch_size=2,
               telemetry_every=1)


def _run(data, out, fault: bool, control: ControlConfig | None = None):
    model = build_model(MICRO, seed=0)

    def inject(row):
        if fault and row["step"] == K - 1:  # the converted layer exists from the first step on
            layer = dict(model.named_modules())[LAYER]
            layer.register_forward_pre_hook(lambda m, args: (args[0] * 1e4,))
            layer.register_forward_hook(lambda m, args, y: y * 1e-4)

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # GEMMs emulated on the CPU
        result = run(data, replace(DEMO, control=control or ControlConfig()), model=model, out_dir=out,
                     checkpoints=False, on_step=inject)
    return [row["loss"] for row in result.history], read_records(out / "telemetry.csv")


def _saturated(records, step: int) -> set[tuple[str, str, str]]:
    return {(r.layer, r.gemm, r.operand) for r in records if r.step == step and r.saturation > 0.5}


def _flagged(records) -> set[str]:
    return {t.layer for t in rank_layers(records) if t.score >= TROUBLE_THRESHOLD}


@pytest.fixture(scope="module")
def data():
    from lowprec.train.data import corpus_data
    return corpus_data()


def test_an_input_scaled_by_1e4_is_seen_widened_and_the_loss_recovers(data, tmp_path):
    clean, clean_records = _run(data, tmp_path / "clean", fault=False)
    faulty, faulty_records = _run(data, tmp_path / "faulty", fault=True)
    # inspect's trouble score flags the faulted layer alone, and nothing in the run without the fault
    assert _flagged(faulty_records) == {LAYER} and _flagged(clean_records) == set()
    auto, auto_records = _run(data, tmp_path / "auto", fault=True, control=CONTROL)
    # the telemetry names the layer and the operand: its input, in the two GEMMs that read it
    hit = {(LAYER, "fprop", "input"), (LAYER, "wgrad", "input")}
    assert _saturated(faulty_records, K - 1) == set() and _saturated(faulty_records, K) == hit
    assert _saturated(faulty_records, K + 1) == hit  # the history has not caught up yet
    with (tmp_path / "auto" / "switches.csv").open() as f:
        switches = [(int(s["step"]), s["layer"], s["gemm"], s["from_recipe"], s["to_recipe"], s["reason"][:10])
                    for s in csv.DictReader(f)]
    # widened after step K, the GEMMs that read the input run in BF16 from K+1, then go back once settled
    assert switches == [(K, LAYER, g, "fp8-delayed", "bf16", "saturation") for g in ("fprop", "wgrad")] + \
        [(K + 4, LAYER, g, "bf16", "fp8-delayed", "settled fo") for g in ("fprop", "wgrad")]
    assert _saturated(auto_records, K) == hit and not any(_saturated(auto_records, s) for s in range(K + 1, 15))
    # steps K+1.. stay within 0.02 nats of the no-fault run (the damage of delayed scaling's two saturated
    # steps is itself small here: its outlier cap lets the history catch up; see the module docstring)
    assert max(abs(a - c) for a, c in zip(auto[K:], clean[K:])) < 0.02
    assert faulty[K - 1] != clean[K - 1] and auto[K - 1] == faulty[K - 1]  # step K ran faulted in both
