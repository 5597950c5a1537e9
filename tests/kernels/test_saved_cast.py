"""Saved activations (``lowprec.nn.saved``) cast on the Triton route, through the interpreter: the codes
and scales kept for backward, and so the gradients, are the reference's bit for bit."""
from __future__ import annotations

import dataclasses
import importlib

import pytest
import torch

pytest.importorskip("triton")

from lowprec.nn import SavedActivations, fp8_activations, rms_norm, swiglu
from lowprec.nn.saved import pack, unpack
from lowprec.quant import QuantizedTensor, blockwise, quantize, rowwise
from tests.kernels.test_triton_quant import assert_same, special

route_module = importlib.import_module("lowprec.kernels.route")  # the package exports a function of that name

SAVED = {"tensor": fp8_activations("tensor"), "1x128": fp8_activations("1x128"),
         "1x32-e5m2": SavedActivations(fmt="e5m2", granularity=blockwise(1, 32)),
         "row": SavedActivations(granularity=rowwise())}


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view({2: torch.int16, 4: torch.int32}[t.dtype.itemsize])


def _saved(tensors, meta) -> QuantizedTensor:
    fmt, g, shape, dtype = meta
    return QuantizedTensor(tensors[0], tensors[1], fmt, g, shape, dtype)


@pytest.mark.parametrize("name", SAVED)
@pytest.mark.parametrize("shape,dtype", [((2, 24, 256), torch.bfloat16), ((40, 200), torch.float32)], ids=str)
def test_the_triton_cast_keeps_the_references_codes_and_scales(name, shape, dtype):
    # (40, 200): a last dimension no block divides, padded by the cast; special values in every row kind
    saved = SAVED[name]
    x = special(shape[0] * (shape[1] if len(shape) == 3 else 1), shape[-1], dtype).view(shape)
    ref = quantize(x, saved.fmt, saved.granularity)
    for backend in ("triton", "torch"):
        tensors, meta = pack(x, saved, backend=backend)
        assert_same(_saved(tensors, meta), ref)
        back = unpack(tensors, meta)
        assert back.dtype == dtype and back.shape == x.shape
        assert torch.equal(_bits(back), _bits(ref.dequantize()))


@pytest.mark.parametrize("name", ["1x128", "1x32-e5m2"])
@pytest.mark.parametrize("shape", [(2, 24, 256), (40, 200), (6, 64)], ids=str)
def test_the_fused_unpack_equals_the_reference(name, shape):
    """The eager backward's one-pass dequantization (``triton_dequant``): the reference's BF16 bits, on
    special values (NaN, infinities, subnormal products, the format's extremes) and ragged widths."""
    saved = SAVED[name]
    x = special(shape[0] * (shape[1] if len(shape) == 3 else 1), shape[-1], torch.bfloat16).view(shape)
    tensors, meta = pack(x, saved, backend="torch")
    got, want = unpack(tensors, meta, backend="triton"), unpack(tensors, meta, backend="torch")
    assert got.dtype == want.dtype == torch.bfloat16 and got.shape == want.shape == x.shape
    nan = torch.isnan(want)
    assert nan.any() and torch.equal(torch.isnan(got), nan)  # a NaN's payload is the device's, not the format's
    assert torch.equal(_bits(got)[~nan], _bits(want)[~nan])


def test_an_empty_tensor_packs_as_the_reference_does():
    x = torch.empty(0, 128, dtype=torch.bfloat16)
    tensors, meta = pack(x, SAVED["1x128"], backend="triton")
    assert_same(_saved(tensors, meta), quantize(x, "e4m3", blockwise(1, 128)))


def _grads(saved):
    g = torch.Generator().manual_seed(5)
    x, w, gate, up, dy = (torch.randn(3, 16, 256, generator=g).bfloat16() for _ in range(5))
    leaves = [t.clone().requires_grad_() for t in (x, w[0, 0], gate, up)]
    y = rms_norm(leaves[0], leaves[1], 1e-6, saved) + swiglu(leaves[2], leaves[3], saved)
    y.backward(dy)
    return [t.grad for t in leaves]


@pytest.mark.parametrize("name", ["tensor", "1x128"])
def test_norm_and_swiglu_take_the_triton_route_where_the_device_runs_it(name, monkeypatch):
    want = _grads(SAVED[name])  # the CPU's route: the reference
    seen = []
    real = route_module.route

    def spy(*args, **kw):
        seen.append(r := real(*args, **kw))
        return r

    cpu = route_module.capability("cpu")
    monkeypatch.setattr(route_module, "capability", lambda device: dataclasses.replace(cpu, triton=True))
    monkeypatch.setattr("lowprec.kernels.route", spy)
    got = _grads(SAVED[name])
    assert seen and all(r.backend_k is route_module.Backend.TRITON for r in seen)
    for a, b in zip(got, want, strict=True):
        assert torch.equal(_bits(a), _bits(b))
