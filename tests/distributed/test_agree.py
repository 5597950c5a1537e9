"""Rank agreement in one process: the group helpers' defaults and errors (the two-rank behaviour is
exercised by the DDP and FSDP2 tests, whose every step agrees through them)."""
from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist

from lowprec.distributed import agree, agree_any, data_parallel_group, is_distributed, is_sharded, local, world_size
from lowprec.optim import Optimizer
from tests.distributed import common as C


def test_one_process_is_not_distributed():
    assert not dist.is_initialized()
    assert world_size() == 1 and not is_distributed()
    assert data_parallel_group() is None and data_parallel_group(False) is None


def test_agree_with_one_rank_returns_the_values_stacked():
    out = agree([torch.tensor(2.5), 1, math.nan])
    assert out.dtype == torch.float32 and out.shape == (3,)
    assert out[:2].tolist() == [2.5, 1.0] and math.isnan(out[2])
    assert agree([3.0, torch.tensor([4.0])], op=dist.ReduceOp.MAX).tolist() == [3.0, 4.0]
    assert agree_any([True, False]) == [True, False]


def test_plain_tensors_are_their_own_local_part():
    t = torch.ones(3)
    assert local(t) is t and not is_sharded(t)


@pytest.mark.parametrize(("call", "exc", "message"), [
    (lambda: agree([]), ValueError, "^values: expected at least one value"),
    (lambda: agree([1.0], op=dist.ReduceOp.PRODUCT), ValueError, "^op: expected torch.distributed.ReduceOp.SUM"),
    (lambda: data_parallel_group(True), ValueError, "^data_parallel: expected an initialized torch.distributed"),
    (lambda: data_parallel_group("yes"), TypeError, "^data_parallel: expected None, True or False"),
    (lambda: data_parallel_group(None, 3), TypeError, "^group: expected a torch.distributed.ProcessGroup"),
])
def test_bad_arguments_are_refused(call, exc, message):
    with pytest.raises(exc, match=message):
        call()


def test_optimizer_asked_for_data_parallelism_without_a_group_says_how_to_launch():
    with pytest.raises(ValueError, match=r"^data_parallel: expected .*\(launch with torchrun\), got world size 1"):
        Optimizer(C.mlp(None).parameters(), torch.optim.SGD, lr=0.1, data_parallel=True)
