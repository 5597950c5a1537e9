"""What ``lowprec train`` cannot run of a planned layout, one line per option, by the rule its
configuration applies; and the hints when nothing fits name only what was not given."""
from __future__ import annotations

import itertools

import pytest

from lowprec.distributed.supported import unsupported
from lowprec.plan.memory import Training
from lowprec.plan.planner import PlanConfig, plan
from lowprec.plan.report import format_plan
from lowprec.train.config import TrainConfig


@pytest.mark.parametrize("parallel, fp8_weights, optim_states, master_weights", list(itertools.product(
    ("none", "ddp", "fsdp2"), (False, True), ("fp32", "fp8"), (True, False))))
def test_the_shared_rule_refuses_what_the_training_config_refuses(parallel, fp8_weights, optim_states,
                                                                  master_weights):
    refused = unsupported(parallel, fp8_weights=fp8_weights, optim_states=optim_states,
                          master_weights=master_weights)
    kwargs = dict(parallel=parallel, fp8_weights=fp8_weights, optim_states=optim_states,
                  master_weights=master_weights, dtype="bfloat16")
    if not refused:
        TrainConfig(**kwargs)
        return
    first = refused[0]
    with pytest.raises(ValueError) as e:
        TrainConfig(**kwargs)
    assert str(e.value) == f"{first.option}: expected {first.expected}, got {first.received}"


def _refusals(**kwargs) -> tuple[str, ...]:
    train = kwargs.pop("training", Training())
    return plan(PlanConfig(model="llama-3-70b", gpu="h200", recipe="fp8-current", training=train,
                           **kwargs)).trainer_refusals


def test_a_layout_the_trainer_refuses_gets_one_line_per_option():
    lines = _refusals(gpus=64, tp=8, zero=3, training=Training(fp8_weights=True, optim_states="fp8"))
    assert lines == (
        "--optim-states fp8: lowprec train expects fp32 or bf16 with tp 8 (FP8 and 8-bit moments group the rows of "
        "shards split along dim 0)",
        "--fp8-weights: lowprec train expects False with tp 8 (FP8 primary weights are not split by tensor "
        "parallelism yet)",
    )  # FP8 moments and FP8 weights run under FSDP2, but not beside tensor parallelism
    text = format_plan(plan(PlanConfig(model="llama-3-70b", gpu="h200", recipe="fp8-current", gpus=64, tp=8,
                                       zero=3, training=Training(fp8_weights=True, optim_states="fp8"))))
    assert "lowprec train cannot run this layout as planned:\n  --optim-states fp8: " in text


@pytest.mark.parametrize("kwargs, expected", [
    (dict(gpus=1), ()),
    (dict(gpus=1, training=Training(fp8_weights=True, optim_states="int8")), ()),  # one process takes both
    (dict(gpus=8, zero=0, training=Training(optim_states="fp8")), ()),  # DDP keeps 8-bit moments
    (dict(gpus=8, zero=3), ()),
    (dict(gpus=8, zero=1), ("--zero 1: lowprec train shards nothing (--parallel ddp, as --zero 0) or everything "
                            "(--parallel fsdp2, as --zero 3)",)),
    (dict(gpus=8, pp=2, ep=1), ("--pp 2: lowprec train has no pipeline parallelism",)),
    (dict(gpus=8, tp=8), ()),  # lowprec train --parallel ddp --tp 8
    (dict(gpus=8, tp=8, zero=1), ()),  # one replica: nothing for ZeRO to shard over
    (dict(gpus=16, tp=8, zero=0), ()),  # lowprec train --parallel ddp --tp 8 on 16 ranks: two replicas
    (dict(gpus=16, tp=8, zero=3), ()),  # --parallel fsdp2 --tp 8: FSDP2 over two groups
    (dict(gpus=16, tp=8, zero=1), ("--zero 1: lowprec train shards nothing (--parallel ddp, as --zero 0) or "
                                   "everything (--parallel fsdp2, as --zero 3)",)),
    (dict(gpus=8, zero=3, training=Training(recompute="full")), ()),  # lowprec train --recompute full
    (dict(gpus=8, zero=0, training=Training(master_weights=False)),
     ("--no-master-weights: lowprec train expects True under ddp/fsdp2 (stochastic rounding swaps param.data), "
      "got False (--parallel ddp on 8 GPUs)",)),
])
def test_only_what_the_trainer_cannot_run_is_named(kwargs, expected):
    assert _refusals(**kwargs) == expected


@pytest.mark.parametrize("gpus, tp, expected", [
    (8, 1, ()),  # lowprec train --ep 8 on 8 ranks
    (16, 1, ()),  # two replicas of 8
    (16, 2, ("--ep 8 with --tp 2: lowprec train splits experts or splits layers, not both",)),
])
def test_expert_parallelism_runs_with_replicas_but_not_beside_tensor_parallelism(gpus, tp, expected):
    p = plan(PlanConfig(model="mixtral-8x7b", gpu="h200", recipe="fp8-current", gpus=gpus, ep=8, tp=tp, zero=0))
    assert p.trainer_refusals == expected


def test_no_hint_for_an_option_already_given():
    def hint(**kwargs) -> str:
        p = plan(PlanConfig(model="llama-3-405b", gpu="a100", recipe="bf16", **kwargs))
        assert p.fewest_gpus is None
        return format_plan(p).split("no GPU count fits with ")[1].splitlines()[0]
    assert "(try --zero 3, more --tp/--pp or --recompute full)" in hint(zero=1)
    given = hint(zero=3, training=Training(recompute="full", seq=131072, micro_batch=8))
    assert "--zero 3" not in given and "--recompute" not in given and "(try more --tp/--pp)" in given
