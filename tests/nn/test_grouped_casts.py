"""Batched per-expert casts (see [Note: batched per-expert casts] in ``lowprec.nn.grouped_casts``): every
expert's codes and scale equal its own per-tensor cast bit for bit, and a ``GroupedLinear`` under a
per-tensor recipe takes them, with the same outputs and gradients as the expert-by-expert loop."""
from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from lowprec import recipes as R
from lowprec.nn import GroupedLinear, grouped
from lowprec.nn import grouped_casts as GC
from lowprec.quant import quantize, tensorwise
from tests.nn.common import bits, randn
from tests.nn.test_grouped import COUNTS, grouped_step, make


def _plan(recipe: str):
    return GroupedLinear(len(COUNTS), 128, 256, recipe=recipe).plan()


def _batched_recipes() -> list[str]:
    out = []
    for name in R.names():
        if R.get(name).uses_delayed_scaling:
            continue
        plan = _plan(name)
        if plan is not None and plan.scaled and GC.batches(plan):
            out.append(name)
    return out


def test_the_per_tensor_recipes_are_batched_and_no_other():
    assert _batched_recipes() == ["fp8-current"]


def _rows(counts, poison: float | None = None) -> torch.Tensor:
    """Rows grouped by expert, each expert's rows at their own magnitude (2^-8 .. 2^8), so that one
    scale for all would differ from each expert's; ``poison`` put in expert 2's first row."""
    x = torch.cat([randn(n, 128, seed=10 + e) * 2.0 ** (4 * e - 8) for e, n in enumerate(counts)])
    if poison is not None:
        x[sum(counts[:2]), 3] = poison
    return x


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
@pytest.mark.parametrize("poison", [None, math.inf, math.nan])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rows_cast_as_each_expert_alone(fmt, poison, dtype):
    x = _rows(COUNTS, poison).to(dtype)
    op = _plan("fp8-current").input
    cast = R.Cast(format=fmt, granularity=tensorwise())
    op = dataclasses.replace(op, cast_k=cast, cast_t=cast)
    k, t = GC.cast_rows(x, GC.expert_of_rows(COUNTS, x.device), len(COUNTS), op, True, True)
    assert k is t  # one format: the transposed side is the same codes
    start = 0
    for e, n in enumerate(COUNTS):
        rows = slice(start, start + n)
        start += n
        if not n:
            continue
        alone = quantize(x[rows], fmt, tensorwise())
        got = k.expert(e, rows)
        assert torch.equal(bits(got.data), bits(alone.data)), e
        assert torch.equal(bits(got.scale), bits(alone.scale)), e
        assert (got.shape, got.dtype) == (alone.shape, alone.dtype)
        alone_t = quantize(x[rows].t(), fmt, tensorwise())
        assert torch.equal(bits(k.expert(e, rows, transposed=True).data), bits(alone_t.data)), e
    if poison is not None:  # expert 2 alone has a NaN scale (its codes all zero), as its own cast has
        assert k.scales.isnan().tolist() == [False, False, True, False]


def test_weights_cast_as_each_expert_alone():
    w = torch.stack([randn(256, 128, seed=20 + e) * 2.0 ** (3 * e - 5) for e in range(4)])
    plan = _plan("fp8-current")
    k, t = GC.cast_weights(w, plan.weight, True, True)
    for e in range(4):
        alone = quantize(w[e], plan.weight.cast_k.fmt, tensorwise())
        assert torch.equal(bits(k.expert(e).data), bits(alone.data))
        assert torch.equal(bits(k.expert(e).scale), bits(alone.scale))
        alone_t = quantize(w[e].t(), plan.weight.cast_t.fmt, tensorwise())
        assert torch.equal(bits(t.expert(e, transposed=True).data), bits(alone_t.data))


@pytest.mark.parametrize("counts", [COUNTS, (0, 0, 64, 0), (16, 16, 16, 16)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_grouped_linear_batched_equals_the_loop(monkeypatch, counts, dtype):
    """The batched path is taken (the loop's autograd function is not called), and its output and every
    gradient equal the loop's bit for bit."""
    g, _, x, dy = make("fp8-current", counts, dtype=dtype)
    calls = []
    real = grouped.BatchedFunction.apply
    monkeypatch.setattr(grouped.BatchedFunction, "apply", lambda *a: calls.append(1) or real(*a))
    batched = grouped_step(g, x, dy, counts)
    assert calls == [1]
    g.weight.grad = g.bias.grad = None
    monkeypatch.setattr(GC, "batches", lambda plan: False)
    looped = grouped_step(g, x, dy, counts)
    assert calls == [1]
    for a, b in zip(batched, looped):
        assert torch.equal(bits(a), bits(b))


def test_inference_takes_the_batched_casts_too(monkeypatch):
    g, _, x, _ = make("fp8-current")
    offsets = torch.tensor(COUNTS).cumsum(0)
    with torch.no_grad():
        batched = g(x, offsets)
        monkeypatch.setattr(GC, "batches", lambda plan: False)
        looped = g(x, offsets)
    assert torch.equal(bits(batched), bits(looped))
