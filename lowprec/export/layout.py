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

AS_TRAINED = "as trained"
"""The layer's weight was written with the codes and scales training used: no second rounding."""
FROM_MASTER = "from the FP32 master"
"""The layer's weight was quantized anew from the FP32 master weight (the recipe's weight cast does not fit the
format)."""


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
