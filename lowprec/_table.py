"""Plain-text and Markdown tables for the CLI and the reports."""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any


def _cell(v: Any) -> str:
    if isinstance(v, float):
        return f"{v:.4g}"
    return str(v)


def format_table(headers: Sequence[str], rows: Sequence[Sequence[Any]], markdown: bool = False) -> str:
    """Columns aligned for a terminal, or a GitHub-flavoured Markdown table."""
    cells = [[_cell(v) for v in r] for r in rows]
    widths = [max([len(h)] + [len(r[i]) for r in cells]) for i, h in enumerate(headers)]
    if markdown:
        line = lambda r: "| " + " | ".join(c.ljust(w) for c, w in zip(r, widths)) + " |"  # noqa: E731
        sep = "|" + "|".join("-" * (w + 2) for w in widths) + "|"
        return "\n".join([line(headers), sep] + [line(r) for r in cells])
    line = lambda r: "  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip()  # noqa: E731
    return "\n".join([line(headers), line(["-" * w for w in widths])] + [line(r) for r in cells])
