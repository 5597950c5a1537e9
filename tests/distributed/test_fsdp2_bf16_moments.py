"""AdamWLP's BF16 moments under FSDP2 (two gloo ranks): DTensors of each parameter's shard, elementwise, so
the run trains like one process with BF16 moments and its checkpoints reshard both ways (two ranks to one
process and back), resuming onto the curve of the run they were cut from.

Two ranks sum their half-batch gradients in another order than one process; a BF16 moment rounds such a
difference to a whole BF16 step now and then (2^-8 relative), so the curves are held to ``BF16_MOMENTS``
rather than the FP32 moments' ``TIGHT`` (measured: at most 1.8e-4 over these steps).
"""
from __future__ import annotations

import math
import shutil

from click.testing import CliRunner

from lowprec.cli import main
from lowprec.train.logs import read_log
from tests.distributed.launch_helpers import REORDERED, forked_cli

BF16_MOMENTS = 1e-3
RUN = ("--model", "tiny", "--steps", "4", "--batch-size", "4", "--seq-len", "32", "--val-batches", "2",
       "--eval-every", "2")
TRAIN = ("train", "--recipe", "bf16", "--save-every", "2", *RUN, "--optim-states", "bf16", "--no-tensorboard",
         "--quiet")


def _close(rows, reference, rtol, steps=None):
    rows = [r for r in rows if steps is None or int(r["step"]) in steps]
    reference = [r for r in reference if steps is None or int(r["step"]) in steps]
    assert [r["step"] for r in rows] == [r["step"] for r in reference] and rows
    for r, ref in zip(rows, reference):
        assert math.isclose(float(r["loss"]), float(ref["loss"]), rel_tol=rtol), (r, ref)
        assert r["skipped"] == ref["skipped"] == "0"


def _cut(src, dst):
    shutil.copytree(src, dst)
    (dst / "checkpoints" / "step_00000004.json").unlink()  # resume from step 2


def test_bf16_moments_under_fsdp2_train_like_one_process_and_reshard_both_ways(tmp_path):
    one, two = tmp_path / "one", tmp_path / "two"
    result = CliRunner().invoke(main, [*TRAIN, "--out", str(one)])
    assert result.exit_code == 0, result.output
    ranks = forked_cli(*TRAIN, "--parallel", "fsdp2", "--out", str(two), out=tmp_path / "ranks")
    assert [(r["exit_code"], r["error"]) for r in ranks] == [(0, None), (0, None)], ranks
    one_rows, two_rows = read_log(one / "log.csv"), read_log(two / "log.csv")
    _close(two_rows, one_rows, BF16_MOMENTS)
    assert math.isclose(float(two_rows[0]["loss"]), float(one_rows[0]["loss"]), rel_tol=REORDERED)

    # two ranks' checkpoint (moments as DTensor shards) resumed by one process: step 3 continues the
    # two-rank run (the moments were restored, not reset), then the orders of summation part again
    _cut(two, tmp_path / "two_to_one")
    result = CliRunner().invoke(main, [*TRAIN, "--out", str(tmp_path / "two_to_one"), "--resume"])
    assert result.exit_code == 0, result.output
    _close(read_log(tmp_path / "two_to_one" / "log.csv"), two_rows, REORDERED, steps={1, 2, 3})

    # and one process's checkpoint resumed on two ranks
    _cut(one, tmp_path / "one_to_two")
    ranks = forked_cli(*TRAIN, "--parallel", "fsdp2", "--out", str(tmp_path / "one_to_two"), "--resume",
                       out=tmp_path / "ranks2")
    assert [(r["exit_code"], r["error"]) for r in ranks] == [(0, None), (0, None)], ranks
    _close(read_log(tmp_path / "one_to_two" / "log.csv"), one_rows, REORDERED, steps={1, 2, 3})
