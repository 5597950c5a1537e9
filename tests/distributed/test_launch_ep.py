"""``lowprec train --ep 2`` on two forked ranks set up as torchrun sets them up: moe-tiny's experts split over
the ranks under FSDP2, trained like one process, its checkpoint resumed by one process; bad ``--ep`` refused."""
from __future__ import annotations

import math

import pytest
from click.testing import CliRunner

from lowprec.cli import main
from lowprec.train.logs import read_log
from tests.distributed.launch_helpers import checkpoint_parts, forked_cli, split_then_one
from tests.distributed.launch_helpers import cli_ok as _cli

RUN = ("train", "--model", "moe-tiny", "--recipe", "fp8-blockwise", "--batch-size", "4", "--seq-len", "32",
       "--val-batches", "2", "--eval-every", "2", "--save-every", "2", "--no-tensorboard", "--quiet")
LOOSE = 1e-3
"""Relative difference of each step's losses from one process's (measured: at most 2e-4): fp8-blockwise's
weight-gradient casts take blocks of each rank's half of the tokens; the FP8 dispatch itself is exact
for this recipe (see tests/distributed/test_expert_parallel.py)."""


def test_ep_trains_like_one_process_and_its_checkpoint_resumes_in_one(tmp_path):
    got, want = split_then_one(tmp_path, RUN, "--parallel", "fsdp2", "--ep", "2")
    assert len(got) == len(want) == 4
    for (loss, val), (ref, ref_val) in zip(got, want):
        assert math.isclose(loss, ref, rel_tol=LOOSE)
        assert (val == "") == (ref_val == "")
        if val:
            assert math.isclose(float(val), float(ref_val), rel_tol=LOOSE)


def test_ep_is_refused_for_a_dense_model_and_for_a_count_that_is_not_the_ranks(tmp_path):
    ranks = forked_cli(*RUN, "--model", "tiny", "--steps", "1", "--parallel", "ddp", "--ep", "2",
                       "--out", str(tmp_path / "a"), out=tmp_path / "a")
    assert ranks[0]["exit_code"] == 1
    assert "Error: ep: expected a model with mixture-of-experts layers" in ranks[0]["stderr"], ranks
    ranks = forked_cli(*RUN, "--steps", "1", "--parallel", "ddp", "--ep", "4", "--out", str(tmp_path / "b"),
                       out=tmp_path / "b")
    assert ranks[0]["exit_code"] == 1
    assert "Error: ep: expected a divisor of the number of ranks (2), got 4" in ranks[0]["stderr"], ranks


def test_two_replicas_of_two_expert_parallel_ranks_train_like_one_process(tmp_path):
    """``--ep 2`` on four ranks: two groups of two, each holding every expert once, the experts' gradients
    summed over the replicas and averaged over all four (FSDP2 averages the rest); the gradient norm counts each
    expert slice once. Measured: the losses within 1.6e-5 of one process's, the first step's gradient norm within
7e-4 (fp8-blockwise's weight-gradient casts take blocks of each rank's own tokens)."""
    one = tmp_path / "one"
    _cli(*RUN, "--steps", "2", "--out", str(one))
    mesh = tmp_path / "mesh"
    ranks = forked_cli(*RUN, "--steps", "2", "--parallel", "fsdp2", "--ep", "2", "--out", str(mesh),
                       out=tmp_path / "r", world_size=4)
    assert [r["exit_code"] for r in ranks] == [0] * 4, ranks
    got, want = read_log(mesh / "log.csv"), read_log(one / "log.csv")
    assert len(got) == len(want) == 2
    for row, ref in zip(got, want, strict=True):
        assert math.isclose(float(row["loss"]), float(ref["loss"]), rel_tol=LOOSE), (got, want)
    assert math.isclose(float(got[0]["grad_norm"]), float(want[0]["grad_norm"]), rel_tol=LOOSE)


def test_ep_needs_a_parallel_run():
    result = CliRunner().invoke(main, [*RUN, "--steps", "1", "--ep", "2"])
    assert result.exit_code != 0
    assert "ep: expected 1 with parallel 'none'" in result.output, result.output


@pytest.mark.parametrize("parallel", ["ddp", "fsdp2"])
def test_a_hugging_face_moe_splits_its_experts_like_the_reference(tmp_path, parallel):
    """``--ep 2`` on a Qwen3-MoE config (transformers' fused experts, run by lowprec as ``HFGroupedExperts``):
    the experts' parameters split by expert over the two ranks (under DDP, which splits nothing else, the
    checkpoint holds them in two parts and every other weight whole), tokens dispatched in FP8, the same
    losses as one process within LOOSE (measured: 1.4e-4), and the split checkpoint resumed by one process."""
    transformers = pytest.importorskip("transformers")
    config = transformers.Qwen3MoeConfig(vocab_size=256, hidden_size=128, num_hidden_layers=2, num_attention_heads=4,
                                         num_key_value_heads=2, head_dim=32, intermediate_size=128,
                                         moe_intermediate_size=128, num_experts=4, num_experts_per_tok=2)
    config.save_pretrained(tmp_path / "qwen3-moe")
    run = (RUN[0], "--model", str(tmp_path / "qwen3-moe"), *RUN[3:])
    got, want = split_then_one(tmp_path, run, "--parallel", parallel, "--ep", "2")
    assert len(got) == len(want) == 4
    for (loss, _), (ref, _) in zip(got, want):
        assert math.isclose(loss, ref, rel_tol=LOOSE), (got, want)
    if parallel == "ddp":
        parts = {k: n for k, n in checkpoint_parts(tmp_path / "split").items() if not k.endswith("/step")}
        experts = {k: n for k, n in parts.items() if ".experts." in k}  # weights and their moments
        assert experts and set(experts.values()) == {2}, parts
        assert {n for k, n in parts.items() if k not in experts} == {1}, parts
