"""A mixture of experts' dispatch and combine ([Note: dispatch and combine]): the same values as advanced
indexing, and gradients that are gathers (the combine's bit for bit the indexing's; the dispatch's the same
sums, in one reduction per token)."""
from __future__ import annotations

import pytest
import torch

from lowprec.nn.dispatch import combine, dispatch, expert_order, inverse_permutation
from lowprec.train.moe_model import MoEConfig, MoEFeedForward


def _routing(n: int, k: int, experts: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    pairs = torch.rand(n, experts, generator=g).topk(k, dim=1).indices.flatten()
    return pairs.argsort(stable=True)


@pytest.mark.parametrize("n", [1, 7, 300])
def test_the_inverse_is_the_argsort(n):
    order = torch.randperm(n, generator=torch.Generator().manual_seed(n))
    inv = inverse_permutation(order)
    assert torch.equal(inv, order.argsort())
    assert torch.equal(order[inv], torch.arange(n)) and inv.dtype == torch.int64


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_forward_values_are_the_indexings_bit_for_bit(dtype):
    n, k, d = 50, 3, 16
    order = _routing(n, k, 8)
    inv = inverse_permutation(order)
    x = torch.randn(n, d).to(dtype)
    assert torch.equal(dispatch(x, order, inv, k), x[order // k])
    y = torch.randn(n * k, d).to(dtype)
    assert torch.equal(combine(y, order, inv), y[order.argsort()])


def _grads(fn, *tensors):
    leaves = [t.detach().clone().requires_grad_() for t in tensors]
    out = fn(*leaves)
    out.backward(torch.arange(out.numel(), dtype=out.dtype).reshape(out.shape) % 7 - 3)  # small integers
    return [t.grad for t in leaves]


def test_gradients_equal_the_indexings():
    """Integer-valued gradients sum exactly in any order, so the dispatch's equals the indexing's bit for bit
    here; the combine's is a gather, equal for any values."""
    n, k, d = 40, 4, 8
    order = _routing(n, k, 6, seed=1)
    inv = inverse_permutation(order)
    x = torch.randn(n, d)
    (ours,) = _grads(lambda t: dispatch(t, order, inv, k), x)
    (ref,) = _grads(lambda t: t[order // k], x)
    assert torch.equal(ours, ref)
    y = torch.randn(n * k, d)
    (ours,) = _grads(lambda t: combine(t, order, inv), y)
    (ref,) = _grads(lambda t: t[order.argsort()], y)
    assert torch.equal(ours, ref)


def test_the_dispatchs_gradient_sums_each_tokens_copies():
    n, k, d = 30, 2, 5
    order = _routing(n, k, 4, seed=2)
    inv = inverse_permutation(order)
    x = torch.randn(n, d, dtype=torch.float64, requires_grad=True)
    g = torch.randn(n * k, d, dtype=torch.float64)
    dispatch(x, order, inv, k).backward(g)
    by_hand = torch.zeros(n, d, dtype=torch.float64)
    for row, pair in enumerate(order.tolist()):
        by_hand[pair // k] += g[row]
    torch.testing.assert_close(x.grad, by_hand, rtol=1e-15, atol=0.0)


def test_the_moe_layer_matches_its_indexing_formulation():
    """The reference MoE layer with dispatch and combine against the same layer written with indexing, in
    float64: outputs equal, every gradient within float64 rounding."""
    torch.manual_seed(0)
    layer = MoEFeedForward(16, 8, MoEConfig(n_experts=4, top_k=2, n_shared=1), shared=None).double()
    x = torch.randn(2, 5, 16, dtype=torch.float64)

    def indexed(m: MoEFeedForward, t: torch.Tensor) -> torch.Tensor:
        b, s, d = t.shape
        flat = t.reshape(b * s, d)
        weights, experts = m.route(flat)
        order = experts.flatten().argsort(stable=True)
        counts = torch.bincount(experts.flatten(), minlength=4)
        y = m.experts(flat[order // m.top_k], counts.cumsum(0))[order.argsort()].view(b * s, m.top_k, d)
        return (y * weights.unsqueeze(-1)).sum(dim=1).view(b, s, d)

    outs, grads = [], []
    for fn in (layer, lambda t: indexed(layer, t)):
        layer.zero_grad()
        xi = x.clone().requires_grad_()
        out = fn(xi)
        out.square().sum().backward()
        outs.append(out.detach())
        grads.append([xi.grad] + [p.grad.clone() for p in layer.parameters()])
    assert torch.equal(outs[0], outs[1])
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-14)


def test_compiled_without_a_graph_break():
    n, k, d = 24, 2, 8
    order = _routing(n, k, 4, seed=3)
    inv = inverse_permutation(order)
    x = torch.randn(n, d, requires_grad=True)

    def f(t):
        return combine(dispatch(t, order, inv, k) * 2.0, order, inv).sum()

    eager = torch.autograd.grad(f(x), x)[0]
    compiled = torch.autograd.grad(torch.compile(f, fullgraph=True, backend="aot_eager")(x), x)[0]
    assert torch.equal(eager, compiled)


@pytest.mark.parametrize("n_experts", [1, 8, 300, 40000])
def test_the_expert_order_is_the_stable_sort_of_the_experts(n_experts):
    g = torch.Generator().manual_seed(n_experts)
    experts = torch.randint(n_experts, (257, 4), generator=g)  # many ties: stability decides the order
    assert torch.equal(expert_order(experts, n_experts), experts.flatten().argsort(stable=True))


def test_slot_major_pairs_dispatch_as_transformers_take_them():
    """Pairs slot by slot (pair i: token i % N, slot i // N): ``x[order % N]`` forward, each token's copies summed
    backward."""
    n, k, d = 20, 3, 4
    g = torch.Generator().manual_seed(5)
    experts = torch.rand(n, 6, generator=g).topk(k, dim=1).indices.t().reshape(-1)  # slot by slot
    order = expert_order(experts, 6)
    inv = inverse_permutation(order)
    x = torch.randn(n, d, dtype=torch.float64)
    assert torch.equal(dispatch(x, order, inv, k, slot_major=True), x[order % n])
    (ours,) = _grads(lambda t: dispatch(t, order, inv, k, slot_major=True), x)
    (ref,) = _grads(lambda t: t[order % n], x)
    assert torch.equal(ours, ref)
