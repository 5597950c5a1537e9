"""Activation calibration: each exported linear's input amax over a few batches, for formats whose activations
carry a static scale (NVFP4's activation global scale).

[Note: calibrating activation scales]
NVFP4 activations are quantized by the serving engine in 1x16 blocks under E4M3 scales, and those scales sit
under one FP32 global scale per layer that the checkpoint must carry (compressed-tensors'
``input_global_scale``, ModelOpt's ``input_scale``); it comes from the largest magnitude the layer's input
takes. :func:`input_amax` runs the model in evaluation mode under ``torch.no_grad`` on the batches given,
records ``max |x|`` of each named linear's input with forward pre-hooks (an expert's rows only, for one expert
of a ``GroupedLinear``), removes the hooks and returns the amax by the exported layer's name. The input is taken
before the layer casts it, so it is what the engine will see, whatever the training recipe. A layer that saw no
input (an expert no token was routed to) or a non-finite one is refused: an invented scale would be silent.
"""
from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

import torch
from torch import nn

from lowprec._checks import describe, fail
from lowprec.nn.grouped_casts import Groups
from lowprec.train.model import Transformer
from lowprec.train.models import HFCausalLM

_EXPERT = re.compile(r"^(?P<module>.+)\[(?P<expert>\d+)\]$")
"""A routed expert's source name, ``layers.0.feed_forward.experts.w1[3]``: the grouped module and the expert."""


@dataclass(frozen=True, slots=True)
class Calibration:
    """What a calibration found: each layer's input amax by its exported name, and what it ran on."""

    input_amax: dict[str, float]
    batches: int
    tokens: int


@dataclass(frozen=True, slots=True)
class _Target:
    """Where one exported layer's input is seen: a module, and for one expert of a grouped module its index."""

    name: str
    module: nn.Module
    expert: int | None


def _target(model: nn.Module, name: str, source: str) -> _Target:
    m = _EXPERT.match(source)
    module_name, expert = (m["module"], int(m["expert"])) if m else (source, None)
    try:
        return _Target(name, model.get_submodule(module_name), expert)
    except AttributeError:
        fail("model", f"a module named {module_name!r} (the source of {name!r})", "a model without it")


def _rows(x: torch.Tensor, offsets: torch.Tensor | Groups, expert: int) -> torch.Tensor:
    """Expert ``expert``'s rows of a grouped layer's input (``offsets``: cumulative token counts, or the
    routing a MoE layer read once for its projections, ``lowprec.nn.grouped.route``)."""
    if isinstance(offsets, Groups):
        offsets = offsets.offsets
    start = 0 if expert == 0 else int(offsets[expert - 1])
    return x[start:int(offsets[expert])]


def _check_batch(i: int, tokens: object) -> torch.Tensor:
    if not isinstance(tokens, torch.Tensor) or tokens.dtype != torch.long or tokens.dim() != 2 \
            or tokens.numel() == 0:
        fail(f"calibrate[{i}]", "a non-empty int64 tensor of token ids (B, T)", describe(tokens), TypeError)
    return tokens


def _forward(model: nn.Module, tokens: torch.Tensor) -> None:
    if isinstance(model, (Transformer, HFCausalLM)):
        model(tokens)
    else:  # a transformers causal LM itself
        model(input_ids=tokens, use_cache=False)


def input_amax(model: nn.Module, batches: Iterable[torch.Tensor], sources: Mapping[str, str]) -> Calibration:
    """The input amax of each layer of ``sources`` (exported name -> its name in ``model``, an expert as
    ``module[e]``) over ``batches`` (see [Note: calibrating activation scales])."""
    if isinstance(batches, torch.Tensor) or not isinstance(batches, Iterable):
        fail("calibrate", "an iterable of token batches, each an int64 tensor (B, T)", describe(batches), TypeError)
    targets = [_target(model, n, s) for n, s in sources.items()]
    amax: dict[str, torch.Tensor] = {}

    def hook_for(t: _Target):
        def hook(module: nn.Module, args: tuple, kwargs: dict) -> None:
            x = args[0] if args else next(iter(kwargs.values()))
            if t.expert is not None:
                offsets = args[1] if len(args) > 1 else kwargs["offsets"]
                x = _rows(x, offsets, t.expert)
            if x.numel():
                a = x.detach().abs().amax().float()
                amax[t.name] = torch.maximum(amax[t.name], a) if t.name in amax else a
        return hook

    device = next(model.parameters()).device
    was_training = model.training
    handles = [t.module.register_forward_pre_hook(hook_for(t), with_kwargs=True) for t in targets]
    n = tokens = 0
    try:
        model.eval()
        with torch.no_grad():
            for i, batch in enumerate(batches):
                batch = _check_batch(i, batch)
                _forward(model, batch.to(device))
                n, tokens = n + 1, tokens + batch.numel()
    finally:
        for h in handles:
            h.remove()
        model.train(was_training)
    if n == 0:
        fail("calibrate", "at least one batch of token ids", "none")
    return Calibration(_checked(amax, targets, n), n, tokens)


def _checked(amax: dict[str, torch.Tensor], targets: list[_Target], n: int) -> dict[str, float]:
    out = {}
    for t in targets:
        a = float(amax[t.name]) if t.name in amax else 0.0
        if not (0.0 < a < float("inf")):
            seen = "no input" if t.name not in amax else f"an input amax of {a}"
            fail("calibrate", f"batches on which every quantized linear sees a finite, non-zero input ({n} "
                 f"batches given)", f"{seen} for {t.name!r}")
        out[t.name] = a
    return out
