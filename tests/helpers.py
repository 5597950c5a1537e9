"""Helpers shared by the whole test suite: signal-to-quantization-noise ratio and its named floors.

[Note: SQNR floors]
A floor is the least SQNR a quantize -> dequantize round trip must keep on ``torch.randn`` data
(1024 x 1024, float32). Each was measured with round-to-nearest onto the element format and the
format's usual scaling, and set a few dB below the measurement, so a test fails on a real loss of
accuracy but not on a change of seed. Tests of a whole GEMM compare against these too.
"""
from __future__ import annotations

import math

import torch

SQNR_FLOORS: dict[str, float] = {
    "fp8_e4m3_cast": 25.0,  # per-tensor amax scale onto E4M3 (3 mantissa bits): measured 31.6 dB
    "fp8_e5m2_cast": 22.0,  # per-tensor amax scale onto E5M2 (2 mantissa bits): measured 25.6 dB
    "mxfp8": 18.0,  # E4M3 in 32-blocks, E8M0 scale: measured 30.7 dB; kept at the usual MX test floor
    "mxfp6": 22.0,  # E3M2 in 32-blocks, E8M0 scale: measured 25.4 dB (E2M3: 30.9 dB), covers both
    "mxfp4": 13.0,  # E2M1 in 32-blocks, E8M0 scale: measured 18.8 dB; FP4 has one mantissa bit
    "nvfp4": 17.0,  # E2M1 in 16-blocks, E4M3 block scale and FP32 global scale: measured 20.4 dB
}


def sqnr(ref: torch.Tensor, test: torch.Tensor) -> float:
    """``20 * log10(||ref|| / ||ref - test||)`` in dB, computed in float64; inf when they are equal."""
    if ref.shape != test.shape:
        raise ValueError(f"ref/test: expected tensors of one shape, got {tuple(ref.shape)} and {tuple(test.shape)}")
    ref64, test64 = ref.detach().double(), test.detach().double()
    noise = torch.linalg.vector_norm(ref64 - test64).item()
    signal = torch.linalg.vector_norm(ref64).item()
    if noise == 0.0:
        return math.inf
    if signal == 0.0:
        return -math.inf
    return 20.0 * math.log10(signal / noise)
