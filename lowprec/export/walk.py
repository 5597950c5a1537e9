"""A trained model seen as the Hugging Face model it will be written as: its config, its linears (each with
its master, its trained weight, or why it stays in high precision) and every other tensor, under the names
its readers look for.

[Note: every parameter is written once]
A walk names every parameter of the lowprec model exactly once, as a linear or as a plain tensor; a model
with a parameter no walk names is refused rather than written without it. Masters come from the optimizer
where it keeps them (BF16 or FP8 parameters), else from the parameter itself, widened to FP32.
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

import torch
from torch import nn

from lowprec._checks import fail
from lowprec.export.layout import LayerWeight
from lowprec.export.trained import Trained, trained


@dataclass(frozen=True, slots=True)
class ExportLinear:
    """One linear of the exported model (a routed expert's projection is one, too)."""

    weight: LayerWeight
    source: str
    """Its name in the lowprec model, for the report (``layers.0.feed_forward.experts.w1[3]``)."""
    kept: str | None
    """Why it is written in high precision, or None."""
    note: str = ""
    bias: torch.Tensor | None = None


@dataclass(slots=True)
class WalkedModel:
    """A model in the names and config of one Hugging Face architecture (see [Note: every parameter is
    written once])."""

    architecture: str
    config: dict
    linears: list[ExportLinear] = field(default_factory=list)
    tensors: dict[str, torch.Tensor] = field(default_factory=dict)
    """Everything that is not a linear's weight (embeddings, norms, biases, buffers), by its name."""
    kept_modules: list[str] = field(default_factory=list)
    """Modules outside ``linears`` the quantized formats must list as not converted (an MoE router that
    the architecture does not hold as a linear, fused experts lowprec cannot see into)."""
    notes: list[str] = field(default_factory=list)


class Masters:
    """Each parameter's FP32 master by its name in the lowprec model (see [Note: every parameter is written
    once]), recording which names were taken so that none is left out."""

    def __init__(self, model: nn.Module, masters: Mapping[str, torch.Tensor | None] | None) -> None:
        # a tied parameter under each of its names; the optimizer knows it by the first
        self.params = dict(model.named_parameters(remove_duplicate=False))
        first: dict[int, str] = {}
        self.first = {n: first.setdefault(id(p), n) for n, p in self.params.items()}
        self.given = dict(masters or {})
        self.taken: set[str] = set()

    def __call__(self, name: str) -> torch.Tensor:
        if name not in self.params:
            fail("model", f"a parameter named {name!r}", "a model without it")
        self.taken.add(name)
        m = self.given.get(self.first[name])
        return (m if m is not None else self.params[name]).detach().float()

    def widened(self) -> list[str]:
        """The parameters held in fewer bits than FP32 whose master was not given: their values as held stand
        for their masters."""
        return [n for n in self.params if n in self.taken and self.given.get(self.first[n]) is None
                and self.params[n].dtype != torch.float32]

    def check_all_taken(self) -> None:
        left = [n for n in self.params if n not in self.taken]
        if left:
            fail("model", "parameters the export knows where to write", f"{len(left)} it does not, the first "
                 f"{left[0]!r}")


def linear(name: str, source: str, layer: nn.Module, masters: Masters, device: torch.device | None,
           master: torch.Tensor | None = None) -> ExportLinear:
    """``layer`` (a linear of the lowprec model named ``source``) as the exported module ``name``;
    ``master``: its master already taken (and re-laid out, e.g. permuted) by the caller."""
    t = trained(layer, device)
    w = master if master is not None else masters(f"{source}.weight")
    bias = masters(f"{source}.bias") if getattr(layer, "bias", None) is not None else None
    q = t.weights[0] if t.weights else None
    return ExportLinear(LayerWeight(name, w, q, t.recipe), source, t.kept, t.note, bias)


def experts(names: list[str], source: str, layer: nn.Module, masters: Masters,
            device: torch.device | None) -> list[ExportLinear]:
    """A ``GroupedLinear`` named ``source`` as one linear per expert, expert ``e`` written as ``names[e]``."""
    t: Trained = trained(layer, device)
    w = masters(f"{source}.weight")  # (E, out, in)
    out = []
    for e, name in enumerate(names):
        q = t.weights[e] if t.weights else None
        out.append(ExportLinear(LayerWeight(name, w[e], q, t.recipe), f"{source}[{e}]", t.kept, t.note))
    return out
