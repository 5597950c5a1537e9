"""GPT-OSS's ``mxfp4`` layout: MoE experts in MXFP4, everything else in high precision.

[Note: GPT-OSS mxfp4 as its readers read it]
``config.json`` says ``quantization_config = {"quant_method": "mxfp4", "modules_to_not_convert": [...]}``. Only
the routed experts are quantized: a fused expert weight ``<experts>.<proj>`` of lowprec's shape
``(E, out, in)`` is stored as ``<experts>.<proj>_blocks`` uint8 ``(E, out, in/32, 16)`` (each 32-element block
of E2M1 codes in 16 bytes, the even element in the low nibble) and ``<experts>.<proj>_scales`` uint8
``(E, out, in/32)``, E8M0 codes (``2^(code - 127)``). transformers unpacks ``byte & 0xF`` first, multiplies by
``ldexp(value, code - 127)`` (exact) in the model's dtype and transposes to its ``(E, in, out)`` parameter; so
the stored experts dequantize to lowprec's values bit for bit (a bfloat16 model rounds them as lowprec's
``dequantize(torch.bfloat16)`` does: a power of two times an E2M1 value is exact there).

GPT-OSS's ``gate_up_proj`` interleaves its two halves along ``out`` (gate in the even rows, up in the odd):
the walk that builds the master lays it out so. Dense linears (attention, the router, the LM head) are not
quantized in this layout: :meth:`GptOssMxfp4Layout.keeps` keeps them, and they are written in BF16.
"""
from __future__ import annotations

from collections.abc import Callable

import torch

from lowprec import formats as F
from lowprec._checks import fail
from lowprec.export.fit import Grid, coded, stored_codes, stored_scale
from lowprec.export.layout import LayerWeight, Layout
from lowprec.quant import mx

GRID = Grid(F.get("e2m1"), mx(32, "ceil"))
"""E2M1 in 1x32 blocks under E8M0 scales; masters are quantized with scales rounded up (the mxfp4 recipe's)."""
BLOCK = 32
SUFFIXES = ("blocks", "scales")
READ_BY = "GptOssExperts"
"""The experts class transformers' mxfp4 loader replaces (it converts GPT-OSS MLPs and no other)."""


def checkpoint_key(name: str, suffix: str) -> str:
    """The key GPT-OSS checkpoints store a tensor of ``write_layer`` under: the fused weight's name and the
    suffix joined by ``_`` (``model.layers.0.mlp.experts.gate_up_proj_blocks``)."""
    return f"{name}_{suffix}"


def experts_module(name: str) -> str:
    """The experts module a fused expert weight ``<experts>.<proj>`` belongs to (what transformers matches
    ``modules_to_not_convert`` against)."""
    return name.rsplit(".", 1)[0] if "." in name else name


class GptOssMxfp4Layout:
    """GPT-OSS mxfp4 (see [Note: GPT-OSS mxfp4 as its readers read it])."""

    name = "mxfp4"
    tensor_name = staticmethod(checkpoint_key)
    """How the export names a tensor of :meth:`write_layer` (``_`` instead of ``.`` between name and suffix)."""

    def keeps(self, w: LayerWeight) -> str | None:
        """Why the layout writes ``w`` in high precision: it quantizes routed experts only, in whole blocks."""
        if w.master.dim() != 3:
            return "GPT-OSS's mxfp4 layout quantizes MoE experts only: a dense linear stays in high precision"
        if w.fused is not None and w.fused.experts_class != READ_BY:
            return (f"transformers reads the mxfp4 layout into {READ_BY} only: {w.fused.experts_class}'s "
                    "fused experts stay in high precision")
        if w.master.shape[-1] % BLOCK:
            return f"GPT-OSS's mxfp4 blocks need in_features a multiple of {BLOCK}, got {w.master.shape[-1]}"
        return None

    def write_layer(self, w: LayerWeight) -> tuple[dict[str, torch.Tensor], str]:
        """``blocks`` and ``scales`` of the experts' weight ``(E, out, in)``; see :func:`checkpoint_key`."""
        why = self.keeps(w)
        if why is not None:
            fail("w", "fused experts GPT-OSS's mxfp4 layout can hold", why)
        e, out, cols = w.master.shape
        c = coded(w, GRID)  # the 2-D view (E * out, in): MX blocks never cross a row, so experts stay apart
        blocks = stored_codes(c).view(e, out, cols // BLOCK, BLOCK // 2)
        scales = stored_scale(c, GRID.granularity.scale_format).view(e, out, cols // BLOCK)
        return {"blocks": blocks, "scales": scales}, c.how

    def config(self, kept: list[str]) -> dict:
        """What ``config.json`` gains: its ``quantization_config`` (:meth:`quantization_config`)."""
        return {"quantization_config": self.quantization_config(kept)}

    def quantization_config(self, kept: list[str]) -> dict:
        """The method, and the modules written in high precision (a kept expert weight by its experts module,
        the unit transformers converts)."""
        names = [experts_module(n) if experts_module(n).endswith("experts") else n for n in kept]
        return {"quant_method": "mxfp4", "modules_to_not_convert": list(dict.fromkeys(names))}

    def extra_files(self, kept: list[str]) -> dict[str, bytes]:
        """None: transformers reads ``config.json`` alone."""
        return {}


LAYOUTS: dict[tuple[str, str | None], Callable[..., Layout]] = {("mxfp4", None): GptOssMxfp4Layout}
"""The layout by ``(format, scheme)``, for the export to register."""
