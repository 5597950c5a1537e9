"""The telemetry name of one expert of a ``lowprec.nn.GroupedLinear``: its layer's name and its index.

[Note: telemetry per expert]
A ``GroupedLinear`` reports each expert's casts under a name of its own, ``<layer>#expert<e>``
(``layers.0.moe.experts.w1#expert3``), so that a sampled step records every expert's figures and one
expert's trouble is not hidden in the worst of all. ``lowprec inspect`` draws the experts of each grouped
layer as a heatmap of its own (experts x layers), ranks the experts like any layer, and suggests the
grouped layer's name for high precision, since a policy keeps or converts a ``GroupedLinear`` whole. The
mark ``#`` is no glob character, so a name never reads as a pattern.
"""
from __future__ import annotations

MARK = "#expert"


def expert_name(layer: str, expert: int) -> str:
    """The name expert ``expert`` of ``layer`` reports under."""
    return f"{layer}{MARK}{expert}"


def split_expert(name: str) -> tuple[str, int | None]:
    """(the layer's name, the expert's index) of a reported name; (name, None) for a layer's own."""
    layer, mark, index = name.rpartition(MARK)
    if not mark or not index.isdigit():
        return name, None
    return layer, int(index)
