"""``train``/``compare`` options for precision control and loss spikes: they reach ``TrainConfig``, a bad
value is one line naming its option, and a short run with them writes its switches."""
from __future__ import annotations

import csv

import pytest
from click.testing import CliRunner

from lowprec.cli import compare_cmd, main, train_cmd
from lowprec.telemetry.control import ControlConfig

SMALL = ["--steps", "2", "--batch-size", "2", "--seq-len", "16", "--val-batches", "1", "--quiet", "--no-tensorboard"]
OPTIONS = ["--auto-precision", "--auto-sqnr-floor", "12", "--auto-saturation-max", "0.01", "--hp-final-fraction",
           "0.25", "--on-spike", "skip"]


class _Captured(Exception):
    pass


def _config(monkeypatch, tmp_path, command: str, *args: str):
    """The TrainConfig the command builds from ``args`` (its run is stopped before it starts)."""
    seen = []

    def capture(*a, **_kw):
        seen.append(next(x for x in a if hasattr(x, "control")))
        raise _Captured

    monkeypatch.setattr(train_cmd, "train", capture)
    monkeypatch.setattr(compare_cmd, "compare", capture)
    result = CliRunner().invoke(main, [command, "--out", str(tmp_path), *SMALL, *args])
    assert isinstance(result.exception, _Captured), result.output
    return seen[0]


@pytest.mark.parametrize("command", ["train", "compare"])
def test_the_options_reach_the_run_config(monkeypatch, tmp_path, command):
    cfg = _config(monkeypatch, tmp_path, command, *OPTIONS)
    assert cfg.control == ControlConfig(auto=True, sqnr_floor_db=12.0, saturation_ceiling=0.01,
                                        hp_final_fraction=0.25)
    assert cfg.on_spike == "skip"
    plain = _config(monkeypatch, tmp_path, command)
    assert plain.control == ControlConfig() and plain.on_spike == "log" and not plain.control.enabled


@pytest.mark.parametrize("args, message", [
    (["--hp-final-fraction", "1.5"], "Error: --hp-final-fraction: expected a fraction in [0, 1), got 1.5 (float)"),
    (["--auto-sqnr-floor", "nan"], "Error: --auto-sqnr-floor: expected a finite number >= 0, got nan (float)"),
    (["--auto-saturation-max", "-0.1"], "Error: --auto-saturation-max: expected a finite number >= 0, got -0.1"),
    (["--auto-precision", "--telemetry-every", "0"],
     "Error: --auto-precision: expected --telemetry-every N > 0 (the controller judges the sampled steps' figures), "
     "got --telemetry-every 0"),
])
@pytest.mark.parametrize("command", ["train", "compare"])
def test_a_bad_value_is_one_line_naming_its_option(tmp_path, command, args, message):
    result = CliRunner().invoke(main, [command, "--out", str(tmp_path), *SMALL, *args])
    lines = result.output.strip().splitlines()
    assert result.exit_code == 1 and len(lines) == 1 and lines[0].startswith(message), result.output


def test_a_run_with_a_final_fraction_switches_its_last_step_to_bf16(tmp_path):
    result = CliRunner().invoke(main, ["train", "--recipe", "mxfp8", "--hp-final-fraction", "0.5", "--out",
                                       str(tmp_path), *SMALL])
    assert result.exit_code == 0, result.output
    with (tmp_path / "switches.csv").open() as f:
        rows = list(csv.DictReader(f))
    assert rows and {(r["step"], r["from_recipe"], r["to_recipe"], r["reason"]) for r in rows} == \
        {("2", "mxfp8", "bf16", "schedule")}
