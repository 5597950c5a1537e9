"""Delayed scaling's third reduction, ``algo="ema"``: the exponential moving average of the history's
amaxes, checked against a hand loop over the amaxes recorded, with the window forgetting old ones."""
from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from lowprec import recipes as R
from tests.nn.common import GemmSpy, make_linear, randn

E4M3_MAX = 448.0


def ema_recipe(history_len: int, coeff: float, margin: int = 0) -> R.Recipe:
    return replace(R.fp8_delayed(), name="fp8-delayed-ema",
                   delayed=R.DelayedScaling(history_len=history_len, algo="ema", ema_coeff=coeff, margin=margin))


def hand_ema(amaxes: list[float], coeff: float, window: int) -> float:
    """The average a loop takes over the last ``window`` amaxes, oldest first, in float64."""
    kept = amaxes[-window:]
    e = kept[0]
    for a in kept[1:]:
        e = (1.0 - coeff) * e + coeff * a
    return e


def _step(lin, x_amax: float, seed: int) -> None:
    x = randn(32, 128, seed=seed)
    x = (x / x.abs().amax() * x_amax).requires_grad_()
    lin(x).backward(randn(32, 256, seed=seed + 1))


@pytest.mark.parametrize(("history_len", "coeff", "margin"), [(3, 0.25, 0), (16, 0.5, 1), (4, 1.0, 0)],
                         ids=["window-forgets", "window-holds-all-margin1", "coeff1-is-most-recent"])
def test_the_input_scale_is_the_ema_of_the_history(monkeypatch, history_len, coeff, margin):
    # powers of two and dyadic coefficients: the loop and the layer's weighted sum are exact, so equal
    amaxes = [8.0, 1.0, 2.0, 0.5, 16.0, 4.0]
    lin = make_linear(ema_recipe(history_len, coeff, margin))
    gemms = GemmSpy(monkeypatch)
    for step, xa in enumerate(amaxes):
        gemms.calls.clear()
        _step(lin, xa, seed=step)
        scale = gemms.calls[0][0].scale
        if step == 0:  # no history yet: current scaling
            want = torch.tensor(xa) / E4M3_MAX
        else:
            want = torch.tensor(hand_ema(amaxes[:step], coeff, history_len), dtype=torch.float64).float()
            want = want * 2.0**margin / E4M3_MAX
        assert torch.equal(scale, want.reshape(1, 1)), f"step {step}"


def test_coefficient_one_gives_the_same_scales_as_most_recent(monkeypatch):
    recent = replace(R.fp8_delayed(), name="fp8-recent", delayed=R.DelayedScaling(history_len=4, algo="most_recent"))
    a, b = make_linear(ema_recipe(4, 1.0)), make_linear(recent)
    for step, xa in enumerate([2.0, 0.25, 8.0, 3.0, 1.0]):
        _step(a, xa, seed=step)
        _step(b, xa, seed=step)
    x = randn(8, 128, seed=99, scale=3.0)
    assert torch.equal(a(x), b(x))


@pytest.mark.parametrize("coeff", [0.0, 1.5, True, "0.1"])
def test_an_ema_coefficient_outside_0_1_is_refused(coeff):
    with pytest.raises(ValueError, match=r"ema_coeff: expected a number in \(0, 1\]"):
        R.DelayedScaling(algo="ema", ema_coeff=coeff)
