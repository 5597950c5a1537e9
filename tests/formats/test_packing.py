"""FP4 (two codes per byte, low nibble first) and FP6 (four codes in three bytes) packing."""
from __future__ import annotations

import pytest
import torch

from lowprec import formats as F


@pytest.mark.parametrize("name, shape", [("e2m1", (16,)), ("e2m1", (3, 8)), ("int4", (2, 3, 4)),
                                         ("e3m2", (12,)), ("e2m3", (5, 8)), ("e3m2", (2, 2, 4))])
def test_round_trip_on_random_codes(name, shape):
    bits = F.get(name).bits
    g = torch.Generator().manual_seed(21)
    codes = torch.randint(0, 2**bits, shape, generator=g, dtype=torch.uint8)
    packed = F.pack(codes, name)
    assert packed.dtype == torch.uint8
    assert packed.shape == (*shape[:-1], shape[-1] * bits // 8)
    assert torch.equal(F.unpack(packed, name), codes)


@pytest.mark.parametrize("name", ["e2m1", "e3m2"])
def test_every_code_survives_in_every_slot(name):
    bits = F.get(name).bits
    codes = torch.arange(2**bits, dtype=torch.uint8)
    # rows of 4 (two FP4 bytes, one FP6 group); row r holds code r - k in slot k: every code in every slot
    slots = torch.stack([codes.roll(k) for k in range(4)], dim=-1)  # (2**bits, 4)
    assert torch.equal(F.unpack(F.pack(slots, name), name), slots)


def test_fp4_layout_low_nibble_first():
    codes = torch.tensor([0x1, 0x2, 0xF, 0x7, 0x0, 0x8], dtype=torch.uint8)
    assert F.pack(codes, "e2m1").tolist() == [0x21, 0x7F, 0x80]
    assert F.unpack(torch.tensor([0xA5], dtype=torch.uint8), "e2m1").tolist() == [0x5, 0xA]


def test_fp4_layout_is_torchs_float4_e2m1fn_x2():
    # torch documents float4_e2m1fn_x2 as two values per byte, the first in bits 3..0 and the second
    # in bits 7..4; torch cannot convert it on CPU, so the check is on the bytes it holds.
    if not hasattr(torch, "float4_e2m1fn_x2"):
        pytest.skip("this torch has no float4_e2m1fn_x2")
    values = torch.tensor([[0.5, -6.0, 1.0, 3.0]])  # codes 0x1, 0xF, 0x2, 0x5
    packed = F.pack(F.encode(values, "e2m1"), "e2m1")
    as_torch = packed.view(torch.float4_e2m1fn_x2)
    assert as_torch.shape == (1, 2)
    assert as_torch.view(torch.uint8).tolist() == [[0xF1, 0x52]]


def test_fp6_layout_by_hand():
    # code i sits in bits 6i..6i+5 of a little-endian 24-bit word:
    # 0x01 | 0x02 << 6 | 0x03 << 12 | 0x3F << 18 = 0xFC3081 -> bytes 0x81, 0x30, 0xFC
    codes = torch.tensor([0x01, 0x02, 0x03, 0x3F, 0x3F, 0x00, 0x00, 0x00], dtype=torch.uint8)
    assert F.pack(codes, "e3m2").tolist() == [0x81, 0x30, 0xFC, 0x3F, 0x00, 0x00]
    assert F.unpack(torch.tensor([0x00, 0x00, 0xFC], dtype=torch.uint8), "e2m3").tolist() == [0, 0, 0, 0x3F]


def test_eight_bit_formats_pack_to_themselves():
    codes = torch.arange(256, dtype=torch.uint8)
    assert torch.equal(F.pack(codes, "e4m3"), codes)
    assert torch.equal(F.unpack(codes, "e4m3"), codes)


@pytest.mark.parametrize("fn, name, shape, match", [
    (F.pack, "e2m1", (3,), "^codes: expected an even last dimension"),
    (F.pack, "e2m1", (4, 5), "^codes: expected an even last dimension"),
    (F.pack, "e3m2", (6,), "^codes: expected a last dimension divisible by 4"),
    (F.pack, "e2m1", (), "^codes: expected a tensor with a last dimension"),
    (F.unpack, "e3m2", (4,), "^packed: expected a last dimension divisible by 3"),
    (F.unpack, "e2m1", (), "^packed: expected a tensor with a last dimension"),
    (F.unpack, "e3m2", (), "^packed: expected a tensor with a last dimension"),
])
def test_bad_shapes_raise(fn, name, shape, match):
    with pytest.raises(ValueError, match=match):
        fn(torch.zeros(shape, dtype=torch.uint8), name)


def test_bad_codes_and_formats_raise():
    with pytest.raises(ValueError, match="^codes: expected values below 16"):
        F.pack(torch.tensor([1, 16], dtype=torch.uint8), "e2m1")
    with pytest.raises(TypeError, match="^codes: expected a uint8 tensor"):
        F.pack(torch.tensor([1, 2]), "e2m1")
    with pytest.raises(TypeError, match="^packed: expected a uint8 tensor"):
        F.unpack(torch.tensor([1, 2]), "e2m1")
    with pytest.raises(ValueError, match="^fmt: expected a format of 4, 6 or 8 bits"):
        F.unpack(torch.zeros(2, dtype=torch.uint8), "bf16")
    with pytest.raises(TypeError, match="^codes: expected an int32 or int64 tensor of fp16 codes"):
        F.pack(torch.zeros(2, dtype=torch.uint8), "fp16")
