"""RMSNorm and SwiGLU saving their inputs in FP8 (``lowprec.nn.saved``): the forward is unchanged,
backward differentiates the high-precision op at the dequantized inputs, the gradient stays within the
bound E4M3's precision gives, and what is saved is the FP8 codes and scales alone."""
from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as nnf

from lowprec.nn import RMSNorm, SavedActivations, fp8_activations, rms_norm, swiglu
from lowprec.quant import blockwise, error_bound, quantize, rowwise, tensorwise
from tests.nn.common import randn, saved_for_backward

SAVED = {"tensor": fp8_activations("tensor"), "1x128": fp8_activations("1x128"),
         "1x32-e5m2": SavedActivations(fmt="e5m2", granularity=blockwise(1, 32)),
         "row": SavedActivations(granularity=rowwise())}
M, K = 48, 384
SILU_D1 = 1.1
"""Bounds |silu'(x)| (its maximum is 1.0998 at x = 2.40)."""
SILU_D2 = 0.5
"""Bounds |silu''(x)| (its maximum, at x = 0)."""


def _llama_rms_norm(x, w, eps):
    x32 = x.float()
    return (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).type_as(x) * w


def _grads(fn, inputs, dy):
    inputs = [t.detach().clone().requires_grad_() for t in inputs]
    fn(*inputs).backward(dy)
    return [t.grad for t in inputs]


def _dequantized_and_bound(x, saved):
    q = quantize(x, saved.fmt, saved.granularity)
    m, k = x.shape
    return q.dequantize(), error_bound(q)[:m, :k]


@pytest.mark.parametrize("name", [None, *SAVED])
def test_the_forward_is_the_high_precision_op(name):
    saved = SAVED.get(name)
    x, w, g, u = (randn(M, K, seed=s) for s in range(4))
    w = w[0].requires_grad_()
    torch.testing.assert_close(rms_norm(x.requires_grad_(), w, 1e-6, saved), _llama_rms_norm(x, w, 1e-6),
                               rtol=0, atol=0)
    torch.testing.assert_close(swiglu(g.requires_grad_(), u, saved), nnf.silu(g) * u, rtol=0, atol=0)


@pytest.mark.parametrize("name", [None, *SAVED])
def test_backward_differentiates_at_the_dequantized_inputs(name):
    """Saving in high precision gives eager PyTorch's gradients; in FP8, eager's at the dequantized inputs."""
    saved = SAVED.get(name)
    x, w, g, u, dy = (randn(M, K, seed=s) for s in range(5))
    w = 1 + 0.1 * w[0]
    deq = (lambda t: t) if saved is None else (lambda t: _dequantized_and_bound(t, saved)[0])
    got = _grads(lambda a, b: rms_norm(a, b, 1e-6, saved), (x, w), dy)
    want = _grads(lambda a, b: _llama_rms_norm(a, b, 1e-6), (deq(x), w), dy)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    got = _grads(lambda a, b: swiglu(a, b, saved), (g, u), dy)
    want = _grads(lambda a, b: nnf.silu(a) * b, (deq(g), deq(u)), dy)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("name", list(SAVED))
def test_swiglu_gradient_within_the_fp8_bound(name):
    """Elementwise: with |g~ - g| <= eg and |u~ - u| <= eu (the cast's error bound),
    |du~ - du| <= |dh| |silu'| eg and |dg~ - dg| <= |dh| (|silu'| eu + (|u| + eu) |silu''| eg)."""
    saved = SAVED[name]
    g, u, dh = randn(M, K, seed=1, scale=3.0), randn(M, K, seed=2), randn(M, K, seed=3)
    gq, eg = _dequantized_and_bound(g, saved)
    _, eu = _dequantized_and_bound(u, saved)
    dg, du = _grads(lambda a, b: swiglu(a, b, saved), (g, u), dh)
    dg_hp, du_hp = _grads(lambda a, b: nnf.silu(a) * b, (g.double(), u.double()), dh.double())
    fp32 = 1e-6 * (dg_hp.abs() + du_hp.abs()) + 1e-30  # rounding of the FP32 arithmetic itself
    assert ((du - du_hp).abs() <= dh.abs() * SILU_D1 * eg + fp32).all()
    assert ((dg - dg_hp).abs() <= dh.abs() * (SILU_D1 * eu + (u.abs() + eu) * SILU_D2 * eg) + fp32).all()
    # and E4M3 at work: each element within 2^-4 of itself, or of half a subnormal step (2^-10 of the
    # scale amax / 448) where it is among the smallest of its block
    if saved.fmt == "e4m3":
        assert ((gq - g).abs() <= 2.0**-4 * g.abs() + 2.0**-10 * g.abs().amax() / 448).all()


@pytest.mark.parametrize("name", list(SAVED))
def test_rms_norm_gradient_within_the_fp8_bound(name):
    """Per row, with eta = ||x~ - x|| / ||x|| (at most E4M3's 2^-4 on these rows) and dn = dy * w:
    ||dx~ - dx|| <= (eta / (1 - eta) + 4 eta) sqrt(K) ||dn|| / ||x|| (the normalisation's Lipschitz
    bound), and ||dw~ - dw|| <= sum over rows of ||dy||_inf sqrt(K) 2 eta / (1 - eta)."""
    saved = SAVED[name]
    x, dy = randn(M, K, seed=4, scale=2.0), randn(M, K, seed=5)
    w = 1 + 0.1 * randn(K, seed=6)
    xq, _ = _dequantized_and_bound(x, saved)
    eta = (xq - x).double().norm(dim=-1) / x.double().norm(dim=-1)  # (M,)
    unit = 2.0**-3 if saved.fmt == "e5m2" else 2.0**-4
    assert (eta <= unit).all()
    dx, dw = _grads(lambda a, b: rms_norm(a, b, 0.0, saved), (x, w), dy)
    dx_hp, dw_hp = _grads(lambda a, b: _llama_rms_norm(a, b, 0.0), (x.double(), w.double()), dy.double())
    dn = (dy * w).double().norm(dim=-1)
    lip = math.sqrt(K) * dn / x.double().norm(dim=-1)
    bound_dx = (eta / (1 - eta) + 4 * eta) * lip + 1e-5 * dx_hp.norm(dim=-1)
    assert ((dx - dx_hp).norm(dim=-1) <= bound_dx).all()
    bound_dw = (dy.double().abs().amax(-1) * math.sqrt(K) * 2 * eta / (1 - eta)).sum() + 1e-5 * dw_hp.norm()
    assert (dw - dw_hp).norm() <= bound_dw


@pytest.mark.parametrize("name", [None, *SAVED])
def test_what_is_saved_is_the_fp8_codes_and_scales(name):
    """The ops save their inputs alone: as they are (no copy), or FP8 data of the padded 2-D view and
    FP32 scales per block; a weight is saved as itself."""
    saved = SAVED.get(name)
    x, g, u = (randn(M, K, seed=s).requires_grad_() for s in range(3))
    norm = RMSNorm(K, saved=saved)
    _, kept = saved_for_backward(lambda: norm(x))
    _, kept_ffn = saved_for_backward(lambda: swiglu(g, u, saved))
    if saved is None:
        assert [t is x for t in kept] == [True, False] and kept[1] is norm.weight
        assert kept_ffn[0] is g and kept_ffn[1] is u and len(kept_ffn) == 2
        return
    want = quantize(x, saved.fmt, saved.granularity)
    assert len(kept) == 3 and kept[2] is norm.weight
    assert kept[0].dtype == want.data.dtype and torch.equal(kept[0].view(torch.uint8), want.data.view(torch.uint8))
    assert torch.equal(kept[1], want.scale)
    assert [t.element_size() for t in kept_ffn] == [1, 4, 1, 4]


def test_no_grad_saves_nothing_and_bf16_keeps_its_dtypes():
    x = randn(4, 64, seed=0, dtype=torch.bfloat16).requires_grad_()
    norm = RMSNorm(64, saved=fp8_activations("1x32"), dtype=torch.bfloat16)
    with torch.no_grad():
        assert saved_for_backward(lambda: norm(x))[0] == 0
    y = norm(x)
    y.float().sum().backward()
    assert y.dtype == x.grad.dtype == norm.weight.grad.dtype == torch.bfloat16
    assert torch.isfinite(x.grad).all()


@pytest.mark.parametrize("call, match", [
    (lambda: SavedActivations(fmt="e2m1"), "fmt: expected one of 'e4m3', 'e5m2'"),
    (lambda: SavedActivations(granularity=blockwise(128, 128)), "granularity: expected tensorwise"),
    (lambda: SavedActivations(granularity="1x128"), "granularity: expected a lowprec.quant.Granularity"),
    (lambda: fp8_activations("2x128"), "fp8_activations: expected 'tensor' or '1xB'"),
    (lambda: RMSNorm(0), "dim: expected a positive int"),
    (lambda: RMSNorm(8, saved="1x128"), "saved: expected None or a lowprec.nn.SavedActivations"),
    (lambda: RMSNorm(8)(torch.ones(2, 4)), "input: expected a last dimension of 8"),
    (lambda: rms_norm(torch.ones(2, 4, dtype=torch.int32), None, 1e-6), "input: expected a float32"),
    (lambda: swiglu(torch.ones(2, 4), torch.ones(2, 8)), "up: expected gate's shape"),
    (lambda: swiglu(torch.ones(2, 4), "x"), "up: expected a float32"),
])
def test_bad_input_is_refused(call, match):
    with pytest.raises((ValueError, TypeError), match=match):
        call()


def test_granularities_named_as_the_cli_takes_them():
    assert fp8_activations("tensor") == SavedActivations(granularity=tensorwise())
    assert fp8_activations() == SavedActivations(fmt="e4m3", granularity=blockwise(1, 128))
    assert str(fp8_activations("1x64")) == "e4m3 block1x64"
