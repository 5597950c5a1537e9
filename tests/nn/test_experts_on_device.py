"""FP8 experts on the counts as the device holds them (see [Note: experts under torch.compile] in
``lowprec.nn.routing``): where every GEMM of the experts runs grouped, a compiled graph holds them, with no
count read on the host and no graph break, and they compute what the experts reading their counts compute,
bit for bit. The CPU runs no grouped GEMM of its own, so these tests tell lowprec that it does and run every
grouped GEMM on lowprec's Triton kernels through Triton's interpreter: the kernels a GPU runs, on the CPU."""
from __future__ import annotations

import copy
import dataclasses
import sys

import pytest
import torch
import torch.nn.functional as F
from torch._dynamo.utils import counters

import lowprec
from lowprec.kernels import grouped_gemm as GG
from lowprec.nn import GroupedLinear, InputShare
from lowprec.nn import grouped_casts as GC
from lowprec.nn.plan import layer_plan
from lowprec.train.model import build_model, preset
from lowprec.train.moe_model import RoutedExperts
from tests.nn.common import randn

RECIPES = ("fp8-current", "fp8-rowwise", "mxfp8", "mxfp4")
"""Per tensor, per row and MX: the MX recipes' three GEMMs folded to row scales (``mx_grouped_here``)."""
COUNTS = (5, 0, 40, 19)


@pytest.fixture
def grouped_here(monkeypatch):
    """The CPU taken as a device with FP8 tensor cores (its plans' GEMMs cuBLAS's) whose experts' GEMMs all
    run grouped, each on lowprec's Triton kernels."""
    C = sys.modules["lowprec.kernels.capability"]
    monkeypatch.setitem(C._KNOWN, torch.device("cpu"), C.Capability("cpu", "cpu", None, True, False, False, False))
    monkeypatch.setattr(GG, "runs_grouped", lambda kind, device, a_fmt, b_fmt, *dims, **kw: True)
    monkeypatch.setattr(GG, "_on_torch", lambda a, b, fast_accum: False)
    layer_plan.cache_clear()
    yield
    layer_plan.cache_clear()


@pytest.fixture
def mx_grouped_here(grouped_here, monkeypatch):
    """As ``grouped_here``, and MX GEMMs taken as running folded on FP8 tensor cores (Ada, Hopper)."""
    from lowprec.nn import grouped

    monkeypatch.setattr(grouped, "folded_runs", lambda device: True)
    layer_plan.cache_clear()
    yield
    layer_plan.cache_clear()


def _layer(recipe: str, bias: bool = False) -> GroupedLinear:
    torch.manual_seed(0)
    return GroupedLinear(len(COUNTS), 64, 96, bias=bias, recipe=recipe)


def _step(layer, x, dy, call):
    layer.weight.grad = None
    x = x.clone().requires_grad_()
    y = call(layer, x)
    y.backward(dy)
    return y.detach(), x.grad, layer.weight.grad.clone()


def _offsets(counts=COUNTS) -> torch.Tensor:
    return torch.tensor(counts).cumsum(0)


@pytest.mark.parametrize("recipe", RECIPES)
def test_a_layer_on_the_device_counts_equals_the_counted_layer_bit_for_bit(recipe, mx_grouped_here):
    """MX experts too: their token sides padded to whole blocks for any routing (zero blocks after the last
    expert's, which no expert reads), the weight gradient folded per expert over the blocks its tokens fill."""
    layer = _layer(recipe)
    x, dy = randn(sum(COUNTS), 64, seed=1), randn(sum(COUNTS), 96, seed=2, scale=1e-2)
    off = _offsets()
    way = layer._on_device(x)
    assert way is layer.plan() and layer.takes_offsets(x)
    counted = _step(layer, x, dy, lambda m, a: m(a, off))
    on_device = _step(layer, x, dy, lambda m, a: m._on_offsets(a, off, way))
    for a, b in zip(on_device, counted, strict=True):
        assert torch.equal(a, b)


def compiled_once_for_every_routing(layer, x: torch.Tensor, dy: torch.Tensor) -> None:
    """A compiled call of ``layer`` on 24 rows equals the eager call bit for bit for several routings (empty
    experts too), compiled once, with no graph break (no count read on the host)."""
    torch._dynamo.reset()
    counters.clear()
    f = torch.compile(lambda a, o: layer(a * 2, o), backend="aot_eager")
    graphs = None
    for ends in ([6, 12, 18, 24], [0, 20, 20, 24], [24, 24, 24, 24]):  # empty experts too
        off = torch.tensor(ends)
        compiled = _step(layer, x, dy, lambda m, a, off=off: f(a, off))
        eager = _step(layer, x, dy, lambda m, a, off=off: m(a * 2, off))
        for a, b in zip(compiled, eager, strict=True):
            assert torch.equal(a, b)
        graphs = graphs or counters["stats"]["unique_graphs"]
    assert counters["stats"]["unique_graphs"] == graphs  # compiled once
    assert dict(counters["graph_break"]) == {}  # nothing left the graph: no count was read


@pytest.mark.parametrize("recipe", RECIPES)
def test_a_compiled_call_holds_the_experts_in_its_graph_for_every_routing(recipe, mx_grouped_here):
    compiled_once_for_every_routing(_layer(recipe), randn(24, 64, seed=3), randn(24, 96, seed=4, scale=1e-2))


def test_delayed_experts_compiled_on_the_device_counts_equal_the_counted_layer_step_after_step(grouped_here):
    """``fp8-delayed`` experts in a compiled graph: each expert scales by its own history and records into it
    from the device's counts (no count read, no graph break), equal bit for bit, step after step, to a copy of
    the layer reading its counts eagerly: outputs, gradients and every expert's history; an expert without
    tokens at a step records nothing at it."""
    torch._dynamo.reset()
    counters.clear()
    eager = _layer("fp8-delayed")
    compiled_layer = copy.deepcopy(eager)
    f = torch.compile(lambda a, o: compiled_layer(a, o), backend="aot_eager")
    x, dy = randn(24, 64, seed=3), randn(24, 96, seed=4, scale=1e-2)
    for step, ends in enumerate(([6, 12, 18, 24], [0, 20, 20, 24], [6, 12, 18, 24], [24, 24, 24, 24])):
        off, grow = torch.tensor(ends), 1.5 ** step  # growing inputs: the delayed scales lag
        got = _step(compiled_layer, x * grow, dy * grow, lambda m, a, off=off: f(a, off))
        want = _step(eager, x * grow, dy * grow, lambda m, a, off=off: m(a, off))
        for a, b in zip(got, want, strict=True):
            assert torch.equal(a, b), step
    assert dict(counters["graph_break"]) == {}
    for (e, a), (_, b) in zip(compiled_layer.delayed_states(), eager.delayed_states(), strict=True):
        assert a.recorded == b.recorded and torch.equal(a.history, b.history), e
    assert [s.recorded for _, s in eager.delayed_states()] == [[3] * 3, [3] * 3, [2] * 3, [3] * 3]


def test_the_reference_experts_compile_into_one_graph_with_gate_and_up_shared(grouped_here):
    """Gate and up read the same rows: eagerly their share casts them once; in the graph the compiler merges
    the two casts; the numbers are the same either way."""
    torch._dynamo.reset()
    counters.clear()
    torch.manual_seed(3)
    m = RoutedExperts(len(COUNTS), 64, 96)
    for lin in (m.w1, m.w3, m.w2):
        lin.set_recipe("fp8-current")
    m.w1.state.share = m.w3.state.share = InputShare(("w1", "w3"))
    x = randn(sum(COUNTS), 64, seed=5)
    outs = []
    for forward in (torch.compile(m, backend="aot_eager"), m):
        xg = x.clone().requires_grad_()
        for p in m.parameters():
            p.grad = None
        y = forward(xg, _offsets())
        y.square().sum().backward()
        outs.append((y.detach(), xg.grad, *(p.grad.clone() for p in m.parameters())))
    assert dict(counters["graph_break"]) == {}
    for a, b in zip(*outs, strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize("recipe", ["fp8-rowwise", "mxfp8"])
def test_the_moe_model_trains_compiled_with_its_fp8_experts_in_the_graph(recipe, mx_grouped_here):
    torch._dynamo.reset()
    counters.clear()
    # one block of moe-tiny and two steps (the second's loss follows the first's update): every GEMM of the
    # experts runs in Triton's interpreter here, which the test's time is
    cfg = dataclasses.replace(preset("moe-tiny"), n_layers=1)
    model = build_model(cfg, seed=0)
    lowprec.convert(model, recipe, lowprec.Policy(skip_small=False))
    twin = copy.deepcopy(model)
    batches = [torch.randint(0, cfg.vocab_size, (2, 17), generator=torch.Generator().manual_seed(s)) for s in range(2)]
    losses = []
    for net, forward in ((model, torch.compile(model, backend="aot_eager")), (twin, twin)):
        opt = torch.optim.AdamW(net.parameters(), lr=1e-2)
        run = []
        for b in batches:
            loss = F.cross_entropy(forward(b[:, :-1]).flatten(0, 1).float(), b[:, 1:].flatten())
            loss.backward()
            opt.step()
            opt.zero_grad()
            run.append(loss.item())
        losses.append(run)
    assert dict(counters["graph_break"]) == {}
    # aot_eager's decompositions move the last bits of the norms and the softmax (as in test_experts_compiled)
    torch.testing.assert_close(torch.tensor(losses[0]), torch.tensor(losses[1]), rtol=5e-4, atol=0)


def test_where_the_device_does_not_run_every_gemm_grouped_the_experts_read_their_counts():
    """The CPU as it is (no grouped FP8 GEMM), a bias, a recipe whose casts are not batched per tensor or per
    row, or no rows: the counted path, outside compiled graphs."""
    x = randn(8, 64, seed=6)
    assert not _layer("fp8-current").takes_offsets(x)
    assert _layer("fp8-current").plan().scaled


@pytest.mark.parametrize(("recipe", "bias", "rows", "takes"), [
    ("fp8-current", False, 8, True), ("fp8-rowwise", False, 8, True), ("fp8-delayed", False, 8, True),
    ("fp8-current", True, 8, False),
    ("mxfp8", False, 8, False), ("fp8-blockwise", False, 8, False), ("fp8-current", False, 0, False)])
def test_which_fp8_experts_take_the_device_counts(recipe, bias, rows, takes, grouped_here):
    assert _layer(recipe, bias).takes_offsets(randn(rows, 64, seed=7)) is takes


def test_padding_for_any_routing_lays_the_tokens_out_as_the_counts_do():
    """``token_padding`` without the counts: each expert's rows at the columns the counts give them, zeros
    after the last expert's up to the bound of any routing; the weight gradient's GEMM reads the same."""
    counts = (5, 0, 40, 19)
    lengths = torch.tensor(counts)
    read, bound = GG.token_padding(counts, lengths), GG.token_padding(None, lengths, rows=sum(counts))
    assert torch.equal(read.ends, bound.ends)
    assert bound.total == GG.padded_bound(sum(counts), len(counts)) == 128 >= read.total == 96
    assert torch.equal(bound.sources[:read.total], read.sources)
    assert (bound.sources[read.total:] == -1).all()
    rows = randn(sum(counts), 32, seed=8).to(torch.float8_e4m3fn)
    a, b = GG.features_padded(rows, read), GG.features_padded(rows, bound)
    assert torch.equal(b[:, :read.total].view(torch.uint8), a.view(torch.uint8))
    assert not b[:, read.total:].view(torch.uint8).any()


@pytest.mark.parametrize("counts", [(0,), (16, 16), (1, 15, 17, 0, 33)])
def test_the_padding_bound_holds_every_routing_of_the_rows(counts):
    lengths = torch.tensor(counts)
    bound = GG.token_padding(None, lengths, rows=sum(counts))
    assert bound.total % 16 == 0 and int(bound.ends[-1]) <= bound.total
    assert GC.Groups.of(None, lengths.cumsum(0), sum(counts)).padded().total == bound.total



def test_mx_experts_read_their_counts_where_mx_gemms_do_not_run_folded(grouped_here, monkeypatch):
    """Without the folded path (a device whose first-use check of it failed), MX experts keep the counted
    path; with it, they take the device's counts."""
    from lowprec.nn import grouped

    monkeypatch.setattr(grouped, "folded_runs", lambda device: False)
    x = randn(8, 64, seed=7)
    assert not _layer("mxfp8").takes_offsets(x)
    monkeypatch.setattr(grouped, "folded_runs", lambda device: True)
    assert _layer("mxfp8").takes_offsets(x)
