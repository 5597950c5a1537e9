"""The fused AdamW step (``lowprec.optim.fused``) equals AdamWLP's torch step bit for bit: parameters,
moment codes and block scales, over several steps, for FP32, BF16 and 8-bit moments, on parameters
smaller than, equal to and larger than a block, with zero gradients and tiny and huge magnitudes."""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from lowprec.optim import AdamWLP, fused
from lowprec.optim.states import StateFormat

SHAPES = [(1,), (100,), (2048,), (3, 1500), (4097,)]
HP = {"lr": 3e-2, "betas": (0.9, 0.95), "weight_decay": 0.1, "eps": 1e-8}


def _params(seed: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(s, generator=gen) * 10.0 ** torch.randint(-3, 3, (1,), generator=gen).item()
            for s in SHAPES]


def _grads(step: int, shapes) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(100 + step)
    out = []
    for i, s in enumerate(shapes):
        g = torch.randn(s, generator=gen) * torch.logspace(-6, 2, s[-1])  # magnitudes over eight decades
        g.view(-1)[:: 7] = 0.0  # exact zeros: second moments that stay 0 get code 0
        if i == 2 and step == 1:
            g.zero_()  # a whole block of zero gradient at a later step
        out.append(g)
    return out


@pytest.mark.parametrize("states", ["fp32", "bf16", "int8"])
def test_fused_step_equals_the_torch_step(states):
    ref = [p.requires_grad_() for p in _params(0)]
    got = [p.clone().detach().requires_grad_() for p in ref]
    opt_ref = AdamWLP(ref, states=states, fused=False, **HP)
    opt_got = AdamWLP(got, states=states, fused=True, **HP)
    for step in range(4):
        if step == 0:
            for p in got:
                p.grad = torch.zeros_like(p)
            assert all(fused.covers(p, StateFormat.parse(states)) for p in got)
        for a, b, g in zip(ref, got, _grads(step, SHAPES)):
            a.grad, b.grad = g.clone(), g.clone()
        opt_ref.step()
        opt_got.step()
        for a, b in zip(ref, got):
            assert torch.equal(a.detach().view(torch.int32), b.detach().view(torch.int32)), f"step {step}"
            sa, sb = opt_ref.state[a], opt_got.state[b]
            assert sa.keys() == sb.keys()
            for key in sa:
                assert sa[key].dtype == sb[key].dtype and torch.equal(sa[key], sb[key]), (step, key)


def test_bf16_gradients_and_coverage():
    """BF16 gradients are widened in the kernel as torch widens them; FP8 moments are not covered."""
    p = torch.randn(3000, requires_grad=True)
    p.grad = torch.randn(3000).to(torch.bfloat16).float()
    assert fused.covers(p, StateFormat.INT8)
    assert not fused.covers(p, StateFormat.FP8)
    assert not fused.covers(p.detach().to(torch.bfloat16).requires_grad_(), StateFormat.INT8)


def test_fused_flag_is_checked():
    with pytest.raises(ValueError, match="fused"):
        AdamWLP([torch.zeros(3, requires_grad=True)], states="int8", fused="yes")
