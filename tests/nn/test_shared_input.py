"""Layers reading the same input (q, k and v; gate and up) share its casts: the input is read once,
the results equal separate casts bit for bit, and nothing outlives the input."""
from __future__ import annotations

import gc

import pytest
import torch

from lowprec.nn import function as LF
from tests.nn.common import QuantizeSpy, make_linear, randn


def _three(recipe):
    return [make_linear(recipe, seed=s) for s in range(3)]


def _run(layers, x):
    outs = [lin(x) for lin in layers]
    sum(o.square().sum() for o in outs).backward()
    return outs


@pytest.mark.parametrize("recipe", ["fp8-current", "fp8-rowwise", "fp8-blockwise", "mxfp8"])
def test_siblings_cast_the_input_once_and_match_separate_casts(recipe, monkeypatch):
    spy = QuantizeSpy(monkeypatch)
    x = randn(32, 128, seed=1).requires_grad_()
    first = make_linear(recipe, seed=9)
    first(x)
    once = spy.reads(x)
    layers = _three(recipe)
    outs = _run(layers, x)
    assert spy.reads(x) == once  # the three layers took the first one's casts
    # reference: each layer on its own copy of the input, so nothing is shared
    ref_layers = _three(recipe)
    xs = [x.detach().clone().requires_grad_() for _ in range(3)]
    ref_outs = [lin(xi) for lin, xi in zip(ref_layers, xs)]
    sum(o.square().sum() for o in ref_outs).backward()
    for o, r in zip(outs, ref_outs):
        assert torch.equal(o, r)
    for lin, ref in zip(layers, ref_layers):
        assert torch.equal(lin.weight.grad, ref.weight.grad)
    # each layer's input gradient is exact; autograd's order of summing the three may differ
    torch.testing.assert_close(x.grad, sum(xi.grad for xi in xs), rtol=1e-6, atol=1e-6)


def test_an_inplace_change_of_the_input_is_cast_anew():
    a, b = make_linear("fp8-current", seed=1), make_linear("fp8-current", seed=1)
    x = randn(16, 128, seed=2)
    ya = a(x)
    x.mul_(4.0)
    yb = b(x)
    assert torch.equal(yb, make_linear("fp8-current", seed=1)(x.clone())) and not torch.equal(ya, yb)


@pytest.mark.parametrize("recipe", ["fp8-delayed", "mxfp4"])
def test_delayed_and_stochastic_casts_are_not_shared(recipe, monkeypatch):
    spy = QuantizeSpy(monkeypatch)
    x = randn(32, 128, seed=1).requires_grad_()
    layers = _three(recipe)
    layers[0](x)
    once = spy.reads(x)
    layers[1](x)
    assert spy.reads(x) == 2 * once


def test_the_casts_are_dropped_with_the_input():
    lin = make_linear("fp8-current")
    x = randn(16, 128, seed=3)
    lin(x)
    assert LF._last_input().casts is not None
    del x
    gc.collect()
    assert LF._last_input().casts is None and LF._last_input().key is None


def test_threads_keep_their_own_slot():
    import threading

    lin = make_linear("fp8-current")
    x = randn(16, 128, seed=3)
    lin(x)
    seen = []
    t = threading.Thread(target=lambda: seen.append(LF._last_input().casts))
    t.start()
    t.join()
    assert seen == [None] and LF._last_input().casts is not None


@pytest.mark.parametrize("recipe", ["fp8-current", "mxfp8"])
def test_inference_mode_tensors_are_cast_without_sharing(recipe):
    layers = _three(recipe)
    x = randn(16, 128, seed=5)
    want = [lin(x) for lin in layers]
    with torch.inference_mode():
        xi = x.clone()  # an inference tensor: no version counter to key a shared cast on
        got = [lin(xi) for lin in layers]
    assert all(torch.equal(g, w) for g, w in zip(got, want))
