"""``lowprec train --parallel ddp --tp 2`` on two forked ranks set up as torchrun sets them up: the tiny model
split over the ranks trains like one process on the same batches, its checkpoint is resumed by one process; a
``--tp`` the trainer cannot run is refused by name."""
from __future__ import annotations

import math

import pytest
from click.testing import CliRunner

from lowprec.cli import main
from lowprec.train.logs import read_log
from tests.distributed.launch_helpers import forked_cli

RUN = ("train", "--model", "tiny", "--recipe", "fp8-current", "--batch-size", "4", "--seq-len", "32",
       "--val-batches", "2", "--eval-every", "2", "--save-every", "2", "--no-tensorboard", "--quiet")
CLOSE = 1e-3
"""Relative difference of each step's training and validation loss from one process's. Measured: the first step's
loss equal, then 4e-6, 1.6e-4 and 6e-6, validation 1.2e-4 and 8e-5: fp8-current's scales are agreed over the
ranks, so the runs part by the order of partial sums alone, which AdamW's first steps at the trainer's learning
rate amplify."""


def _cli(*args: str) -> None:
    result = CliRunner().invoke(main, list(args))
    assert result.exit_code == 0, result.output


def _losses(out) -> list[tuple[float, str]]:
    return [(float(r["loss"]), r["val_loss"]) for r in read_log(out / "log.csv")]


def test_tp_trains_like_one_process_and_its_checkpoint_resumes_in_one(tmp_path):
    one = tmp_path / "one"  # two steps, then grown to four by a resume (as the split run below)
    _cli(*RUN, "--steps", "2", "--out", str(one))
    _cli(*RUN, "--steps", "4", "--out", str(one), "--resume")
    tp = tmp_path / "tp"
    ranks = forked_cli(*RUN, "--steps", "2", "--parallel", "ddp", "--tp", "2", "--out", str(tp), out=tmp_path / "r")
    assert [r["exit_code"] for r in ranks] == [0, 0], ranks
    _cli(*RUN, "--steps", "4", "--out", str(tp), "--resume")  # split weights saved as shards, loaded whole
    got, want = _losses(tp), _losses(one)
    assert len(got) == len(want) == 4
    for (loss, val), (ref, ref_val) in zip(got, want, strict=True):
        assert math.isclose(loss, ref, rel_tol=CLOSE), (got, want)
        assert (val == "") == (ref_val == "")
        if val:
            assert math.isclose(float(val), float(ref_val), rel_tol=CLOSE)


def test_tp_with_recomputation_and_compiled(tmp_path):
    """Recomputed blocks give the split run's numbers bit for bit (the first block's input is not split again
    when checkpointing calls the block once more); the compiled split run stays within ``CLOSE`` of them."""
    runs = {}
    for name, extra in (("plain", ()), ("selective", ("--recompute", "selective")),
                        ("compiled", ("--compile", "--recompute", "full"))):
        ranks = forked_cli(*RUN, "--steps", "2", "--parallel", "ddp", "--tp", "2", *extra, "--out",
                           str(tmp_path / name), out=tmp_path / f"r_{name}")
        assert [r["exit_code"] for r in ranks] == [0, 0], ranks
        runs[name] = [loss for loss, _ in _losses(tmp_path / name)]
    assert runs["selective"] == runs["plain"]
    assert all(math.isclose(a, b, rel_tol=CLOSE) for a, b in zip(runs["compiled"], runs["plain"], strict=True))


def test_a_tp_other_than_the_ranks_is_refused(tmp_path):
    ranks = forked_cli(*RUN, "--steps", "1", "--parallel", "ddp", "--tp", "4", "--out", str(tmp_path / "a"),
                       out=tmp_path / "a")
    assert ranks[0]["exit_code"] == 1
    assert "Error: tp: expected the number of ranks (2)" in ranks[0]["stderr"], ranks


@pytest.mark.parametrize("args, message", [
    (("--tp", "2"), "tp: expected 1 unless parallel is 'ddp'"),
    (("--tp", "0"), "tp: expected a positive int"),
])
def test_tp_needs_a_ddp_run(args, message):
    result = CliRunner().invoke(main, [*RUN, "--steps", "1", *args])
    assert result.exit_code != 0
    assert message in result.output + str(result.exception)
