"""The comparison report: recipes against the BF16 baseline over seeds, with a noise-aware verdict each.

Written as Markdown, as one self-contained HTML page (the PNG inlined as base64), as JSON and
as the PNG itself. The verdicts are :mod:`lowprec.train.verdict`'s: each recipe's gap to the
baseline judged against its family's tolerance and beside the baseline's seed band.
"""
from __future__ import annotations

import html
import json
import math
import statistics
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from lowprec._checks import fail
from lowprec._files import check_writable
from lowprec._html import inline_png
from lowprec._table import format_table
from lowprec.convert import Coverage
from lowprec.train.result import FINAL_WINDOW, RunResult
from lowprec.train.verdict import (
    Family,
    Level,
    SeedBand,
    Thresholds,
    Verdict,
    gap_and_noise,
    judge,
    paired_gap,
    pct,
    untested,
    worst,
)

__all__ = ["CompareReport", "PNG_NAME", "RecipeRuns", "Thresholds", "overall"]

PNG_NAME = "loss_curves.png"
_GIB = float(1 << 30)


@dataclass(frozen=True, slots=True)
class RecipeRuns:
    """One recipe's runs in a comparison, one per seed."""

    recipe: str
    """The name the recipe goes by (a preset's name, or a user recipe's ``name``)."""
    family: Family
    """Which tolerance it is held to."""
    seeds: tuple[int, ...]
    results: tuple[RunResult, ...]
    """The run of each seed, in the order of ``seeds``."""

    def __post_init__(self) -> None:
        if not self.results or len(self.seeds) != len(self.results) or len(set(self.seeds)) != len(self.seeds):
            fail("seeds", f"one distinct seed per run of {self.recipe!r} ({len(self.results)} runs)",
                 list(self.seeds))

    @classmethod
    def of(cls, result: RunResult, seed: int = 0) -> RecipeRuns:
        """A preset's single run (the family from its name)."""
        return cls(result.recipe, Family.of(result.recipe), (seed,), (result,))

    @property
    def band(self) -> SeedBand:
        return SeedBand(self.seeds, tuple(r.final_val_loss for r in self.results))

    @property
    def failure(self) -> str | None:
        """Why a run of it failed (diverged, a non-finite loss) and at which seed; None if none did."""
        for seed, r in zip(self.seeds, self.results):
            if r.has_nan:
                return f"{'diverged' if r.diverged else 'non-finite loss'} (seed {seed})"
        return None

    @property
    def coverage(self) -> Coverage | None:
        """How much of the model ran the recipe (every seed converts the same model alike); None if unknown."""
        return self.results[0].coverage


def _mean(values: Sequence[float]) -> float:
    return statistics.fmean(values) if all(math.isfinite(v) for v in values) else math.nan


@dataclass(frozen=True, slots=True)
class CompareReport:
    runs: tuple[RecipeRuns, ...]
    """Every recipe's runs, the baseline's among them."""
    baseline: str
    context: dict[str, Any]
    """Model, data (with its sha256), training settings, versions and device: what makes a run reproducible."""
    thresholds: Thresholds = field(default_factory=Thresholds)

    def __post_init__(self) -> None:
        names = [r.recipe for r in self.runs]
        if self.baseline not in names:
            fail("baseline", f"one of the compared recipes {names}", self.baseline)

    @property
    def base(self) -> RecipeRuns:
        return next(r for r in self.runs if r.recipe == self.baseline)

    @property
    def results(self) -> tuple[RunResult, ...]:
        """Every run, recipe by recipe."""
        return tuple(res for r in self.runs for res in r.results)

    def verdict(self, runs: RecipeRuns) -> Verdict:
        """The verdict on one recipe's runs against the baseline's (see :mod:`lowprec.train.verdict`)."""
        t, base = self.thresholds, self.base
        tol = t.tolerance(runs.family)
        if runs is base:  # the baseline is judged only on whether its runs finished
            level = Level.FAIL if runs.failure or not math.isfinite(base.band.mean) else Level.PASS
            return Verdict(level, 0.0 if level is Level.PASS else math.nan, math.nan, tol,
                           runs.failure or "the baseline")
        gap, noise = gap_and_noise(runs.band, base.band, t.noise_z)
        failure = runs.failure or (None if math.isfinite(base.band.mean) else
                                   "the baseline has no finite validation loss")
        v = judge(gap, noise, tol, t, failure)
        why = untested(runs.coverage)
        # a failed run is a fact whatever ran it; any other verdict needs the recipe to have run
        return v if v.level is Level.FAIL or why is None else Verdict(Level.NOT_TESTED, gap, noise, tol, why)

    def rows(self) -> list[dict[str, Any]]:
        rows = []
        for r in self.runs:
            v = self.verdict(r)
            rows.append({
                "recipe": r.recipe, "family": r.family.value, "seeds": list(r.seeds),
                "val_losses": [res.final_val_loss for res in r.results],
                "final_train_loss": _mean([res.final_train_loss for res in r.results]),
                "final_val_loss": r.band.mean, "gap_to_baseline": v.gap, "noise": v.noise,
                "gap_same_seeds": math.nan if r is self.base else paired_gap(r.band, self.base.band),
                "within_noise": v.within_noise, "tolerance": v.tolerance, "tolerance_source": r.family.source,
                "tokens_per_s": statistics.fmean(res.tokens_per_s for res in r.results),
                "peak_memory_bytes": max((res.peak_memory_bytes for res in r.results if res.peak_memory_bytes
                                          is not None), default=None),
                "skipped_steps": sum(res.skipped_steps for res in r.results), "steps": r.results[0].steps,
                "verdict": v.level.value, "label": v.label, "reason": v.reason,
                "converted": str(r.coverage) if r.coverage is not None else None,
                "coverage": r.coverage.to_dict() if r.coverage is not None else None,
            })
        return rows

    def band_line(self) -> str:
        """The baseline's seed band in words: mean ± standard deviation and each seed's value."""
        b = self.base.band
        each = ", ".join(f"{_num(v)} (seed {s})" for s, v in zip(b.seeds, b.values))
        if len(b.values) == 1:
            return f"`{self.baseline}` band: one seed, {each}: noise unknown (use more seeds)"
        return (f"`{self.baseline}` band over {len(b.values)} seeds: {_num(b.mean)} ± {_num(b.std)} "
                f"(std, {pct(b.std / b.mean)} of the mean): {each}")

    def to_json(self) -> dict[str, Any]:
        """Plain JSON: a non-finite number becomes null, which every JSON reader accepts."""
        return _finite_or_none({
            "baseline": self.baseline, "thresholds": asdict(self.thresholds), **self.context,
            "baseline_band": self.base.band.to_json(),
            "results": [{**row, "conversion": r.results[0].conversion,
                         "runs": [{"seed": s, "final_val_loss": res.final_val_loss,
                                   "final_train_loss": res.final_train_loss, "curve": _curve(res)}
                                  for s, res in zip(r.seeds, r.results)]}
                        for row, r in zip(self.rows(), self.runs)],
        })

    _HEADERS = ("recipe", "linears converted", "seeds", "train loss", "val loss", "gap to {}", "noise ±",
                "same seeds", "tolerance", "tokens/s", "peak mem (GiB)", "skipped", "verdict")

    def _cells(self) -> list[list[Any]]:
        return [[row["recipe"], _converted(r.coverage), len(row["seeds"]), _num(row["final_train_loss"]),
                 _num(row["final_val_loss"]), _gap(row["gap_to_baseline"]), _abs(row["noise"]),
                 _gap(row["gap_same_seeds"]), pct(row["tolerance"]), f"{row['tokens_per_s']:,.0f}",
                 _mem(row["peak_memory_bytes"]), row["skipped_steps"], row["label"]]
                for row, r in zip(self.rows(), self.runs)]

    def table(self, markdown: bool = False) -> str:
        return format_table([h.format(self.baseline) for h in self._HEADERS], self._cells(), markdown=markdown)

    def reasons(self) -> list[str]:
        """One line per recipe: its verdict, why, what ran it, the same-seed gap, and the tolerance it was held
        to with where that comes from."""
        out = []
        for row in self.rows():
            if row["recipe"] == self.baseline:
                continue
            ran = f"; {row['converted']}" if row["converted"] and row["verdict"] != Level.NOT_TESTED.value else ""
            same = (f"; same-seed gap {_gap(row['gap_same_seeds'])} (shown, not judged)"
                    if math.isfinite(row["gap_same_seeds"]) else "")
            out.append(f"{row['recipe']}: {row['label']}: {row['reason']}{ran}{same}; tolerance "
                       f"{pct(row['tolerance'])} for {Family(row['family']).title} ({row['tolerance_source']}, "
                       "widened for short runs)")
        return out

    def legend(self) -> list[str]:
        """What the verdicts mean, in plain words: the report's first lines."""
        t = self.thresholds
        tols = ", ".join(f"{f.title} {pct(t.tolerance(f))}" for f in Family)
        b = f"`{self.baseline}`"
        return [
            f"PASS: the recipe's final validation loss is within its family's tolerance of {b}'s ({tols}). "
            f"*(within noise)*: the gap is no larger than {b}'s own seeds differ by, so these runs cannot tell "
            f"the recipe from {b}.",
            f"WARN: beyond the tolerance, but by less than the noise or than {t.warn_factor:g}x the tolerance: "
            "not resolved; more seeds (--seeds, --recipe-seeds) or steps could bring it within.",
            "FAIL: beyond the tolerance by more than both the noise and that margin, or a non-finite loss at any seed.",
            f"NOT TESTED: the recipe ran on no linear, or on linears holding under half of the linear parameters: "
            f"its runs measure {b}, not the recipe, and earn no verdict (the reason names the option that "
            "converts them).",
            "Why similar gaps can get different verdicts: each family has its own tolerance (above), so a gap of "
            "3% is beyond an 8-bit recipe's and within a 4-bit one's; and the gap is to the mean of "
            f"{b}'s seeds, so the seed a recipe trained with moves it by up to the noise. The same-seed gap "
            f"compares each run with {b}'s run from the same initialisation and data: where it is near zero "
            "and the gap is not, the gap is mostly which seed the recipe drew.",
        ]

    def notes(self) -> list[str]:
        """The lines under the table, in Markdown (the HTML page drops the backticks); one place to add one."""
        t = self.thresholds
        return [
            self.band_line(),
            f"Gap: relative difference of the mean final validation loss to `{self.baseline}`'s; lower is better. "
            f"Noise: {t.noise_z:g} standard errors of the gap, from the seed-to-seed spread pooled over both "
            "recipes' seeds; a gap no larger is *within noise*. Same seeds: the mean gap to "
            f"`{self.baseline}`'s runs of the recipe's own seeds (same initialisation and data order), which most "
            "of the seed-to-seed spread does not move; shown, not judged.",
            "Linears converted: of the model's linears, how many ran the recipe, and their share of the linear "
            "parameters. Tolerances and their sources: docs/verdicts.md.",
            f"Train loss: mean over the last {FINAL_WINDOW} steps. Validation: a fixed set of "
            f"{self.context['train']['val_batches']} batches from the held-out split, the same for every seed.",
            "Peak memory: the CUDA allocator's peak, or on a CPU the process's resident-set peak "
            "(interpreter and libraries included).",
        ]

    def title(self) -> str:
        c, k = self.context, len(self.base.seeds)
        seeds = f", {self.baseline} over {k} seeds" if k > 1 else ""
        return f"lowprec compare: {c['model']['name']} model, {c['train']['steps']} steps{seeds}"

    def to_markdown(self) -> str:
        lines = [f"# {self.title()}", "", *[f"- {line}" for line in self.legend()], "",
                 self.table(markdown=True), "", "## Verdicts", "",
                 *[f"- {line}" for line in self.reasons()], "", *[f"- {note}" for note in self.notes()], "",
                 f"![loss curves]({PNG_NAME})", "", "## Setup", "", *[f"- {k}: {v}" for k, v in _setup(self.context)]]
        for r in self.runs:
            lines += ["", f"### Conversion: {r.recipe}", "", "```", r.results[0].conversion, "```"]
        return "\n".join(lines) + "\n"

    def to_html(self, png: bytes) -> str:
        e = html.escape
        head = "".join(f"<th>{e(h.format(self.baseline))}</th>" for h in self._HEADERS)
        body = "".join("<tr>" + "".join(f"<td>{e(str(c))}</td>" for c in cells[:-1])
                       + f"<td class=\"{row['verdict'].replace(' ', '_')}\">{e(cells[-1])}</td></tr>"
                       for cells, row in zip(self._cells(), self.rows()))
        setup = _items(f"{k}: {v}" for k, v in _setup(self.context))
        return (f"<!doctype html><html><head><meta charset=\"utf-8\"><title>lowprec compare</title><style>"
                f"body{{font-family:sans-serif;max-width:1200px;margin:2em auto}}table{{border-collapse:collapse}}"
                f"td,th{{border:1px solid #ccc;padding:4px 10px;text-align:right}}.PASS{{background:#c8f0c8}}"
                f".WARN{{background:#f8e8a0}}.FAIL{{background:#f4b8b8}}.NOT_TESTED{{background:#d8d8d8}}img{{max-width:100%}}</style></head><body>"
                f"<h1>{e(self.title())}</h1><ul>{_items(self.legend())}</ul><table><tr>{head}</tr>{body}</table><h2>Verdicts</h2>"
                f"<ul>{_items(self.reasons())}</ul><ul>{_items(self.notes())}</ul>"
                f"{inline_png(png, 'loss curves')}<h2>Setup</h2><ul>{setup}</ul>"
                f"</body></html>\n")

    def curves(self) -> list[RunResult]:
        """The runs to draw, each named by its recipe and, when there are several, its seed."""
        many = any(len(r.seeds) > 1 for r in self.runs)
        return [replace(res, recipe=f"{r.recipe} seed {s}") if many else res
                for r in self.runs for s, res in zip(r.seeds, r.results)]

    def write(self, out_dir: str | Path) -> dict[str, Path]:
        """``report.md``, ``report.html``, ``report.json`` and the PNG in ``out_dir``; returns their paths."""
        # matplotlib takes a second to import: only the commands that draw should pay for it
        from lowprec.train.plot import loss_curves_png

        out = check_writable("out_dir", out_dir, directory=True)
        out.mkdir(parents=True, exist_ok=True)
        png = loss_curves_png(self.curves(), f"{self.context['model']['name']} model, "
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


def _items(lines: Iterable[str]) -> str:
    """HTML list items of Markdown lines (their backticks and emphasis dropped)."""
    return "".join(f"<li>{html.escape(line).replace('`', '').replace('*', '')}</li>" for line in lines)


def _curve(r: RunResult) -> list[dict[str, Any]]:
    return [{k: h[k] for k in ("step", "loss", "val_loss", "lr", "skipped")} for h in r.history]


def _setup(c: dict[str, Any]) -> list[tuple[str, Any]]:
    t = c["train"]
    seeds = c.get("seeds", {"baseline": [t["seed"]], "recipes": [t["seed"]]})
    return [("model", f"{c['model']['name']} ({c['model']['params']:,} parameters)"),
            ("data", f"{c['data']['source']}, sha256 {c['data']['fingerprint']}"),
            ("batch", f"{t['batch_size']} x {t['seq_len']} tokens x {t['grad_accum']} micro-batches"),
            ("schedule", f"lr {t['lr']}, warmup {t['warmup_steps']}, cosine to {t['min_lr_ratio']} x lr"),
            ("seeds", f"baseline {seeds['baseline']}, other recipes {seeds['recipes']} (each seed: its own "
                      "initialisation, data order and rounding draws)"),
            ("policy", json.dumps(t.get("policy")) + " (lowprec.policy_file form)"),
            ("high-precision start", f"{t['hp_start_steps']} steps"),
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


def _abs(x: float) -> str:
    return "n/a" if not math.isfinite(x) else f"{x:.2%}"


def _converted(c: Coverage | None) -> str:
    if c is None:
        return "n/a"
    return f"{c.converted}/{c.linears} ({c.share}" + (f", {c.unseen} unseen)" if c.unseen else ")")


def _mem(x: int | None) -> str:
    return "n/a" if x is None else f"{x / _GIB:.2f}"


def overall(rows: Sequence[dict[str, Any]]) -> str:
    """The worst verdict of a report's rows: what a script gating on the comparison looks at."""
    return worst([r["verdict"] for r in rows]).value
