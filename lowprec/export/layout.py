"""What every export format implements: how one linear's weight is written, and what the model's config says.

[Note: export layouts]
An export walks the model once and hands each format a :class:`LayerWeight` per linear it may quantize (the
Hugging Face module name, the FP32 master, and the recipe's own quantized weight when training had one). The
format answers with the tensors to write under that module's name and how it made them: the trained codes as
they were (:data:`AS_TRAINED`), or a fresh quantization of the FP32 master (:data:`FROM_MASTER`). Layers the
format keeps in high precision (embeddings, norms, the LM head, routers, layers the recipe kept) are written
as BF16 ``weight`` and listed in the config the format writes, under the names its readers look for.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from lowprec.quant.tensor import QuantizedTensor

# [Note: fused expert weights]
# transformers 5 keeps a MoE block's routed experts as 3-D parameters of one module (``<experts>.gate_up_proj``,
# ``<experts>.down_proj``); ``lowprec.convert`` runs them through ``GroupedLinear`` under the same names. An
# export hands each such parameter to the format as one ``LayerWeight`` named by the parameter (not a module),
# its master ``(E, out, in)`` whatever the storage, and each expert's trained cast in ``per_expert``. A format
# that has a 3-D form its readers load names its tensors with ``tensor_name(name, suffix)``; a format without
# one keeps the weight (``keeps``), and it is written in BF16 under its own name, in its own storage order.

AS_TRAINED = "as trained"
"""The layer's weight was written with the codes and scales training used: no second rounding."""
FROM_MASTER = "from the FP32 master"
"""The layer's weight was quantized anew from the FP32 master weight (the recipe's weight cast does not fit the
format)."""


@dataclass(frozen=True, slots=True)
class Fused:
    """How a Hugging Face experts module holds one fused projection (see [Note: fused expert weights])."""

    experts_class: str
    """The transformers class of the experts module (``GptOssExperts``, ``MixtralExperts``)."""
    transposed: bool
    """Stored ``(E, in, out)`` (GPT-OSS) rather than ``(E, out, in)``."""
    has_bias: bool
    """The module adds a per-expert bias (``<proj>_bias``, written beside it in BF16)."""


@dataclass(frozen=True)
class LayerWeight:
    """One linear (or a group of experts) as an export format sees it."""

    name: str
    """The module's name in the exported model, e.g. ``model.layers.0.self_attn.q_proj``."""
    master: torch.Tensor
    """The FP32 master weight: ``(out, in)``, or ``(E, out, in)`` for experts."""
    trained: QuantizedTensor | None = None
    """The weight as the recipe's forward GEMM used it (cast along ``in``), or None where training had no
    quantized weight the format could take (a BF16 recipe, a Hadamard-transformed cast, a cast whose blocks
    an export re-layout would split): the format then quantizes ``master``. Layers the export keeps in high
    precision never reach :meth:`Layout.write_layer`."""
    recipe: str | None = None
    """The training recipe's name, or None."""
    fused: Fused | None = None
    """Set for a fused experts' parameter (see [Note: fused expert weights]); None for a module's linear."""
    per_expert: tuple[QuantizedTensor | None, ...] = ()
    """A fused weight's trained casts, one per expert (each ``(out, in)``; ``trained`` is then None): the
    recipe cast each expert on its own, so their scales need not make one 3-D cast."""


class Layout(Protocol):
    """An export format (see [Note: export layouts])."""

    name: str

    def write_layer(self, w: LayerWeight) -> tuple[dict[str, torch.Tensor], str]:
        """The tensors to write for ``w``, keyed by their suffix (``weight``, ``weight_scale``, ...), and how
        they were made (:data:`AS_TRAINED` or :data:`FROM_MASTER`)."""
        ...

    def config(self, kept: list[str]) -> dict:
        """What the format adds to ``config.json`` (its ``quantization_config``), ``kept`` being the names of
        the linears written in high precision."""
        ...

    def keeps(self, w: LayerWeight) -> str | None:
        """Why the format writes ``w`` in high precision although the recipe quantized it (a shape it cannot
        take, a kind of layer it does not quantize), or None. Optional: a format without it keeps none."""
        ...

    def extra_files(self, kept: list[str]) -> dict[str, bytes]:
        """Other files the format's readers need (ModelOpt's ``hf_quant_config.json``), by file name."""
        ...
