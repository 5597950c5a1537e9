"""``requantize_all`` (the optimizer's requantization of every FP8 weight after a step) stores the bits
``FP8Weight.requantize_`` stores weight by weight, with the per-tensor weights' amaxes taken together:
on the reference and on the Triton route (through the interpreter: see conftest), for ordinary masters and for those
at the edges of the scale rule (zero, BF16's overflow, a NaN), mixed with 128x128-block weights. Its
multi-tensor cast (``lowprec.kernels.requantize_many``) equals the reference on every BF16 value."""
from __future__ import annotations

import dataclasses
import importlib
import warnings

import pytest
import torch

from lowprec.nn import plan as plan_module
from lowprec.nn.fp8_requantize import requantize_all
from lowprec.nn.fp8_weight import FP8Weight
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
        from lowprec.kernels import triton_multi

        quantize, many = triton_quant.quantize, triton_multi.requantize
        monkeypatch.setattr(triton_quant, "quantize", lambda *a, **k: calls.append("one") or quantize(*a, **k))
        monkeypatch.setattr(triton_multi, "requantize", lambda *a: calls.append("many") or many(*a))
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
    # on the Triton route both ways went through the kernels: weight by weight alone; together, the
    # 128x128-block weight by itself, then the per-tensor weights in one launch
    assert calls[made:] == (["one"] * len(alone) + ["one", "many"] if name == "triton" else [])


def test_a_pair_count_mismatch_is_refused():
    w = _weights([tensorwise()], False)
    with pytest.raises(ValueError):
        requantize_all(w, [])


@pytest.mark.parametrize("scale", [1.0, 2.0**-3, 0.7, 3.1e-5, 0.0, float("nan")])
def test_the_multi_tensor_cast_equals_the_reference_on_every_bf16_value(scale):
    """Every BF16 bit pattern (finite, infinite, NaN: ties of E4M3's grid and its overflow among them),
    split into tensors of lengths around the kernel's block, cast with one scale; and the scale stored.
    The scales 0 and NaN zero every code."""
    pytest.importorskip("triton")
    from lowprec import kernels as K
    from lowprec.quant import quantize

    every = torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16).view(torch.bfloat16).float()
    sizes = [1, 4095, 4096, 4097, 2**16 - 4095 - 4096 - 4097 - 1]
    sources = list(every.split(sizes))
    scales = torch.full((len(sources),), scale)
    codes = [torch.empty(n, dtype=torch.float8_e4m3fn) for n in sizes]
    outs = [torch.empty(1, 1) for _ in sizes]
    K.requantize_many(sources, scales, codes, outs, torch.bfloat16, backend="triton")
    for src, c, o in zip(sources, codes, outs):
        ref = quantize(src.to(torch.bfloat16), "e4m3", tensorwise(), scale=torch.tensor(scale))
        got, want = c.view(torch.uint8), ref.data.view(torch.uint8).view(-1)
        nan = src.isnan()  # a NaN's code is NaN either way; its sign is the device's (see the kernel)
        assert torch.equal(got[~nan], want[~nan])
        assert torch.equal(got[nan] & 0x7F, want[nan] & 0x7F)
        assert torch.equal(o, ref.scale) or (o.isnan().all() and ref.scale.isnan().all())


def test_the_multi_tensor_cast_takes_one_launch_for_bf16_only(monkeypatch):
    """FP16 weights (or other layouts) are cast one by one, with the same bits."""
    pytest.importorskip("triton")
    from lowprec import kernels as K
    from lowprec.kernels import triton_multi

    launches = []
    many = triton_multi.requantize
    monkeypatch.setattr(triton_multi, "requantize", lambda *a: launches.append(1) or many(*a))
    src = [randn(8, 16, seed=1), randn(3, 5, seed=2)]
    for dtype, want in ((torch.bfloat16, 1), (torch.float16, 0)):
        codes = [torch.empty(s.shape, dtype=torch.float8_e4m3fn) for s in src]
        outs = [torch.empty(1, 1) for _ in src]
        before = len(launches)
        K.requantize_many(src, torch.tensor([0.01, 0.02]), codes, outs, dtype, backend="triton")
        assert len(launches) - before == want
        for s, c, scale in zip(src, codes, (0.01, 0.02)):
            ref = K.quantize(s.to(dtype), "e4m3", tensorwise(), scale=torch.tensor(scale))
            assert torch.equal(c.view(torch.uint8), ref.data.view(torch.uint8).view(c.shape))


def test_the_multi_tensor_cast_names_a_bad_argument():
    from lowprec import kernels as K

    src = [randn(4, 8, seed=1), randn(2, 3, seed=2)]
    codes = [torch.empty(s.shape, dtype=torch.float8_e4m3fn) for s in src]
    outs = [torch.empty(1, 1) for _ in src]
    scales = torch.tensor([0.1, 0.2])
    bad = [("scales", dict(scales=torch.tensor([0.1]))), ("codes", dict(codes=codes[:1])),
           ("codes\\[1\\]", dict(codes=[codes[0], torch.empty(2, 3, dtype=torch.uint8)])),
           ("codes\\[0\\]", dict(codes=[torch.empty(5, dtype=torch.float8_e4m3fn), codes[1]])),
           ("scale_outs\\[1\\]", dict(scale_outs=[outs[0], torch.empty(2)])),
           ("sources\\[0\\]", dict(sources=[src[0].to(torch.int32), src[1]]))]
    for name, change in bad:
        args = dict(sources=src, scales=scales, codes=codes, scale_outs=outs) | change
        with pytest.raises((ValueError, TypeError), match=f"^{name}: expected"):
            K.requantize_many(args["sources"], args["scales"], args["codes"], args["scale_outs"], torch.bfloat16)


def test_the_multi_tensor_cast_bumps_the_versions_of_what_it_writes():
    """The kernel writes codes and scales through their addresses; autograd's in-place check still sees
    a write (a backward that saved them before the step would otherwise read the new codes silently)."""
    pytest.importorskip("triton")
    from lowprec import kernels as K

    src = [randn(8, 16, seed=1), randn(3, 5, seed=2)]
    codes = [torch.empty(s.shape, dtype=torch.float8_e4m3fn) for s in src]
    outs = [torch.empty(1, 1) for _ in src]
    before = [t._version for t in codes + outs]
    K.requantize_many(src, torch.tensor([0.01, 0.02]), codes, outs, torch.bfloat16, backend="triton")
    assert all(t._version > v for t, v in zip(codes + outs, before))
