"""A model loaded from a Hugging Face config (``lowprec.train.models.HFCausalLM``), written under its own
names and config: its linears as linears, everything else as it is.

Weights lowprec cannot see into (fused 3-D experts, see [Note: weights lowprec cannot see into] in
``lowprec.unseen``) never ran quantized: they are written in BF16 and their modules listed as not converted.
"""
from __future__ import annotations

import torch
from torch import nn

from lowprec.export.walk import Masters, WalkedModel, linear
from lowprec.unseen import find_unseen


def _config(hf: nn.Module) -> dict:
    config = hf.config.to_dict()
    config.pop("quantization_config", None)  # the format writes its own
    config["torch_dtype"] = config["dtype"] = "bfloat16"
    return config


def walk_hf(hf: nn.Module, prefix: str, masters: Masters, device: torch.device | None) -> WalkedModel:
    """``hf``, a transformers causal LM, under its own names (see the module's docstring); ``prefix``: its name
    in the model ``masters`` holds (``model.`` inside ``HFCausalLM``)."""
    walked = WalkedModel(type(hf).__name__, _config(hf))
    taken: set[str] = set()
    for name, m in hf.named_modules():
        if isinstance(m, nn.Linear):
            walked.linears.append(linear(name, prefix + name, m, masters, device))
            taken.update(f"{name}.{p}" for p, _ in m.named_parameters(recurse=False))
    reported = {id(m) for m in hf.modules() if isinstance(m, nn.Linear)}
    for u in find_unseen(hf, reported):
        walked.kept_modules.append(u.name.rpartition(".")[0])
        walked.notes.append(f"{u.name} {tuple(u.shape)} ({u.module}): a weight lowprec cannot see into, never "
                            "quantized in training, written in BF16")
    for name, _ in hf.named_parameters():
        if name not in taken:
            walked.tensors[name] = masters(prefix + name)
    walked.kept_modules = sorted(set(walked.kept_modules))
    return walked
