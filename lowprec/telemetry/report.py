"""``lowprec inspect``'s report: one self-contained HTML page, its PNG heatmaps (layers x sampled steps) of
the worst SQNR, underflow and saturation inlined and written beside it, the layers ranked by trouble, and
a suggested policy file.

Heatmaps are drawn on a bare ``matplotlib.figure.Figure`` with the Agg canvas (no pyplot state).
Each cell is a layer's worst record at a step over its GEMM operands: the lowest SQNR, the largest
underflow and saturation fractions.
"""
from __future__ import annotations

import html
import io
import json
import math
import os
from collections.abc import Callable
from pathlib import Path

from lowprec import formats as F
from lowprec._files import check_writable
from lowprec._html import inline_png
from lowprec.policy_file import policy_to_dict, save_policy
from lowprec.telemetry.experts import split_expert
from lowprec.telemetry.stats import OperandStats
from lowprec.telemetry.trouble import (
    SATURATION_FLOOR,
    SQNR_ALLOWANCE_DB,
    TROUBLE_THRESHOLD,
    LayerTrouble,
    floors,
    rank_layers,
    suggest_policy,
)

HEATMAPS = (  # (figure, file suffix, title, worst of a cell's records, colour map)
    ("sqnr_db", "sqnr", "worst SQNR (dB; white: exact)", min, "viridis"),
    ("underflow", "underflow", "largest underflow (fraction flushed to 0)", max, "magma"),
    ("saturation", "saturation", "largest saturation (fraction clipped)", max, "magma"),
)
POLICY_FILE = "suggested_policy.json"


def _table(records: list[OperandStats], figure: str, worst: Callable, row: Callable,
           column: Callable) -> tuple[list, list, list[list[float]]]:
    """(rows, columns, the worst ``figure`` of the records in each cell): rows and columns as ``row(r)``
    and ``column(r)`` name a record's (None: not in the table); NaN for an empty cell and for an exact
    cast's +inf SQNR."""
    rows, columns, cells = {}, {}, {}
    for r in records:
        key = (row(r), column(r))
        if None in key:
            continue
        rows[key[0]], columns[key[1]] = None, None
        cells.setdefault(key, []).append(getattr(r, figure))

    def cell(key) -> float:
        v = worst(cells[key]) if key in cells else math.nan
        return v if math.isfinite(v) else math.nan

    return list(rows), list(columns), [[cell((a, b)) for b in columns] for a in rows]


def grid(records: list[OperandStats], figure: str, worst: Callable) -> tuple[list[str], list[int], list[list[float]]]:
    """(layers in order of appearance, sampled steps, rows of the worst ``figure`` per layer and step;
    NaN where a layer has no record at a step, and for an exact cast's +inf SQNR). A grouped layer's
    experts are one row, their worst (:func:`expert_grid` draws them apart)."""
    layers, steps, rows = _table(records, figure, worst, lambda r: split_expert(r.layer)[0], lambda r: r.step)
    order = sorted(range(len(steps)), key=steps.__getitem__)
    return layers, [steps[i] for i in order], [[row[i] for i in order] for row in rows]


def expert_grid(records: list[OperandStats], figure: str, worst: Callable) -> tuple[list[str], list[int],
                                                                                      list[list[float]]]:
    """(grouped layers, expert indices, the worst ``figure`` per layer and expert over every sampled step
    and operand): the experts x layers table of [Note: telemetry per expert]; empty without experts."""
    # a layer's own record has no expert index (None), which leaves it out of the table
    layers, experts, rows = _table(records, figure, worst, lambda r: split_expert(r.layer)[0],
                                   lambda r: split_expert(r.layer)[1])
    order = sorted(range(len(experts)), key=experts.__getitem__)
    return layers, [experts[i] for i in order], [[row[i] for i in order] for row in rows]


def heatmap_png(records: list[OperandStats], figure: str, title: str, worst: Callable, cmap: str, path: Path,
                experts: bool = False) -> bytes:
    """Draw the heatmap into ``path`` (layers x steps; ``experts``: grouped layers x experts); its bytes,
    which the report also embeds."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg  # a second to import: only inspect pays
    from matplotlib.figure import Figure

    layers, steps, rows = (expert_grid if experts else grid)(records, figure, worst)
    fig = Figure(figsize=(min(14, 4 + 0.25 * len(steps)), 1.5 + 0.16 * len(layers)), dpi=100, layout="constrained")
    FigureCanvasAgg(fig)
    ax = fig.subplots()
    image = ax.imshow(rows, aspect="auto", interpolation="nearest", cmap=cmap)
    fig.colorbar(image, ax=ax)
    ax.set_yticks(range(len(layers)), layers, fontsize=6)
    every = max(1, len(steps) // 20)
    ax.set_xticks(range(0, len(steps), every), [str(s) for s in steps[::every]], fontsize=7)
    ax.set(title=title, xlabel="expert" if experts else "step", ylabel="layer")
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", metadata={"Software": None})  # same records, same bytes
    path.write_bytes(buffer.getvalue())
    return buffer.getvalue()


def _row(t: LayerTrouble, threshold: float) -> str:
    mark = ' class="keep"' if t.score >= threshold else ""
    cells = (t.layer, f"{t.score:.2f}", t.worst, f"{t.worst_sqnr_db:.1f}", f"{100 * t.max_saturation:.3f}%",
             f"{100 * t.max_underflow:.3f}%")
    return f"<tr{mark}>" + "".join(f"<td>{html.escape(c)}</td>" for c in cells) + "</tr>"


def write_report(records: list[OperandStats], out: Path, title: str,
                 threshold: float = TROUBLE_THRESHOLD) -> tuple[Path, list[LayerTrouble]]:
    """Write ``out`` (the HTML), its heatmaps beside it (``<stem>_sqnr.png``, ...) and the suggested
    policy (``suggested_policy.json``, there too); the policy file's path and the ranking."""
    check_writable("out", out, directory=False)
    out.parent.mkdir(parents=True, exist_ok=True)
    images = []
    for figure, suffix, caption, worst, cmap in HEATMAPS:
        png = out.with_name(f"{out.stem}_{suffix}.png")
        data = heatmap_png(records, figure, caption, worst, cmap, png)
        # inlined, so that the page is whole on its own (the PNGs beside it are for other uses)
        images.append(f"<h3>{html.escape(caption)}</h3>{inline_png(data, f'{suffix} heatmap ({png.name})')}")
    if any(split_expert(r.layer)[1] is not None for r in records):  # see [Note: telemetry per expert]
        figure, suffix, caption, worst, cmap = HEATMAPS[0]
        png = out.with_name(f"{out.stem}_experts_{suffix}.png")
        data = heatmap_png(records, figure, f"{caption}, over every sampled step", worst, cmap, png, experts=True)
        images.append(f"<h3>Experts x layers: {html.escape(caption)}</h3>"
                      f"{inline_png(data, f'experts {suffix} heatmap ({png.name})')}")
    ranked = rank_layers(records)
    policy = suggest_policy(ranked, threshold)
    policy_path = save_policy(policy, out.with_name(POLICY_FILE))
    kept = [t.layer for t in ranked if t.score >= threshold]
    steps = sorted({r.step for r in records})
    table = "\n".join(_row(t, threshold) for t in ranked)
    underflow = ", ".join(f"{n.upper()} {floors(F.get(n)).underflow:.2f}" for n in ("e2m1", "e4m3", "e5m2"))
    page = f"""<!doctype html>
<html><head><meta charset="utf-8"><title>{html.escape(title)}</title>
<style>body{{font-family:sans-serif;margin:2em}} td,th{{padding:2px 8px;text-align:left}}
tr.keep{{background:#fdd}} img{{max-width:100%}}</style></head><body>
<h1>{html.escape(title)}</h1>
<p>{len(records)} records: {len({r.layer for r in records})} layers, {len(steps)} sampled steps
({steps[0]} to {steps[-1]}).</p>
<h2>Layers ranked by trouble</h2>
<p>Each record is judged against floors of the format its operand was cast to: underflow above
a floor that falls as the square root of the binades the format keeps below a block's largest value
({underflow}), saturation above {SATURATION_FLOOR:.0%} in any format, SQNR more than {SQNR_ALLOWANCE_DB:g} dB
under the format's ideal. A record's trouble is its
worst figure's distance to its floor as a fraction of the floor (1 at the floor); a layer scores its worst
record (non-finite values: inf). Layers scoring {threshold:g} or more (shaded) are suggested for high precision.</p>
<table><tr><th>layer</th><th>trouble</th><th>worst record</th><th>worst SQNR (dB)</th><th>max saturation</th>
<th>max underflow</th></tr>
{table}</table>
<h2>Suggested policy</h2>
<p>{html.escape(', '.join(kept)) if kept else 'No layer is in trouble: the default policy.'}
Written to <a href="{policy_path.name}">{policy_path.name}</a>; train with it by
<code>lowprec train --policy {policy_path.name}</code>.</p>
<pre>{html.escape(json.dumps(policy_to_dict(policy), indent=1))}</pre>
<h2>Heatmaps (layers x sampled steps)</h2>
{''.join(images)}
</body></html>
"""
    out.write_text(page)
    return policy_path, ranked


def inspect_links(out_dir: Path, runs: list[tuple[str, str | None]]) -> str:
    """For a comparison in ``out_dir``: write the inspect report of each run (recipe, its directory)
    that has telemetry, into its directory; the HTML section linking them ("" when none has any)."""
    from lowprec.telemetry.records import FILENAME, read_records

    items = []
    for recipe, run_dir in runs:
        if run_dir is None or not (Path(run_dir) / FILENAME).is_file():
            continue
        records = read_records(Path(run_dir) / FILENAME)
        if not records:
            continue
        page = Path(run_dir) / "inspect.html"
        write_report(records, page, f"lowprec inspect: {recipe}")
        rel = Path(os.path.relpath(page, out_dir)).as_posix()  # the comparison's pages move with their folder
        items.append(f'<li><a href="{html.escape(rel)}">{html.escape(recipe)}</a></li>')
    return f"<h2>Telemetry (lowprec inspect)</h2><ul>{''.join(items)}</ul>" if items else ""
