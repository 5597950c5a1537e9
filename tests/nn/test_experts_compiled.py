"""Mixtures of experts under ``torch.compile`` (see [Note: experts under torch.compile] in
``lowprec.nn.routing``): the routed experts run outside the graph, so a model whose routing changes at every
step compiles once, and it trains as the eager model does. Before, every step's counts compiled the graph after
them again, until Dynamo's recompile limit sent the frame back to eager."""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch._dynamo.utils import counters

import lowprec
from lowprec.nn import GroupedLinear
from lowprec.nn.routing import expert_counts
from lowprec.train.model import build_model, preset

pytestmark = pytest.mark.slow


def _graphs() -> int:
    return counters["stats"]["unique_graphs"]


def _breaks_not_ours() -> list[str]:
    """The graph breaks whose reason is not lowprec's experts run outside the graph."""
    return [reason for reason in counters["graph_break"] if "lowprec.nn.routing" not in reason]


def _batches(n: int, vocab: int) -> list[torch.Tensor]:
    return [torch.randint(0, vocab, (2, 33), generator=torch.Generator().manual_seed(s)) for s in range(n)]


def _train(model, batches, compiled: bool) -> tuple[list[float], dict[str, torch.Tensor]]:
    """Losses of AdamW steps on ``batches`` and the first step's gradients; compiled: also that no step after
    the first compiled a graph."""
    forward = torch.compile(model, backend="aot_eager") if compiled else model
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses, grads = [], {}
    for i, x in enumerate(batches):
        logits = forward(x[:, :-1])
        loss = F.cross_entropy(logits.flatten(0, 1).float(), x[:, 1:].flatten())
        loss.backward()
        if i == 0:
            grads = {name: p.grad.clone() for name, p in model.named_parameters()}
            after_first = _graphs() if compiled else None
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    if compiled:
        assert _graphs() == after_first, "a later step compiled a graph again"
    return losses, grads


@pytest.mark.parametrize("recipe", [None, "fp8-current", "fp8-rowwise", "mxfp8"])
def test_the_reference_moe_compiles_once_and_trains_as_eager(recipe):
    torch._dynamo.reset()
    counters.clear()
    cfg = preset("moe-tiny")
    model = build_model(cfg, seed=0)
    if recipe is not None:
        lowprec.convert(model, recipe, lowprec.Policy(skip_small=False))
    twin = copy.deepcopy(model)
    batches = _batches(4, cfg.vocab_size)
    routed = []  # the first layer's offsets at each step, in the eager twin
    twin.layers[0].feed_forward.experts.register_forward_pre_hook(lambda m, args: routed.append(args[1].tolist()))
    compiled, grads = _train(model, batches, compiled=True)
    eager, eager_grads = _train(twin, batches, compiled=False)
    assert len({tuple(r) for r in routed}) == len(batches)  # every step routed differently
    # aot_eager runs the eager kernels; its decompositions move the last bits of the norms and the softmax,
    # and a moved bit can move an FP8 code a step, which the next steps carry on
    torch.testing.assert_close(torch.tensor(compiled), torch.tensor(eager), rtol=5e-4, atol=0)
    for name, g in grads.items():
        torch.testing.assert_close(g, eager_grads[name], rtol=1e-3, atol=1e-6, msg=name)
    assert _breaks_not_ours() == []
    experts = [n for n, g in grads.items() if ".experts." in n]
    assert experts and all(torch.count_nonzero(grads[n]) for n in experts)  # the experts did learn


def test_a_grouped_linear_called_from_compiled_code_is_not_compiled_again_for_new_counts():
    torch._dynamo.reset()
    counters.clear()
    layer = GroupedLinear(4, 32, 16, recipe="fp8-current")
    f = torch.compile(lambda x, offsets: layer(x * 2, offsets).square().sum(), backend="aot_eager")
    x = torch.randn(24, 32)
    for ends in ([6, 12, 18, 24], [0, 20, 20, 24], [24, 24, 24, 24]):  # empty experts too
        offsets = torch.tensor(ends)
        xc, xe = x.clone().requires_grad_(), x.clone().requires_grad_()
        f(xc, offsets).backward()
        layer(xe * 2, offsets).square().sum().backward()
        assert torch.equal(xc.grad, xe.grad)
        if ends[0] == 6:
            after_first = _graphs()
    assert _graphs() == after_first
    assert _breaks_not_ours() == []


@pytest.mark.parametrize("n", [1, 5, 64])
def test_expert_counts_are_bincounts_of_a_fixed_shape(n):
    expert = torch.randint(0, 6, (n,), generator=torch.Generator().manual_seed(n))
    expert[0] = 5  # an expert at the end; some in between stay empty at n=1 and n=5
    assert torch.equal(expert_counts(expert, 8), torch.bincount(expert, minlength=8))
    assert expert_counts(expert.int(), 8).dtype == torch.int64


@pytest.fixture
def grouped_mm_on_cpu(monkeypatch):
    """The CPU taken as a device whose BF16 experts run as one ``torch._grouped_mm`` (PyTorch's CPU kernel)."""
    from lowprec.nn import grouped

    monkeypatch.setattr(grouped, "GROUPED_BF16_DEVICES", ("cuda", "cpu"))


def test_bf16_experts_on_grouped_mm_compile_into_the_graph_without_a_break(grouped_mm_on_cpu):
    """BF16 experts need only the offsets on the device: no count is read, so nothing leaves the graph."""
    torch._dynamo.reset()
    counters.clear()
    cfg = preset("moe-tiny")
    model = build_model(cfg, seed=0).to(torch.bfloat16)
    twin = copy.deepcopy(model)
    compiled, grads = _train(model, _batches(3, cfg.vocab_size), compiled=True)
    eager, eager_grads = _train(twin, _batches(3, cfg.vocab_size), compiled=False)
    assert dict(counters["graph_break"]) == {}
    torch.testing.assert_close(torch.tensor(compiled), torch.tensor(eager), rtol=2e-2, atol=0)  # BF16 weights
    w2 = "layers.1.feed_forward.experts.w2.weight"
    torch.testing.assert_close(grads[w2].float(), eager_grads[w2].float(), rtol=5e-2, atol=1e-3)


def test_offsets_a_compiled_bf16_call_does_not_read_are_checked_on_the_device(grouped_mm_on_cpu):
    torch._dynamo.reset()
    layer = GroupedLinear(2, 32, 16, dtype=torch.bfloat16)
    f = torch.compile(lambda x, offsets: layer(x, offsets), backend="aot_eager")
    x = torch.randn(8, 32, dtype=torch.bfloat16)
    torch.testing.assert_close(f(x, torch.tensor([3, 8])), layer(x, torch.tensor([3, 8])), rtol=0, atol=0)
    for bad in ([3, 7], [5, 3]):  # not ending at x's rows; decreasing
        with pytest.raises(RuntimeError, match="offsets: expected non-decreasing cumulative token counts"):
            f(x, torch.tensor(bad))
    with pytest.raises(ValueError, match=r"^offsets: expected shape \(2,\) \(one per expert\)"):
        f(x, torch.tensor([8]))
    with pytest.raises(TypeError, match=r"^offsets: expected an integer tensor of cumulative token counts"):
        f(x, torch.tensor([3.0, 8.0]))
