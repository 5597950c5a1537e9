"""``lowprec train`` and ``lowprec compare`` under torchrun: two gloo processes on the CPU against one process.

One run goes through torchrun itself; the others fork this process into ranks that get the
environment torchrun gives its workers (the same code path, without three fresh interpreters).

The global batch is split across the ranks, so two ranks see, together, the batch one process
sees: the curves differ only by rounding (a mean of two half-batch means, gradients summed in
another order). With the ``bf16`` recipe on FP32 parameters that is at most ``TIGHT`` relative
over these steps (measured: 1.3e-4); ``fp8-current`` takes each rank's own amax of its activations and gradients, so
its scales differ between one and two processes (``LOOSE``).
"""
from __future__ import annotations

import json
import math
import shutil

import pytest
from click.testing import CliRunner

from lowprec.cli import main
from lowprec.train.checkpoint import list_checkpoints
from lowprec.train.logs import read_log
from tests.distributed.launch_helpers import REORDERED, TIGHT, explain, forked_cli, torchrun

LOOSE = 1e-2
"""Relative difference of each step's train and validation loss for fp8-current, whose per-tensor scales come
from each rank's half of the batch (measured: at most 2.3e-3 over these steps)."""
RUN = ("--model", "tiny", "--steps", "4", "--batch-size", "4", "--seq-len", "32", "--val-batches", "2",
       "--eval-every", "2")
TRAIN = ("train", "--recipe", "bf16", "--save-every", "2", *RUN)


def _one_process(*args: str) -> None:
    result = CliRunner().invoke(main, list(args))
    assert result.exit_code == 0, result.output


@pytest.fixture(scope="module")
def one_process(tmp_path_factory):
    """The single-process run the torchrun runs are compared with: its log rows."""
    out = tmp_path_factory.mktemp("one")
    _one_process(*TRAIN, "--out", str(out), "--no-tensorboard", "--quiet")
    return read_log(out / "log.csv")


def _assert_close_curves(rows, reference, rtol):
    assert [r["step"] for r in rows] == [r["step"] for r in reference]
    for r, ref in zip(rows, reference):
        assert r["lr"] == ref["lr"]
        assert math.isclose(float(r["loss"]), float(ref["loss"]), rel_tol=rtol), (r, ref)
        assert (r["val_loss"] == "") == (ref["val_loss"] == "")
        if ref["val_loss"]:
            assert math.isclose(float(r["val_loss"]), float(ref["val_loss"]), rel_tol=rtol), (r, ref)
        assert r["skipped"] == ref["skipped"] == "0"


def test_torchrun_ddp_trains_like_one_process_and_only_rank_0_speaks(one_process, tmp_path):
    proc = torchrun("-m", "lowprec", *TRAIN, "--parallel", "ddp", "--out", str(tmp_path))
    assert proc.returncode == 0, explain(proc)
    rows = read_log(tmp_path / "log.csv")
    _assert_close_curves(rows, one_process, TIGHT)
    # same initialisation and data: the first loss agrees up to the order of its mean
    assert math.isclose(float(rows[0]["loss"]), float(one_process[0]["loss"]), rel_tol=REORDERED), \
        (rows[0], one_process[0])
    assert rows != one_process  # two processes really ran: the rounding differs after the first step
    # rank 0 alone prints, logs and writes TensorBoard events (each writer names its file by process)
    assert proc.stdout.count("step 4: train loss") == 1, proc.stdout
    assert proc.stderr.count("tiny: 1,672,896 parameters, recipe bf16, 4 steps on cpu x 2 ranks (ddp)") == 1
    assert len(list((tmp_path / "tensorboard").glob("events.out.tfevents.*"))) == 1
    # every rank wrote its shards of each checkpoint
    assert [s for s, _ in list_checkpoints(tmp_path / "checkpoints")] == [2, 4]
    assert sorted(p.name for p in (tmp_path / "checkpoints" / "step_00000004").iterdir()) == \
        [".metadata", "__0_0.distcp", "__1_0.distcp"]


def test_a_ddp_checkpoint_resumes_on_one_process(tmp_path):
    # resharding 2 -> 1: two ranks (forked with torchrun's environment) save, one process without torchrun
    # goes on from step 2
    ranks = forked_cli(*TRAIN, "--parallel", "ddp", "--out", str(tmp_path / "ddp"), "--no-tensorboard", "--quiet",
                       out=tmp_path)
    assert [r["exit_code"] for r in ranks] == [0, 0], ranks
    cut = tmp_path / "cut"
    shutil.copytree(tmp_path / "ddp", cut)
    (cut / "checkpoints" / "step_00000004.json").unlink()
    _one_process(*TRAIN, "--out", str(cut), "--no-tensorboard", "--quiet", "--resume")
    rows, ddp = read_log(cut / "log.csv"), read_log(tmp_path / "ddp" / "log.csv")
    assert rows[:2] == ddp[:2]  # the history comes from the checkpoint
    # step 3 starts from the weights two ranks left at step 2 and reads the batch of step 3: its loss
    # (before the update) differs from the two ranks' only by the order of the mean over the batch
    assert math.isclose(float(rows[2]["loss"]), float(ddp[2]["loss"]), rel_tol=REORDERED), (rows[2], ddp[2])
    _assert_close_curves(rows, ddp, TIGHT)


def _only_rank_0_speaks(ranks: list[dict]) -> dict:
    assert [r["exit_code"] for r in ranks] == [0, 0] and [r["error"] for r in ranks] == [None, None], ranks
    assert ranks[1]["stdout"] == ranks[1]["stderr"] == ""
    return ranks[0]


def test_fsdp2_trains_like_one_process_on_the_global_batch(one_process, tmp_path):
    # ranks forked from this process with torchrun's environment (torchrun itself is tested above)
    ranks = forked_cli(*TRAIN, "--parallel", "fsdp2", "--out", str(tmp_path), "--no-tensorboard", out=tmp_path)
    assert _only_rank_0_speaks(ranks)["stdout"].count("step 4: train loss") == 1
    _assert_close_curves(read_log(tmp_path / "log.csv"), one_process, TIGHT)


def test_ddp_compare_fp8_current_against_one_process(tmp_path):
    args = ("compare", "--recipes", "fp8-current", "--seeds", "2", *RUN, "--no-tensorboard", "--quiet")
    _one_process(*args, "--out", str(tmp_path / "one"))
    # --fail-on warn: every rank gates on the same verdicts, so all exit alike (2 unless all PASS)
    ranks = forked_cli(*args, "--fail-on", "warn", "--parallel", "ddp", "--out", str(tmp_path / "ddp"), out=tmp_path)
    report = json.loads((tmp_path / "ddp" / "report.json").read_text())
    worst = 0 if all(r["verdict"] == "PASS" for r in report["results"]) else 2
    assert [r["exit_code"] for r in ranks] == [worst, worst], ranks
    assert ranks[0]["stdout"].count("report: ") == 1 and not ranks[1]["stdout"]  # the table and report from rank 0
    assert report["baseline_band"]["seeds"] == [0, 1]
    for run, rtol in (("bf16/seed-0", TIGHT), ("bf16/seed-1", TIGHT), ("fp8-current/seed-0", LOOSE)):
        _assert_close_curves(read_log(tmp_path / "ddp" / "runs" / run / "log.csv"),
                             read_log(tmp_path / "one" / "runs" / run / "log.csv"), rtol)


def test_fsdp2_all_gathers_fp8_weights_bit_for_bit_and_resumes_from_its_checkpoint(tmp_path):
    # fp8-current under FSDP2: weights all-gathered as E4M3 (the default) train exactly as all-gathered
    # in FP32; the checkpoint holds plain weights, and a run cut at step 2 resumes onto the same curve
    fp8 = ("train", "--recipe", "fp8-current", "--save-every", "2", *RUN, "--parallel", "fsdp2",
           "--no-tensorboard", "--quiet")
    for name, flag in (("fp8", "--fp8-all-gather"), ("param", "--no-fp8-all-gather")):
        ranks = forked_cli(*fp8, flag, "--out", str(tmp_path / name), out=tmp_path / f"{name}-ranks")
        assert [r["exit_code"] for r in ranks] == [0, 0], ranks
    rows, plain = read_log(tmp_path / "fp8" / "log.csv"), read_log(tmp_path / "param" / "log.csv")
    assert [r["loss"] for r in rows] == [r["loss"] for r in plain] and len(rows) == 4
    cut = tmp_path / "cut"
    shutil.copytree(tmp_path / "fp8", cut)
    (cut / "checkpoints" / "step_00000004.json").unlink()
    ranks = forked_cli(*fp8, "--out", str(cut), "--resume", out=tmp_path / "resume-ranks")
    assert [r["exit_code"] for r in ranks] == [0, 0], ranks
    again = read_log(cut / "log.csv")
    assert [(r["loss"], r["val_loss"], r["grad_norm"]) for r in again] == \
        [(r["loss"], r["val_loss"], r["grad_norm"]) for r in rows]
