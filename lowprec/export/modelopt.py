"""NVIDIA ModelOpt's NVFP4 layout (``modelopt-nvfp4``), as TensorRT-LLM, vLLM and SGLang read it.

[Note: ModelOpt NVFP4 as its readers read it]
``hf_quant_config.json`` says ``{"producer": {...}, "quantization": {"quant_algo": ..., "kv_cache_quant_algo":
null, "group_size": 16, "exclude_modules": [kept linears]}}``; each quantized linear stores, under its module's
name, ``weight`` uint8 (out, in/2) (two E2M1 codes per byte, the even element in the low nibble),
``weight_scale`` float8_e4m3fn (out, in/16) and ``weight_scale_2`` float32 (a 0-d tensor).

``weight_scale_2`` multiplies (ModelOpt's ``amax / (6 * 448)``): it is lowprec's dequantizing global scale as
it is, no reciprocal taken. ModelOpt's reader computes ``decode * (fp32(weight_scale) * weight_scale_2)``: the
same two products in the same order as lowprec's ``QuantizedTensor.dequantize``, so the stored weight
dequantizes to lowprec's values bit for bit. (compressed-tensors' converter from this layout takes
``1 / weight_scale_2`` as its global scale: one FP32 rounding, see ``lowprec.export.compressed``.)

Activations: ``quant_algo`` ``NVFP4`` quantizes them too (W4A4), with a static per-layer global scale,
``input_scale = amax / (6 * 448)`` (FP32, 0-d), which only calibration gives. With each layer's input amax the
layout writes it and ``NVFP4``; without, it writes ``W4A16_NVFP4`` (weights only, which vLLM serves through
Marlin) and warns, rather than an ``input_scale`` it would have to invent.
"""
from __future__ import annotations

import importlib.metadata
import json
import warnings
from collections.abc import Callable, Mapping

import torch

from lowprec import formats as F
from lowprec._checks import describe, fail
from lowprec.export.fit import (
    Grid,
    checked_input_amax,
    coded,
    layer_input_amax,
    linear_misfit,
    stored_codes,
    stored_scale,
)
from lowprec.export.layout import LayerWeight, Layout
from lowprec.quant import nvfp4

GRID = Grid(F.get("e2m1"), nvfp4(16))
"""E2M1 in 1x16 blocks under E4M3 scales and an FP32 global scale; masters are quantized in 1x16 blocks."""
GROUP = 16
_NVFP4_MAX = 448.0 * 6.0
CONFIG_FILE = "hf_quant_config.json"


def input_scale(amax: float) -> torch.Tensor:
    """ModelOpt's static activation scale ``fp32(amax / (6 * 448))`` (0-d): the activations' global scale,
    dequantizing like ``weight_scale_2``."""
    if not isinstance(amax, (int, float)) or not amax > 0 or amax == float("inf"):
        fail("input_amax", "a finite positive number per layer", describe(amax))
    return torch.tensor(float(amax), dtype=torch.float32) / torch.tensor(_NVFP4_MAX)


def _producer() -> dict:
    try:
        version = importlib.metadata.version("lowprec")
    except importlib.metadata.PackageNotFoundError:  # run from a source tree that is not installed
        version = "unknown"
    return {"name": "lowprec", "version": version}


class ModelOptNvfp4Layout:
    """ModelOpt NVFP4 (see [Note: ModelOpt NVFP4 as its readers read it])."""

    name = "modelopt-nvfp4"
    calibrates = True
    """Its activations take a calibrated global scale (``input_amax``, written as ``input_scale``)."""

    def __init__(self, input_amax: Mapping[str, float] | None = None) -> None:
        self.input_amax = checked_input_amax(input_amax)
        """Each quantized linear's calibrated input amax (W4A4), or None (weights only)."""

    @property
    def quant_algo(self) -> str:
        return "NVFP4" if self.input_amax is not None else "W4A16_NVFP4"

    def keeps(self, w: LayerWeight) -> str | None:
        """Why ModelOpt's NVFP4 cannot hold ``w`` (its readers need whole 16-element groups along ``in``)."""
        return linear_misfit(w, "ModelOpt NVFP4", GROUP, "ModelOpt NVFP4")

    def write_layer(self, w: LayerWeight) -> tuple[dict[str, torch.Tensor], str]:
        """``weight``, ``weight_scale``, ``weight_scale_2`` (and ``input_scale`` with calibration)."""
        why = self.keeps(w)
        if why is not None:
            fail("w", "a weight ModelOpt NVFP4 can hold", why)
        c = coded(w, GRID)
        out = {"weight": stored_codes(c), "weight_scale": stored_scale(c, GRID.granularity.scale_format),
               "weight_scale_2": c.global_scale.reshape(()).float().clone()}
        if self.input_amax is not None:
            out["input_scale"] = input_scale(layer_input_amax(self.input_amax, w.name))
        return out, c.how

    def config(self, kept: list[str]) -> dict:
        """Nothing in ``config.json``: ModelOpt's readers take ``hf_quant_config.json``."""
        return {}

    def extra_files(self, kept: list[str]) -> dict[str, bytes]:
        """``hf_quant_config.json``, naming the ``kept`` linears in ``exclude_modules``."""
        if self.input_amax is None:
            warnings.warn("lowprec: ModelOpt NVFP4 written weight-only (W4A16_NVFP4): W4A4 needs each layer's "
                          "calibrated input amax (calibrate=...)", stacklevel=2)
        quantization = {"quant_algo": self.quant_algo, "kv_cache_quant_algo": None, "group_size": GROUP,
                        "exclude_modules": list(kept)}
        text = json.dumps({"producer": _producer(), "quantization": quantization}, indent=2) + "\n"
        return {CONFIG_FILE: text.encode()}


LAYOUTS: dict[tuple[str, str | None], Callable[..., Layout]] = {("modelopt-nvfp4", None): ModelOptNvfp4Layout}
"""The layout by ``(format, scheme)``, for the export to register."""
