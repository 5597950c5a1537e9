"""Training logs: one CSV row per step (always) and TensorBoard scalars (optional).

Losses are written with ``repr`` (the shortest text that reads back as the same float), so two
runs' CSV files can be compared bit for bit. A resumed run rewrites the CSV from the history
saved in the checkpoint, dropping rows of steps that the interrupted run took after it; a run that
rolls back to a checkpoint (``on_spike="rollback"``) rewrites it the same way (:meth:`RunLog.rewind`).
"""
from __future__ import annotations

import csv
import os
from pathlib import Path
from typing import Any

from lowprec.telemetry import OperandStats
from lowprec.telemetry.records import FILENAME as TELEMETRY_CSV
from lowprec.telemetry.records import TelemetryWriter

COLUMNS = ("step", "lr", "loss", "val_loss", "grad_norm", "loss_scale", "skipped", "spike", "recipe",
           "tokens_per_s", "elapsed_s", "amax_outliers")
"""``val_loss`` is empty on steps without validation; ``recipe`` is ``bf16`` during a high-precision start;
``amax_outliers`` (delayed scaling only) counts the amaxes capped so far (``lowprec.nn.delayed``)."""
_SCALARS = ("loss", "val_loss", "lr", "grad_norm", "loss_scale", "tokens_per_s")


def _text(value: Any) -> str:
    if value is None:
        return ""
    if isinstance(value, bool):
        return str(int(value))
    return repr(value) if isinstance(value, float) else str(value)


class RunLog:
    """Writes the rows of one run to ``<out>/log.csv`` and, if asked, ``<out>/tensorboard/``."""

    def __init__(self, out_dir: Path, history: list[dict[str, Any]], tensorboard: bool) -> None:
        out_dir.mkdir(parents=True, exist_ok=True)
        self.path = out_dir / "log.csv"
        self._file = self.path.open("w", newline="")
        self._csv = csv.writer(self._file)
        self._csv.writerow(COLUMNS)
        for row in history:
            self._csv.writerow([_text(row.get(c)) for c in COLUMNS])
        self._file.flush()
        self._tb = None
        if tensorboard:
            # imported here: TensorBoard takes a second to import and runs without it need not pay that
            from torch.utils.tensorboard import SummaryWriter

            last = history[-1]["step"] if history else 0
            # purge_step drops events a killed run wrote past the checkpoint being resumed
            self._tb = SummaryWriter(str(out_dir / "tensorboard"), purge_step=last + 1 if history else None)
        # sampled operand figures: rows after a resumed checkpoint's step dropped, as above
        self._telemetry = TelemetryWriter(out_dir / TELEMETRY_CSV, history[-1]["step"] if history else None)

    def write(self, row: dict[str, Any]) -> None:
        self._csv.writerow([_text(row.get(c)) for c in COLUMNS])
        self._file.flush()  # a killed run keeps every row it finished
        if self._tb is not None:
            for name in _SCALARS:
                if row.get(name) is not None:
                    self._tb.add_scalar(name, row[name], row["step"])

    def rewind(self, history: list[dict[str, Any]]) -> None:
        """After a roll-back: ``log.csv`` is the history again (the rows of the undone steps dropped) and
        ``telemetry.csv`` holds no step past its end; each file replaced whole, so a killed run leaves
        either the old or the new one. TensorBoard keeps the undone steps' events (its files are append-only)."""
        self._file.close()
        rewrite(self.path, COLUMNS, [[_text(row.get(c)) for c in COLUMNS] for row in history])
        self._file = self.path.open("a", newline="")
        self._csv = csv.writer(self._file)
        self._telemetry.rewind(history[-1]["step"] if history else 0)

    def write_telemetry(self, records: list[OperandStats]) -> None:
        """A sampled step's operand figures: rows of ``telemetry.csv``, and TensorBoard scalars grouped
        by figure (``telemetry_sqnr_db/<layer>/<gemm>.<operand>``)."""
        self._telemetry.write(records)
        if self._tb is not None:
            for r in records:
                for figure in ("sqnr_db", "underflow", "saturation", "amax", "scale"):
                    self._tb.add_scalar(f"telemetry_{figure}/{r.layer}/{r.gemm}.{r.operand}", getattr(r, figure),
                                        r.step)

    def close(self) -> None:
        self._file.close()
        self._telemetry.close()
        if self._tb is not None:
            self._tb.close()


def rewrite(path: Path, header: tuple[str, ...], rows: list[list[str]]) -> None:
    """``path`` replaced whole by a CSV of ``header`` and ``rows`` (written beside it, then renamed)."""
    tmp = path.with_name(path.name + ".tmp")
    with tmp.open("w", newline="") as f:
        w = csv.writer(f)
        w.writerow(header)
        w.writerows(rows)
    os.replace(tmp, path)


def read_log(path: Path) -> list[dict[str, str]]:
    """The rows of a ``log.csv`` as dicts of strings."""
    with Path(path).open(newline="") as f:
        return list(csv.DictReader(f))
