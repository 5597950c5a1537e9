"""Auxiliary-loss-free balancing of the reference MoE layer (see [Note: auxiliary-loss-free balancing] in
``lowprec.train.moe_model``): the bias chooses the experts and never weighs them, training forwards count
the tokens, and each taken step moves every bias by the rate toward balance."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from lowprec.nn.recomputation import recomputation
from lowprec.train.model import PRESETS, build_model
from lowprec.train.moe_model import MoEConfig, balance_experts

RATE = 0.25
CFG = dataclasses.replace(PRESETS["moe-tiny"], moe=MoEConfig(n_experts=8, top_k=2, n_shared=1, balance_rate=RATE))


def _layer():
    return build_model(CFG, seed=3).layers[0].feed_forward


def test_the_bias_chooses_and_the_probabilities_weigh():
    ff = _layer()
    x = torch.randn(40, CFG.dim)
    probs = ff.router(x).float().softmax(-1)
    with torch.no_grad():
        ff.expert_bias.copy_(torch.tensor([0.0, 0, 0, 0, 0, 0, 0, 1.0]))  # expert 7 always chosen
    weights, experts = ff.route(x)
    assert (experts == 7).any(dim=1).all()
    chosen = probs.gather(1, experts)
    torch.testing.assert_close(weights, chosen / chosen.sum(1, keepdim=True), rtol=0, atol=0)


def test_without_a_rate_there_is_no_bias_and_routing_is_unchanged():
    ff = build_model(PRESETS["moe-tiny"], seed=3).layers[0].feed_forward
    assert not hasattr(ff, "expert_bias") and "expert_bias" not in ff.state_dict()
    assert balance_experts(ff) == 0


def _train_forward(ff, x):
    ff.train()
    return ff(x).sum()


def test_a_taken_step_moves_each_bias_by_the_rate_toward_balance():
    ff = _layer()
    x = torch.randn(2, 24, CFG.dim)
    _train_forward(ff, x).backward()
    load = ff.expert_load.clone()
    assert load.sum() == 2 * 24 * CFG.moe.top_k  # every (token, slot) counted once
    assert balance_experts(ff) == 1
    want = RATE * torch.sign(load.mean() - load)
    assert torch.equal(ff.expert_bias, want) and want.abs().sum() > 0
    assert not ff.expert_load.any()  # counts cleared
    assert "expert_bias" in ff.state_dict() and "expert_load" not in ff.state_dict()


def test_a_skipped_step_clears_the_counts_and_keeps_the_bias():
    ff = _layer()
    _train_forward(ff, torch.randn(2, 24, CFG.dim))
    balance_experts(ff, taken=False)
    assert not ff.expert_bias.any() and not ff.expert_load.any()


@pytest.mark.parametrize("where", ["eval", "no_grad", "recomputed"])
def test_only_training_forwards_count(where):
    ff = _layer()
    x = torch.randn(2, 24, CFG.dim)
    if where == "eval":
        ff.eval()
        ff(x)
    elif where == "no_grad":
        with torch.no_grad():
            ff.train()
            ff(x)
    else:
        with recomputation():
            _train_forward(ff, x)
    assert not ff.expert_load.any()


def test_balancing_evens_out_the_experts_over_steps():
    """A router leaning to experts 0 and 1, the same batch routed again after each step (rate 0.005): the
    tokens per expert spread less (standard deviation 10.3 -> 4.5 measured), the busiest expert gets fewer."""
    cfg = dataclasses.replace(CFG, moe=dataclasses.replace(CFG.moe, balance_rate=0.005))
    ff = build_model(cfg, seed=3).layers[0].feed_forward
    with torch.no_grad():
        ff.router.weight[:2] += 0.05
    torch.manual_seed(0)
    x = torch.randn(4, 32, CFG.dim)

    def counts():
        with torch.no_grad():
            _, experts = ff.route(x.flatten(0, 1))
        return torch.bincount(experts.flatten(), minlength=8).float()

    before = counts()
    for _ in range(8):
        _train_forward(ff, x)
        balance_experts(ff)
    after = counts()
    assert after.std() < before.std() / 2 and after.max() < before.max()
