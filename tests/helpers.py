"""Helpers shared by the whole test suite: signal-to-quantization-noise ratio and its named floors, and the
benchmark scripts loaded as modules.

[Note: SQNR floors]
A floor is the least SQNR a quantize -> dequantize round trip must keep on ``torch.randn`` data
(1024 x 1024, float32). Each was measured with round-to-nearest onto the element format and the
format's usual scaling, and set a few dB below the measurement, so a test fails on a real loss of
accuracy but not on a change of seed. Tests of a whole GEMM compare against these too.
"""
from __future__ import annotations

import importlib.util
import math
import sys
from pathlib import Path
from types import ModuleType

import pytest
import torch

SQNR_FLOORS: dict[str, float] = {
    "fp8_e4m3_cast": 25.0,  # per-tensor amax scale onto E4M3 (3 mantissa bits): measured 31.6 dB
    "fp8_e5m2_cast": 22.0,  # per-tensor amax scale onto E5M2 (2 mantissa bits): measured 25.6 dB
    "mxfp8": 18.0,  # E4M3 in 32-blocks, E8M0 scale: measured 30.7 dB; kept at the usual MX test floor
    "mxfp6": 22.0,  # E3M2 in 32-blocks, E8M0 scale: measured 25.4 dB (E2M3: 30.9 dB), covers both
    "mxfp4": 13.0,  # E2M1 in 32-blocks, E8M0 scale: measured 18.8 dB; FP4 has one mantissa bit
    "nvfp4": 17.0,  # E2M1 in 16-blocks, E4M3 block scale and FP32 global scale: measured 20.4 dB
}

RECIPE_SQNR_FLOORS: dict[str, tuple[float, float]] = {
    # recipe: (output, gradients) of one lowprec.nn.Linear(256, 256) against a float64 F.linear on
    # randn x and dy, weights N(0, 1/256); "measured" is the lowest of eight seeds (output; dx and dw)
    "bf16": (47.0, 47.0),  # measured 50.8; 50.8
    "fp16": (65.0, 65.0),  # measured 68.8; 68.8
    "fp8-delayed": (25.0, 21.0),  # its first step is current scaling: as fp8-current
    "fp8-current": (25.0, 21.0),  # E4M3 forward, E5M2 gradients: measured 28.6; 24.5
    "fp8-rowwise": (25.0, 25.0),  # E4M3 everywhere: measured 28.6; 28.6
    "fp8-blockwise": (25.0, 25.0),  # measured 28.6; 28.6
    "mxfp8": (25.0, 25.0),  # measured 28.5; 28.4
    "mxfp4": (13.0, 25.0),  # E2M1 forward, nearest: measured 15.8 (stochastic: 12.6); MXFP8 backward 28.4
    "nvfp4": (14.0, 12.0),  # measured 16.6; 15.0 (E2M1 gradients, stochastic rounding)
}



def stochastic_forward_recipe():
    """The ``mxfp4`` preset with its forward operands rounded stochastically: a recipe whose training
    forward draws random bits (no preset's does: they round gradients only), for the tests of what such
    draws must not break (evaluation, replays, cast sharing)."""
    from dataclasses import replace

    from lowprec import recipes as R

    r = R.get("mxfp4")
    sr = replace(r.fprop.lhs, rounding="stochastic")
    return replace(r, name="mxfp4-sr-forward", fprop=replace(r.fprop, lhs=sr, rhs=sr))


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


BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


def load_benchmark(name: str, mp: pytest.MonkeyPatch) -> ModuleType:
    """``benchmarks/<name>.py`` as the module ``name``, while ``mp`` lasts: the scripts import their siblings
    (``_common``, ``_models``) by plain name, so ``benchmarks/`` goes on ``sys.path``."""
    mp.syspath_prepend(str(BENCHMARKS))
    spec = importlib.util.spec_from_file_location(name, BENCHMARKS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    mp.setitem(sys.modules, name, module)  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module
