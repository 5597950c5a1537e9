"""Bad input under torchrun: one line from rank 0, a non-zero exit, no traceback from lowprec (see [Note: one
error line under torchrun] in :mod:`lowprec.cli.app`). torchrun's own report of the failed ranks follows it."""
from __future__ import annotations

import re

import pytest

from lowprec.cli import app
from tests.distributed.launch_helpers import explain, forked_cli, torchrun
from tests.small_rule import native_small_rule  # noqa: F401 (a fixture)

BAD = ("train", "--parallel", "ddp", "--device", "cpu", "--steps", "2", "--on-spike", "rollback")
"""Refused on every rank, after the process group is up: rollback without checkpoints to return to."""
MESSAGE = ("--on-spike: expected --save-every N > 0 with rollback (a roll-back returns to the newest checkpoint; "
           "--save-every 0 saves only after the last step), got rollback with --save-every 0")


def test_under_torchrun_bad_input_is_said_once_by_rank_0_without_a_traceback(tmp_path):
    proc = torchrun("-m", "lowprec", *BAD, "--out", str(tmp_path))
    assert proc.returncode == 1, explain(proc)
    assert [line for line in proc.stderr.splitlines() if "Error" in line and "--on-spike" in line] == \
        [f"Error: {MESSAGE}"], explain(proc)
    assert not re.search(r'File ".*lowprec[/\\]', proc.stderr), explain(proc)  # torchrun's traceback alone
    # the other rank waited, silent, and torchrun stopped it: rank 0's exit is the root cause it reports
    assert re.search(r"Root Cause.*?rank\s*:\s*0 .*?exitcode\s*:\s*1 ", proc.stderr, re.DOTALL), explain(proc)


def test_a_rank_that_fails_alone_says_its_error_with_its_rank_after_the_wait(tmp_path, monkeypatch):
    # forked ranks have no torchrun to stop rank 1 once rank 0 has exited: it says its error after the wait,
    # as a rank whose error rank 0 did not share would
    monkeypatch.setattr(app, "OTHER_RANK_WAIT_S", 0.5)
    ranks = forked_cli(*BAD, "--out", str(tmp_path), out=tmp_path)
    assert [r["exit_code"] for r in ranks] == [1, 1] and [r["error"] for r in ranks] == [None, None], ranks
    assert ranks[0]["stderr"] == f"Error: {MESSAGE}\n"
    assert ranks[1]["stderr"] == f"Error: rank 1: {MESSAGE}\n"


@pytest.mark.usefixtures("native_small_rule")
def test_the_small_layers_line_comes_from_rank_0_alone(tmp_path):
    # every warning is one line from rank 0; the small layers' own line was shown by every rank
    ranks = forked_cli("train", "--parallel", "ddp", "--device", "cpu", "--steps", "1", "--batch-size", "2",
                       "--seq-len", "16", "--val-batches", "1", "--recipe", "fp8-current", "--no-tensorboard",
                       "--quiet", "--out", str(tmp_path / "run"), out=tmp_path)
    assert [r["exit_code"] for r in ranks] == [0, 0], ranks
    said = [[line for line in r["stderr"].splitlines() if "linears stay in" in line] for r in ranks]
    assert len(said[0]) == 1 and said[0][0].startswith("warning: "), ranks[0]["stderr"]
    assert said[1] == [], ranks[1]["stderr"]
