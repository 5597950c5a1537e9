"""The comparison report: recipes against the BF16 baseline, with a verdict each.

Written as Markdown, as one self-contained HTML page (the PNG inlined as base64), as JSON and
as the PNG itself.

[Note: verdicts]
The measure is the relative gap of the final validation loss to the baseline's,
``(val - val_bf16) / val_bf16``; a recipe that does better than the baseline has a negative gap
and passes. The tolerance depends on the element width of the recipe: 8-bit and wider recipes
must come within ``fp8`` (2%), 4- and 6-bit ones within ``fp4`` (5%). Within the tolerance is
PASS, within ``warn_factor`` times it WARN, beyond it FAIL. A non-finite loss anywhere, or a run
that diverged, is FAIL whatever the gap.
"""
from __future__ import annotations

import base64
import html
import json
import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from lowprec._checks import fail
from lowprec._table import format_table
from lowprec.train.result import FINAL_WINDOW, RunResult

PNG_NAME = "loss_curves.png"
_GIB = float(1 << 30)


@dataclass(frozen=True, kw_only=True, slots=True)
class Thresholds:
    """Tolerances on the relative final validation-loss gap to the baseline."""

    fp8: float = 0.02
    """For recipes whose narrowest element is 8 bits or wider."""
    fp4: float = 0.05
    """For recipes with 4- or 6-bit elements (``mxfp4``, ``nvfp4``, ``mxfp6``)."""
    warn_factor: float = 2.0
    """A gap up to this many tolerances is WARN rather than FAIL."""

    def __post_init__(self) -> None:
        for name in ("fp8", "fp4"):
            if not 0 < getattr(self, name) < 1:
                fail(name, "a relative gap in (0, 1)", getattr(self, name))
        if not self.warn_factor >= 1:
            fail("warn_factor", "a number >= 1", self.warn_factor)

    def tolerance(self, recipe: str) -> float:
        return self.fp4 if ("fp4" in recipe or "fp6" in recipe) else self.fp8


def verdict(result: RunResult, baseline_val: float, thresholds: Thresholds) -> tuple[str, float, str]:
    """``(PASS|WARN|FAIL, relative gap, reason)`` of one recipe against the baseline's final val loss."""
    if result.has_nan:
        return "FAIL", math.nan, "diverged" if result.diverged else "non-finite loss"
    if not math.isfinite(baseline_val):
        return "FAIL", math.nan, "the baseline has no finite validation loss"
    gap = (result.final_val_loss - baseline_val) / baseline_val
    tol = thresholds.tolerance(result.recipe)
    if gap <= tol:
        return "PASS", gap, f"gap <= {tol:.0%}"
    if gap <= tol * thresholds.warn_factor:
        return "WARN", gap, f"{tol:.0%} < gap <= {tol * thresholds.warn_factor:.0%}"
    return "FAIL", gap, f"gap > {tol * thresholds.warn_factor:.0%}"


@dataclass(frozen=True, slots=True)
class CompareReport:
    results: tuple[RunResult, ...]
    baseline: str
    context: dict[str, Any]
    """Model, data (with its sha256), training settings, versions and device: what makes a run reproducible."""
    thresholds: Thresholds = field(default_factory=Thresholds)

    def __post_init__(self) -> None:
        if self.baseline not in [r.recipe for r in self.results]:
            fail("baseline", f"one of the compared recipes {[r.recipe for r in self.results]}", self.baseline)

    def rows(self) -> list[dict[str, Any]]:
        base = next(r for r in self.results if r.recipe == self.baseline).final_val_loss
        rows = []
        for r in self.results:
            v, gap, reason = verdict(r, base, self.thresholds)
            rows.append({
                "recipe": r.recipe, "final_train_loss": r.final_train_loss, "final_val_loss": r.final_val_loss,
                "gap_to_baseline": gap, "tokens_per_s": r.tokens_per_s, "peak_memory_bytes": r.peak_memory_bytes,
                "skipped_steps": r.skipped_steps, "steps": r.steps, "verdict": v, "reason": reason,
            })
        return rows

    def to_json(self) -> dict[str, Any]:
        """Plain JSON: a non-finite number becomes null, which every JSON reader accepts."""
        return _finite_or_none({
            "baseline": self.baseline, "thresholds": asdict(self.thresholds), **self.context,
            "results": [{**row, "conversion": r.conversion,
                         "curve": [{k: h[k] for k in ("step", "loss", "val_loss", "lr", "skipped")} for h in r.history]}
                        for row, r in zip(self.rows(), self.results)],
        })

    def table(self, markdown: bool = False) -> str:
        headers = ["recipe", "train loss", "val loss", "gap to " + self.baseline, "tokens/s", "peak mem (GiB)",
                   "skipped", "verdict"]
        cells = [[row["recipe"], _num(row["final_train_loss"]), _num(row["final_val_loss"]),
                  _gap(row["gap_to_baseline"]), f"{row['tokens_per_s']:,.0f}", _mem(row["peak_memory_bytes"]),
                  row["skipped_steps"], row["verdict"]] for row in self.rows()]
        return format_table(headers, cells, markdown=markdown)

    def _rules(self) -> list[str]:
        t = self.thresholds
        return [
            f"Gap: relative difference of the final validation loss to `{self.baseline}`; lower is better.",
            f"PASS: gap <= {t.fp8:.0%} for 8-bit recipes, <= {t.fp4:.0%} for 4/6-bit ones; WARN: up to "
            f"{t.warn_factor:g}x that; FAIL: beyond, or any non-finite loss.",
            f"Train loss: mean over the last {FINAL_WINDOW} steps. Validation: a fixed set of "
            f"{self.context['train']['val_batches']} batches from the held-out split.",
            "Peak memory: the CUDA allocator's peak, or on a CPU the process's resident-set peak "
            "(interpreter and libraries included).",
        ]

    def to_markdown(self) -> str:
        c = self.context
        lines = [f"# lowprec compare: {c['model']['name']} model, {c['train']['steps']} steps", "",
                 self.table(markdown=True), "", *[f"- {rule}" for rule in self._rules()], "",
                 f"![loss curves]({PNG_NAME})", "", "## Setup", "", *[f"- {k}: {v}" for k, v in _setup(c)]]
        for r in self.results:
            lines += ["", f"### Conversion: {r.recipe}", "", "```", r.conversion, "```"]
        return "\n".join(lines) + "\n"

    def to_html(self, png: bytes) -> str:
        c = self.context
        e = html.escape
        rows = self.rows()
        head = "".join(f"<th>{e(h)}</th>" for h in ("recipe", "train loss", "val loss", f"gap to {self.baseline}",
                                                     "tokens/s", "peak mem (GiB)", "skipped", "verdict"))
        body = "".join(
            f"<tr><td>{e(r['recipe'])}</td><td>{_num(r['final_train_loss'])}</td><td>{_num(r['final_val_loss'])}</td>"
            f"<td>{_gap(r['gap_to_baseline'])}</td><td>{r['tokens_per_s']:,.0f}</td><td>{_mem(r['peak_memory_bytes'])}"
            f"</td><td>{r['skipped_steps']}</td><td class=\"{r['verdict']}\">{r['verdict']}</td></tr>" for r in rows)
        setup = "".join(f"<li>{e(k)}: {e(str(v))}</li>" for k, v in _setup(c))
        rules = "".join(f"<li>{e(rule).replace('`', '')}</li>" for rule in self._rules())
        img = base64.b64encode(png).decode()
        return (f"<!doctype html><html><head><meta charset=\"utf-8\"><title>lowprec compare</title><style>"
                f"body{{font-family:sans-serif;max-width:1100px;margin:2em auto}}table{{border-collapse:collapse}}"
                f"td,th{{border:1px solid #ccc;padding:4px 10px;text-align:right}}.PASS{{background:#c8f0c8}}"
                f".WARN{{background:#f8e8a0}}.FAIL{{background:#f4b8b8}}img{{max-width:100%}}</style></head><body>"
                f"<h1>lowprec compare: {e(c['model']['name'])} model, {c['train']['steps']} steps</h1>"
                f"<table><tr>{head}</tr>{body}</table><ul>{rules}</ul>"
                f"<img alt=\"loss curves\" src=\"data:image/png;base64,{img}\"><h2>Setup</h2><ul>{setup}</ul>"
                f"</body></html>\n")

    def write(self, out_dir: str | Path) -> dict[str, Path]:
        """``report.md``, ``report.html``, ``report.json`` and the PNG in ``out_dir``; returns their paths."""
        # matplotlib takes a second to import: only the commands that draw should pay for it
        from lowprec.train.plot import loss_curves_png

        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        png = loss_curves_png(self.results, f"{self.context['model']['name']} model, "
                                            f"data sha256 {self.context['data']['fingerprint'][:12]}")
        paths = {"png": out / PNG_NAME, "markdown": out / "report.md", "html": out / "report.html",
                 "json": out / "report.json"}
        paths["png"].write_bytes(png)
        paths["markdown"].write_text(self.to_markdown())
        from lowprec.telemetry.report import inspect_links  # each recipe's lowprec inspect report, linked

        links = inspect_links(out, [(r.recipe, r.out_dir) for r in self.results])
        paths["html"].write_text(self.to_html(png).replace("</body>", f"{links}</body>"))
        paths["json"].write_text(json.dumps(self.to_json(), indent=1))
        return paths


def _setup(c: dict[str, Any]) -> list[tuple[str, Any]]:
    t = c["train"]
    return [("model", f"{c['model']['name']} ({c['model']['params']:,} parameters)"),
            ("data", f"{c['data']['source']}, sha256 {c['data']['fingerprint']}"),
            ("batch", f"{t['batch_size']} x {t['seq_len']} tokens x {t['grad_accum']} micro-batches"),
            ("schedule", f"lr {t['lr']}, warmup {t['warmup_steps']}, cosine to {t['min_lr_ratio']} x lr"),
            ("seed", t["seed"]), ("high-precision start", f"{t['hp_start_steps']} steps"),
            ("device", f"{c['device']} ({t['dtype']} parameters)"),
            ("versions", f"lowprec {c['lowprec_version']}, torch {c['torch_version']}, "
                         f"Python {c['python_version']}")]


def _finite_or_none(obj: Any) -> Any:
    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    if isinstance(obj, dict):
        return {k: _finite_or_none(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_finite_or_none(v) for v in obj]
    return obj


def _num(x: float) -> str:
    return "nan" if not math.isfinite(x) else f"{x:.4f}"


def _gap(x: float) -> str:
    return "n/a" if not math.isfinite(x) else f"{x:+.2%}"


def _mem(x: int | None) -> str:
    return "n/a" if x is None else f"{x / _GIB:.2f}"


def overall(rows: Sequence[dict[str, Any]]) -> str:
    """The worst verdict of a report: what a script gating on the comparison looks at."""
    order = ["PASS", "WARN", "FAIL"]
    return max((r["verdict"] for r in rows), key=order.index)
