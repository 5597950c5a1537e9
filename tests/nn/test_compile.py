"""``torch.compile(fullgraph=True)`` of a converted layer, forward and backward, equals eager.

[Note: why aot_eager]
The graph is captured by Dynamo and differentiated by AOTAutograd as for inductor; only code generation
is left out. Inductor itself compiles these graphs to the same numbers but, on two CPU cores with a
cold cache, takes about 2 minutes (fp8-current) and 8 minutes (mxfp8) to generate C++ for the
pure-torch quantizer that the CPU path traces, which no test budget allows. ``aot_eager`` splits the
joint graph with the default partitioner; inductor uses the min-cut one, which
``aot_eager_decomp_partition`` (:data:`PARTITIONED`) runs too, with inductor's decompositions: tests
of what that partitioner decides, or refuses, use it.
"""
from __future__ import annotations

import pytest
import torch

from lowprec.nn import linear as linear_module
from tests.nn.common import calls, make_linear, partitioned_graphs, randn

pytestmark = pytest.mark.slow
PARTITIONED = "aot_eager_decomp_partition"
"""The backend that splits forward and backward as inductor does (see [Note: why aot_eager])."""


def _compiled_matches_eager(recipe) -> None:
    torch._dynamo.reset()
    lin = make_linear(recipe, 64, 32) if not isinstance(recipe, torch.nn.Module) else recipe
    x, dy = randn(16, 64, seed=1), randn(16, 32, seed=2)
    compiled = torch.compile(lin, fullgraph=True, backend="aot_eager")
    xc = x.clone().requires_grad_()
    yc = compiled(xc)
    yc.backward(dy)
    dwc, lin.weight.grad = lin.weight.grad, None
    xe = x.clone().requires_grad_()
    ye = lin(xe)
    ye.backward(dy)
    assert torch.equal(yc, ye) and torch.equal(xc.grad, xe.grad) and torch.equal(dwc, lin.weight.grad)


@pytest.mark.parametrize("recipe", ["fp8-current", "mxfp8"])
def test_a_converted_linear_compiles_with_fullgraph(recipe):
    _compiled_matches_eager(recipe)


@pytest.mark.parametrize("recipe", ["fp8-current", "fp8-rowwise", "mxfp8"])
def test_a_compiled_backward_recasts_the_input_with_eagers_bits(recipe):
    # [Note: recasting the input in backward]: compiled code casts x.T again in backward, eager code
    # keeps forward's cast; the gradients agree (that the partitioner then keeps no cast is
    # tests/kernels/test_recast_input.py's).
    lin = make_linear(recipe, 64, 32)
    lin.set_recipe(lin.recipe, recast_input=True)
    assert lin.plan().recast_input
    _compiled_matches_eager(lin)


@pytest.mark.parametrize("recipe", ["fp8-current", "mxfp8"])
def test_everything_but_the_autocast_lookup_compiles_with_fullgraph(recipe, monkeypatch):
    # the autocast lookup (autocast.resolve) compiles too, reading a plain mirror of its ContextVar (the
    # test above); with it replaced by the bound recipe the rest is one graph, so a failure of the test
    # above that this one does not share points at the lookup
    monkeypatch.setattr(linear_module, "resolve", lambda bound: bound)
    _compiled_matches_eager(recipe)


def _delayed(algo: str):
    from dataclasses import replace

    from lowprec import recipes as R

    return replace(R.fp8_delayed(), name=f"fp8-delayed-{algo}", delayed=R.DelayedScaling(history_len=4, algo=algo))


@pytest.mark.parametrize("backend", ["aot_eager", PARTITIONED])
@pytest.mark.parametrize("algo", ["max", "most_recent", "ema"])
def test_delayed_scaling_compiles_into_one_graph_and_follows_eager_step_by_step(algo, backend):
    # the amax histories are tensors recorded by tensor operations, forward and backward, so the
    # compiled layer neither breaks its graph nor recompiles as the history fills; inductor's
    # partitioner takes them too (see [Note: delayed scaling under torch.compile] in lowprec.nn.delayed)
    torch._dynamo.reset()
    eager, comp = make_linear(_delayed(algo), 64, 32), make_linear(_delayed(algo), 64, 32)
    compiled = torch.compile(comp, fullgraph=True, backend=backend)
    for step in range(3):
        x, dy = randn(16, 64, seed=10 + step, scale=step + 1.0), randn(16, 32, seed=20 + step)
        xe, xc = x.clone().requires_grad_(), x.clone().requires_grad_()
        ye = eager(xe)
        ye.backward(dy)
        with torch._dynamo.config.patch(error_on_recompile=step > 0):
            yc = compiled(xc)
        yc.backward(dy)
        torch.testing.assert_close(yc, ye, rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(xc.grad, xe.grad, rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(comp.weight.grad, eager.weight.grad, rtol=1e-6, atol=1e-6)
        assert torch.equal(comp.delayed_state.history, eager.delayed_state.history), f"step {step}"
        assert comp.delayed_state.recorded == eager.delayed_state.recorded == [step + 1] * 3

    # after compiled steps, an eager call reads the history compiled code recorded
    x = randn(16, 64, seed=99)
    assert torch.equal(comp(x), eager(x))


@pytest.mark.parametrize("backend", ["aot_eager", PARTITIONED])
def test_recorded_high_precision_steps_compile_into_one_graph_and_follow_eager(backend):
    # lazy scale initialisation: the amaxes recorded under autocast("bf16", record_amax=True) by tensor
    # operations, so a compiled BF16 step records inside its graph as eager code does
    import lowprec

    torch._dynamo.reset()
    eager, comp = make_linear(_delayed("max"), 64, 32), make_linear(_delayed("max"), 64, 32)
    compiled = torch.compile(comp, fullgraph=True, backend=backend)
    for step in range(3):
        x, dy = randn(16, 64, seed=10 + step, scale=step + 1.0), randn(16, 32, seed=20 + step)
        xe, xc = x.clone().requires_grad_(), x.clone().requires_grad_()
        with lowprec.autocast("bf16", record_amax=True):
            ye = eager(xe)
            ye.backward(dy)
            with torch._dynamo.config.patch(error_on_recompile=step > 0):
                yc = compiled(xc)
            yc.backward(dy)
        assert torch.equal(yc, ye) and torch.equal(xc.grad, xe.grad)
        assert torch.equal(comp.weight.grad, eager.weight.grad)
        assert torch.equal(comp.delayed_state.history, eager.delayed_state.history), f"step {step}"
        assert comp.delayed_state.recorded == eager.delayed_state.recorded == [step + 1] * 3


def test_forward_takes_its_delayed_scales_through_an_opaque_copy():
    """[Note: delayed scaling under torch.compile]: the input's and the weight's delayed scales are
    ``lowprec::keep`` outputs that forward's casts read, which the partitioner must not recompute in
    backward from the histories forward writes; grad_output's scale, made in backward, is not kept."""
    lin = make_linear(_delayed("most_recent"), 64, 32)
    graphs = partitioned_graphs(lin, randn(16, 64, seed=1).requires_grad_())
    forward = graphs["forward"]
    kept = [n for n in forward.graph.nodes if n.target is torch.ops.lowprec.keep.default]
    assert len(kept) == 2
    # each feeds forward's own computation, not only what it hands backward
    outputs = set(next(n for n in forward.graph.nodes if n.op == "output").args[0])
    assert all(any(u not in outputs for u in k.users) for k in kept)
    backward = graphs["backward"]
    assert calls(backward, torch.ops.lowprec.keep.default) == 0
    # of the state, backward takes grad_output's pending amax and record count (it writes both), never a
    # history nor a forward role's (see [Note: the delayed-scaling bank] in lowprec.nn.delayed_bank)
    bank = lin.delayed_state.bank
    placeholders = [n.meta["val"] for n in backward.graph.nodes if n.op == "placeholder"]
    assert sum(v.dtype == torch.int64 for v in placeholders) == 1
    assert not any(v.shape == bank.history.shape for v in placeholders)


def test_a_delayed_weight_transposed_in_another_format_is_cast_in_forward():
    """weight.T is cast again in backward only where its delayed scale is forward's own; in another
    format forward casts it and backward takes that cast, compiled or not."""
    from dataclasses import replace

    from lowprec import recipes as R

    same = _delayed("max")
    other = replace(same, name="fp8-delayed-e5m2-wt",
                    dgrad=replace(same.dgrad, rhs=replace(same.dgrad.rhs, format="e5m2")))
    assert other.dgrad.rhs.scaling is R.Scaling.DELAYED and other.fprop.rhs.format == "e4m3"
    assert make_linear(same, 64, 32).plan().recast_weight_t
    assert not make_linear(other, 64, 32).plan().recast_weight_t
    torch._dynamo.reset()
    eager, comp = make_linear(other, 64, 32), make_linear(other, 64, 32)
    compiled = torch.compile(comp, fullgraph=True, backend=PARTITIONED)
    for step in range(3):
        x, dy = randn(16, 64, seed=10 + step, scale=step + 1.0), randn(16, 32, seed=20 + step)
        xe, xc = x.clone().requires_grad_(), x.clone().requires_grad_()
        eager(xe).backward(dy)
        compiled(xc).backward(dy)
        torch.testing.assert_close(xc.grad, xe.grad, rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(comp.weight.grad, eager.weight.grad, rtol=1e-6, atol=1e-6)
        assert torch.equal(comp.delayed_state.history, eager.delayed_state.history), f"step {step}"
