"""The experts' gate and up projections read the same routed rows: converted together (``share_inputs``'
``("w1", "w3")``), they cast the rows once per forward and give the same numbers, bit for bit, as two
projections casting them apart; different groups or a changed tensor are cast anew."""
from __future__ import annotations

import pytest
import torch

import lowprec
from lowprec.nn import GroupedLinear, InputShare
from lowprec.nn import grouped_casts as GC
from lowprec.nn.grouped import route
from lowprec.train.moe_model import RoutedExperts
from tests.nn.common import randn

COUNTS = (5, 0, 19, 8)


def _experts(recipe: str, share: bool) -> RoutedExperts:
    torch.manual_seed(3)
    m = RoutedExperts(len(COUNTS), 64, 96)
    for lin in (m.w1, m.w3, m.w2):
        lin.set_recipe(recipe)
    if share:
        m.w1.state.share = m.w3.state.share = InputShare(("w1", "w3"))
    return m


def _spy(monkeypatch) -> list:
    seen = []
    real = GC.cast_rows

    def cast_rows(x2, g, op, need_k, need_t, *delay):
        seen.append(x2.data_ptr())
        return real(x2, g, op, need_k, need_t, *delay)

    monkeypatch.setattr(GC, "cast_rows", cast_rows)
    return seen


@pytest.mark.parametrize("recipe", ["fp8-current", "fp8-rowwise", "mxfp8"])
def test_gate_and_up_cast_the_rows_once_and_equal_separate_casts(recipe, monkeypatch):
    seen = _spy(monkeypatch)
    offsets = torch.tensor(COUNTS).cumsum(0)
    outs = []
    for share in (True, False):
        m = _experts(recipe, share)
        x = randn(sum(COUNTS), 64, seed=1).requires_grad_()
        seen.clear()
        y = m(x, offsets)
        forward_casts = list(seen)
        y.square().sum().backward()
        outs.append((y, x.grad, m.w1.weight.grad, m.w3.weight.grad, m.w2.weight.grad, forward_casts))
        # w1 and w3 read x, w2 the activations: two casts of x apart, one shared
        assert forward_casts.count(x.data_ptr()) == (1 if share else 2)
    for a, b in zip(outs[0][:5], outs[1][:5]):
        assert torch.equal(a, b)


def test_other_groups_of_the_same_rows_are_cast_anew(monkeypatch):
    seen = _spy(monkeypatch)
    m = _experts("fp8-current", True)
    x = randn(sum(COUNTS), 64, seed=2)
    g1 = route(x, torch.tensor(COUNTS).cumsum(0))
    g2 = route(x, torch.tensor((10, 2, 10, 10)).cumsum(0))
    with torch.no_grad():
        m.w1(x, g1)
        m.w3(x, g2)  # other groups: its own casts, its own per-expert scales
        want = GroupedLinear(len(COUNTS), 64, 96, recipe="fp8-current")
        want.weight.copy_(m.w3.weight)
        assert torch.equal(m.w3(x, g2), want(x, g2))
    # w1 on g1, w3 on g2, the unshared layer on g2; w3's second call on g2 took its share's casts
    assert seen.count(x.data_ptr()) == 3


def test_an_inplace_change_of_the_rows_is_cast_anew():
    m = _experts("fp8-current", True)
    x = randn(sum(COUNTS), 64, seed=4)
    g = route(x, torch.tensor(COUNTS).cumsum(0))
    with torch.no_grad():
        m.w1(x, g)
        x.mul_(8.0)
        got = m.w3(x, g)
        alone = _experts("fp8-current", False)
        assert torch.equal(got, alone.w3(x.clone(), g))


def test_convert_groups_the_experts_gate_and_up():
    from lowprec.train.model import build_model, preset

    model = build_model(preset("moe-tiny"))
    report = lowprec.convert(model, "fp8-current")
    groups = [g for g in report.shared_inputs if g[0].endswith("experts.w1")]
    assert groups and all(g[1].endswith("experts.w3") and len(g) == 2 for g in groups)
    block = next(m for n, m in model.named_modules() if n.endswith("experts"))
    assert block.w1.state.share is block.w3.state.share is not None and block.w2.state.share is None
