"""[Note: recasting the input in backward] on the Triton route (through the interpreter), where the casts
are opaque operators in the compiled graph, as on a GPU: a norm followed by a converted linear, compiled
with the partitioner ``torch.compile`` uses (min-cut rematerialisation). With the recast the graph keeps
no FP8 copy of the linear's input (the partitioner rebuilds the norm's output from its input, which the
norm's backward keeps anyway); without it, it keeps one. The gradients are eager's, bit for bit, either
way."""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

import lowprec
from lowprec.nn import RMSNorm
from tests.nn.common import calls, partitioned_graphs, randn, saved_for_backward

pytestmark = pytest.mark.slow
M, K, N = 64, 128, 256


def _block(recipe: str, recast: bool) -> torch.nn.Module:
    torch.manual_seed(0)
    model = torch.nn.Sequential(RMSNorm(K), torch.nn.Linear(K, N, bias=False))
    lowprec.convert(model, recipe, policy=lowprec.Policy(skip_small=False, recast_inputs=recast))
    assert model[1].plan().recast_input is recast
    return model


def _step(model: torch.nn.Module, compiled: bool) -> tuple[int, list[torch.Tensor], list[torch.Tensor]]:
    torch._dynamo.reset()
    fwd = torch.compile(model, backend="aot_eager_decomp_partition", fullgraph=True) if compiled else model
    x = randn(M, K, seed=1).requires_grad_()
    dy = randn(M, N, seed=2)
    out: list[torch.Tensor] = []
    nbytes, kept = saved_for_backward(lambda: out.append(fwd(x)))
    out[0].backward(dy)
    grads = [x.grad] + [p.grad for p in model.parameters()]
    model.zero_grad()
    return nbytes, kept, grads


def _fp8_copies(kept: list[torch.Tensor]) -> list[torch.Tensor]:
    """The saved tensors holding FP8 codes of the linear's input (M x K, or transposed)."""
    return [t for t in kept if t.element_size() == 1 and t.numel() == M * K]


@pytest.mark.parametrize("recipe", ["fp8-current", "mxfp8"])
def test_a_compiled_backward_recasts_the_input_instead_of_keeping_its_cast(recipe, triton_cpu):
    _, _, eager = _step(_block(recipe, True), compiled=False)
    with_bytes, with_kept, with_grads = _step(_block(recipe, True), compiled=True)
    without_bytes, without_kept, without_grads = _step(_block(recipe, False), compiled=True)
    assert _fp8_copies(without_kept) and not _fp8_copies(with_kept)
    assert without_bytes - with_bytes >= M * K  # at least the FP8 copy (and its scales) less
    for got in (with_grads, without_grads):
        for a, b in zip(got, eager, strict=True):
            assert torch.equal(a, b)


class _Shared(torch.nn.Module):
    """A norm read by three linears (attention's q, k and v projections)."""

    def __init__(self) -> None:
        super().__init__()
        self.norm = RMSNorm(K)
        self.q, self.k, self.v = (torch.nn.Linear(K, N, bias=False) for _ in range(3))

    def forward(self, x):
        h = self.norm(x)
        return self.q(h) * self.k(h) + self.v(h)


@pytest.mark.parametrize("recast", [False, True])
def test_layers_reading_one_input_make_one_cast_of_it_in_a_compiled_graph(recast, triton_cpu):
    """Compiled code shares the input's cast by the compiler merging equal calls (eager code by
    ``InputShare``): every argument of the three calls must be the same node, with no fresh empty
    tensor standing in for an amax the cast does not take (with the recast, forward makes the input's
    cast along K alone, whose transposed side takes no amax)."""
    torch.manual_seed(0)
    model = _Shared()
    lowprec.convert(model, "fp8-current", policy=lowprec.Policy(skip_small=False, recast_inputs=recast))
    graphs = partitioned_graphs(model, randn(M, K, seed=1).requires_grad_())
    # forward: the input once and the three weights; backward: three output gradients, three weight.T
    cast = torch.ops.lowprec.tile_cast.default
    assert (calls(graphs["forward"], cast), calls(graphs["backward"], cast)) == (4, 6)
