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


def test_is_sharded_reads_every_mesh_dimension():
    """A DTensor split along any dimension of its mesh is sharded; one replicated on every dimension is not."""
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import DTensor, Replicate, Shard

    started = not dist.is_initialized()
    if started:
        dist.init_process_group("gloo", init_method="tcp://127.0.0.1:0", rank=0, world_size=1)
    try:
        mesh = DeviceMesh("cpu", torch.zeros(1, 1, dtype=torch.int64), mesh_dim_names=("dp", "tp"))
        t = torch.ones(2, 2)
        assert is_sharded(DTensor.from_local(t, mesh, [Replicate(), Shard(0)], run_check=False))
        assert is_sharded(DTensor.from_local(t, mesh, [Shard(0), Replicate()], run_check=False))
        assert not is_sharded(DTensor.from_local(t, mesh, [Replicate(), Replicate()], run_check=False))
    finally:
        if started:
            dist.destroy_process_group()
