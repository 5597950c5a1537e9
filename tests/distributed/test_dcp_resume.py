"""Distributed checkpoints in training: exact resume on the same number of ranks, and a save killed midway."""
from __future__ import annotations

import json
import math
import os
import shutil
import warnings
from dataclasses import replace

import pytest

from lowprec.train.checkpoint import is_distributed_checkpoint, list_checkpoints
from lowprec.train.data import load_data
from lowprec.train.logs import read_log
from lowprec.train.loop import train
from lowprec.train.model import build_model
from tests.distributed import dcp_scenarios
from tests.distributed.launch_helpers import MICRO, MICRO_CFG, TIGHT, forked


@pytest.fixture(autouse=True)
def _quiet():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "emulated on cpu" is expected here
        yield


@pytest.mark.parametrize("parallel", ["ddp", "fsdp2"])
def test_resume_on_the_same_number_of_ranks_repeats_the_curve_bit_for_bit(tmp_path, parallel):
    forked(dcp_scenarios.resume, tmp_path, parallel, store=tmp_path / "store")
    curves = [json.loads((tmp_path / f"curves_{r}.json").read_text()) for r in (0, 1)]
    for c in curves:
        assert len(c["whole"]) == dcp_scenarios.RESUME_STEPS
        assert c["resumed"] == c["whole"]
    assert curves[0] == curves[1]  # every rank logs the global loss and validation loss
    rows = read_log(tmp_path / "cut" / "log.csv")  # rank 0 rewrote it from the checkpoint's history
    assert [(r["step"], r["loss"]) for r in rows] == [(str(s), repr(loss)) for s, loss, *_ in curves[0]["whole"]]


@pytest.mark.parametrize("where", ["shards", "publish"])
def test_a_save_killed_midway_leaves_the_previous_checkpoint_loadable(tmp_path, where):
    # "shards": rank 1 dies while writing its shards; "publish": rank 0 dies after renaming the shards'
    # directory into place, before writing the JSON that marks the checkpoint complete
    with pytest.raises(Exception, match="signal|SIGKILL|exited"):
        forked(dcp_scenarios.kill, tmp_path, where, store=tmp_path / "store")
    ckpt = tmp_path / "checkpoints"
    stem = f"step_{dcp_scenarios.KILL_AT_STEP:08d}"
    left = ckpt / (f".{stem}.partial" if where == "shards" else stem)
    assert left.is_dir() and not (ckpt / f"{stem}.json").exists()
    assert [s for s, _ in list_checkpoints(ckpt)] == [2]
    killed = read_log(tmp_path / "log.csv")  # rank 0 logged step 4 before saving it
    assert [r["step"] for r in killed] == ["1", "2", "3", "4"]
    # one process, no process group, resumes from step 2 (2 ranks -> 1) and saves step 4 its own way
    cfg = replace(MICRO_CFG, steps=4, save_every=2)
    result = train(build_model(MICRO, seed=0), load_data(), cfg, out_dir=tmp_path, resume=True)
    assert [r["loss"] for r in result.history[:2]] == [float(r["loss"]) for r in killed[:2]]
    # step 3 starts from the two ranks' weights of step 2, on the batch of step 3
    assert math.isclose(result.history[2]["loss"], float(killed[2]["loss"]), rel_tol=1e-6)
    assert [s for s, _ in list_checkpoints(ckpt)] == [2, 4]
    assert not any(n.endswith(".partial") for n in os.listdir(ckpt))  # the next save cleared the leftovers


@pytest.mark.parametrize("parallel", ["ddp", "fsdp2"])
def test_a_single_process_checkpoint_resumes_on_two_ranks(tmp_path, parallel):
    cfg = replace(MICRO_CFG, steps=4, eval_every=2, save_every=2)
    one = train(build_model(MICRO, seed=0), load_data(), cfg, out_dir=tmp_path / "one")
    shutil.copytree(tmp_path / "one", tmp_path / "cut")
    (tmp_path / "cut" / "checkpoints" / "step_00000004.json").unlink()
    forked(dcp_scenarios.resume_on_ranks, tmp_path / "cut", replace(cfg, parallel=parallel), store=tmp_path / "s")
    rows = read_log(tmp_path / "cut" / "log.csv")
    assert [float(r["loss"]) for r in rows[:2]] == [r["loss"] for r in one.history[:2]]
    # step 3 starts from the one process's weights of step 2, each rank on its half of the batch of step 3
    assert math.isclose(float(rows[2]["loss"]), one.history[2]["loss"], rel_tol=1e-6)
    for r, r_one in zip(rows[2:], one.history[2:]):
        assert math.isclose(float(r["loss"]), r_one["loss"], rel_tol=TIGHT)
    assert is_distributed_checkpoint(tmp_path / "cut" / "checkpoints" / "step_00000004.json")


def test_a_corrupt_shard_is_refused_on_every_rank(tmp_path):
    forked(dcp_scenarios.kill, tmp_path, "none", store=tmp_path / "store")
    shard = tmp_path / "checkpoints" / f"step_{MICRO_CFG.steps:08d}" / "__1_0.distcp"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))
    forked(dcp_scenarios.resume_expecting_error, tmp_path, store=tmp_path / "store2")
    messages = [(tmp_path / f"error_{r}.txt").read_text() for r in (0, 1)]
    assert messages[0] == messages[1]
    assert messages[0].startswith("checkpoint: expected every shard of") and "__1_0.distcp" in messages[0]
    assert "corrupt or truncated" in messages[0]
    with pytest.raises(ValueError, match="checkpoint: expected every shard of.*__1_0.distcp"):
        train(build_model(MICRO, seed=0), load_data(), MICRO_CFG, out_dir=tmp_path, resume=True)
