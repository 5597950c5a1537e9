"""FP8 primary weights under DDP (two gloo ranks): the run with ``--fp8-weights`` (BF16 parameters stored as
E4M3 codes, FP32 masters in the optimizer) trains bit for bit as the same DDP run with BF16 weights and FP32
masters (the codes are the cast that run makes of its weights at every forward), and a run cut at step 2
resumes from its checkpoint onto the same curve, bit for bit."""
from __future__ import annotations

from tests.distributed.launch_helpers import fp8_weights_train_as_bf16

RUN = ("--model", "tiny", "--steps", "4", "--batch-size", "4", "--seq-len", "32", "--val-batches", "2",
       "--eval-every", "2")
TRAIN = ("train", "--recipe", "fp8-current", "--save-every", "2", *RUN, "--dtype", "bfloat16", "--parallel", "ddp",
         "--no-tensorboard", "--quiet")


def test_ddp_with_fp8_weights_trains_and_resumes_as_bf16_weights_do(tmp_path):
    fp8_weights_train_as_bf16(tmp_path, TRAIN, steps=4)


def _wrapped_with_other_weights():
    import torch
    import torch.distributed as dist

    import lowprec
    from lowprec.distributed.launch import wrap

    torch.manual_seed(dist.get_rank())  # each rank its own initial weights
    m = torch.nn.Sequential(torch.nn.Linear(64, 64)).to(torch.bfloat16)
    lowprec.convert(m, "fp8-current", lowprec.Policy(skip_small=False), fp8_weights=True)
    wrap(m, "ddp")
    w = m[0].weight
    assert w.initial is not None  # kept for the optimizer, which makes its FP32 master from it
    for t in (w.initial.float(), w.float()):
        got = [torch.empty_like(t) for _ in range(2)]
        dist.all_gather(got, t)
        assert torch.equal(got[0], got[1])  # rank 0's initial value and its codes, on every rank


def test_ranks_made_with_other_weights_share_rank_0s_initial_value_and_codes(tmp_path):
    from tests.distributed.launch_helpers import forked

    forked(_wrapped_with_other_weights, store=tmp_path / "store")
