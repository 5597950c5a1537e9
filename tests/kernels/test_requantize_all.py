"""``requantize_all`` (the optimizer's requantization of every FP8 weight after a step) stores the bits
``FP8Weight.requantize_`` stores weight by weight, with the per-tensor weights' amaxes taken together:
on the reference and on the Triton route (through the interpreter: see conftest), for ordinary masters and for those
at the edges of the scale rule (zero, BF16's overflow, a NaN), mixed with 128x128-block weights."""
from __future__ import annotations

import dataclasses
import importlib
import warnings

import pytest
import torch

from lowprec.nn import plan as plan_module
from lowprec.nn.fp8_weight import FP8Weight, requantize_all
from lowprec.quant import blockwise, tensorwise
from tests.nn.common import randn

route_module = importlib.import_module("lowprec.kernels.route")  # the package exports a function of that name


@pytest.fixture(params=["reference", "triton"])
def route(request, monkeypatch):
    """The route the casts take; on "triton" the calls into the kernels are counted (``calls``)."""
    calls = []
    if request.param == "triton":
        pytest.importorskip("triton")
        from lowprec.kernels import triton_quant

        cpu = route_module.capability("cpu")
        monkeypatch.setattr(route_module, "capability", lambda device: dataclasses.replace(cpu, triton=True))
        quantize = triton_quant.quantize
        monkeypatch.setattr(triton_quant, "quantize", lambda *a, **k: calls.append(1) or quantize(*a, **k))
    plan_module.operand_plan.cache_clear()
    yield request.param, calls
    plan_module.operand_plan.cache_clear()


def _masters() -> list[torch.Tensor]:
    big = randn(64, 32, seed=3)
    big[5, 7] = 3.4e38  # rounds to BF16's infinity: an infinite amax, the scale NaN
    nan = randn(32, 64, seed=4)
    nan[1, 2] = float("nan")
    return [randn(64, 32, seed=1, scale=0.02), randn(128, 128, seed=2, scale=3.0), torch.zeros(32, 32),
            big, nan, randn(16, 256, seed=5, scale=1e-30)]


def _weights(granularities, amax: bool) -> list[FP8Weight]:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return [FP8Weight.of(randn(*m.shape, seed=9).to(torch.bfloat16), g, amax=amax)
                for m, g in zip(_masters(), granularities)]


@pytest.mark.parametrize("amax", [False, True], ids=["current", "with-amax"])
def test_requantizing_together_stores_what_each_weight_stores_alone(route, amax):
    granularities = [tensorwise()] * 5 + [blockwise(128, 128)]
    alone, together = _weights(granularities, amax), _weights(granularities, amax)
    name, calls = route
    made = len(calls)
    for p, m in zip(alone, _masters()):
        p.requantize_(m)
    requantize_all(together, _masters())
    for i, (a, b) in enumerate(zip(alone, together)):
        assert torch.equal(a._data.view(torch.uint8), b._data.view(torch.uint8)), i
        assert torch.equal(a._scale, b._scale) or (a._scale.isnan().all() and b._scale.isnan().all()), i
        if amax:
            assert torch.equal(a._amax, b._amax) or (a._amax.isnan() and b._amax.isnan()), i
        assert b._initial is None
    # on the Triton route both ways went through the kernels, each weight once
    assert len(calls) - made == (2 * len(alone) if name == "triton" else 0)


def test_a_pair_count_mismatch_is_refused():
    w = _weights([tensorwise()], False)
    with pytest.raises(ValueError):
        requantize_all(w, [])
