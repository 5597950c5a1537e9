"""QuantizedTensor: a frozen holder; its storage, byte count, repr and scale codes."""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from lowprec import formats as F
from lowprec.quant import blockwise, columnwise, mx, nvfp4, quantize, rowwise, tensorwise
from tests.quant._reference import ML_DTYPES


def sample(m: int = 64, k: int = 128) -> torch.Tensor:
    return torch.randn(m, k, generator=torch.Generator().manual_seed(0))


def test_frozen():
    q = quantize(sample(), "e4m3", tensorwise())
    with pytest.raises(dataclasses.FrozenInstanceError):
        q.scale = torch.ones(1, 1)
    with pytest.raises(dataclasses.FrozenInstanceError):
        q.fmt = F.get("e5m2")
    with pytest.raises((AttributeError, TypeError)):  # slots: no new attributes either
        q.extra = 1


# (fmt, granularity, bytes) for a (64, 128) tensor, by hand: element bits * 8192 / 8 + scale bytes.
NBYTES = [
    ("e4m3", tensorwise(), 8192 + 4),
    ("e5m2", rowwise(), 8192 + 64 * 4),
    ("e4m3", columnwise(), 8192 + 128 * 4),
    ("e4m3", blockwise(1, 128), 8192 + 64 * 4),
    ("e4m3", blockwise(128, 128), 16384 + 4),  # 64 rows padded to 128: the padding is stored too
    ("e4m3", mx(32), 8192 + 64 * 4),  # one E8M0 byte per 32 elements
    ("e3m2", mx(32), 8192 * 6 // 8 + 64 * 4),  # FP6: four codes in three bytes
    ("e2m1", mx(32), 8192 // 2 + 64 * 4),  # FP4: half a byte per element
    ("e2m1", nvfp4(16), 8192 // 2 + 64 * 8 + 4),  # E4M3 byte per 16 elements, FP32 global scale
    ("e2m1", nvfp4(16, two_d=True), 8192 // 2 + 4 * 8 + 4),
]


@pytest.mark.parametrize(("fmt", "g", "nbytes"), NBYTES, ids=[f"{f}-{g}" for f, g, _ in NBYTES])
def test_nbytes(fmt, g, nbytes):
    assert quantize(sample(), fmt, g).nbytes == nbytes


@pytest.mark.parametrize(("fmt", "bits"), [("e2m1", 4), ("e3m2", 6), ("e2m3", 6)])
def test_nbytes_is_the_packed_size_plus_scales(fmt, bits):
    q = quantize(sample(), fmt, mx(32))
    assert q.data.dtype == torch.uint8 and int(q.data.max()) < 2**bits  # one code per byte in memory
    packed = F.pack(q.data, fmt)
    assert packed.numel() == q.data.numel() * bits // 8
    assert q.nbytes == packed.numel() + q.scale.numel()
    assert torch.equal(F.unpack(packed, fmt), q.data)


@pytest.mark.parametrize(("fmt", "dtype"), [("e4m3", torch.float8_e4m3fn), ("e5m2", torch.float8_e5m2),
                                            ("e3m2", torch.uint8), ("e2m1", torch.uint8), ("int8", torch.int8)])
def test_storage_dtype(fmt, dtype):
    g = tensorwise() if fmt == "int8" else mx(32)
    q = quantize(sample(), fmt, g)
    assert q.data.dtype == dtype and q.data.shape == (64, 128) and q.scale.dtype == torch.float32


def test_int8_tensorwise_is_symmetric_rounding_to_integers():
    x = torch.tensor([[127.0, -63.4, 0.5, 1.5, -127.0]])
    q = quantize(x, "int8", tensorwise())
    assert q.scale.item() == 1.0
    assert q.data.tolist() == [[127, -63, 0, 2, -127]]  # half to even


def test_repr():
    q = quantize(torch.randn(3, 5, 37).to(torch.bfloat16), "e2m1", nvfp4(16, two_d=True))
    assert repr(q) == ("QuantizedTensor(shape=(3, 5, 37), fmt=e2m1, granularity=nvfp4-16x16, "
                       "dtype=torch.bfloat16, device=cpu)")
    assert "granularity=mx32-ceil" in repr(quantize(sample(), "e4m3", mx(32, "ceil")))
    assert "granularity=block1x128" in repr(quantize(sample(), "e4m3", blockwise(1, 128)))
    assert "granularity=row" in repr(quantize(sample(), "e4m3", rowwise()))


def test_scale_codes():
    x = sample()
    fp32 = quantize(x, "e4m3", rowwise())
    assert torch.equal(fp32.scale_codes(), fp32.scale)
    e8m0 = quantize(x, "e4m3", mx(32))
    want = np.log2(e8m0.scale.double().numpy()) + 127  # E8M0 code = biased exponent
    np.testing.assert_array_equal(e8m0.scale_codes().numpy(), want.astype(np.uint8))
    nv = quantize(x, "e2m1", nvfp4(16))
    want = nv.scale.numpy().astype(ML_DTYPES["e4m3"]).view(np.uint8)
    np.testing.assert_array_equal(nv.scale_codes().numpy(), want)


def test_effective_scale_and_block_shape():
    nv = quantize(sample(), "e2m1", nvfp4(16, two_d=True))
    assert nv.block_shape == (16, 16) and nv.scale.shape == (4, 8)
    assert torch.equal(nv.effective_scale(), nv.scale * nv.global_scale)
    t = quantize(sample(), "e4m3", tensorwise())
    assert t.block_shape == (64, 128) and t.global_scale is None and torch.equal(t.effective_scale(), t.scale)


def test_dequantize_dtype_and_function_form():
    from lowprec.quant import dequantize, fake_quantize

    x = sample().to(torch.bfloat16)
    q = quantize(x, "e4m3", mx(32))
    assert q.dequantize().dtype == torch.bfloat16
    assert q.dequantize(torch.float16).dtype == torch.float16
    assert torch.equal(dequantize(q, torch.float32), q.dequantize(torch.float32))
    assert torch.equal(fake_quantize(x, "e4m3", mx(32)), q.dequantize())
