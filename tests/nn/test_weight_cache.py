"""Weight casts: outside ``cached_weight_casts`` a layer casts its weight at every forward and keeps no
copy; inside, a weight is quantized once and reused by every micro-batch of gradient accumulation,
and an in-place update of the weight invalidates the cast."""
from __future__ import annotations

import pytest
import torch

from lowprec.nn import cached_weight_casts
from tests.nn.common import LOW_PRECISION, QuantizeSpy, make_linear, randn

MICRO_BATCHES = 3


def _micro_batch(lin, seed: int) -> None:
    x = randn(32, 128, seed=seed).requires_grad_()
    (lin(x).square().mean() / MICRO_BATCHES).backward()


def _casts_per_forward(recipe: str) -> int:
    # a per-tensor cast of weight.T is weight's cast transposed; other granularities cast weight.T anew
    return 1 if recipe in ("fp8-delayed", "fp8-current") else 2


@pytest.mark.parametrize("recipe", LOW_PRECISION)
def test_weight_is_cast_once_per_step_across_micro_batches(recipe, monkeypatch):
    lin = make_linear(recipe)
    opt = torch.optim.SGD(lin.parameters(), lr=0.5)
    spy = QuantizeSpy(monkeypatch)
    per_step = _casts_per_forward(recipe)
    for step in range(2):
        with cached_weight_casts(lin):
            for micro in range(MICRO_BATCHES):
                _micro_batch(lin, seed=10 * step + micro)
                assert spy.reads(lin.weight) == per_step * (step + 1), f"step {step}, micro-batch {micro}"
        assert lin.state.weight_cache is None  # dropped on leaving the region
        opt.step()
        opt.zero_grad()


@pytest.mark.parametrize("recipe", ["fp8-current", "mxfp8"])
def test_outside_the_region_every_forward_casts_and_nothing_is_kept(recipe, monkeypatch):
    lin = make_linear(recipe)
    spy = QuantizeSpy(monkeypatch)
    for micro in range(MICRO_BATCHES):
        _micro_batch(lin, seed=micro)
        # forward casts the weight for its GEMM, backward casts weight.T for the data gradient
        assert spy.reads(lin.weight) == 2 * (micro + 1)
        assert lin.state.weight_cache is None


def test_regions_nest_and_the_cache_lives_until_the_outer_one_ends():
    lin = make_linear("fp8-current")
    with cached_weight_casts(lin):
        with cached_weight_casts(lin):
            _micro_batch(lin, seed=1)
        assert lin.state.weight_cache is not None
    assert lin.state.weight_cache is None and lin.state.cache_depth == 0


@pytest.mark.parametrize("recipe", ["fp8-rowwise", "fp8-delayed", "fp8-blockwise", "nvfp4"])
def test_cached_and_uncached_micro_batches_give_the_same_gradients(recipe):
    # cached: weight.T cast at forward and kept; uncached: cast again in backward with forward's scale
    a, b = make_linear(recipe), make_linear(recipe)
    torch.manual_seed(0)  # nvfp4 rounds its gradients stochastically: the same draws for both
    with cached_weight_casts(a):
        for micro in range(MICRO_BATCHES):
            _micro_batch(a, seed=micro)
    torch.manual_seed(0)
    for micro in range(MICRO_BATCHES):
        _micro_batch(b, seed=micro)
    assert torch.equal(a.weight.grad, b.weight.grad)
    if a.delayed_state is not None:  # every forward records the weight's amax, cached or not
        assert torch.equal(a.delayed_state.history, b.delayed_state.history)


@pytest.mark.parametrize("recipe", ["fp8-current", "fp8-rowwise", "mxfp8", "mxfp4", "nvfp4"])
def test_after_an_optimizer_step_the_layer_uses_the_new_weight(recipe):
    lin = make_linear(recipe)
    opt = torch.optim.AdamW(lin.parameters(), lr=0.1)
    with cached_weight_casts(lin):
        _micro_batch(lin, seed=1)
        opt.step()
        x = randn(16, 128, seed=2)
        torch.manual_seed(0)
        y = lin(x)
    fresh = make_linear(recipe)
    fresh.load_state_dict(lin.state_dict())
    torch.manual_seed(0)
    assert torch.equal(y, fresh(x))


@pytest.mark.parametrize("update", ["no_grad mul_", "copy_", "assign .data"])
def test_any_inplace_update_through_the_parameter_invalidates_the_cache(update):
    lin = make_linear("fp8-current")
    x = randn(16, 128, seed=3)
    with cached_weight_casts(lin):
        before = lin(x)
        with torch.no_grad():
            if update == "no_grad mul_":
                lin.weight.mul_(2.0)
            elif update == "copy_":
                lin.weight.copy_(lin.weight * 2.0)
            else:
                lin.weight.data = lin.weight.data * 2.0
        after = lin(x)
    assert torch.equal(after, lin(x)) and not torch.equal(after, before)


def test_outside_the_region_a_write_through_weight_data_is_seen():
    lin = make_linear("fp8-current")
    x = randn(16, 128, seed=3)
    before = lin(x)
    lin.weight.data.copy_(lin.weight.data * 2.0)  # EMA swaps and some optimizers write this way
    after = lin(x)
    fresh = make_linear("fp8-current")
    fresh.load_state_dict(lin.state_dict())
    assert not torch.equal(after, before) and torch.equal(after, fresh(x))


@pytest.mark.xfail(strict=True, reason="limitation: weight.data.copy_() does not bump the parameter's version "
                   "counter, so inside cached_weight_casts the cache keeps the old weight's cast")
def test_inside_the_region_an_update_through_weight_data_invalidates_the_cache():
    lin = make_linear("fp8-current")
    x = randn(16, 128, seed=3)
    with cached_weight_casts(lin):
        lin(x)
        lin.weight.data.copy_(lin.weight.data * 2.0)
        after = lin(x)
        lin.clear_cache()
        assert torch.equal(after, lin(x))
