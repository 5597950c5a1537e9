"""The ``hf`` format: a plain BF16 Hugging Face model, every weight rounded to nearest from its FP32 master."""
from __future__ import annotations

import torch

from lowprec.export.layout import FROM_MASTER, LayerWeight


class HFLayout:
    """Every linear written as a BF16 ``weight``; nothing added to the config (see [Note: export layouts])."""

    name = "hf"

    def write_layer(self, w: LayerWeight) -> tuple[dict[str, torch.Tensor], str]:
        return {"weight": w.master.to(torch.bfloat16)}, FROM_MASTER

    def keeps(self, w: LayerWeight) -> str | None:
        return None

    def config(self, kept: list[str]) -> dict:
        return {}

    def extra_files(self, kept: list[str]) -> dict[str, bytes]:
        return {}


LAYOUTS = {("hf", None): HFLayout}
"""The registry's entries of this module (see ``lowprec.export.registry``)."""
