"""Lazy scale initialisation: inside ``autocast(<high precision>, record_amax=True)`` a layer bound to a
delayed recipe computes in high precision and records its amaxes as a delayed step would, so the first
delayed step takes its scales from them (see [Note: lazy scale initialisation] in ``lowprec.nn.record``)."""
from __future__ import annotations

import contextlib

import pytest
import torch

import lowprec
from lowprec.nn import cached_weight_casts
from tests.nn.common import GemmSpy, make_linear, randn
from tests.nn.test_delayed import E4M3_MAX, E5M2_MAX, delayed_recipe, with_amax

REGIONS = {"bf16": dict(recipe="bf16"), "disabled": dict(enabled=False)}
"""The two high-precision regions that may record: an unscaled recipe, or no recipe at all."""


def recording(region: str = "bf16") -> contextlib.AbstractContextManager:
    return lowprec.autocast(**REGIONS[region], record_amax=True)


def _scale(amax: float, fmax: float) -> torch.Tensor:
    # the dequantizing scale of [Note: delayed scaling] with margin 0, in float32 as the layer computes it
    return (torch.tensor(amax) / fmax).reshape(1, 1)


def _step(lin, x: torch.Tensor, dy: torch.Tensor):
    x = x.clone().requires_grad_()
    y = lin(x)
    y.backward(dy)
    return y, x.grad


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("region", list(REGIONS))
def test_recorded_steps_fill_each_roles_history_with_its_tensors_amaxes(region, dtype):
    lin = make_linear("fp8-delayed", dtype=dtype)
    xs = [with_amax(randn(4, 8, 128, seed=i, dtype=dtype), a) for i, a in enumerate([4.0, 8.0, 2.0])]
    dys = [randn(4, 8, 256, seed=10 + i, dtype=dtype) * s for i, s in enumerate([0.5, 3.0, 0.01])]
    weight_amaxes = []
    for x, dy in zip(xs, dys):
        weight_amaxes.append(lin.weight.detach().abs().amax().float())
        with recording(region):
            _step(lin, x, dy)
        with torch.no_grad():
            lin.weight.mul_(1.5)  # an optimizer step between: each forward records the weight it read
    state = lin.delayed_state
    assert state.recorded == [3, 3, 3] and state.outliers.tolist() == [0, 0, 0]
    want = torch.stack([torch.stack([x.abs().amax().float() for x in xs]), torch.stack(weight_amaxes),
                        torch.stack([dy.abs().amax().float() for dy in dys])], dim=1)  # (steps, roles)
    assert torch.equal(state.history[:3], want) and not state.history[3:].any()


@pytest.mark.parametrize("record", [True, False])
def test_the_first_delayed_step_takes_its_scales_from_the_recorded_history(monkeypatch, record):
    lin = make_linear("fp8-delayed")
    w_amax = lin.weight.abs().amax().item()
    gemms = GemmSpy(monkeypatch)
    for i, (xa, dya) in enumerate([(4.0, 0.5), (8.0, 0.25)]):
        with lowprec.autocast("bf16", record_amax=record):
            _step(lin, with_amax(randn(32, 128, seed=i), xa), with_amax(randn(32, 256, seed=10 + i), dya))
    assert gemms.calls == []  # the recorded steps quantized nothing
    x, dy = with_amax(randn(32, 128, seed=5), 2.0), with_amax(randn(32, 256, seed=6), 1.0)
    _step(lin, x, dy)  # the first fp8-delayed step
    (x_q, w_q), (dy_q, _), _ = gemms.calls  # fprop, dgrad, wgrad
    if record:  # the history's max: x 8, dy 0.5; the weight's own amax, recorded twice
        assert torch.equal(x_q.scale, _scale(8.0, E4M3_MAX)) and torch.equal(dy_q.scale, _scale(0.5, E5M2_MAX))
    else:  # nothing recorded: current scaling, from this step's own tensors
        assert torch.equal(x_q.scale, _scale(2.0, E4M3_MAX)) and torch.equal(dy_q.scale, _scale(1.0, E5M2_MAX))
    assert torch.equal(w_q.scale, _scale(w_amax, E4M3_MAX))
    assert lin.delayed_state.recorded == ([3, 3, 3] if record else [1, 1, 1])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("region", list(REGIONS))
def test_recording_leaves_outputs_and_gradients_bit_identical(region, dtype):
    x, dy = randn(4, 8, 128, seed=1, dtype=dtype), randn(4, 8, 256, seed=2, dtype=dtype)
    runs = []
    for record in (False, True):
        lin = make_linear("fp8-delayed", dtype=dtype)
        with lowprec.autocast(**REGIONS[region], record_amax=record):
            y, dx = _step(lin, x, dy)
        runs.append((y, dx, lin.weight.grad, lin.bias.grad))
        assert lin.delayed_state.recorded == ([1, 1, 1] if record else [0, 0, 0])
    for plain, recorded in zip(*runs):
        assert plain.dtype == recorded.dtype and torch.equal(plain, recorded)


def test_micro_batches_record_as_many_amaxes_as_delayed_steps_would():
    # with gradient accumulation a delayed layer records its (cached) weight at every forward
    delayed, lazy = make_linear("fp8-delayed"), make_linear("fp8-delayed")
    for lin, region in ((delayed, contextlib.nullcontext()), (lazy, recording())):
        with region, cached_weight_casts(lin):
            for i in range(2):
                _step(lin, randn(32, 128, seed=i), randn(32, 256, seed=10 + i))
    assert lazy.delayed_state.recorded == delayed.delayed_state.recorded == [2, 2, 2]
    assert torch.equal(lazy.delayed_state.history, delayed.delayed_state.history)


def test_recording_follows_the_delayed_rules_outliers_capped_and_non_finite_as_zero():
    lin = make_linear(delayed_recipe(outlier_bits=8))
    outlier, bad = with_amax(randn(32, 128, seed=1), 4.0), randn(32, 128, seed=2)
    outlier[3, 7], bad[0, 0] = 1e30, float("inf")
    with recording():
        for x in (with_amax(randn(32, 128, seed=0), 4.0), outlier, bad):
            _step(lin, x, randn(32, 256, seed=3))
    assert lin.delayed_state.history[:3, 0].tolist() == [4.0, 4.0 * 2**8, 0.0]
    assert lin.delayed_state.outliers.tolist() == [1, 0, 0]


def test_evaluation_and_layers_that_never_run_delayed_record_nothing():
    lin = make_linear("fp8-delayed")
    with recording(), torch.no_grad():
        lin(randn(32, 128, seed=0))
    assert lin.delayed_state.recorded == [0, 0, 0]
    kept = make_linear("fp8-delayed", out_features=100)  # not a multiple of 16: high precision always
    current = make_linear("fp8-current")
    with recording():
        for layer in (kept, current):
            _step(layer, randn(32, 128, seed=0), randn(32, layer.out_features, seed=1))
    assert kept.delayed_state is None and current.delayed_state is None


def test_outside_the_region_and_in_a_nested_region_without_it_nothing_is_recorded():
    lin = make_linear("fp8-delayed")
    with recording(), lowprec.autocast("bf16"):
        _step(lin, randn(32, 128, seed=0), randn(32, 256, seed=1))
    assert lin.delayed_state.recorded == [0, 0, 0]
    with lowprec.autocast("bf16"), recording():
        _step(lin, randn(32, 128, seed=0), randn(32, 256, seed=1))
    assert lin.delayed_state.recorded == [1, 1, 1]
