"""The ``fp8`` format: DeepSeek-V3's and Qwen-FP8's layout, which transformers and vLLM load.

[Note: the fp8 layout]
Each quantized linear is written as ``weight`` float8_e4m3fn ``(out, in)`` and ``weight_scale_inv`` float32
``(ceil(out/128), ceil(in/128))``, one scale per 128x128 block, a multiplier (``W ~= weight * scale``, the
same convention as lowprec's ``QuantizedTensor``); partial blocks at the edges are scaled as if padded with
zeros, which never changes a block's amax. The config says ``quant_method`` fp8, ``fmt`` e4m3, dynamic
activation scales and ``weight_block_size`` [128, 128]; the layers kept in BF16 are listed under both
``modules_to_not_convert`` (transformers reads it) and ``ignored_layers`` (vLLM reads it).

A model trained with ``fp8-blockwise`` cast its weights to exactly these blocks for its forward GEMM (E4M3,
128x128, FP32 scales from the block's amax): its codes and scales are written as they were (as trained).
Every other recipe's weights are quantized anew from the FP32 master with lowprec's quantizer.
"""
from __future__ import annotations

import torch

from lowprec import formats as F
from lowprec._checks import fail
from lowprec.export.layout import AS_TRAINED, FROM_MASTER, LayerWeight
from lowprec.quant import GranularityKind, QuantizedTensor, blockwise, quantize

BLOCK = 128
E4M3 = F.get("e4m3")
GRANULARITY = blockwise(BLOCK, BLOCK)


def quantization_config(kept: list[str]) -> dict:
    """The ``quantization_config`` of [Note: the fp8 layout]."""
    return {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
            "weight_block_size": [BLOCK, BLOCK], "modules_to_not_convert": list(kept),
            "ignored_layers": list(kept)}


def fits(q: QuantizedTensor | None, shape: torch.Size) -> bool:
    """Whether a trained weight cast is the layout's own: E4M3 in 128x128 blocks with FP32 scales."""
    return (q is not None and q.fmt is E4M3 and q.granularity.kind is GranularityKind.BLOCK
            and q.block_shape == (BLOCK, BLOCK) and q.global_scale is None and tuple(q.shape) == tuple(shape))


def blocks(q: QuantizedTensor) -> dict[str, torch.Tensor]:
    """``q`` (E4M3, 128x128) as the layout's two tensors: the codes cropped to the weight's shape, the
    scales as they are (one per block, edges included)."""
    out, inner = q.shape
    return {"weight": q.data[:out, :inner].contiguous(), "weight_scale_inv": q.scale.float().contiguous()}


def _one(master: torch.Tensor, q: QuantizedTensor | None) -> tuple[dict[str, torch.Tensor], str]:
    if fits(q, master.shape):
        return blocks(q), AS_TRAINED
    return blocks(quantize(master.float(), E4M3, GRANULARITY)), FROM_MASTER


def _experts(w: LayerWeight) -> tuple[dict[str, torch.Tensor], str]:
    """A fused experts' weight (E, out, in), each expert in its own 128x128 blocks: ``weight`` (E, out, in)
    and ``weight_scale_inv`` (E, ceil(out/128), ceil(in/128)), as transformers' FP8 experts hold them."""
    casts = w.per_expert or (None,) * w.master.shape[0]
    parts = [_one(m, q) for m, q in zip(w.master.unbind(0), casts)]
    how = AS_TRAINED if all(h == AS_TRAINED for _, h in parts) else FROM_MASTER
    return {k: torch.stack([p[k] for p, _ in parts]) for k in parts[0][0]}, how


class FP8Layout:
    """See [Note: the fp8 layout]."""

    name = "fp8"
    fused_note = ("fused experts are written as transformers' FP8 experts hold them (<proj> and <proj>_scale_inv "
                  "per expert): transformers (5.24) dequantizing on a machine without an FP8 GPU loads those "
                  "weights without their scales; load them on an FP8 GPU, or export hf")
    """What the report says when fused experts are written in this layout."""

    def write_layer(self, w: LayerWeight) -> tuple[dict[str, torch.Tensor], str]:
        if w.master.dim() == 3 and w.fused is not None and self.keeps(w) is None:
            return _experts(w)
        if w.master.dim() != 2:
            fail(f"weight {w.name!r}", "a 2-D (out, in) weight for the fp8 layout", tuple(w.master.shape))
        return _one(w.master, w.trained)

    @staticmethod
    def tensor_name(name: str, suffix: str) -> str:
        """A fused experts' tensors as transformers' FP8 experts name them: ``<proj>`` and
        ``<proj>_scale_inv``."""
        return name if suffix == "weight" else f"{name}_{suffix.removeprefix('weight_')}"

    def keeps(self, w: LayerWeight) -> str | None:
        """Fused experts transformers' FP8 experts cannot hold stay in high precision."""
        f = w.fused
        if f is None:
            return None
        if f.has_bias or f.transposed:
            return (f"transformers' FP8 experts hold (E, out, in) weights without biases: {f.experts_class}'s "
                    "fused experts stay in high precision")
        if w.name.endswith("gate_up_proj") and w.master.shape[1] <= BLOCK:
            return (f"transformers' FP8 experts hold two scale rows for gate_up_proj: its {w.master.shape[1]} "
                    f"rows fill one {BLOCK}-row block")
        return None

    def config(self, kept: list[str]) -> dict:
        return {"quantization_config": quantization_config(kept)}

    def extra_files(self, kept: list[str]) -> dict[str, bytes]:
        return {}


LAYOUTS = {("fp8", None): FP8Layout}
"""The registry's entries of this module (see ``lowprec.export.registry``)."""
