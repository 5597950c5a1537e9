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
def test_fused_step_equals_the_torch_step(states, monkeypatch):
    assert fused.INTERPRETED  # the kernel runs here (tests/kernels/conftest.py), or this compares torch with torch
    launches = []
    monkeypatch.setattr(fused, "_launch", lambda *a, _f=fused._launch: launches.append(a[0].numel()) or _f(*a))
    ref = [p.requires_grad_() for p in _params(0)]
    got = [p.clone().detach().requires_grad_() for p in ref]
    opt_ref = AdamWLP(ref, states=states, fused=False, **HP)
    opt_got = AdamWLP(got, states=states, fused=True, **HP)
    for step in range(4):
        for a, b, g in zip(ref, got, _grads(step, SHAPES)):
            a.grad, b.grad = g.clone(), g.clone()
        opt_ref.step()
        before = len(launches)
        opt_got.step()
        assert launches[before:] == [len(SHAPES) * fused.ROW]  # every parameter took the kernel, in one launch
        for a, b in zip(ref, got):
            assert torch.equal(a.detach().view(torch.int32), b.detach().view(torch.int32)), f"step {step}"
            sa, sb = opt_ref.state[a], opt_got.state[b]
            assert sa.keys() == sb.keys()
            for key in sa:
                assert sa[key].dtype == sb[key].dtype and torch.equal(sa[key], sb[key]), (step, key)


def test_one_launch_per_gradient_dtype_and_step_count(monkeypatch):
    """Parameters whose gradients differ in dtype, or whose step counts differ (one sat out a step),
    take one launch each, with the same bits as the torch step."""
    launches = []
    monkeypatch.setattr(fused, "_launch", lambda *a, _f=fused._launch: launches.append(a[0].numel()) or _f(*a))
    ref = [p.requires_grad_() for p in _params(1)]
    got = [p.clone().detach().requires_grad_() for p in ref]
    for p in ref + got:
        p.grad_dtype = None  # let a float32 parameter take a BF16 gradient
    opt_ref = AdamWLP(ref, states="int8", fused=False, **HP)
    opt_got = AdamWLP(got, states="int8", fused=True, **HP)
    for step in range(3):
        for i, (a, b, g) in enumerate(zip(ref, got, _grads(step, SHAPES))):
            g = g.bfloat16() if i % 2 else g  # BF16 gradients beside float32 ones
            a.grad, b.grad = (None, None) if (step == 0 and i == 4) else (g.clone(), g.clone())
        opt_ref.step()
        before = len(launches)
        opt_got.step()
        # step 0: float32 (0, 2) and BF16 (1, 3) gradients; then parameter 4 is one step behind
        want = [2, 2] if step == 0 else [2, 2, 1]
        assert sorted(launches[before:], reverse=True) == [n * fused.ROW for n in want]
        for a, b in zip(ref, got):
            assert torch.equal(a.detach().view(torch.int32), b.detach().view(torch.int32)), f"step {step}"
            for key in opt_ref.state[a]:
                assert torch.equal(opt_ref.state[a][key], opt_got.state[b][key]), (step, key)


def test_coverage():
    """The kernel takes float32 parameters whose gradient and states are contiguous; FP8 moments are not
    covered (per-group powers); other parameters take the torch step."""
    p = torch.randn(3000, requires_grad=True)
    p.grad = torch.randn(3000)
    state = {"step": torch.tensor(1.0), "exp_avg": torch.zeros(3000, dtype=torch.int8)}
    assert fused.covers(p, state, StateFormat.INT8)
    assert not fused.covers(p, state, StateFormat.FP8)
    assert not fused.covers(p.detach().to(torch.bfloat16).requires_grad_(), state, StateFormat.INT8)
    assert not fused.covers(p, {"exp_avg": torch.zeros(3000, 2, dtype=torch.int8)[:, 0]}, StateFormat.INT8)


def test_empty_parameters_are_skipped():
    empty, full = torch.zeros(0, requires_grad=True), torch.randn(100, requires_grad=True)
    for fused_step in (True, False):
        opt = AdamWLP([empty, full], states="int8", fused=fused_step, **HP)
        empty.grad, full.grad = torch.zeros(0), torch.randn(100)
        opt.step()
        assert empty not in opt.state and full in opt.state


def test_fused_flag_is_checked():
    with pytest.raises(ValueError, match="fused"):
        AdamWLP([torch.zeros(3, requires_grad=True)], states="int8", fused="yes")


@pytest.mark.parametrize("states", ["bf16", "int8"])
def test_training_through_the_optimizer_is_the_same_fused_or_not(states):
    """BF16 parameters with FP32 masters (``lowprec.optim.Optimizer``): five training steps give the same
    weights, masters and moments with the fused step as with the torch step; the state_dict round trips."""
    from lowprec.optim import Optimizer
    from tests.optim.common import assert_same_state, batch, mlp, mse

    runs = []
    for use in (False, True):
        model = mlp(torch.bfloat16)
        opt = Optimizer(model.parameters(), AdamWLP, states=states, fused=use, master_weights=True, **HP)
        for s in range(5):
            x, y = batch(s, torch.bfloat16)
            opt.backward(mse(model, x, y))
            opt.step()
        runs.append((model, opt))
    (a, opt_a), (b, opt_b) = runs
    for p, q in zip(a.parameters(), b.parameters()):
        assert torch.equal(p.view(torch.int16), q.view(torch.int16))
    assert_same_state(opt_a.state_dict(), opt_b.state_dict())
