"""``train``'s --telemetry-every follows --steps (16 samples a run, at most every 500 steps), so that the
README's ``lowprec inspect runs/train`` works after a default ``train``: with 500 against the default 300
steps, a default run sampled nothing and inspect had nothing to read."""
from __future__ import annotations

import pytest
from click.testing import CliRunner

from lowprec.cli import main
from lowprec.cli.train_cmd import TRAIN_DEFAULTS, config_from_options, default_telemetry_every
from lowprec.telemetry.records import read_records


@pytest.mark.parametrize("steps, every", [(300, 18), (16, 1), (10, 1), (1000, 62), (8000, 500), (100_000, 500)])
def test_the_default_interval_scales_with_steps(steps, every):
    assert default_telemetry_every(steps) == every
    assert steps // every >= min(steps, 16)  # every run, however short, gets its samples


def _opts(**given):
    from lowprec.cli.train_cmd import train_cmd
    ctx = train_cmd.make_context("train", [], resilient_parsing=True)
    return {**{k: v for k, v in ctx.params.items() if k not in ("recipe", "out", "resume", "save_every", "keep")},
            **given}


def test_train_uses_the_scaled_default_and_keeps_an_explicit_value_and_a_checkpoints():
    assert TRAIN_DEFAULTS.telemetry_every is None
    assert config_from_options("bf16", _opts()).telemetry_every == 18  # the default 300 steps: 16 samples
    assert config_from_options("bf16", _opts(steps=1600)).telemetry_every == 100
    assert config_from_options("bf16", _opts(steps=1600, telemetry_every=7)).telemetry_every == 7
    assert config_from_options("bf16", _opts(telemetry_every=0)).telemetry_every == 0
    resumed = {"telemetry_every": 18}
    assert config_from_options("bf16", _opts(steps=600), resumed=resumed).telemetry_every == 18


def test_a_default_train_can_be_inspected(tmp_path):
    out = tmp_path / "run"
    result = CliRunner().invoke(main, ["train", "--recipe", "fp8-current", "--steps", "32", "--batch-size", "2",
                                       "--seq-len", "32", "--val-batches", "1", "--quiet", "--no-tensorboard",
                                       "--out", str(out)])
    assert result.exit_code == 0, result.output
    assert sorted({r.step for r in read_records(out / "telemetry.csv")}) == list(range(2, 33, 2))  # 16 samples
    inspected = CliRunner().invoke(main, ["inspect", str(out)])
    assert inspected.exit_code == 0 and (out / "inspect.html").is_file(), inspected.output
