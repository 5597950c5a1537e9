"""FP32 master weights and FP32 gradient accumulation for BF16/FP16 models."""
from __future__ import annotations

import pytest
import torch

from lowprec.optim import GradAccumulator, LossScaleConfig, MasterWeights, Optimizer
from tests.optim.common import assert_same_state, batch, bits, clone_state, mlp, mse


def _regression():
    """Weights in [1, 1.25] (BF16 spacing 2^-7 there) and a target within 0.04 of them.

    AdamW with lr 1e-3 moves a weight by about 1e-3 per step: less than half the spacing, so a
    BF16 weight updated in place rounds back to where it was, every step.
    """
    g = torch.Generator().manual_seed(0)
    w0 = (1.0 + 0.25 * torch.rand(1, 16, generator=g)).to(torch.bfloat16)  # (1, 16)
    delta = 0.04 * (torch.rand(1, 16, generator=g) * 2 - 1)  # (1, 16)
    x = torch.randn(256, 16, generator=g)  # (256, 16)
    y = x @ (w0.float() + delta).T  # (256, 1)
    return w0, x, y


def _train(mode: str, steps: int = 100):
    """Full-batch AdamW on the regression; returns final weights (float32), masters, and the loss."""
    w0, x, y = _regression()
    dtype = torch.float32 if mode == "fp32" else torch.bfloat16
    lin = torch.nn.Linear(16, 1, bias=False).to(dtype)
    with torch.no_grad():
        lin.weight.copy_(w0)
    if mode in ("fp32", "plain"):  # torch alone: the reference and the plain-BF16 baseline
        opt = torch.optim.AdamW(lin.parameters(), lr=1e-3, weight_decay=0.0)
    else:
        opt = Optimizer(lin.parameters(), torch.optim.AdamW, lr=1e-3, weight_decay=0.0,
                        master_weights=mode == "masters", stochastic_rounding=mode == "sr")
    for _ in range(steps):
        opt.zero_grad()
        loss = (lin(x.to(dtype)).float() - y).pow(2).mean()
        if isinstance(opt, Optimizer):
            opt.backward(loss)
        else:
            loss.backward()
        opt.step()
    masters = opt.master_weights[0] if mode == "masters" else None
    return lin.weight.detach().float(), masters, (lin(x.to(dtype)).float() - y).pow(2).mean().item()


def test_masters_track_fp32_where_plain_bf16_updates_underflow():
    w0, _, _ = _regression()
    ref, _, ref_loss = _train("fp32")
    plain, _, plain_loss = _train("plain")
    mine, masters, loss = _train("masters")
    assert (ref - w0.float()).abs().max() > 0.03  # the reference did move
    assert torch.equal(plain, w0.float())  # plain BF16 AdamW never moved a weight
    plain_err = (plain - ref).abs().mean().item()  # measured 0.021
    err = (mine - ref).abs().mean().item()  # measured 0.0023: BF16 rounding of the masters
    master_err = (masters - ref).abs().max().item()  # measured 0.0039
    assert plain_err > 0.015 and err < 0.004 and err < plain_err / 5
    assert master_err < 0.006
    assert ref_loss < 1e-6 and plain_loss > 5e-3 and loss < 5e-4  # measured 1e-7, 8.5e-3, 2.4e-4
    assert torch.equal(mine, masters.to(torch.bfloat16).float())  # the model holds the rounded masters


def test_stochastic_rounding_also_tracks_fp32():
    ref, _, _ = _train("fp32")
    plain, _, plain_loss = _train("plain")
    sr, _, sr_loss = _train("sr")
    plain_err, sr_err = (plain - ref).abs().mean().item(), (sr - ref).abs().mean().item()
    assert sr_err < plain_err / 3  # measured 0.0040 against 0.021
    assert sr_loss < plain_loss / 5  # measured 4.8e-4 against 8.5e-3


def test_gradients_accumulate_in_fp32_exactly():
    model = mlp(torch.bfloat16)
    micro = [batch(i, torch.bfloat16, n=4) for i in range(8)]
    expected = [torch.zeros(p.shape) for p in model.parameters()]  # float32 sum of each BF16 gradient
    for x, y in micro:
        grads = torch.autograd.grad(mse(model, x, y), list(model.parameters()))
        for e, g in zip(expected, grads):
            e.add_(g.float())
    acc = GradAccumulator()
    acc.add(list(model.parameters()))
    for x, y in micro:
        mse(model, x, y).backward()
    got = acc.grads()
    for g, e in zip(got, expected):
        assert g.dtype == torch.float32 and torch.equal(g, e)
    assert all(p.grad is None for p in model.parameters())  # the BF16 gradients were folded and freed

    acc.remove_hooks()  # without the hooks autograd sums in BF16 and rounds after every micro-batch
    for x, y in micro:
        mse(model, x, y).backward()
    exact = [e.double() for e in expected]
    bf16_err = sum((p.grad.double() - e).abs().sum().item() for p, e in zip(model.parameters(), exact))
    fp32_err = sum((g.double() - e).abs().sum().item() for g, e in zip(got, exact))
    assert fp32_err == 0.0 < bf16_err


def test_accumulator_hooks_die_with_it():
    model = mlp(torch.bfloat16)
    acc = GradAccumulator()
    acc.add(list(model.parameters()))
    del acc
    x, y = batch(0, torch.bfloat16)
    mse(model, x, y).backward()
    assert all(p.grad is not None for p in model.parameters())


def test_master_copies_are_exact_and_round_to_nearest_into_params():
    p = torch.nn.Parameter(torch.tensor([1.0, -2.5], dtype=torch.bfloat16))
    q = torch.nn.Parameter(torch.tensor([3.0]))
    mw = MasterWeights(enabled=True)
    targets = mw.add([p, q])
    assert targets[0].dtype == torch.float32 and torch.equal(targets[0], p.float()) and targets[1] is q
    # 1 + 2^-8 is a tie between 1 and 1 + 2^-7: to nearest even gives 1; near 2.5 the spacing is
    # 2^-6, and 2.5 + 0.75 * 2^-6 rounds up
    targets[0].copy_(torch.tensor([1.0 + 2.0**-8, -(2.5 + 0.75 * 2.0**-6)]))
    mw.copy_to_params()
    assert p.tolist() == [1.0, -(2.5 + 2.0**-6)]


def test_fp32_params_get_no_master_and_masters_off_gets_none():
    model = mlp(torch.bfloat16)
    fp32 = torch.nn.Parameter(torch.ones(3))
    opt = Optimizer([*model.parameters(), fp32], torch.optim.SGD, lr=0.1)
    assert [m is None for m in opt.master_weights] == [False] * 4 + [True]
    assert opt.param_groups[0]["params"][-1] is fp32
    assert all(t.dtype == torch.float32 for t in opt.param_groups[0]["params"])
    opt = Optimizer(model.parameters(), torch.optim.SGD, lr=0.1, master_weights=False)
    assert all(m is None for m in opt.master_weights)
    assert [t for t in opt.param_groups[0]["params"]] == list(model.parameters())


def test_fp16_model_with_dynamic_scale_skips_overflow_then_trains():
    model = mlp(torch.float16)
    opt = Optimizer(model.parameters(), torch.optim.AdamW, lr=1e-2, loss_scale=LossScaleConfig(init_scale=2.0**24))
    results, losses = [], []
    for step in range(30):
        opt.zero_grad()
        x, y = batch(step % 4, torch.float16)
        loss = mse(model, x, y)
        opt.backward(loss)
        results.append(opt.step(loss=loss))
        losses.append(loss.item())
    # the output's gradient, 2 * scale * (out - y) / 128, overflows float16 (65504) until the
    # scale has backed off enough; from then on every step is taken
    skipped = [r.skipped for r in results]
    first_taken = skipped.index(False)
    assert first_taken >= 1 and not any(skipped[first_taken:]) and opt.skipped_steps == first_taken
    assert all(r.reason == "non-finite gradients" for r in results[:first_taken])
    assert [r.loss_scale for r in results[:first_taken + 1]] == [2.0**(24 - k) for k in range(first_taken + 1)]
    ref = mlp()  # float32 AdamW over the batches of the steps taken
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    for step in range(first_taken, 30):
        ref_opt.zero_grad()
        x, y = batch(step % 4)
        ref_loss = mse(ref, x, y)
        ref_loss.backward()
        ref_opt.step()
    assert losses[-1] < 0.9 * losses[first_taken]
    assert abs(losses[-1] - ref_loss.item()) < 1e-3  # measured 2e-5


def _stepped_sgd(seed: int) -> Optimizer:
    model = mlp(torch.bfloat16, seed=seed)
    opt = Optimizer(model.parameters(), torch.optim.SGD, lr=0.1, momentum=0.9)
    x, y = batch(seed, torch.bfloat16)
    opt.backward(mse(model, x, y))
    opt.step()
    return opt


def test_master_state_rejects_mismatch_and_changes_nothing():
    sd = _stepped_sgd(0).state_dict()
    other = _stepped_sgd(1)
    params, state = [p.detach().clone() for p in other.params], clone_state(other.state_dict())
    bad = dict(sd, master_weights=sd["master_weights"][:-1])
    with pytest.raises(ValueError, match=r"^state_dict\['master_weights'\]: expected a list of 4"):
        other.load_state_dict(bad)
    wrong_shape = list(sd["master_weights"])
    wrong_shape[0] = torch.zeros(3)
    with pytest.raises(ValueError, match=r"\[0\]: expected a float32 tensor of shape \(16, 8\)"):
        other.load_state_dict(dict(sd, master_weights=wrong_shape))
    assert all(torch.equal(bits(p), bits(q)) for p, q in zip(other.params, params))
    assert_same_state(other.state_dict(), state)
