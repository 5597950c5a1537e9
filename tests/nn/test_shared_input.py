"""Layers reading the same input (q, k and v; gate and up) share its casts: the input is read once,
the results equal separate casts bit for bit, and nothing outlives the input. The groups are made
explicitly, by ``convert`` from the policy or by hand with an ``InputShare``."""
from __future__ import annotations

import gc
import threading

import pytest
import torch

import lowprec
from lowprec.nn import InputShare
from lowprec.train.model import ModelConfig, build_model
from tests.helpers import stochastic_forward_recipe
from tests.nn.common import QuantizeSpy, make_linear, randn


def _group(recipe, n=3):
    layers = [make_linear(recipe, seed=s) for s in range(n)]
    share = InputShare(tuple(f"l{i}" for i in range(n)))
    for lin in layers:
        lin.state.share = share
    return layers, share


def _run(layers, x):
    outs = [lin(x) for lin in layers]
    sum(o.square().sum() for o in outs).backward()
    return outs


@pytest.mark.parametrize("recipe", ["fp8-current", "fp8-rowwise", "fp8-blockwise", "mxfp8", "mxfp4"])
def test_a_group_casts_the_input_once_and_matches_separate_casts(recipe, monkeypatch):
    spy = QuantizeSpy(monkeypatch)
    x = randn(32, 128, seed=1).requires_grad_()
    alone = make_linear(recipe, seed=9)  # no group: its own casts
    alone(x)
    once = spy.reads(x)
    layers, _ = _group(recipe)
    outs = _run(layers, x)
    assert spy.reads(x) == 2 * once  # the group cast x once, the first layer of it
    ref_layers = [make_linear(recipe, seed=s) for s in range(3)]
    xs = [x.detach().clone().requires_grad_() for _ in range(3)]
    ref_outs = [lin(xi) for lin, xi in zip(ref_layers, xs)]
    sum(o.square().sum() for o in ref_outs).backward()
    for o, r in zip(outs, ref_outs):
        assert torch.equal(o, r)
    for lin, ref in zip(layers, ref_layers):
        assert torch.equal(lin.weight.grad, ref.weight.grad)
    # each layer's input gradient is exact; autograd's order of summing the three may differ
    torch.testing.assert_close(x.grad, sum(xi.grad for xi in xs), rtol=1e-6, atol=1e-6)


def test_layers_outside_a_group_never_share(monkeypatch):
    spy = QuantizeSpy(monkeypatch)
    x = randn(32, 128, seed=1)
    a, b = make_linear("fp8-current", seed=1), make_linear("fp8-current", seed=2)
    a(x)
    once = spy.reads(x)
    b(x)
    assert spy.reads(x) == 2 * once


def test_an_inplace_change_of_the_input_is_cast_anew():
    (a, b), _ = _group("fp8-current", 2)
    x = randn(16, 128, seed=2)
    ya = a(x)
    x.mul_(4.0)
    yb = b(x)
    assert torch.equal(yb, make_linear("fp8-current", seed=1)(x.clone())) and not torch.equal(ya, yb)


@pytest.mark.parametrize("recipe", ["fp8-delayed", "sr-forward"])
def test_delayed_and_stochastic_casts_are_not_shared(recipe, monkeypatch):
    spy = QuantizeSpy(monkeypatch)
    x = randn(32, 128, seed=1).requires_grad_()
    layers, share = _group(stochastic_forward_recipe() if recipe == "sr-forward" else recipe)
    layers[0](x)
    once = spy.reads(x)
    layers[1](x)
    assert spy.reads(x) == 2 * once and not share.holding


def test_the_casts_are_dropped_with_the_input():
    (lin,), share = _group("fp8-current", 1)
    x = randn(16, 128, seed=3)
    lin(x)
    assert share.holding
    del x
    gc.collect()
    assert not share.holding


def test_another_thread_with_another_input_never_takes_these_casts():
    (a, b), share = _group("fp8-current", 2)
    x = randn(16, 128, seed=3)
    a(x)
    got = []
    t = threading.Thread(target=lambda: got.append(b(randn(16, 128, seed=4))))
    t.start()
    t.join()
    assert torch.equal(got[0], make_linear("fp8-current", seed=1)(randn(16, 128, seed=4)))


@pytest.mark.parametrize("recipe", ["fp8-current", "mxfp8"])
def test_inference_mode_tensors_are_cast_without_sharing(recipe):
    layers, share = _group(recipe)
    x = randn(16, 128, seed=5)
    want = [lin(x) for lin in layers]
    with torch.inference_mode():
        xi = x.clone()  # an inference tensor: no version counter to key a shared cast on
        got = [lin(xi) for lin in layers]
    assert all(torch.equal(g, w) for g, w in zip(got, want))


def test_convert_groups_qkv_and_gate_up_and_reports_them(monkeypatch):
    cfg = ModelConfig(vocab_size=64, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=128, max_seq_len=16)
    model = build_model(cfg, seed=0)
    report = lowprec.convert(model, "fp8-current")
    attn, ffn = model.layers[0].attention, model.layers[0].feed_forward
    assert attn.wq.state.share is attn.wk.state.share is attn.wv.state.share is not None
    assert ffn.w1.state.share is ffn.w3.state.share is not None and ffn.w2.state.share is None
    assert attn.wo.state.share is None and attn.wq.state.share is not model.layers[1].attention.wq.state.share
    assert ("layers.0.attention.wq", "layers.0.attention.wk", "layers.0.attention.wv") in report.shared_inputs
    assert "4 group(s) of layers share their input's casts (w1/w3, wq/wk/wv)" in str(report)
    alone = build_model(cfg, seed=0)
    assert not lowprec.convert(alone, "fp8-current", lowprec.Policy(share_inputs=())).shared_inputs
    tokens = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(0))
    calls = []
    for m in (model, alone):
        spy = QuantizeSpy(monkeypatch)
        out = m(tokens)
        out.sum().backward()
        calls.append(len(spy.calls))
        monkeypatch.undo()
    # per block, wk, wv and w3 take the group's cast of their input (one per-tensor cast serves both sides)
    assert calls[1] - calls[0] == 2 * 3
    for p, q in zip(model.parameters(), alone.parameters()):
        assert torch.equal(p.grad, q.grad)
