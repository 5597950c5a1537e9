"""``on_spike``: a spike injected into one step's loss is skipped (weights untouched) or rolled back to
the last checkpoint with the data moved past it, the logs then holding each step once; ``control``: the
BF16 final fraction in a run."""
from __future__ import annotations

import csv
from dataclasses import replace
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from lowprec.distributed.launch import Ranks
from lowprec.telemetry import OperandStats
from lowprec.telemetry.control import ControlConfig, Switch
from lowprec.telemetry.records import TelemetryWriter, read_records
from lowprec.train import step_control
from lowprec.train.checkpoint import latest_checkpoint, load_checkpoint
from lowprec.train.data import TokenData
from lowprec.train.logs import read_log
from lowprec.train.model import build_model
from tests.train.runs import CFG, MICRO, nan_model, run

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


def _run(corpus, tmp_path, on_spike: str, steps: int = 14, bad: frozenset[int] | None = None, **settings):
    """A run whose step ``SPIKE_AT`` spikes once; with ``bad``, each batch drawn at a position in ``bad``
    spikes instead (a bad stretch of data, as often as it is drawn)."""
    model, rows, params, positions = Spiky(), [], {}, []
    original = TokenData.train_batch

    def spy(self, seed, step, *a, **kw):
        positions.append(step)
        model.armed = model.armed or (bad is not None and step in bad)
        return original(self, seed, step, *a, **kw)

    def on_step(row):
        rows.append(row)
        params[row["step"]] = [p.detach().clone() for p in model.parameters()]
        if bad is None and row["step"] == SPIKE_AT - 1 and not any(r["spike"] for r in rows):
            model.armed = True

    cfg = replace(CFG, **{"steps": steps, "eval_every": steps, "on_spike": on_spike, "save_every": 2,
                          "warmup_steps": 2, **settings})
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


BAD = frozenset({13, 15, 18})
"""Batch positions that spike: 13 and 15 roll back to step 12's checkpoint twice, 18 to step 14's."""


def test_repeated_rollbacks_move_the_offset_on_and_never_draw_a_batch_twice(corpus, tmp_path, capsys):
    result, _, _, positions = _run(corpus, tmp_path, "rollback", steps=18, bad=BAD)
    # step 13 (position 13) back to 12: offset 1; step 14 (position 15) back to 12 again: offset 1 + 2 = 3,
    # not the checkpoint's 0 + 2 (which drew position 15 again at step 13); step 15 (position 18) back to 14:
    # offset 3 + 1 = 4. Every position drawn once, in order, each bad one once
    assert positions == list(range(1, 18 + 4 + 1))
    assert [r["step"] for r in result.history] == list(range(1, 19))
    assert not any(r["spike"] or r["skipped"] for r in result.history)
    _, state = load_checkpoint(latest_checkpoint(tmp_path / "checkpoints"))
    assert state["run"]["data"]["position"]["data_offset"] == 4
    said = [line for line in capsys.readouterr().err.splitlines() if line.startswith("step ")]
    assert said == [f"step {s}: loss spike: rolled back to the checkpoint of step {k}, the data moved past this "
                    f"step's batch (roll-back {i} of {step_control.MAX_ROLLBACKS})"
                    for i, (s, k) in enumerate([(13, 12), (14, 12), (15, 14)], start=1)]


def test_past_the_rollback_limit_a_spike_is_skipped_and_the_console_says_so_once(corpus, tmp_path, capsys,
                                                                                  monkeypatch):
    monkeypatch.setattr(step_control, "MAX_ROLLBACKS", 2)
    result, _, _, positions = _run(corpus, tmp_path, "rollback", steps=18, bad=BAD)
    assert positions == list(range(1, 18 + 3 + 1))  # the third spike, skipped, moves the data no further
    assert [r["step"] for r in result.history if r["skipped"]] == [15]
    said = [line for line in capsys.readouterr().err.splitlines() if line.startswith("step ")]
    assert said == [
        "step 13: loss spike: rolled back to the checkpoint of step 12, the data moved past this step's batch "
        "(roll-back 1 of 2)",
        "step 14: loss spike: rolled back to the checkpoint of step 12, the data moved past this step's batch "
        "(roll-back 2 of 2); rollback limit reached; further spikes are skipped",
        "step 15: skipped (loss spike)"]


def test_a_skipped_step_is_said_on_the_console(corpus, tmp_path, capsys):
    _run(corpus, tmp_path, "skip")
    assert [line for line in capsys.readouterr().err.splitlines() if line.startswith("step ")] == [
        f"step {SPIKE_AT}: skipped (loss spike)"]
    run(corpus, replace(CFG, steps=2), model=nan_model())
    assert [line for line in capsys.readouterr().err.splitlines() if line.startswith("step ")] == [
        "step 1: skipped (non-finite loss)", "step 2: skipped (non-finite loss)"]


def test_a_spike_before_the_first_checkpoint_is_skipped_saying_why(corpus, tmp_path, capsys):
    result, _, _, positions = _run(corpus, tmp_path, "rollback", steps=14, save_every=20)
    assert positions == list(range(1, 15)) and [r["step"] for r in result.history if r["skipped"]] == [SPIKE_AT]
    assert [line for line in capsys.readouterr().err.splitlines() if line.startswith("step ")] == [
        f"step {SPIKE_AT}: skipped (loss spike, no checkpoint yet to roll back to)"]


def test_the_switches_of_a_step_are_one_line_grouped_by_change_and_reason(capsys):
    one = SimpleNamespace(ranks=Ranks())
    step_control.say_switches(one, 7, [])
    step_control.say_switches(one, 7, [Switch(7, "layers.0.attention.wq", "fprop", "nvfp4", "mxfp8", "SQNR 3.0 < 8"),
                                       Switch(7, "layers.0.attention.wk", "wgrad", "nvfp4", "mxfp8", "loss spikes"),
                                       Switch(7, "layers.1.attention.wk", "dgrad", "nvfp4", "mxfp8", "loss spikes")])
    assert capsys.readouterr().err == ("step 7: precision switch: layers.0.attention.wq fprop nvfp4 -> mxfp8 "
                                       "(SQNR 3.0 < 8); 2 GEMMs nvfp4 -> mxfp8 (loss spikes)\n")


def test_the_console_lines_come_from_rank_0_alone(capsys):
    step_control.say(SimpleNamespace(ranks=Ranks(rank=1, world_size=2, distributed=True)), "step 1: skipped")
    step_control.say(SimpleNamespace(ranks=Ranks(rank=0, world_size=2, distributed=True)), "step 2: skipped")
    assert capsys.readouterr().err == "step 2: skipped\n"


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


def test_the_final_fraction_runs_the_last_steps_in_bf16_and_logs_the_switch(corpus, tmp_path, capsys):
    model = build_model(MICRO, seed=0)
    cfg = replace(CFG, recipe="mxfp8", steps=4, eval_every=4, control=ControlConfig(hp_final_fraction=0.25))
    run(corpus, cfg, model=model, out_dir=tmp_path)
    with (tmp_path / "switches.csv").open() as f:
        switches = list(csv.DictReader(f))
    assert switches and {(s["step"], s["to_recipe"], s["reason"]) for s in switches} == {("4", "bf16", "schedule")}
    converted = [m for m in model.modules() if getattr(m, "recipe", None) is not None]
    assert converted and all(m.recipe.name == "bf16" for m in converted)
    # the console says it in one line, the switches of one step grouped by what changed and why
    assert [line for line in capsys.readouterr().err.splitlines() if line.startswith("step ")] == [
        f"step 4: precision switch: {len(switches)} layers mxfp8 -> bf16 (schedule)"]


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


def test_rollback_without_checkpoints_is_refused_before_the_run_starts(corpus, tmp_path):
    with pytest.raises(ValueError, match=r"^on_spike: expected save_every > 0 with 'rollback' \(a roll-back returns "
                                         r"to the newest checkpoint; .*\), got 'rollback' with save_every 0$"):
        replace(CFG, on_spike="rollback")
    cfg = replace(CFG, on_spike="rollback", save_every=2)
    model = build_model(MICRO, seed=0)
    before = [p.detach().clone() for p in model.parameters()]
    for kw, got in (({"out_dir": tmp_path, "checkpoints": False}, "checkpoints=False"), ({}, "out_dir=None")):
        with pytest.raises(ValueError, match=rf"^on_spike: expected 'log' or 'skip' when the run saves no "
                                             rf"checkpoints .*, got 'rollback' with {got}$"):
            run(corpus, cfg, model=model, **kw)
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))  # not converted: refused first
    assert not any(tmp_path.iterdir())


@pytest.mark.parametrize(("command", "message"), [
    ("train", "Error: --on-spike: expected --save-every N > 0 with rollback (a roll-back returns to the newest "
                  "checkpoint; --save-every 0 saves only after the last step), got rollback with --save-every 0\n"),
    ("compare", "Error: --on-spike: expected log or skip under compare (its runs save no checkpoints to roll "
                    "back to), got rollback\n")])
def test_the_command_line_refuses_rollback_without_checkpoints_in_one_line(tmp_path, command, message):
    from click.testing import CliRunner

    from lowprec.cli import main

    result = CliRunner().invoke(main, [command, "--on-spike", "rollback", "--steps", "2", "--out", str(tmp_path)])
    assert result.exit_code == 1 and result.output == message
    assert {p.name for p in tmp_path.iterdir()} <= {".lowprec.lock"}  # no run started (compare locks --out first)
