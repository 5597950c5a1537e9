"""The compressed-tensors layout (vLLM, SGLang and transformers read it): one scheme per export.

[Note: compressed-tensors as its readers read it]
``config.json`` carries ``quantization_config = {"quant_method": "compressed-tensors", "format": ...,
"config_groups": {"group_0": {"targets": ["Linear"], "weights": ..., "input_activations": ...}}, "ignore":
[kept linears]}``; each quantized linear stores, under its module's name:

============  =====================  ==========================================================================
scheme        format                 tensors
============  =====================  ==========================================================================
fp8-dynamic   float-quantized        ``weight`` float8_e4m3fn (out, in); ``weight_scale`` float32 (out, 1)
fp8-block     float-quantized        ``weight`` float8_e4m3fn; ``weight_scale`` float32 (ceil(out/128), in/128)
mxfp8         mxfp8-quantized        ``weight`` float8_e4m3fn; ``weight_scale`` uint8 E8M0 codes (out, in/32)
mxfp4         mxfp4-pack-quantized   ``weight_packed`` uint8 (out, in/2); ``weight_scale`` uint8 E8M0 (out, in/32)
nvfp4         nvfp4-pack-quantized   ``weight_packed`` uint8 (out, in/2); ``weight_scale`` float8_e4m3fn
                                     (out, in/16); ``weight_global_scale`` float32 (1,)
============  =====================  ==========================================================================

What the reader computes, and how close it is to lowprec's own dequantization ``decode * scale`` (float32):

* FP8 schemes: ``weight.to(scale.dtype) * scale``. The scales are written as float32, so a reader that keeps
  them in float32 (vLLM; transformers loading with ``dequantize=True``) computes lowprec's product exactly.
  transformers' compressed modules hold scales in the model's dtype: loading into a bfloat16 model rounds each
  FP32 scale to bfloat16 once.
* MX schemes: ``2^(code - 127)`` in bfloat16 times the element: a power of two times an FP8/FP4 value, exact.
* nvfp4: compressed-tensors' global scale divides, ``decode * (s / G)``; lowprec's global scale ``g``
  multiplies (``decode * (s * g)``). The layout writes ``G = fp32(1 / g)`` (one rounding, exact when ``g`` is
  a power of two). ``fp32(s / G)`` equals lowprec's ``fp32(s * g)`` when ``g`` is a power of two; otherwise it
  can be one FP32 rounding away from it (one unit in the last place of the block's effective scale). The
  codes, block scales and ``1 / G`` read back exactly. The decompressed weight is bfloat16 (its FP4 unpacking
  is bfloat16), the rounding lowprec's ``dequantize(torch.bfloat16)`` makes too.

Activations are quantized by the reader at run time (``dynamic``). NVFP4 activations also need a calibrated
global scale (``input_global_scale``, ``448 * 6 / amax``): given the layers' input amax the layout writes it
and the W4A4 scheme; without, it writes the weight-only scheme (NVFP4A16) and warns.
"""
from __future__ import annotations

import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from functools import partial

import torch

from lowprec import formats as F
from lowprec._checks import check_choice, describe, fail
from lowprec.export.fit import (
    Coded,
    Grid,
    checked_input_amax,
    coded,
    layer_input_amax,
    linear_misfit,
    stored_codes,
    stored_scale,
)
from lowprec.export.layout import LayerWeight, Layout
from lowprec.quant import blockwise, mx, nvfp4, rowwise

_NVFP4_GLOBAL = 448.0 * 6.0
"""E4M3's largest times E2M1's: compressed-tensors' global scale is this over the tensor's amax."""


def _float_args(bits: int, strategy: str, dynamic: bool | str, **extra) -> dict:
    """One ``QuantizationArgs`` as ``config.json`` holds it: a symmetric float quantization."""
    return {"num_bits": bits, "type": "float", "symmetric": True, "strategy": strategy, "dynamic": dynamic, **extra}


@dataclass(frozen=True, slots=True)
class Scheme:
    """One compressed-tensors scheme: its format, the grid its weights are on, and its config arguments."""

    name: str
    format: str
    """compressed-tensors' ``CompressionFormat`` value."""
    grid: Grid
    weights: dict
    input_activations: dict | None
    """The activations' arguments (None: weight-only)."""
    min_multiple: int = 1
    """``in`` must be a multiple of this for the scheme's readers (its blocks along ``in``)."""


_E8M0 = {"scale_dtype": "torch.uint8", "zp_dtype": "torch.uint8"}
_E4M3 = {"scale_dtype": "torch.float8_e4m3fn", "zp_dtype": "torch.float8_e4m3fn"}

SCHEMES: dict[str, Scheme] = {s.name: s for s in (
    Scheme("fp8-dynamic", "float-quantized", Grid(F.get("e4m3"), rowwise()),
           _float_args(8, "channel", False), _float_args(8, "token", True)),
    Scheme("fp8-block", "float-quantized", Grid(F.get("e4m3"), blockwise(128, 128)),
           _float_args(8, "block", False, block_structure=[128, 128]),
           _float_args(8, "group", True, group_size=128), min_multiple=128),
    Scheme("mxfp8", "mxfp8-quantized", Grid(F.get("e4m3"), mx(32, "ceil")),
           _float_args(8, "group", False, group_size=32, **_E8M0),
           _float_args(8, "group", True, group_size=32, **_E8M0), min_multiple=32),
    Scheme("mxfp4", "mxfp4-pack-quantized", Grid(F.get("e2m1"), mx(32, "ceil")),
           _float_args(4, "group", False, group_size=32, **_E8M0),
           _float_args(4, "group", True, group_size=32, **_E8M0), min_multiple=32),
    Scheme("nvfp4", "nvfp4-pack-quantized", Grid(F.get("e2m1"), nvfp4(16)),
           _float_args(4, "tensor_group", False, group_size=16, **_E4M3),
           _float_args(4, "tensor_group", "local", group_size=16, **_E4M3), min_multiple=16),
)}
"""The schemes by name. Masters are quantized with lowprec's rule for that format: MX scales rounded up (the
mxfp8 and mxfp4 recipes'), NVFP4 in 1x16 blocks (the blocks the format stores)."""


def nvfp4_input_global_scale(amax: float) -> torch.Tensor:
    """compressed-tensors' activation global scale ``fp32(448 * 6 / amax)``, shape (1,): one rounding, as
    compressed-tensors computes its own from an observed amax."""
    if not isinstance(amax, (int, float)) or not amax > 0 or amax == float("inf"):
        fail("input_amax", "a finite positive number per layer", describe(amax))
    return torch.full((1,), _NVFP4_GLOBAL) / torch.full((1,), float(amax))


class CompressedTensorsLayout:
    """compressed-tensors in one scheme (see [Note: compressed-tensors as its readers read it])."""

    name = "compressed-tensors"

    def __init__(self, scheme: str, input_amax: Mapping[str, float] | None = None) -> None:
        check_choice("scheme", scheme, list(SCHEMES))
        self.scheme = SCHEMES[scheme]
        self.input_amax = checked_input_amax(input_amax)
        """NVFP4 only: each quantized linear's calibrated input amax, for its activations' global scale."""

    @property
    def calibrates(self) -> bool:
        """Whether the scheme's activations take a calibrated scale (``input_amax``): NVFP4's global scale.
        The other schemes quantize activations at run time (dynamic)."""
        return self.scheme.name == "nvfp4"

    @property
    def _static_inputs(self) -> bool:
        """NVFP4 with calibrated activations (W4A4); without them the scheme is written weight-only."""
        return self.calibrates and self.input_amax is not None

    def keeps(self, w: LayerWeight) -> str | None:
        """Why this scheme cannot hold ``w`` (its readers need whole blocks along ``in``), or None."""
        return linear_misfit(w, "compressed-tensors", self.scheme.min_multiple, self.scheme.name)

    def write_layer(self, w: LayerWeight) -> tuple[dict[str, torch.Tensor], str]:
        """The layer's tensors by suffix, and whether they are the trained codes or the master's."""
        why = self.keeps(w)
        if why is not None:
            fail("w", f"a weight the {self.scheme.name} scheme can hold", why)
        c = coded(w, self.scheme.grid)
        out = {**self._codes(c), "weight_scale": stored_scale(c, self.scheme.grid.granularity.scale_format)}
        if c.global_scale is not None:
            # the reader divides by it: the reciprocal of lowprec's dequantizing global scale (one FP32 rounding)
            out["weight_global_scale"] = torch.ones(1) / c.global_scale.reshape(1).float()
        if self._static_inputs:
            out["input_global_scale"] = nvfp4_input_global_scale(layer_input_amax(self.input_amax, w.name))
        return out, c.how

    @staticmethod
    def _codes(c: Coded) -> dict[str, torch.Tensor]:
        key = "weight" if c.codes.dtype != torch.uint8 else "weight_packed"  # FP8 as it is, FP4 packed
        return {key: stored_codes(c)}

    def config(self, kept: list[str]) -> dict:
        """What ``config.json`` gains: its ``quantization_config`` (:meth:`quantization_config`)."""
        return {"quantization_config": self.quantization_config(kept)}

    def quantization_config(self, kept: list[str]) -> dict:
        """The scheme's one config group over every ``Linear`` but the ``kept`` ones."""
        s = self.scheme
        inputs = s.input_activations
        if s.name == "nvfp4" and not self._static_inputs:
            warnings.warn("lowprec: compressed-tensors nvfp4 written weight-only (NVFP4A16): NVFP4 activations "
                          "need each layer's calibrated input amax (calibrate=...)", stacklevel=3)
            inputs = None
        group = {"targets": ["Linear"], "weights": dict(s.weights),
                 "input_activations": None if inputs is None else dict(inputs), "output_activations": None}
        return {"quant_method": "compressed-tensors", "format": s.format, "quantization_status": "compressed",
                "config_groups": {"group_0": group}, "ignore": list(kept), "kv_cache_scheme": None}

    def extra_files(self, kept: list[str]) -> dict[str, bytes]:
        """None: compressed-tensors reads ``config.json`` alone."""
        return {}


def _factory(scheme: str) -> Callable[..., Layout]:
    return partial(CompressedTensorsLayout, scheme)


LAYOUTS: dict[tuple[str, str | None], Callable[..., Layout]] = {
    ("compressed-tensors", name): _factory(name) for name in SCHEMES
}
"""Each scheme's layout by ``(format, scheme)``, for the export to register."""
