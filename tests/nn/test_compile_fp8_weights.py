"""A model with FP8 primary weights compiles into whole graphs (``fullgraph=True``: no break at its
layers) and trains as eager does, step by step, with the optimizer requantizing the codes between
steps outside the graph. Compiled with ``aot_eager`` (see [Note: why aot_eager] in test_compile)."""
from __future__ import annotations

import warnings

import pytest
import torch

import lowprec
from lowprec.nn.fp8_convert import fp8_weights
from lowprec.optim import Optimizer
from lowprec.train.model import ModelConfig, build_model

pytestmark = pytest.mark.slow

# every linear a multiple of 128, so that fp8-blockwise converts them all
CFG = ModelConfig(vocab_size=64, dim=128, n_layers=1, n_heads=4, n_kv_heads=4, ffn_dim=256, max_seq_len=16)
POLICY = lowprec.Policy(keep_last_blocks=0)


def _train(recipe: str, compiled: bool, steps: int = 3) -> list[float]:
    model = build_model(CFG, seed=0).to(torch.bfloat16)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "emulated on cpu"
        lowprec.convert(model, recipe, POLICY, fp8_weights=True)
    assert len(fp8_weights(model)) == 7  # q, k, v, o, gate, up, down
    fwd = torch.compile(model, backend="aot_eager", fullgraph=True) if compiled else model
    opt = Optimizer(model.parameters(), torch.optim.AdamW, lr=1e-2)
    g = torch.Generator().manual_seed(5)
    losses = []
    for _ in range(steps):
        tokens = torch.randint(0, CFG.vocab_size, (2, 16), generator=g)
        logits = fwd(tokens[:, :-1])
        loss = torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), tokens[:, 1:].flatten())
        opt.backward(loss)
        opt.step(loss)
        losses.append(loss.item())
    return losses


@pytest.mark.parametrize("recipe", ["fp8-current", "fp8-blockwise"])
def test_a_model_with_fp8_weights_compiles_whole_and_trains_like_eager(recipe):
    torch._dynamo.reset()
    breaks = torch._dynamo.utils.counters["graph_break"]
    breaks.clear()
    eager = _train(recipe, False)
    comp = _train(recipe, True)
    assert sum(breaks.values()) == 0, dict(breaks)
    # the losses move (the codes follow the masters), and the compiled steps read the codes the optimizer
    # wrote in place, not the ones the graph was traced with
    assert len(set(eager)) == len(eager)
    torch.testing.assert_close(torch.tensor(comp), torch.tensor(eager), rtol=2e-3, atol=0)
