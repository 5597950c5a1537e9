"""Each rank's share of the data, and what a parallel run refuses before it starts."""
from __future__ import annotations

import pytest
import torch
from click.testing import CliRunner

from lowprec.cli import main
from lowprec.distributed.launch import Ranks, apply_grad_comm, transformer_blocks
from lowprec.train.config import TrainConfig
from lowprec.train.data import load_data
from lowprec.train.model import build_model
from tests.distributed.launch_helpers import MICRO


@pytest.fixture(scope="module")
def data():
    return load_data()


@pytest.mark.parametrize("world_size", [2, 4])
def test_the_ranks_shares_of_a_step_are_the_batch_of_one_process(data, world_size):
    whole_x, whole_y = data.train_batch(3, 7, 2, 8, 16)  # (M, B, T)
    shares = [data.train_batch(3, 7, 2, 8, 16, rank=r, world_size=world_size) for r in range(world_size)]
    assert all(x.shape == (2, 8 // world_size, 16) for x, _ in shares)
    assert torch.equal(torch.cat([x for x, _ in shares], dim=1), whole_x)
    assert torch.equal(torch.cat([y for _, y in shares], dim=1), whole_y)
    whole_val = data.val_batches(3, 8, 16)
    val_shares = [data.val_batches(3, 8, 16, rank=r, world_size=world_size) for r in range(world_size)]
    for i, (x, y) in enumerate(whole_val):
        assert torch.equal(torch.cat([s[i][0] for s in val_shares]), x)
        assert torch.equal(torch.cat([s[i][1] for s in val_shares]), y)


def test_a_batch_the_ranks_cannot_share_evenly_is_refused(data):
    with pytest.raises(ValueError, match=r"batch_size: expected a multiple of the number of ranks 4 .*, got 6"):
        data.train_batch(0, 1, 1, 6, 16, rank=0, world_size=4)
    with pytest.raises(ValueError, match=r"rank: expected an int in \[0, 2\), got 2"):
        data.val_batches(1, 4, 16, rank=2, world_size=2)


@pytest.mark.parametrize("command", ["train", "compare"])
def test_parallel_without_torchrun_is_a_one_line_error(command, tmp_path):
    result = CliRunner().invoke(main, [command, "--parallel", "fsdp2", "--steps", "2", "--out", str(tmp_path)])
    assert result.exit_code == 1
    assert result.output == (f"Error: --parallel: expected a launch through torchrun (torchrun --nproc-per-node N "
                             f"-m lowprec {command} --parallel fsdp2 ...), got a single process\n")
    assert not any(tmp_path.iterdir())  # refused before anything was built or written


def test_a_parallel_run_needs_a_process_group():
    with pytest.raises(ValueError, match="parallel: expected an initialized process group for 'ddp'"):
        Ranks.of("ddp")
    assert Ranks.of("none") == Ranks(rank=0, world_size=1, distributed=False)
    with pytest.raises(ValueError, match="parallel: expected one of 'none', 'ddp', 'fsdp2', got 'tp'"):
        TrainConfig(parallel="tp")
    with pytest.raises(ValueError, match="grad_comm: expected one of 'fp32', 'bf16', 'fp8', got 'fp4'"):
        TrainConfig(grad_comm="fp4")


def test_low_precision_gradient_communication_needs_ranks():
    model = build_model(MICRO)
    with pytest.raises(ValueError, match=r"grad_comm: expected fp32 in a single process .*, got 'fp8'"):
        apply_grad_comm(model, "none", "fp8")
    apply_grad_comm(model, "none", "fp32")  # nothing to register


def test_fsdp2_shards_each_transformer_block():
    model = build_model(MICRO)
    assert transformer_blocks(model) == list(model.layers)
