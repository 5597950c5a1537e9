"""A high-precision start as long as the run (``hp_start_steps >= steps``) leaves the recipe no step: the run
goes ahead (a run that will grow by resuming may want it) and says so in one warning, from rank 0."""
from __future__ import annotations

import warnings
from dataclasses import replace

from click.testing import CliRunner

from lowprec.cli import main
from tests.train.runs import CFG, run


def _warnings_of(data, **settings) -> list[str]:
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        run(data, replace(CFG, steps=2, eval_every=2, **settings))
    return [str(w.message) for w in seen if "hp_start_steps" in str(w.message)]


def test_a_start_that_covers_every_step_warns_once(data):
    assert _warnings_of(data, recipe="fp8-current", hp_start_steps=3) == [
        "lowprec: hp_start_steps 3 >= steps 2: every step of the run is in bf16, none in fp8-current"]
    assert len(_warnings_of(data, recipe="fp8-current", hp_start_steps=2)) == 1


def test_a_start_that_leaves_the_recipe_a_step_or_a_bf16_run_says_nothing(data):
    assert _warnings_of(data, recipe="fp8-current", hp_start_steps=1) == []
    assert _warnings_of(data, recipe="bf16", hp_start_steps=2) == []


def test_the_command_line_shows_it_as_one_warning_line(tmp_path):
    args = ["train", "--model", "tiny", "--recipe", "fp8-current", "--steps", "1", "--hp-start-steps", "1",
            "--batch-size", "2", "--seq-len", "16", "--val-batches", "1", "--quiet", "--no-tensorboard"]
    with warnings.catch_warnings():
        warnings.simplefilter("default")  # as a user's shell has it (this folder's tests silence warnings)
        result = CliRunner().invoke(main, [*args, "--out", str(tmp_path)])
    assert result.exit_code == 0, result.output
    lines = [line for line in result.stderr.splitlines() if "hp_start_steps" in line]
    assert lines == ["warning: lowprec: hp_start_steps 1 >= steps 1: every step of the run is in bf16, "
                     "none in fp8-current"]
