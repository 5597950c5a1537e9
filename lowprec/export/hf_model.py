"""A model loaded from a Hugging Face config (``lowprec.train.models.HFCausalLM``), written under its own
names and config: its linears as linears, everything else as it is.

Fused 3-D experts that ``lowprec.convert`` ran through ``GroupedLinear`` (``lowprec.convert_hf_moe``) are
linears too, one per fused parameter, named by the parameter (see [Note: fused expert weights] in
``lowprec.export.layout``). Weights lowprec cannot see into (see [Note: weights lowprec cannot see into] in
``lowprec.unseen``) never ran quantized: they are written in BF16 and their modules listed as not converted.
"""
from __future__ import annotations

import torch
from torch import nn

from lowprec.convert_hf_moe import HFGroupedExperts
from lowprec.export.layout import Fused, LayerWeight
from lowprec.export.trained import trained
from lowprec.export.walk import ExportLinear, Masters, WalkedModel, linear
from lowprec.unseen import find_unseen


def _config(hf: nn.Module) -> dict:
    config = hf.config.to_dict()
    config.pop("quantization_config", None)  # the format writes its own
    config["torch_dtype"] = config["dtype"] = "bfloat16"
    return config


def fused_experts(name: str, source: str, m: HFGroupedExperts, masters: Masters,
                  device: torch.device | None) -> list[ExportLinear]:
    """The fused parameters of ``m`` (named ``name`` in the exported model, ``source`` in the lowprec one) as
    one linear each: master ``(E, out, in)``, each expert's trained cast."""
    out = []
    for p, g in zip(m.projections, m.grouped()):
        t = trained(g, device)
        w = masters(f"{source}.{p.weight}")
        w = w.transpose(1, 2).contiguous() if p.transposed else w  # (E, out, in)
        fused = Fused(m.hf_class.__name__, p.transposed, p.bias is not None)
        lw = LayerWeight(f"{name}.{p.weight}", w, None, t.recipe, fused, t.weights)
        out.append(ExportLinear(lw, f"{source}.{p.weight}", t.kept, t.note))
    return out


def walk_hf(hf: nn.Module, prefix: str, masters: Masters, device: torch.device | None) -> WalkedModel:
    """``hf``, a transformers causal LM, under its own names (see the module's docstring); ``prefix``: its name
    in the model ``masters`` holds (``model.`` inside ``HFCausalLM``)."""
    walked = WalkedModel(type(hf).__name__, _config(hf))
    taken: set[str] = set()
    for name, m in hf.named_modules():
        if isinstance(m, nn.Linear):
            walked.linears.append(linear(name, prefix + name, m, masters, device))
        elif isinstance(m, HFGroupedExperts):
            walked.linears += fused_experts(name, prefix + name, m, masters, device)
            taken.update(f"{name}.{p.weight}" for p in m.projections)  # its biases are plain tensors
            continue
        else:
            continue
        taken.update(f"{name}.{p}" for p, _ in m.named_parameters(recurse=False))
    reported = {id(m) for m in hf.modules() if isinstance(m, (nn.Linear, HFGroupedExperts))}
    for u in find_unseen(hf, reported):
        walked.kept_modules.append(u.name.rpartition(".")[0])
        walked.notes.append(f"{u.name} {tuple(u.shape)} ({u.module}): a weight lowprec cannot see into, never "
                            "quantized in training, written in BF16")
    for name, _ in hf.named_parameters():
        if name not in taken:
            walked.tensors[name] = masters(prefix + name)
    walked.kept_modules = sorted(set(walked.kept_modules))
    return walked
