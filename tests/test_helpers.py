"""The shared test helpers: ``sqnr`` by hand, and the FP8 cast floors on the data they were set on."""
from __future__ import annotations

import math

import pytest
import torch

from lowprec import formats as F
from tests.helpers import SQNR_FLOORS, sqnr


def test_sqnr_by_hand():
    ref = torch.tensor([3.0, 4.0])  # ||ref|| = 5
    assert sqnr(ref, torch.tensor([3.0, 4.5])) == pytest.approx(20 * math.log10(5 / 0.5))  # 20 dB
    assert sqnr(ref, torch.tensor([3.0, 4.0])) == math.inf
    assert sqnr(torch.zeros(2), torch.ones(2)) == -math.inf
    assert sqnr(ref.bfloat16(), torch.tensor([3.0, 4.05])) == pytest.approx(20 * math.log10(5 / 0.05))


def test_sqnr_refuses_different_shapes():
    with pytest.raises(ValueError, match="^ref/test: expected tensors of one shape"):
        sqnr(torch.zeros(2), torch.zeros(3))


def test_floors_are_named_and_ordered():
    assert set(SQNR_FLOORS) == {"fp8_e4m3_cast", "fp8_e5m2_cast", "mxfp8", "mxfp6", "mxfp4", "nvfp4"}
    assert SQNR_FLOORS["fp8_e4m3_cast"] > SQNR_FLOORS["fp8_e5m2_cast"] > SQNR_FLOORS["nvfp4"] > SQNR_FLOORS["mxfp4"]


@pytest.mark.parametrize("name, fmt", [("fp8_e4m3_cast", "e4m3"), ("fp8_e5m2_cast", "e5m2")])
def test_fp8_cast_floors_hold_with_margin(name, fmt):
    x = torch.randn(1024, 1024, generator=torch.Generator().manual_seed(0))
    scale = x.abs().amax() / F.get(fmt).max  # dequantizing per-tensor scale
    got = sqnr(x, F.round_to(x / scale, fmt) * scale)
    assert SQNR_FLOORS[name] + 3 <= got < SQNR_FLOORS[name] + 8  # a floor, a few dB below what is measured
