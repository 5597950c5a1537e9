"""``on_spike``: a spike injected into one step's loss is skipped (weights untouched) or rolled back to
the last checkpoint with the data moved past it, the logs then holding each step once; ``control``: the
BF16 final fraction in a run."""
from __future__ import annotations

import csv
from dataclasses import replace

import pytest
import torch
from torch import nn

from lowprec.telemetry import OperandStats
from lowprec.telemetry.control import ControlConfig
from lowprec.telemetry.records import TelemetryWriter, read_records
from lowprec.train.checkpoint import latest_checkpoint, load_checkpoint
from lowprec.train.data import TokenData
from lowprec.train.logs import read_log
from lowprec.train.model import build_model
from tests.train.runs import CFG, MICRO, run

SPIKE_AT = 13
"""After the spike detector's first 10 losses; an odd step, one past a checkpoint (``save_every=2``)."""


class Spiky(nn.Module):
    """The micro model, whose logits are scaled by 30 in the training forward of one step."""

    def __init__(self) -> None:
        super().__init__()
        self.inner = build_model(MICRO, seed=0)
        self.armed = False

    def forward(self, tokens):
        logits = self.inner(tokens)
        if self.armed and self.training:
            self.armed = False
            return logits * 30.0
        return logits


def _run(corpus, tmp_path, on_spike: str, steps: int = 14, **settings):
    model, rows, params, positions = Spiky(), [], {}, []
    original = TokenData.train_batch

    def spy(self, seed, step, *a, **kw):
        positions.append(step)
        return original(self, seed, step, *a, **kw)

    def on_step(row):
        rows.append(row)
        params[row["step"]] = [p.detach().clone() for p in model.parameters()]
        if row["step"] == SPIKE_AT - 1 and not any(r["spike"] for r in rows):
            model.armed = True

    cfg = replace(CFG, steps=steps, eval_every=steps, on_spike=on_spike, save_every=2, warmup_steps=2, **settings)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(TokenData, "train_batch", spy)
        result = run(corpus, cfg, model=model, out_dir=tmp_path, on_step=on_step)
    return result, rows, params, positions


@pytest.fixture(scope="module")
def corpus():
    from lowprec.train.data import corpus_data
    return corpus_data()


def test_skip_leaves_the_spike_steps_weights_as_they_were(corpus, tmp_path):
    result, rows, params, positions = _run(corpus, tmp_path, "skip")
    spiked = [r for r in rows if r["spike"]]
    assert [r["step"] for r in spiked] == [SPIKE_AT] and spiked[0]["skipped"]
    assert all(torch.equal(a, b) for a, b in zip(params[SPIKE_AT - 1], params[SPIKE_AT]))
    assert positions == list(range(1, 15)) and len(result.history) == 14


def test_rollback_returns_to_the_checkpoint_and_draws_the_data_after_the_spike(corpus, tmp_path):
    result, rows, params, positions = _run(corpus, tmp_path, "rollback")
    # step 13 spiked: back to step 12's checkpoint; steps 13.. then draw the batches of 14.. (offset 1)
    assert positions == list(range(1, 16))
    assert [r["step"] for r in result.history] == list(range(1, 15))
    assert not any(r["spike"] for r in result.history)  # the spike row went with the roll-back
    _, state = load_checkpoint(latest_checkpoint(tmp_path / "checkpoints"))
    assert state["run"]["data"]["position"]["data_offset"] == 1
    assert [r["step"] for r in rows] == list(range(1, 15))  # on_step never saw the rolled-back row
    logged = read_log(tmp_path / "log.csv")  # nor does the log keep it
    assert [int(r["step"]) for r in logged] == list(range(1, 15)) and not any(r["spike"] == "True" for r in logged)


def test_after_a_rollback_the_logs_hold_each_step_once_as_in_the_history(corpus, tmp_path):
    # telemetry on every step, and the BF16 final fraction's switches at step 13: the spike's step
    control = ControlConfig(hp_final_fraction=0.15)
    result, _, _, _ = _run(corpus, tmp_path, "rollback", recipe="mxfp8", telemetry_every=1, control=control)
    assert [r["step"] for r in result.history] == list(range(1, 15))
    log = read_log(tmp_path / "log.csv")
    assert [int(r["step"]) for r in log] == list(range(1, 15))
    assert [float(r["loss"]) for r in log] == [r["loss"] for r in result.history]
    assert not any(r["spike"] == "1" for r in log)
    records = read_records(tmp_path / "telemetry.csv")
    keys = [(r.step, r.layer, r.gemm, r.operand) for r in records]
    per_step = {s: sum(1 for k in keys if k[0] == s) for s in range(1, 13)}  # 13-14 run in BF16: no casts
    assert len(set(keys)) == len(keys) and len(set(per_step.values())) == 1 and per_step[1] > 0
    assert max(k[0] for k in keys) == 12
    with (tmp_path / "switches.csv").open() as f:
        switches = [(s["step"], s["layer"], s["gemm"]) for s in csv.DictReader(f)]
    assert sorted(switches) == sorted(("13", layer, "all") for layer in {r.layer for r in records})


def test_the_final_fraction_runs_the_last_steps_in_bf16_and_logs_the_switch(corpus, tmp_path):
    model = build_model(MICRO, seed=0)
    cfg = replace(CFG, recipe="mxfp8", steps=4, eval_every=4, control=ControlConfig(hp_final_fraction=0.25))
    run(corpus, cfg, model=model, out_dir=tmp_path)
    with (tmp_path / "switches.csv").open() as f:
        switches = list(csv.DictReader(f))
    assert switches and {(s["step"], s["to_recipe"], s["reason"]) for s in switches} == {("4", "bf16", "schedule")}
    converted = [m for m in model.modules() if getattr(m, "recipe", None) is not None]
    assert converted and all(m.recipe.name == "bf16" for m in converted)


def test_a_rewound_telemetry_file_drops_the_undone_steps(tmp_path):
    def rows(step):
        return [OperandStats("a", "fprop", "input", 1.0, 1.0, 0.0, 0.0, float(step), step)]

    writer = TelemetryWriter(tmp_path / "telemetry.csv", None)
    for step in (1, 2, 3):
        writer.write(rows(step))
    writer.rewind(2)
    writer.write(rows(3))
    writer.close()
    assert [(r.step, r.sqnr_db) for r in read_records(tmp_path / "telemetry.csv")] == [(1, 1.0), (2, 2.0), (3, 3.0)]
