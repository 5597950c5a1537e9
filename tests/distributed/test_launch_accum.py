"""Gradient accumulation across ranks: micro-batches reduce their gradients once per step, and N ranks
with M micro-batches each train like one process with M micro-batches of the global batch."""
from __future__ import annotations

import json
import math
import warnings
from dataclasses import replace
from pathlib import Path

import pytest
import torch.distributed as dist

from lowprec.train.data import load_data
from lowprec.train.loop import train
from lowprec.train.model import build_model
from tests.distributed.launch_helpers import MICRO, MICRO_CFG, TIGHT, forked

CFG = replace(MICRO_CFG, steps=4, eval_every=2, grad_accum=2)


def _curve(result) -> list:
    return [(r["step"], r["loss"], r["val_loss"], r["skipped"]) for r in result.history]


def _train_on_ranks(out: Path, parallel: str) -> None:
    result = train(build_model(MICRO, seed=0), load_data(), replace(CFG, parallel=parallel))
    (out / f"curve_{dist.get_rank()}.json").write_text(json.dumps(_curve(result)))


@pytest.mark.parametrize("parallel", ["ddp", "fsdp2"])
def test_accumulating_ranks_train_like_one_accumulating_process(tmp_path, parallel):
    forked(_train_on_ranks, tmp_path, parallel, store=tmp_path / "store")
    curves = [json.loads((tmp_path / f"curve_{r}.json").read_text()) for r in (0, 1)]
    assert curves[0] == curves[1]  # losses are the global batch's on every rank
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        one = _curve(train(build_model(MICRO, seed=0), load_data(), CFG))
    assert [c[0] for c in curves[0]] == [c[0] for c in one]
    for (_, loss, val, skipped), (_, loss_1, val_1, skipped_1) in zip(curves[0], one):
        assert math.isclose(loss, loss_1, rel_tol=TIGHT) and skipped == skipped_1 is False
        assert (val is None) == (val_1 is None) and (val is None or math.isclose(val, val_1, rel_tol=TIGHT))
