"""Bad input is refused with an error that names the argument, what was expected and what came."""
from __future__ import annotations

import pytest
import torch

from lowprec import formats as F

X = torch.tensor([1.0, 2.0])


@pytest.mark.parametrize("x, got", [
    (torch.tensor([1, 2]), "torch.int64"),
    (torch.tensor([1, 2], dtype=torch.int32), "torch.int32"),
    (torch.tensor([1 + 2j]), "torch.complex64"),
    (torch.tensor([True]), "torch.bool"),
    (torch.tensor([1.0]).to(torch.float8_e4m3fn), "torch.float8_e4m3fn"),  # storage, not values
    ([1.0, 2.0], "list"),
])
def test_round_to_refuses_non_float_x(x, got):
    with pytest.raises(TypeError, match=f"^x: expected .*got .*{got}"):
        F.round_to(x, "e4m3")
    with pytest.raises(TypeError, match="^x: expected"):
        F.encode(x, "e4m3")


@pytest.mark.parametrize("fmt, exc, got", [("e9m9", ValueError, "'e9m9'"), ("", ValueError, "''"),
                                           (8, TypeError, "8 \\(int\\)"), (None, TypeError, "None")])
def test_unknown_formats(fmt, exc, got):
    with pytest.raises(exc, match=f"^fmt: expected .*got {got}"):
        F.get(fmt)
    with pytest.raises(exc, match="^fmt: expected"):
        F.round_to(X, fmt)
    with pytest.raises(exc, match="^fmt: expected"):
        F.decode(torch.zeros(2, dtype=torch.uint8), fmt)


def test_unknown_format_lists_the_known_ones():
    with pytest.raises(ValueError, match="e4m3, e5m2"):
        F.get("fp7")


def test_unknown_rounding():
    with pytest.raises(ValueError, match="^rounding: expected one of 'nearest', 'stochastic', got 'up'"):
        F.round_to(X, "e4m3", rounding="up")


@pytest.mark.parametrize("rand, exc, got", [
    (torch.rand(3), ValueError, r"shape \(3,\)"),
    (torch.rand(2, 1), ValueError, r"shape \(2, 1\)"),
    (torch.rand(2, dtype=torch.float64), ValueError, "torch.float64"),
    ([0.1, 0.2], TypeError, "list"),
])
def test_wrong_rand(rand, exc, got):
    with pytest.raises(exc, match=rf"^rand: expected a float32 tensor of shape \(2,\), got .*{got}"):
        F.round_to(X, "e4m3", "stochastic", rand=rand)


@pytest.mark.parametrize("name, codes, got", [
    ("e2m1", [0, 16], "max 16"), ("e3m2", [64], "max 64"), ("int4", [255], "max 255"),
])
def test_small_codes_out_of_range(name, codes, got):
    with pytest.raises(ValueError, match=f"^codes: expected values below {2 ** F.get(name).bits} .*got {got}"):
        F.decode(torch.tensor(codes, dtype=torch.uint8), name)


@pytest.mark.parametrize("name, codes", [("fp16", [70000]), ("bf16", [-1]), ("tf32", [2**19]),
                                         ("fp32", [2**32])])
def test_wide_codes_out_of_range(name, codes):
    bits = F.get(name).bits
    with pytest.raises(ValueError, match=rf"^codes: expected values in \[0, 2\^{bits}\)"):
        F.decode(torch.tensor(codes), name)


@pytest.mark.parametrize("name, codes, got", [
    ("e4m3", torch.zeros(2, dtype=torch.int64), "torch.int64"),
    ("e4m3", torch.zeros(2).to(torch.float8_e5m2), "torch.float8_e5m2"),  # another format's bits
    ("e2m1", torch.zeros(2).to(torch.float8_e4m3fn), "torch.float8_e4m3fn"),
    ("e4m3", torch.zeros(2, dtype=torch.int8), "torch.int8"),
    ("e4m3", torch.zeros(2), "torch.float32"),
    ("fp16", torch.zeros(2, dtype=torch.uint8), "torch.uint8"),
    ("e4m3", [1, 2], "list"),
])
def test_codes_of_the_wrong_dtype(name, codes, got):
    with pytest.raises(TypeError, match=f"^codes: expected .*got .*{got}"):
        F.decode(codes, name)


def test_decode_table_only_for_small_formats():
    with pytest.raises(ValueError, match="^fmt: expected a format of 8 bits or fewer, got bf16"):
        F.decode_table("bf16")


def test_round_to_leaves_its_input_alone():
    x = torch.tensor([1.3, -500.0, float("inf")])
    before = x.clone()
    F.round_to(x, "e4m3")
    F.round_to(x, "e4m3", "stochastic", generator=torch.Generator().manual_seed(0))
    assert torch.equal(x, before)
