"""The step guard: non-finite steps skipped bit-exactly, clipping as torch does it, loss spikes."""
from __future__ import annotations

import math

import pytest
import torch

from lowprec.optim import LOSS_SPIKE, NONFINITE_GRADS, NONFINITE_LOSS, Optimizer, SpikeDetector, StepGuard
from tests.optim.common import assert_same_state, batch, bits, clone_state, mlp, mse

CONFIGS = {
    "bf16-masters": dict(dtype=torch.bfloat16, master_weights=True),
    "bf16-plain": dict(dtype=torch.bfloat16, master_weights=False),
    "bf16-sr": dict(dtype=torch.bfloat16, master_weights=False, stochastic_rounding=True),
    "fp16-masters": dict(dtype=torch.float16, master_weights=True),
    "fp32": dict(dtype=torch.float32, master_weights=True),
}


def _setup(name: str):
    cfg = dict(CONFIGS[name])
    dtype = cfg.pop("dtype")
    model = mlp(dtype)
    opt = Optimizer(model.parameters(), torch.optim.AdamW, lr=1e-2, weight_decay=0.1, betas=(0.9, 0.95),
                    loss_scale="dynamic", max_grad_norm=1.0, **cfg)
    return model, opt, dtype


def _good_step(model, opt, dtype, step: int):
    opt.zero_grad()
    total = 0.0
    for micro in range(2):
        x, y = batch(10 * step + micro, dtype)
        loss = mse(model, x, y) / 2
        opt.backward(loss)
        total += loss.item()
    return opt.step(loss=total)


def _snapshot(model, opt):
    return ([p.detach().clone() for p in model.parameters()],
            [None if m is None else m.clone() for m in opt.master_weights],
            clone_state(opt.optimizer.state_dict()))


@pytest.mark.parametrize("name", list(CONFIGS))
@pytest.mark.parametrize("poison", ["grad-nan", "grad-inf", "loss-nan"])
def test_skipped_step_leaves_everything_bit_identical(name, poison):
    model, opt, dtype = _setup(name)
    for step in range(3):
        assert not _good_step(model, opt, dtype, step).skipped
    params, masters, inner = _snapshot(model, opt)
    assert inner["state"][0]["step"].item() == 3  # AdamW has state worth protecting
    scale = opt.loss_scale

    opt.zero_grad()
    x, y = batch(99, dtype)
    weight = model[0].weight
    bad = {"grad-nan": math.nan, "grad-inf": math.inf}.get(poison)
    handle = weight.register_hook(lambda g: g * bad) if bad is not None else None
    loss = mse(model, x, y)
    opt.backward(loss)
    if handle is not None:
        handle.remove()
    result = opt.step(loss=math.nan if poison == "loss-nan" else loss)

    assert result.skipped and opt.skipped_steps == 1
    assert result.reason == (NONFINITE_LOSS if poison == "loss-nan" else NONFINITE_GRADS)
    for p, before in zip(model.parameters(), params):
        assert p.dtype == dtype and torch.equal(bits(p), bits(before))
    for m, before in zip(opt.master_weights, masters):
        assert (m is None) == (before is None) and (m is None or torch.equal(bits(m), bits(before)))
    assert_same_state(opt.optimizer.state_dict(), inner)
    assert all(p.grad is None for p in model.parameters())
    assert all(m is None or m.grad is None for m in opt.master_weights)
    # the scale backs off for overflowing gradients only; a bad loss is not the scale's fault
    assert opt.loss_scale == (scale if poison == "loss-nan" else scale / 2)


@pytest.mark.parametrize("name", ["bf16-masters", "fp32"])
def test_run_with_skipped_step_continues_like_run_without(name):
    ref_model, ref_opt, dtype = _setup(name)
    model, opt, _ = _setup(name)
    for step in range(4):
        _good_step(ref_model, ref_opt, dtype, step)
        _good_step(model, opt, dtype, step)
        if step == 1:  # an extra, poisoned step only in the second run
            opt.zero_grad()
            x, y = batch(7, dtype)
            opt.backward(mse(model, x * math.inf, y))
            assert opt.step().reason == NONFINITE_GRADS
    for p, q in zip(model.parameters(), ref_model.parameters()):
        assert torch.equal(bits(p), bits(q))  # a power-of-two backoff changes no unscaled gradient
    assert_same_state(opt.optimizer.state_dict(), ref_opt.optimizer.state_dict())


@pytest.mark.parametrize("max_norm", [0.05, 100.0])
def test_clipping_matches_torch_clip_grad_norm(max_norm):
    ref = mlp()
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    model = mlp()
    opt = Optimizer(model.parameters(), torch.optim.AdamW, lr=1e-2, max_grad_norm=max_norm)
    for step in range(3):
        x, y = batch(step)
        ref_opt.zero_grad()
        mse(ref, x, y).backward()
        ref_norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), max_norm)
        ref_opt.step()
        opt.zero_grad()
        opt.backward(mse(model, x, y))
        result = opt.step()
        assert result.grad_norm == ref_norm.item()
        assert result.clipped == (max_norm < 1.0)
        for p, q in zip(model.parameters(), ref.parameters()):
            assert torch.equal(p, q)


def test_grad_norm_is_of_unscaled_gradients():
    w = torch.nn.Parameter(torch.tensor([3.0, 4.0]))
    opt = Optimizer([w], torch.optim.SGD, lr=0.0, loss_scale=1024.0)
    opt.backward((w * w).sum() / 2)  # gradient w: norm 5
    result = opt.step()
    assert result.grad_norm == 5.0 and result.loss_scale == 1024.0


def test_spike_threshold_by_hand():
    d = SpikeDetector(window=5, factor=3.0, min_history=5)
    for loss in [1.0, 1.1, 0.9, 1.0, 1.0]:
        assert not d.observe(loss)
    assert d.threshold() == pytest.approx(1.0 + 3.0 * math.sqrt(0.004), rel=1e-12)  # mean 1, var 0.02/5
    assert not d.observe(1.18)
    d2 = SpikeDetector(window=5, factor=3.0, min_history=5)
    for loss in [1.0, 1.1, 0.9, 1.0, 1.0]:
        d2.observe(loss)
    assert d2.observe(1.2)


def test_spike_flat_window_floor_warmup_and_nonfinite():
    d = SpikeDetector(window=4, factor=3.0, min_history=3)
    assert not d.observe(2.0) and not d.observe(2.0)
    assert not d.observe(50.0)  # only two losses seen: too few to judge
    d = SpikeDetector(window=4, factor=3.0, min_history=3)
    for _ in range(4):
        d.observe(2.0)
    assert d.threshold() == pytest.approx(2.0 + 3.0 * 0.02)  # std 0: the floor 1% of the mean
    assert not d.observe(2.05)
    assert not d.observe(math.nan) and not d.observe(math.inf)
    assert d.state_dict() == [2.0, 2.0, 2.0, 2.05]  # non-finite losses never enter; the oldest left


def test_optimizer_reports_spike_and_still_steps():
    model = mlp()
    opt = Optimizer(model.parameters(), torch.optim.SGD, lr=1e-3, spike_window=8, spike_factor=3.0)
    results = []
    for step in range(12):
        opt.zero_grad()
        x, y = batch(step)
        loss = mse(model, x, y)
        opt.backward(loss)
        results.append(opt.step(loss=loss * (10.0 if step == 10 else 1.0)))
    assert [r.spike for r in results] == [step == 10 for step in range(12)]
    assert not any(r.skipped for r in results)
    assert opt.guard.spike_count == 1 and opt.guard.steps == 12


def test_guard_rejects_bad_arguments():
    with pytest.raises(ValueError, match="^max_grad_norm: expected"):
        StepGuard(max_grad_norm=0.0)
    with pytest.raises(ValueError, match="^spike_window: expected"):
        StepGuard(max_grad_norm=None, spike_window=0)
    with pytest.raises(ValueError, match="^spike_factor: expected"):
        StepGuard(max_grad_norm=None, spike_factor=-1.0)
    w = torch.nn.Parameter(torch.ones(2))
    opt = Optimizer([w], torch.optim.SGD, lr=0.1)
    opt.backward(w.sum())
    with pytest.raises(TypeError, match="^loss: expected"):
        opt.step(loss="1.0")
    with pytest.raises(ValueError, match="^loss: expected"):
        opt.step(loss=torch.ones(3))


def test_skip_spikes_skips_the_spike_step_leaving_weights_and_optimizer_state_as_they_were():
    model = mlp()
    opt = Optimizer(model.parameters(), torch.optim.AdamW, lr=1e-2, spike_window=8, spike_factor=3.0,
                    skip_spikes=True)
    results = []
    for step in range(12):
        if step == 10:
            params_before = [p.detach().clone() for p in model.parameters()]
            state_before = clone_state(opt.state_dict()["optimizer"])
        opt.zero_grad()
        x, y = batch(step)
        loss = mse(model, x, y)
        opt.backward(loss)
        results.append(opt.step(loss=loss * (10.0 if step == 10 else 1.0)))
        if step == 10:
            assert all(torch.equal(bits(a), bits(p.detach())) for a, p in zip(params_before, model.parameters()))
            assert_same_state(opt.state_dict()["optimizer"], state_before)
    assert [r.skipped for r in results] == [r.spike for r in results] == [step == 10 for step in range(12)]
    assert results[10].reason == LOSS_SPIKE and opt.guard.skipped_steps == 1
    assert results[11].reason is None  # the next ordinary loss steps


def test_skip_spikes_must_be_a_bool():
    with pytest.raises(TypeError, match="^skip_spikes: expected a bool"):
        StepGuard(max_grad_norm=None, skip_spikes="yes")
