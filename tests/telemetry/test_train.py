"""``lowprec train``'s telemetry: telemetry.csv rows on the sampled steps, a run's numbers unchanged by
it, and a resumed run's file equal to an uninterrupted run's."""
from __future__ import annotations

import warnings
from dataclasses import replace

import pytest

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
