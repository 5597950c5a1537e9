"""Stochastic rounding of BF16/FP16 weights updated without masters."""
from __future__ import annotations

import math

import pytest
import torch

from lowprec.optim import Optimizer, StochasticRounding, stochastic_round
from tests.optim.common import assert_same_state, batch, bits, clone_state, mlp, mse


@pytest.mark.parametrize("dtype, lo, hi", [
    (torch.bfloat16, 1.0 - 2.0**-8, 1.0),  # spacing 2^-8 just below 1
    (torch.float16, 1.0 - 2.0**-11, 1.0),  # spacing 2^-11 just below 1
])
def test_stochastic_round_is_unbiased(dtype, lo, hi):
    n = 200_000
    x = torch.full((n,), lo + 0.3 * (hi - lo))  # 30% of the way from lo to hi
    y = stochastic_round(x, dtype, torch.Generator().manual_seed(0))
    assert y.dtype == dtype
    values = y.float()
    assert set(values.unique().tolist()) == {lo, hi}
    p_up = (values == hi).double().mean().item()
    sigma = math.sqrt(0.3 * 0.7 / n)  # a Bernoulli(0.3) mean over n draws
    assert abs(p_up - 0.3) < 5 * sigma
    nearest = x.to(dtype).float().double().mean().item()  # to nearest: always lo, biased by 0.3 spacing
    assert abs(values.double().mean().item() - x.double().mean().item()) < abs(nearest - x.double().mean().item()) / 50


def test_rejects_other_dtypes():
    with pytest.raises(ValueError, match="^dtype: expected torch.bfloat16 or torch.float16"):
        stochastic_round(torch.ones(2), torch.float32)


def _sgd_constant_grad(stochastic_rounding: bool, steps: int, n: int = 20_000) -> torch.Tensor:
    """BF16 weights at 1.0, ``steps`` SGD steps of lr 1 on a gradient of 1e-3 (a quarter of the spacing)."""
    w = torch.nn.Parameter(torch.ones(n, dtype=torch.bfloat16))
    opt = Optimizer([w], torch.optim.SGD, lr=1.0, master_weights=False, stochastic_rounding=stochastic_rounding)
    for _ in range(steps):
        opt.zero_grad()
        opt.backward((w.float() * 1e-3).sum())  # gradient 1e-3, rounded to bf16 by autograd
        opt.step()
    return w.detach()


def test_sr_weights_follow_small_updates_on_average():
    steps = 10
    g = torch.tensor(1e-3, dtype=torch.bfloat16).item()  # the gradient as autograd delivers it
    expected = 1.0 - steps * g
    plain = _sgd_constant_grad(False, steps)
    assert torch.equal(plain, torch.ones_like(plain))  # to nearest, every update is lost
    sr = _sgd_constant_grad(True, steps)
    assert sr.dtype == torch.bfloat16
    # each step adds rounding noise of std <= spacing / 2; over 10 steps and 20000 weights the mean's
    # std is below 2^-8 / 2 * sqrt(10) / sqrt(20000) = 4.4e-5
    assert abs(sr.double().mean().item() - expected) < 2.5e-4
    assert sr.float().std().item() > 0  # weights did round differently


def test_same_seed_same_result_and_generator_state_saved():
    def run(seed, steps, opt=None, model=None):
        model = model or mlp(torch.bfloat16)
        opt = opt or Optimizer(model.parameters(), torch.optim.AdamW, lr=1e-3, master_weights=False,
                               stochastic_rounding=True, seed=seed)
        for step in range(steps):
            opt.zero_grad()
            x, y = batch(step, torch.bfloat16)
            opt.backward(mse(model, x, y))
            opt.step()
        return model, opt

    a, _ = run(0, 4)
    b, _ = run(0, 4)
    c, _ = run(1, 4)
    assert all(torch.equal(bits(p), bits(q)) for p, q in zip(a.parameters(), b.parameters()))
    assert not all(torch.equal(p, q) for p, q in zip(a.parameters(), c.parameters()))
    model, opt = run(0, 2)
    sd = clone_state(opt.state_dict())  # a snapshot: like torch's, the state_dict holds live tensors
    assert set(sd["stochastic_rounding"]) == {"cpu"}
    assert all(s.dtype == torch.float32 for s in opt.optimizer.state[model[0].weight].values())
    model2 = mlp(torch.bfloat16)
    model2.load_state_dict(model.state_dict())
    opt2 = Optimizer(model2.parameters(), torch.optim.AdamW, lr=1e-3, master_weights=False,
                     stochastic_rounding=True, seed=123)  # the seed is overridden by the saved state
    opt2.load_state_dict(sd)
    assert all(s.dtype == torch.float32 for s in opt2.optimizer.state[model2[0].weight].values())
    assert_same_state(opt2.state_dict(), sd)
    # both continue with steps 0 and 1 of data: same random bits, same weights
    for m, o in ((model, opt), (model2, opt2)):
        run(None, 2, o, m)
    assert all(torch.equal(bits(p), bits(q)) for p, q in zip(model.parameters(), model2.parameters()))


def test_widened_restores_dtype_when_step_raises():
    w = torch.nn.Parameter(torch.tensor([1.0, 2.0], dtype=torch.bfloat16))
    sr = StochasticRounding(seed=0)
    with pytest.raises(RuntimeError, match="boom"):
        with sr.widened([w]):
            assert w.dtype == torch.float32
            raise RuntimeError("boom")
    assert w.dtype == torch.bfloat16 and w.tolist() == [1.0, 2.0]


def test_sr_requires_no_masters():
    with pytest.raises(ValueError, match="^stochastic_rounding: expected False when master_weights=True"):
        Optimizer(mlp(torch.bfloat16).parameters(), torch.optim.SGD, lr=0.1, stochastic_rounding=True)
