"""``lowprec train``'s telemetry: telemetry.csv rows on the sampled steps, a run's numbers unchanged by
it, a resumed run's file equal to an uninterrupted run's, and the precision controller judging the sampled
steps' figures."""
from __future__ import annotations

import csv
import math
import warnings
from dataclasses import replace

import pytest

from lowprec.telemetry.control import ControlConfig
from lowprec.telemetry.records import read_records
from lowprec.train.config import TrainConfig
from lowprec.train.data import load_data
from lowprec.train.loop import train
from lowprec.train.model import ModelConfig, build_model

MICRO = ModelConfig(dim=64, n_layers=1, n_heads=2, n_kv_heads=1, ffn_dim=128, max_seq_len=32)
CFG = TrainConfig(recipe="fp8-current", steps=4, batch_size=2, seq_len=16, eval_every=4, val_batches=1,
                  warmup_steps=1, tensorboard=False, progress=False, telemetry_every=2)
LINEARS = 7  # q, k, v, o and the three FFN projections; the head is kept in high precision


class _Stop(Exception):
    pass


@pytest.fixture(scope="module")
def data():
    return load_data()


def _run(data, cfg, **kw):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "emulated on cpu"
        return train(build_model(MICRO, seed=0), data, cfg, **kw)


def test_sampled_steps_write_rows_and_change_no_number(data, tmp_path):
    sampled = _run(data, CFG, out_dir=tmp_path / "on", checkpoints=False)
    plain = _run(data, replace(CFG, telemetry_every=0), out_dir=tmp_path / "off", checkpoints=False)
    timings = ("tokens_per_s", "elapsed_s")
    assert [{k: v for k, v in row.items() if k not in timings} for row in sampled.history] == \
        [{k: v for k, v in row.items() if k not in timings} for row in plain.history]
    assert not (tmp_path / "off" / "telemetry.csv").exists()
    records = read_records(tmp_path / "on" / "telemetry.csv")
    assert sorted({r.step for r in records}) == [2, 4]
    assert len(records) == 2 * LINEARS * 6
    assert {(r.gemm, r.operand) for r in records} == {
        ("fprop", "input"), ("fprop", "weight"), ("dgrad", "grad_output"), ("dgrad", "weight"),
        ("wgrad", "grad_output"), ("wgrad", "input")}
    assert all(r.sqnr_db > 20 and r.saturation == 0 for r in records)  # current scaling on E4M3 / E5M2


def test_a_resumed_run_keeps_the_sampled_steps_before_its_checkpoint(data, tmp_path):
    cfg = replace(CFG, telemetry_every=1, save_every=2)
    _run(data, cfg, out_dir=tmp_path / "whole")

    def stop(row):
        if row["step"] == 3:
            raise _Stop

    with pytest.raises(_Stop):
        _run(data, cfg, out_dir=tmp_path / "cut", on_step=stop)  # step 3 sampled, checkpoint at 2
    assert {r.step for r in read_records(tmp_path / "cut" / "telemetry.csv")} == {1, 2, 3}
    _run(data, cfg, out_dir=tmp_path / "cut", resume=True)
    whole = (tmp_path / "whole" / "telemetry.csv").read_text()
    assert (tmp_path / "cut" / "telemetry.csv").read_text() == whole


def test_the_controller_judges_the_sampled_steps_figures_after_the_bf16_start(data, tmp_path):
    # a floor above any FP8 cast's SQNR: every GEMM of a judged step is trouble
    control = ControlConfig(auto=True, sqnr_floor_db=60.0)
    cfg = replace(CFG, steps=3, eval_every=3, telemetry_every=1, hp_start_steps=2, control=control)
    model = build_model(MICRO, seed=0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        train(model, data, cfg, out_dir=tmp_path, checkpoints=False)
    records = read_records(tmp_path / "telemetry.csv")
    with (tmp_path / "switches.csv").open() as f:
        switches = list(csv.DictReader(f))
    worst = {}
    for r in records:
        if r.step == 3:
            worst[r.layer, r.gemm] = min(worst.get((r.layer, r.gemm), math.inf), r.sqnr_db)
    assert len(worst) == 3 * LINEARS
    # steps 1-2 (BF16 start) are sampled but not judged; step 3's figures widen each GEMM one level
    assert {(s["step"], s["layer"], s["gemm"], s["from_recipe"], s["to_recipe"]) for s in switches} == \
        {("3", layer, gemm, "fp8-current", "bf16") for layer, gemm in worst}
    assert {s["reason"] for s in switches} == {f"SQNR {worst[s['layer'], s['gemm']]:.1f} dB < 60" for s in switches}
    assert all(m.recipe.name == "bf16" for m in model.modules() if getattr(m, "recipe", None) is not None)


def test_auto_precision_without_telemetry_is_refused():
    with pytest.raises(ValueError, match=r"^telemetry_every: expected a positive int with control.auto"):
        replace(CFG, telemetry_every=0, control=ControlConfig(auto=True))
