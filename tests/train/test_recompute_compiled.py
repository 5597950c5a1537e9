"""Recomputation under ``torch.compile``, with the casts on the Triton route (through the interpreter), where
they are opaque operators in the graph, as on a GPU: the partitioner ``torch.compile`` uses (min-cut
rematerialisation) plans what a checkpointed block recomputes. Each mode keeps less than the one before
(``full`` only the blocks' inputs and what lies outside the blocks), and the gradients are those of the compiled
model without recomputation, bit for bit (and eager's, to the last bits decompositions move). (On this
partitioner ``full`` keeps as much under torch's default policy as under ``recompute_all``: what the policy
spares shows under inductor, measured on the GPU: BENCHMARKS.md, runs 28 and 29.)"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("triton")

import lowprec
from lowprec.train.model import ModelConfig, build_model
from lowprec.train.recompute import Recompute, recompute_blocks
from tests.nn.common import saved_for_backward

pytestmark = pytest.mark.slow
CFG = ModelConfig(dim=64, n_layers=2, n_heads=2, n_kv_heads=1, ffn_dim=128, vocab_size=64, max_seq_len=32)


def _step(recipe: str, mode: str, compiled: bool) -> tuple[int, list[torch.Tensor], list[torch.Tensor]]:
    """(bytes saved for backward, gradients, delayed-scaling histories) of one step of the micro model."""
    torch._dynamo.reset()
    model = build_model(CFG, seed=0)
    if recipe != "bf16":
        lowprec.convert(model, recipe, lowprec.Policy(skip_small=False))
    recompute_blocks(model, mode)
    forward = torch.compile(model, backend="aot_eager_decomp_partition") if compiled else model
    x = torch.randint(0, CFG.vocab_size, (2, 17), generator=torch.Generator().manual_seed(0))
    losses = []

    def run():
        logits = forward(x[:, :-1])
        losses.append(F.cross_entropy(logits.flatten(0, 1), x[:, 1:].flatten()))

    nbytes, _ = saved_for_backward(run)
    losses[0].backward()
    histories = [m.delayed_state.history.clone() for m in model.modules()
                 if getattr(m, "delayed_state", None) is not None]
    return nbytes, [p.grad for p in model.parameters()], histories


@pytest.mark.parametrize("recipe", ["fp8-current", "fp8-delayed"])
def test_compiled_recomputation_keeps_less_and_gives_the_same_gradients(triton_cpu, recipe):
    _, eager, _ = _step(recipe, "none", compiled=False)
    kept, grads, histories = {}, {}, {}
    for mode in (m.value for m in Recompute):
        kept[mode], grads[mode], histories[mode] = _step(recipe, mode, compiled=True)
        assert len(grads[mode]) == len(eager) and all(g is not None for g in grads[mode])
    for mode in ("selective", "full"):  # the compiled graphs run the same operations on the same values
        for g, e in zip(grads[mode], grads["none"], strict=True):
            torch.testing.assert_close(g, e, rtol=0, atol=0)
        # a recomputed forward records no amax a second time
        assert len(histories[mode]) == len(histories["none"]) == (0 if recipe == "fp8-current" else 14)
        for h, e in zip(histories[mode], histories["none"], strict=True):
            assert torch.equal(h, e)
    for g, e in zip(grads["none"], eager, strict=True):  # decompositions move the last bits
        torch.testing.assert_close(g, e, rtol=1e-3, atol=1e-6)
    assert kept["full"] < kept["selective"] < kept["none"], kept
