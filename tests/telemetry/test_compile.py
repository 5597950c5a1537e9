"""Telemetry under ``torch.compile``: unsampled steps run the compiled graph with no graph break and
no recompilation, and a sampled step gives the figures of the eager model (see [Note: telemetry under
torch.compile]). Compiled with ``aot_eager`` as the other compile tests (see [Note: why aot_eager])."""
from __future__ import annotations

import copy

import pytest
import torch

import lowprec
from lowprec import telemetry as T
from lowprec.telemetry import collect

pytestmark = pytest.mark.slow



def _model() -> torch.nn.Module:
    """A tiny model: an embedding, then three converted linears (a GELU between the first two)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Embedding(64, 32), torch.nn.Linear(32, 64), torch.nn.GELU(),
                                torch.nn.Linear(64, 32), torch.nn.Linear(32, 64))
    lowprec.convert(model, "fp8-delayed", lowprec.Policy(keep_last_blocks=0))
    return model


def _step(fwd, tokens):
    logits = fwd(tokens[:, :-1])  # (B, T, vocab)
    loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())
    loss.backward()


# one recipe, as compiling costs a minute per recipe on two cores: delayed scaling, the one with state
# the graph reads and writes
def test_unsampled_steps_stay_in_the_graph_and_sampled_steps_equal_eager(monkeypatch):
    torch._dynamo.reset()
    counters = torch._dynamo.utils.counters
    counters.clear()
    model = _model()
    eager = copy.deepcopy(model)
    compiled = torch.compile(model, backend="aot_eager", fullgraph=True)
    g = torch.Generator().manual_seed(5)
    batches = [torch.randint(0, 64, (2, 16), generator=g) for _ in range(4)]

    with monkeypatch.context() as m:  # proof that the unsampled steps compute nothing of telemetry
        m.setattr(collect, "stats_tensor", lambda *a: (_ for _ in ()).throw(AssertionError("computed")))
        tel = T.Telemetry(every=3)
        for step, tokens in enumerate(batches[:2], start=1):
            with tel.region(compiled, step) as t:
                assert t is None
                _step(compiled, tokens)
                _step(eager, tokens)
    graphs = counters["stats"]["unique_graphs"]
    assert graphs >= 1 and sum(counters["graph_break"].values()) == 0, dict(counters["graph_break"])

    with tel.region(compiled, 3) as sampled:  # runs eagerly, whatever compiled it
        _step(compiled, batches[2])
    with T.sample(eager, step=3) as reference:
        _step(eager, batches[2])
    assert len(sampled.records) == 3 * 6  # three converted linears, six operand sides each
    assert sampled.records == reference.records

    _step(compiled, batches[3])  # back in the compiled graph: nothing recompiled
    assert counters["stats"]["unique_graphs"] == graphs
    assert sum(counters["graph_break"].values()) == 0
