"""A whole converted model compiles and trains as users run it: ``torch.compile`` over a model under
BF16 autocast, with the optimizer step outside the graph, equal to eager step by step.

Compiled with ``aot_eager_decomp_partition`` (see [Note: why aot_eager] in test_compile): Dynamo captures
the graphs, AOTAutograd differentiates them and splits forward from backward as for inductor."""
from __future__ import annotations

import pytest
import torch

import lowprec
from lowprec.train.model import ModelConfig, build_model
from tests.nn.test_compile import PARTITIONED

pytestmark = pytest.mark.slow

# every linear a multiple of 128, so that fp8-blockwise converts them all; one layer kept in high
# precision (the head) shows a fallback layer compiles too
CFG = ModelConfig(vocab_size=64, dim=128, n_layers=1, n_heads=4, n_kv_heads=4, ffn_dim=256, max_seq_len=16)
POLICY = lowprec.Policy(keep_last_blocks=0)


def _train(model, steps: int, compiled: bool) -> list[float]:
    fwd = torch.compile(model, backend=PARTITIONED) if compiled else model
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    g = torch.Generator().manual_seed(5)
    losses = []
    for _ in range(steps):
        tokens = torch.randint(0, CFG.vocab_size, (2, 16), generator=g)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            logits = fwd(tokens[:, :-1])
        loss = torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), tokens[:, 1:].flatten())
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


@pytest.mark.parametrize("recipe", ["fp8-delayed", "fp8-rowwise", "fp8-blockwise"])
def test_a_converted_model_compiles_and_trains_like_eager(recipe):
    torch._dynamo.reset()
    breaks = torch._dynamo.utils.counters["graph_break"]
    breaks.clear()
    runs = []
    for compiled in (False, True):
        model = build_model(CFG, seed=0)
        lowprec.convert(model, recipe, POLICY)
        runs.append(_train(model, 3, compiled))
    eager, comp = runs
    assert all(torch.isfinite(torch.tensor(comp)))
    # the same quantized values; only the order of a few float32 sums may differ under the compiler
    torch.testing.assert_close(torch.tensor(comp), torch.tensor(eager), rtol=2e-3, atol=0)
    assert sum(breaks.values()) == 0, dict(breaks)


def test_a_compiled_evaluation_finds_its_plans_made(monkeypatch):
    """The evaluation plan (every cast to nearest) is made with the training plan, when the layer gets its
    recipe: a compiled validation forward would otherwise trace the planner inside its graph."""
    import lowprec.nn.linear as linear_module

    torch._dynamo.reset()
    model = build_model(CFG, seed=0)
    lowprec.convert(model, "mxfp4", POLICY)
    calls = []
    real = linear_module.layer_plan
    monkeypatch.setattr(linear_module, "layer_plan", lambda *a, **k: calls.append(a) or real(*a, **k))
    fwd = torch.compile(model, backend="aot_eager")
    tokens = torch.randint(0, CFG.vocab_size, (2, 15))
    model.eval()
    with torch.no_grad():
        fwd(tokens)
    model.train()
    fwd(tokens).sum().backward()
    assert calls == []
