"""``torch.compile(fullgraph=True)`` of a converted layer, forward and backward, equals eager.

[Note: why aot_eager]
The graph is captured by Dynamo and differentiated by AOTAutograd exactly as for inductor; only code
generation is left out. Inductor itself compiles these graphs to the same numbers but, on two CPU
cores with a cold cache, takes about 2 minutes (fp8-current) and 8 minutes (mxfp8) to generate C++
for the pure-torch quantizer that the CPU path traces, which no test budget allows.
"""
from __future__ import annotations

import pytest
import torch

from lowprec.nn import linear as linear_module
from tests.nn.common import make_linear, randn

pytestmark = pytest.mark.slow


def _compiled_matches_eager(recipe: str) -> None:
    torch._dynamo.reset()
    lin = make_linear(recipe, 64, 32)
    x, dy = randn(16, 64, seed=1), randn(16, 32, seed=2)
    compiled = torch.compile(lin, fullgraph=True, backend="aot_eager")
    xc = x.clone().requires_grad_()
    yc = compiled(xc)
    yc.backward(dy)
    dwc, lin.weight.grad = lin.weight.grad, None
    xe = x.clone().requires_grad_()
    ye = lin(xe)
    ye.backward(dy)
    torch.testing.assert_close(yc, ye, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(xc.grad, xe.grad, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(dwc, lin.weight.grad, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("recipe", ["fp8-current", "mxfp8"])
def test_a_converted_linear_compiles_with_fullgraph(recipe):
    _compiled_matches_eager(recipe)


@pytest.mark.parametrize("recipe", ["fp8-current", "mxfp8"])
def test_everything_but_the_autocast_lookup_compiles_with_fullgraph(recipe, monkeypatch):
    # isolates the one graph break above: with the context lookup replaced, the rest is one graph
    monkeypatch.setattr(linear_module, "resolve", lambda bound: bound)
    _compiled_matches_eager(recipe)
