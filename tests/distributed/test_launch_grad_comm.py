"""The training loop's low-precision gradient communication and amax reduction: ``--grad-comm`` reaches
``lowprec.distributed.grad_comm`` and delayed scaling ``lowprec.distributed.amax`` from ``lowprec train``."""
from __future__ import annotations

import math
import warnings
from dataclasses import replace
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from click.testing import CliRunner

from lowprec.cli import main
from lowprec.train.data import load_data
from lowprec.train.logs import read_log
from lowprec.train.loop import train
from lowprec.train.model import build_model
from tests.distributed.launch_helpers import MICRO, MICRO_CFG, REORDERED, forked, forked_cli

FP8_GRADS = 2e-2
"""Relative difference of each step's loss, FP8 gradient communication against one FP32 process."""


@pytest.mark.parametrize("parallel", ["ddp", "fsdp2"])
def test_fp8_gradient_communication_trains_like_one_process(tmp_path, parallel):
    args = ("train", "--recipe", "bf16", "--model", "tiny", "--steps", "4", "--batch-size", "4", "--seq-len", "32",
            "--val-batches", "2", "--eval-every", "2", "--no-tensorboard", "--quiet")
    ranks = forked_cli(*args, "--parallel", parallel, "--grad-comm", "fp8", "--out", str(tmp_path / "fp8"),
                       out=tmp_path)
    assert [r["exit_code"] for r in ranks] == [0, 0], ranks
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert CliRunner().invoke(main, [*args, "--out", str(tmp_path / "one")]).exit_code == 0
    rows, one = read_log(tmp_path / "fp8" / "log.csv"), read_log(tmp_path / "one" / "log.csv")
    # the first loss comes before any gradient: the same weights and batch, only its mean reordered
    assert math.isclose(float(rows[0]["loss"]), float(one[0]["loss"]), rel_tol=REORDERED), (rows[0], one[0])
    assert all(math.isclose(float(r["loss"]), float(o["loss"]), rel_tol=FP8_GRADS) for r, o in zip(rows, one))
    assert rows != one


def _delayed_histories(out: Path) -> None:
    model = build_model(MICRO, seed=0)  # train() converts it in place, then wraps it
    train(model, load_data(), replace(MICRO_CFG, recipe="fp8-delayed", steps=3, eval_every=3, parallel="ddp"))
    states = {k: v for k, v in model.state_dict().items() if k.endswith("_extra_state")}
    torch.save(states, out / f"histories_{dist.get_rank()}.pt")


def test_delayed_scaling_histories_agree_across_ranks(tmp_path):
    # each rank sees its own rows, so its own activation amaxes: only the reduction makes them agree
    forked(_delayed_histories, tmp_path, store=tmp_path / "store")
    ranks = [torch.load(tmp_path / f"histories_{r}.pt") for r in (0, 1)]
    assert len(ranks[0]) == 2 * 7 and ranks[0].keys() == ranks[1].keys()
    assert all(torch.equal(ranks[0][k], ranks[1][k]) for k in ranks[0])
    assert all(ranks[0][k][2:].amax() > 0 for k in ranks[0])  # amaxes were recorded
