"""The loss-curve figure of a comparison, as PNG bytes.

Drawn on a bare ``matplotlib.figure.Figure`` with the Agg canvas: no pyplot, so no global figure
state and no display backend is touched.
"""
from __future__ import annotations

import io
from collections.abc import Sequence

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from lowprec.train.result import RunResult

_SMOOTH = 10
"""Train losses are shown as a running mean over this many steps; the raw curve is too noisy to compare."""


def _running_mean(values: Sequence[float], window: int) -> list[float]:
    out, total = [], 0.0
    for i, v in enumerate(values):
        total += v
        if i >= window:
            total -= values[i - window]
        out.append(total / min(i + 1, window))
    return out


def loss_curves_png(results: Sequence[RunResult], title: str) -> bytes:
    """Train loss (running mean) and validation loss against step, one line per recipe."""
    fig = Figure(figsize=(11, 4.2), dpi=100, layout="constrained")
    FigureCanvasAgg(fig)
    train_ax, val_ax = fig.subplots(1, 2)
    for r in results:
        rows = [row for row in r.history if not row["skipped"]]
        steps = [row["step"] for row in rows]
        train_ax.plot(steps, _running_mean([row["loss"] for row in rows], _SMOOTH), label=r.recipe, linewidth=1.2)
        evals = [row for row in r.history if row.get("val_loss") is not None]
        val_ax.plot([row["step"] for row in evals], [row["val_loss"] for row in evals], marker="o",
                    markersize=3, label=r.recipe, linewidth=1.2)
    train_ax.set(title=f"train loss (mean of {_SMOOTH} steps)", xlabel="step", ylabel="cross-entropy (nats)")
    val_ax.set(title="validation loss", xlabel="step", ylabel="cross-entropy (nats)")
    for ax in (train_ax, val_ax):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(title, fontsize=10)
    buf = io.BytesIO()
    # no timestamp or software tag in the PNG, so the same curves give the same bytes
    fig.savefig(buf, format="png", metadata={"Software": None})
    return buf.getvalue()
