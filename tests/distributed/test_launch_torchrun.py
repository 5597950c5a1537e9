"""``lowprec train`` and ``lowprec compare`` under torchrun: two gloo processes on the CPU against one process.

The global batch is split across the ranks, so two ranks see, together, the batch one process
sees: the curves differ only by rounding (a mean of two half-batch means, gradients summed in
another order). With the ``bf16`` recipe on FP32 parameters that is at most ``TIGHT`` relative
over these steps; ``fp8-current`` takes each rank's own amax of its activations and gradients, so
its scales differ between one and two processes (``LOOSE``).
"""
from __future__ import annotations

import math
import shutil

import pytest
import torch
from click.testing import CliRunner

from lowprec.cli import main
from lowprec.train.checkpoint import list_checkpoints
from lowprec.train.logs import read_log
from tests.distributed.launch_helpers import explain, torchrun

TIGHT = 1e-3
"""Relative difference of each step's train and validation loss, bf16 recipe, FP32 parameters."""
LOOSE = 2e-2
"""The same for fp8-current, whose per-tensor scales come from each rank's half of the batch."""
RUN = ("--model", "tiny", "--steps", "4", "--batch-size", "4", "--seq-len", "32", "--val-batches", "2",
       "--eval-every", "2")
TRAIN = ("train", "--recipe", "bf16", "--save-every", "2", *RUN)
FSDP2_XFAIL = ("lowprec.optim.Optimizer's step guard reads FSDP2's DTensor gradients as local tensors "
               "(.tolist() on a DTensor); the optimizer's distributed fix makes the norm and the skip global")


@pytest.fixture(autouse=True)
def _one_torch_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def _one_process(*args: str) -> None:
    result = CliRunner().invoke(main, list(args))
    assert result.exit_code == 0, result.output


@pytest.fixture(scope="module")
def one_process(tmp_path_factory):
    """The single-process run the torchrun runs are compared with: its log rows."""
    out = tmp_path_factory.mktemp("one")
    _one_process(*TRAIN, "--out", str(out), "--no-tensorboard", "--quiet")
    return read_log(out / "log.csv")


@pytest.fixture(scope="module")
def ddp_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("ddp")
    proc = torchrun("-m", "lowprec", *TRAIN, "--parallel", "ddp", "--out", str(out))
    assert proc.returncode == 0, explain(proc)
    return proc, out


def _assert_close_curves(rows, reference, rtol):
    assert [r["step"] for r in rows] == [r["step"] for r in reference]
    for r, ref in zip(rows, reference):
        assert r["lr"] == ref["lr"]
        assert math.isclose(float(r["loss"]), float(ref["loss"]), rel_tol=rtol), (r, ref)
        assert (r["val_loss"] == "") == (ref["val_loss"] == "")
        if ref["val_loss"]:
            assert math.isclose(float(r["val_loss"]), float(ref["val_loss"]), rel_tol=rtol), (r, ref)
        assert r["skipped"] == ref["skipped"] == "0"


def test_ddp_trains_like_one_process_on_the_global_batch(ddp_run, one_process):
    _, out = ddp_run
    rows = read_log(out / "log.csv")
    _assert_close_curves(rows, one_process, TIGHT)
    assert rows[0]["loss"] == one_process[0]["loss"]  # same initialisation and data: the first loss agrees
    assert rows != one_process  # two processes really ran: the rounding differs after the first step


def test_only_rank_0_logs_prints_and_writes(ddp_run):
    proc, out = ddp_run
    assert proc.stdout.count("step 4: train loss") == 1, proc.stdout
    assert proc.stderr.count("tiny: 1,672,896 parameters, recipe bf16, 4 steps on cpu x 2 ranks (ddp)") == 1
    events = list((out / "tensorboard").glob("events.out.tfevents.*"))
    assert len(events) == 1  # each writer names its file by process: one file, one writer
    assert len(read_log(out / "log.csv")) == 4


def test_ddp_checkpoints_are_distributed_and_resume_on_one_process(ddp_run, tmp_path):
    _, out = ddp_run
    assert [s for s, _ in list_checkpoints(out / "checkpoints")] == [2, 4]
    assert sorted(p.name for p in (out / "checkpoints" / "step_00000004").iterdir()) == \
        [".metadata", "__0_0.distcp", "__1_0.distcp"]
    # resharding 2 -> 1: go on from step 2 in one process without torchrun
    cut = tmp_path / "cut"
    shutil.copytree(out, cut)
    (cut / "checkpoints" / "step_00000004.json").unlink()
    _one_process(*TRAIN, "--out", str(cut), "--no-tensorboard", "--quiet", "--resume")
    rows, ddp = read_log(cut / "log.csv"), read_log(out / "log.csv")
    assert rows[:2] == ddp[:2]  # the history comes from the checkpoint
    # step 3 starts from the weights two ranks left at step 2 and reads the batch of step 3: its loss
    # (before the update) differs from the two ranks' only by the order of the mean over the batch
    assert math.isclose(float(rows[2]["loss"]), float(ddp[2]["loss"]), rel_tol=1e-6)
    _assert_close_curves(rows, ddp, TIGHT)


@pytest.mark.xfail(reason=FSDP2_XFAIL, strict=False)
def test_fsdp2_trains_like_one_process_on_the_global_batch(one_process, tmp_path):
    proc = torchrun("-m", "lowprec", *TRAIN, "--parallel", "fsdp2", "--out", str(tmp_path), "--no-tensorboard")
    assert proc.returncode == 0, explain(proc)
    _assert_close_curves(read_log(tmp_path / "log.csv"), one_process, TIGHT)
    assert proc.stdout.count("step 4: train loss") == 1


def test_ddp_compare_fp8_current_against_one_process(tmp_path):
    args = ("compare", "--recipes", "fp8-current", *RUN, "--no-tensorboard", "--quiet")
    _one_process(*args, "--out", str(tmp_path / "one"))
    proc = torchrun("-m", "lowprec", *args, "--parallel", "ddp", "--out", str(tmp_path / "ddp"))
    assert proc.returncode == 0, explain(proc)
    assert proc.stdout.count("report: ") == 1  # the table and report from rank 0 only
    assert (tmp_path / "ddp" / "report.json").is_file()
    for recipe, rtol in (("bf16", TIGHT), ("fp8-current", LOOSE)):
        _assert_close_curves(read_log(tmp_path / "ddp" / "runs" / recipe / "log.csv"),
                             read_log(tmp_path / "one" / "runs" / recipe / "log.csv"), rtol)
