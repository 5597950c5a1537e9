"""The composed Optimizer: checkpoints, LR schedulers, param groups, argument errors."""
from __future__ import annotations

import io
import math

import pytest
import torch

from lowprec.optim import LossScaleConfig, Optimizer
from tests.optim.common import assert_same_state, batch, bits, mlp, mse

SETUPS = {
    "bf16-masters": (torch.bfloat16, dict(master_weights=True, loss_scale="dynamic", max_grad_norm=0.5)),
    "bf16-sr": (torch.bfloat16, dict(master_weights=False, stochastic_rounding=True, seed=3)),
    "fp16-masters": (torch.float16, dict(loss_scale=LossScaleConfig(init_scale=2.0**20, growth_interval=2))),
    "fp32": (torch.float32, dict(max_grad_norm=1.0)),
}


def _make(name: str):
    dtype, kw = SETUPS[name]
    model = mlp(dtype)
    opt = Optimizer(model.parameters(), torch.optim.AdamW, lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1,
                    spike_window=4, **kw)
    return model, opt, dtype


def _train(model, opt, dtype, steps):
    for step in steps:
        opt.zero_grad()
        total = 0.0
        for micro in range(2):
            x, y = batch(10 * step + micro, dtype, n=8)
            loss = mse(model, x, y) / 2
            opt.backward(loss)
            total += loss.item()
        opt.step(loss=math.nan if step == 2 else total)  # step 2 is skipped: the counters have something


def _roundtrip(obj):
    buf = io.BytesIO()
    torch.save(obj, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=True)


@pytest.mark.parametrize("name", list(SETUPS))
def test_resume_from_saved_state_is_bit_identical(name):
    model, opt, dtype = _make(name)
    _train(model, opt, dtype, range(8))

    first, first_opt, _ = _make(name)
    _train(first, first_opt, dtype, range(4))
    saved = _roundtrip({"model": first.state_dict(), "optim": first_opt.state_dict()})
    resumed, resumed_opt, _ = _make(name)
    resumed.load_state_dict(saved["model"])
    resumed_opt.load_state_dict(saved["optim"])
    assert resumed_opt.skipped_steps == first_opt.skipped_steps >= 1
    _train(resumed, resumed_opt, dtype, range(4, 8))

    for p, q in zip(resumed.parameters(), model.parameters()):
        assert p.dtype == dtype and torch.equal(bits(p), bits(q))
    assert_same_state(resumed_opt.state_dict(), opt.state_dict())
    assert resumed_opt.skipped_steps == opt.skipped_steps


def test_state_dict_contents():
    model, opt, dtype = _make("bf16-masters")
    _train(model, opt, dtype, range(3))
    sd = opt.state_dict()
    assert set(sd) == {"optimizer", "master_weights", "loss_scale", "guard", "stochastic_rounding"}
    assert [m.dtype for m in sd["master_weights"]] == [torch.float32] * 4
    assert sd["loss_scale"]["scale"] == opt.loss_scale
    assert sd["guard"]["skipped_steps"] == 1 and sd["guard"]["steps"] == 3
    assert len(sd["guard"]["window"]) == 2  # the NaN loss of step 2 is not in the window
    assert sd["optimizer"]["state"][0]["exp_avg"].dtype == torch.float32


def test_load_refuses_mismatched_configuration():
    _, with_scale, _ = _make("bf16-masters")
    _, without, _ = _make("fp32")
    with pytest.raises(ValueError, match=r"^state_dict\['loss_scale'\]: expected None"):
        without.load_state_dict(with_scale.state_dict())
    with pytest.raises(ValueError, match=r"^state_dict\['loss_scale'\]: expected saved state"):
        with_scale.load_state_dict(without.state_dict())
    with pytest.raises(ValueError, match="^state_dict: expected a dict with keys"):
        without.load_state_dict({"optimizer": {}})


@pytest.mark.parametrize("pass_wrapper", [False, True])
def test_lambda_lr_drives_the_inner_optimizer(pass_wrapper):
    w = torch.nn.Parameter(torch.ones(3, dtype=torch.bfloat16))
    opt = Optimizer([w], torch.optim.SGD, lr=0.5)
    sched = torch.optim.lr_scheduler.LambdaLR(opt if pass_wrapper else opt.optimizer, lambda s: 0.5**s)
    masters = opt.master_weights[0]
    expected = masters.clone()
    for step in range(3):
        lr = opt.param_groups[0]["lr"]
        assert lr == 0.5 * 0.5**step and opt.optimizer.param_groups[0]["lr"] == lr
        opt.zero_grad()
        opt.backward((w.float() * torch.tensor([1.0, 2.0, 3.0])).sum())  # gradient (1, 2, 3)
        opt.step()
        expected -= lr * torch.tensor([1.0, 2.0, 3.0])
        assert torch.equal(masters, expected)
        sched.step()
    assert torch.equal(w, expected.to(torch.bfloat16))


def test_param_groups_keep_their_options():
    model = mlp(torch.bfloat16)
    groups = [{"params": model[0].parameters(), "lr": 0.1}, {"params": model[2].parameters(), "lr": 0.0}]
    opt = Optimizer(groups, torch.optim.SGD, lr=1.0)
    assert [g["lr"] for g in opt.param_groups] == [0.1, 0.0]
    frozen = [p.detach().clone() for p in model[2].parameters()]
    moving = [p.detach().clone() for p in model[0].parameters()]
    x, y = batch(0, torch.bfloat16)
    opt.backward(mse(model, x, y))
    opt.step()
    assert all(torch.equal(p, q) for p, q in zip(model[2].parameters(), frozen))
    assert not any(torch.equal(p, q) for p, q in zip(model[0].parameters(), moving))


def test_add_param_group():
    model = mlp(torch.bfloat16)
    opt = Optimizer(model[0].parameters(), torch.optim.SGD, lr=0.1)
    opt.add_param_group({"params": model[2].parameters(), "lr": 0.2})
    assert len(opt.param_groups) == 2 and len(opt.master_weights) == 4
    before = model[2].weight.detach().clone()
    x, y = batch(0, torch.bfloat16)
    opt.backward(mse(model, x, y))
    assert opt.step().grad_norm > 0
    assert not torch.equal(model[2].weight, before)
    assert torch.equal(model[2].weight, opt.master_weights[2].to(torch.bfloat16))


def test_step_drops_gradients_and_remove_hooks_restores_plain_grads():
    model = mlp(torch.bfloat16)
    opt = Optimizer(model.parameters(), torch.optim.SGD, lr=0.1)
    x, y = batch(0, torch.bfloat16)
    opt.backward(mse(model, x, y))
    assert all(p.grad is None for p in model.parameters())  # folded into float32 buffers
    opt.step()
    assert all(g is None for g in opt._grads.grads())
    opt.remove_hooks()
    mse(model, x, y).backward()
    assert all(p.grad is not None and p.grad.dtype == torch.bfloat16 for p in model.parameters())


@pytest.mark.parametrize("kwargs, exc, message", [
    (dict(loss_scale="auto"), ValueError, "^loss_scale: expected None, 'dynamic'"),
    (dict(max_grad_norm=-1.0), ValueError, "^max_grad_norm: expected"),
    (dict(master_weights="yes"), TypeError, "^master_weights: expected a bool"),
    (dict(spike_window=0), ValueError, "^spike_window: expected a positive int"),
])
def test_constructor_rejects_bad_options(kwargs, exc, message):
    with pytest.raises(exc, match=message):
        Optimizer(mlp().parameters(), torch.optim.SGD, lr=0.1, **kwargs)


def test_constructor_rejects_bad_params():
    w = torch.nn.Parameter(torch.ones(2))
    with pytest.raises(TypeError, match="^params: expected float32, bfloat16 or float16 tensors, got a torch.float64"):
        Optimizer([torch.nn.Parameter(torch.ones(2, dtype=torch.float64))], torch.optim.SGD, lr=0.1)
    with pytest.raises(ValueError, match="^params: expected each parameter once"):
        Optimizer([w, w], torch.optim.SGD, lr=0.1)
    with pytest.raises(ValueError, match="^params: expected at least one parameter"):
        Optimizer([], torch.optim.SGD, lr=0.1)
    with pytest.raises(TypeError, match="^params: expected an iterable"):
        Optimizer(w, torch.optim.SGD, lr=0.1)
    with pytest.raises(TypeError, match="^optimizer_cls: expected a torch optimizer class"):
        Optimizer([w], "adamw", lr=0.1)
    with pytest.raises(TypeError, match="^optimizer_cls: expected a callable returning a torch.optim.Optimizer"):
        Optimizer([w], lambda groups, **kw: object())


def test_backward_and_zero_grad_reject_bad_input():
    w = torch.nn.Parameter(torch.ones(2))
    opt = Optimizer([w], torch.optim.SGD, lr=0.1)
    with pytest.raises(TypeError, match="^loss: expected a one-element tensor that requires grad"):
        opt.backward(torch.ones(()))
    with pytest.raises(TypeError, match="^loss: expected a one-element tensor"):
        opt.backward(1.0)
    with pytest.raises(ValueError, match="^set_to_none: expected True"):
        opt.zero_grad(set_to_none=False)
