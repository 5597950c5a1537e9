"""Delayed scaling: each role's amax history, the scale it gives (``max`` or ``most_recent``, times
``2^margin``), current scaling until a role has a history, and the history in ``state_dict``."""
from __future__ import annotations

from dataclasses import replace

import pytest
import torch

import lowprec
from lowprec import recipes as R
from lowprec.nn import Linear, cached_weight_casts
from lowprec.nn.delayed import ROLES
from tests.nn.common import GemmSpy, QuantizeSpy, make_linear, randn

E4M3_MAX, E5M2_MAX = 448.0, 57344.0


def delayed_recipe(history_len: int = 1024, algo: str = "max", margin: int = 0) -> R.Recipe:
    return replace(R.fp8_delayed(), name="fp8-delayed-test",
                   delayed=R.DelayedScaling(history_len=history_len, algo=algo, margin=margin))


def with_amax(t: torch.Tensor, amax: float) -> torch.Tensor:
    """``t`` rescaled so that its largest magnitude is exactly ``amax`` (a power of two here)."""
    return t / t.abs().amax() * amax


def _step(lin, x_amax: float, dy_amax: float, seed: int) -> None:
    x = with_amax(randn(32, 128, seed=seed), x_amax).requires_grad_()
    lin(x).backward(with_amax(randn(32, 256, seed=seed + 1), dy_amax))


def _scale(amax: float, margin: int, fmax: float) -> torch.Tensor:
    # the dequantizing scale of [Note: delayed scaling], in float32 as the layer computes it
    return ((torch.tensor(amax) * 2.0**margin) / fmax).reshape(1, 1)


def test_each_role_records_its_own_amax_once_per_cast():
    lin = make_linear("fp8-delayed")
    w_amax = lin.weight.abs().amax().item()
    for i, (xa, dya) in enumerate([(4.0, 0.5), (8.0, 0.25), (2.0, 1.0)]):
        _step(lin, xa, dya, seed=i)
    state = lin.delayed_state
    # every forward casts (and records) the weight as well: no cache outside cached_weight_casts
    assert state.recorded == [3, 3, 3] and ROLES == ("input", "weight", "grad_output")
    assert state.history[:3, 0].tolist() == [4.0, 8.0, 2.0]
    assert state.history[:3, 2].tolist() == [0.5, 0.25, 1.0]
    assert state.history[:3, 1].tolist() == [w_amax] * 3


def test_inside_cached_weight_casts_the_weight_is_cast_once_and_recorded_per_forward(monkeypatch):
    # the same history as without the cache (and as compiled code, which holds no cache)
    lin = make_linear("fp8-delayed")
    w_amax = lin.weight.abs().amax().item()
    spy = QuantizeSpy(monkeypatch)
    with cached_weight_casts(lin):
        for i, (xa, dya) in enumerate([(4.0, 0.5), (8.0, 0.25), (2.0, 1.0)]):
            _step(lin, xa, dya, seed=i)
    assert spy.reads(lin.weight) == 1
    assert lin.delayed_state.recorded == [3, 3, 3]
    assert lin.delayed_state.history[:3, 1].tolist() == [w_amax] * 3


def test_an_evaluation_fill_of_the_cache_is_not_reused_by_training():
    lin = make_linear("fp8-delayed")
    with cached_weight_casts(lin):
        with torch.no_grad():
            lin(randn(8, 128, seed=4))  # casts the weight without recording its amax
        _step(lin, 4.0, 0.5, seed=5)
    assert lin.delayed_state.recorded == [1, 1, 1]
    assert lin.delayed_state.history[0, 1].item() == lin.weight.abs().amax().item()


@pytest.mark.parametrize(("algo", "margin", "x_amaxes", "want"), [
    # history_len 2: step 4 has forgotten step 1's 8.0
    ("max", 0, [8.0, 1.0, 2.0, 0.5], [8.0, None, 8.0, 8.0, 2.0]),
    ("most_recent", 0, [8.0, 1.0, 2.0, 0.5], [8.0, None, 8.0, 1.0, 2.0]),
    ("max", 2, [8.0, 1.0, 2.0, 0.5], [8.0, None, 8.0, 8.0, 2.0]),
], ids=["max", "most_recent", "max-margin2"])
def test_the_input_scale_comes_from_the_history(monkeypatch, algo, margin, x_amaxes, want):
    # want[k] is the amax behind step k's scale (k = 1..4); step 1 has no history: current scaling
    lin = make_linear(delayed_recipe(history_len=2, algo=algo, margin=margin))
    gemms = GemmSpy(monkeypatch)
    for step, xa in enumerate(x_amaxes, start=1):
        gemms.calls.clear()
        _step(lin, xa, 1.0, seed=step)
        fprop_lhs = gemms.calls[0][0]
        expected = _scale(xa, 0, E4M3_MAX) if step == 1 else _scale(want[step], margin, E4M3_MAX)
        assert torch.equal(fprop_lhs.scale, expected), f"step {step}"


def test_grad_output_uses_its_own_history_in_e5m2(monkeypatch):
    lin = make_linear(delayed_recipe(margin=1))
    gemms = GemmSpy(monkeypatch)
    _step(lin, 4.0, 0.5, seed=0)
    gemms.calls.clear()
    _step(lin, 4.0, 0.125, seed=2)
    dgrad_lhs = gemms.calls[1][0]  # forward, dgrad, wgrad
    assert tuple(dgrad_lhs.shape) == (32, 256) and dgrad_lhs.fmt.name == "e5m2"
    assert torch.equal(dgrad_lhs.scale, _scale(0.5, 1, E5M2_MAX))


def test_a_value_above_the_delayed_scale_saturates_instead_of_overflowing(monkeypatch):
    lin = make_linear("fp8-delayed")
    gemms = GemmSpy(monkeypatch)
    _step(lin, 1.0, 1.0, seed=0)
    gemms.calls.clear()
    _step(lin, 16.0, 1.0, seed=1)  # 16x the history's amax
    q = gemms.calls[0][0]
    assert torch.isfinite(q.dequantize()).all() and q.dequantize().abs().max().item() == 1.0


def test_a_non_finite_amax_is_recorded_as_zero():
    lin = make_linear("fp8-delayed")
    x = randn(32, 128, seed=0)
    x[3, 7] = float("inf")
    lin(x)
    assert lin.delayed_state.recorded[0] == 1 and lin.delayed_state.history[0, 0].item() == 0.0


def test_evaluation_under_no_grad_leaves_the_input_history_alone():
    lin = make_linear("fp8-delayed")
    lin(randn(32, 128, seed=0))  # a training forward records the input's amax once
    before = lin.delayed_state.history.clone(), list(lin.delayed_state.recorded)
    with torch.no_grad():
        lin(randn(32, 128, seed=1) * 100)
    assert torch.equal(lin.delayed_state.history, before[0]) and lin.delayed_state.recorded == before[1]


@pytest.mark.parametrize("recipe", R.names())
def test_state_dict_has_extra_state_only_for_delayed_recipes(recipe):
    lin = make_linear(recipe)
    _step(lin, 1.0, 1.0, seed=0)
    sd = lin.state_dict()
    if R.get(recipe).uses_delayed_scaling:
        assert list(sd) == ["weight", "bias", "_extra_state"]
        extra = sd["_extra_state"]
        assert extra.dtype == torch.float32 and extra.shape == (1024 + 2, len(ROLES))
    else:
        assert list(sd) == ["weight", "bias"]


def test_the_history_round_trips_through_state_dict():
    src = make_linear("fp8-delayed")
    for i, xa in enumerate([2.0, 8.0]):
        _step(src, xa, 0.5, seed=i)
    dst = make_linear("fp8-delayed", seed=5)
    dst.load_state_dict(src.state_dict(), strict=True)
    assert dst.delayed_state.recorded == src.delayed_state.recorded
    assert torch.equal(dst.delayed_state.history, src.delayed_state.history)
    x = randn(8, 128, seed=9)
    assert torch.equal(dst(x), src(x))  # same weights, same scales


def test_a_history_of_another_length_is_ignored_with_a_warning():
    src = make_linear("fp8-delayed")
    _step(src, 2.0, 0.5, seed=0)
    dst = make_linear(delayed_recipe(history_len=16))
    with pytest.warns(UserWarning, match=r"delayed-scaling state does not match this recipe \(history_len 16\)"):
        dst.load_state_dict(src.state_dict())
    assert dst.delayed_state.recorded == [0, 0, 0]
    assert torch.equal(dst.weight, src.weight)


def test_a_layer_made_on_the_meta_device_gets_its_state_on_the_real_one():
    with torch.device("meta"):
        lin = Linear(128, 256, recipe="fp8-delayed")
    lin.to_empty(device="cpu")
    with torch.no_grad():
        lin.weight.normal_(0, 0.05)
        lin.bias.zero_()
    _step(lin, 4.0, 0.5, seed=1)
    assert lin.delayed_state.recorded == [1, 1, 1] and lin.delayed_state.history.device.type == "cpu"


def test_a_fresh_delayed_model_has_plain_keys_and_fallback_layers_no_state():
    model = torch.nn.Sequential(torch.nn.Linear(128, 256), torch.nn.ReLU(), torch.nn.Linear(256, 100))
    lowprec.convert(model, "fp8-delayed", lowprec.Policy(keep_head=False, keep_last_blocks=0))
    assert model[2].hp_reason is not None and model[2].delayed_state is None  # 100 is not a multiple of 16
    plain = torch.nn.Sequential(torch.nn.Linear(128, 256), torch.nn.ReLU(), torch.nn.Linear(256, 100))
    plain.load_state_dict(model.state_dict(), strict=True)
