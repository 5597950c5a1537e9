"""Loss-scale dynamics: growth, backoff, and the same sequence as torch.amp.GradScaler."""
from __future__ import annotations

import math

import pytest
import torch

from lowprec.optim import LossScaleConfig, LossScaler, Optimizer
from tests.optim.common import bits

# steps whose inputs are large: their float16 gradients overflow unless the scale is small
_LARGE = {5, 6, 7, 8}


def _fp16_product_loss(w: torch.Tensor, step: int) -> torch.Tensor:
    """A float32 loss whose gradient flows through a float16 product, as under float16 autocast.

    The gradient of the product is ``scale * x`` in float16: it overflows once that passes 65504.
    """
    g = torch.Generator().manual_seed(step)
    x = torch.rand(6, generator=g) + 0.5  # (6,) in [0.5, 1.5)
    if step in _LARGE:
        x = x * 1000.0
    return (w.half() * x.half()).float().sum()


def _run_gradscaler(steps: int, **cfg) -> tuple[list[float], list[torch.Tensor]]:
    torch.manual_seed(0)
    w = torch.nn.Parameter(torch.randn(6))
    opt = torch.optim.AdamW([w], lr=0.01)
    scaler = torch.amp.GradScaler("cpu", **cfg)
    scales, weights = [], []
    for step in range(steps):
        opt.zero_grad()
        scales.append(scaler.get_scale())
        scaler.scale(_fp16_product_loss(w, step)).backward()
        scaler.step(opt)
        scaler.update()
        weights.append(w.detach().clone())
    return scales, weights


def _run_lowprec(steps: int, **cfg) -> tuple[list[float], list[torch.Tensor], list[bool]]:
    torch.manual_seed(0)
    w = torch.nn.Parameter(torch.randn(6))
    opt = Optimizer([w], torch.optim.AdamW, lr=0.01, loss_scale=LossScaleConfig(**cfg))
    scales, weights, skipped = [], [], []
    for step in range(steps):
        opt.zero_grad()
        loss = _fp16_product_loss(w, step)
        opt.backward(loss)
        result = opt.step(loss=loss)
        scales.append(result.loss_scale)
        weights.append(w.detach().clone())
        skipped.append(result.skipped)
    return scales, weights, skipped


@pytest.mark.parametrize("cfg", [
    dict(init_scale=1024.0, growth_factor=2.0, backoff_factor=0.5, growth_interval=2),
    dict(init_scale=1000.0, growth_factor=3.0, backoff_factor=0.3, growth_interval=3),  # not powers of two
])
def test_same_scales_and_weights_as_gradscaler(cfg):
    ref_scales, ref_weights = _run_gradscaler(14, **cfg)
    scales, weights, skipped = _run_lowprec(14, **cfg)
    assert scales == ref_scales
    for a, b in zip(weights, ref_weights):
        assert torch.equal(bits(a), bits(b))
    # the schedule exercises both directions: some steps overflowed, and the scale also grew
    assert any(skipped) and not all(skipped)
    assert max(scales) > cfg["init_scale"] and min(scales) < cfg["init_scale"]


def test_first_config_sequence_by_hand():
    # float16 gradients are scale * x: x < 1.5 stays below 65504 up to a scale of 4096, while
    # x * 1000 (steps 5-8) overflows down to a scale of 256; the scale doubles after 2 good steps
    scales, _, skipped = _run_lowprec(14, init_scale=1024.0, growth_interval=2)
    assert scales == [1024.0, 1024.0, 2048.0, 2048.0, 4096.0, 4096.0, 2048.0, 1024.0, 512.0, 256.0,
                      256.0, 512.0, 512.0, 1024.0]
    assert skipped == [step in _LARGE for step in range(14)]


def test_growth_after_interval_and_backoff():
    s = LossScaler(LossScaleConfig(init_scale=8.0, growth_interval=3))
    seen = []
    for found_inf in [False, False, False, False, True, False, False, False]:
        s.update(found_inf)
        seen.append((s.scale, s.growth_tracker))
    assert seen == [(8.0, 1), (8.0, 2), (16.0, 0), (16.0, 1), (8.0, 0), (8.0, 1), (8.0, 2), (16.0, 0)]


def test_growth_stops_before_float32_overflow():
    s = LossScaler(LossScaleConfig(init_scale=2.0**127, growth_interval=1))
    s.update(False)
    assert s.scale == 2.0**127 and s.growth_tracker == 0


def test_static_scale_never_changes():
    s = LossScaler(LossScaleConfig.parse(128.0))
    for found_inf in [True, False, False, True]:
        s.update(found_inf)
    assert s.scale == 128.0


def test_inv_scale_is_float32_reciprocal():
    s = LossScaler(LossScaleConfig(init_scale=3.0))
    assert s.inv_scale == torch.tensor(3.0, dtype=torch.float64).reciprocal().float().item()
    assert s.inv_scale != 1 / 3  # rounded to float32, as GradScaler's inverse scale is


def test_parse():
    assert LossScaleConfig.parse(None) is None
    assert LossScaleConfig.parse("dynamic") == LossScaleConfig()
    assert LossScaleConfig.parse(4) == LossScaleConfig(init_scale=4.0, dynamic=False)


@pytest.mark.parametrize("arg, bad", [
    ("static", "loss_scale"), (-1.0, "loss_scale"), (math.inf, "loss_scale"), (True, "loss_scale"),
])
def test_parse_rejects(arg, bad):
    with pytest.raises(ValueError, match=f"^{bad}: expected"):
        LossScaleConfig.parse(arg)


@pytest.mark.parametrize("kw, name", [
    (dict(growth_factor=1.0), "growth_factor"), (dict(backoff_factor=1.5), "backoff_factor"),
    (dict(growth_interval=0), "growth_interval"), (dict(init_scale=0.0), "init_scale"),
])
def test_config_rejects(kw, name):
    with pytest.raises(ValueError, match=f"^{name}: expected"):
        LossScaleConfig(**kw)


def test_state_dict_round_trip_and_rejects():
    s = LossScaler(LossScaleConfig(init_scale=8.0, growth_interval=3))
    s.update(False)
    s.update(True)
    s.update(False)
    t = LossScaler(LossScaleConfig(init_scale=8.0, growth_interval=3))
    t.load_state_dict(s.state_dict())
    assert (t.scale, t.growth_tracker) == (4.0, 1)
    with pytest.raises(ValueError, match="growth_tracker"):
        t.load_state_dict({"scale": 4.0, "growth_tracker": -1})
