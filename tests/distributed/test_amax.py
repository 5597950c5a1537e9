"""Delayed scaling across ranks: one all-reduce (MAX) per step for every layer's amax history."""
from __future__ import annotations

import pytest
import torch

from lowprec.distributed import delayed_states, reduce_amax_histories, sync_amaxes
from tests.distributed import common as C
from tests.distributed import session
from tests.distributed.checks import STEPS
from tests.distributed.harness import result

dist_results = session.dist_results


def test_histories_agree_across_ranks_after_each_sync(dist_results):
    ranks = [r["fp8-delayed"] for r in result(dist_results, "ddp_recipes")]
    a, b = ranks
    assert a["layers"] == b["layers"] == 2  # both linears of the MLP
    assert a["collectives"] == b["collectives"] == [1] * STEPS  # one all-reduce per step, not one per layer
    for before_a, before_b, after_a, after_b in zip(a["before"], b["before"], a["after"], b["after"]):
        assert not torch.equal(before_a, before_b)  # each rank recorded its own half batch's amaxes
        assert torch.equal(after_a, after_b)
        assert torch.equal(after_a, torch.maximum(before_a, before_b))
        rows = after_a[:STEPS]  # (steps, roles): every role recorded once per step
        assert bool((rows > 0).all()) and not bool(after_a[STEPS:].any())
    for count_a, count_b in zip(a["counts"], b["counts"]):
        assert torch.equal(count_a, count_b) and count_a.tolist() == [STEPS] * 3


def test_every_experts_histories_agree_across_ranks_after_each_sync(dist_results):
    """Delayed experts: each expert's histories are reduced with the others' in the one all-reduce; the
    expert routed no token recorded nothing on either rank."""
    a, b = result(dist_results, "ddp_delayed_experts")
    assert a["experts"] == b["experts"] == 3
    for step, (before_a, before_b, after_a, after_b) in enumerate(zip(a["before"], b["before"], a["after"],
                                                                      b["after"])):
        for e in (0, 2):
            assert not torch.equal(before_a[e], before_b[e]), (step, e)  # each rank its own rows' amaxes
        for e in range(3):
            assert torch.equal(after_a[e], after_b[e]), (step, e)
            assert torch.equal(after_a[e], torch.maximum(before_a[e], before_b[e])), (step, e)
        assert not after_a[1].any()  # no tokens, no amax
        assert bool((after_a[0][:step + 1] > 0).all()) and bool((after_a[2][:step + 1] > 0).all())


def test_sync_is_a_no_op_in_one_process():
    model = C.mlp("fp8-delayed")
    C.train(model, C.sgd(model.parameters()), range(2))
    before = [s.history.clone() for s in delayed_states(model)]
    assert len(before) == 2
    assert sync_amaxes(model) == 0
    assert all(torch.equal(x, s.history) for x, s in zip(before, delayed_states(model)))
    assert delayed_states(C.mlp("fp8-current")) == []  # no delayed scaling, no state
    assert reduce_amax_histories(C.mlp("fp8-current")) == 0  # nothing to reduce: no collective needed


def test_sync_refuses_a_non_module():
    with pytest.raises(TypeError, match="^model: expected a torch.nn.Module"):
        sync_amaxes([torch.zeros(3)])
