"""``telemetry.csv``: a run's operand figures in long format, one row per layer x GEMM x operand x
sampled step, and reading them back.

Floats are written with ``repr`` (``inf`` and ``nan`` included), so a row reads back as the same
figures. A resumed run keeps the rows of the steps up to its checkpoint and drops those an
interrupted run wrote after it, as ``log.csv`` does.
"""
from __future__ import annotations

import csv
import math
import os
from pathlib import Path

from lowprec import formats as F
from lowprec._checks import fail
from lowprec.telemetry.stats import GEMMS, OPERANDS, OperandStats

FILENAME = "telemetry.csv"
COLUMNS = ("step", "layer", "gemm", "operand", "amax", "scale", "underflow", "saturation", "sqnr_db", "format")
_FIGURES = COLUMNS[4:9]
_BEFORE_FORMAT = COLUMNS[:9]
"""The columns of files written before the cast's format was recorded: read with the format unknown."""


def row_of(r: OperandStats) -> list[str]:
    return ([str(r.step), r.layer, r.gemm, r.operand] + [repr(float(getattr(r, c))) for c in _FIGURES]
            + [r.fmt.name if r.fmt is not None else ""])


class TelemetryWriter:
    """Appends records to ``path``; the file is made at the first write, so a run without telemetry
    leaves none. ``last_step``: the step a resumed run goes on from (rows after it are dropped); None
    for a fresh run, which removes a file an earlier run left."""

    def __init__(self, path: Path, last_step: int | None) -> None:
        self.path = Path(path)
        self._file = None
        kept = _rows_through(self.path, last_step) if last_step is not None else []
        if kept:
            self._open()
            self._csv.writerows(kept)
            self._file.flush()
        else:
            self.path.unlink(missing_ok=True)

    def _open(self) -> None:
        self._file = self.path.open("w", newline="")
        self._csv = csv.writer(self._file)
        self._csv.writerow(COLUMNS)

    def write(self, records: list[OperandStats]) -> None:
        if self._file is None:
            self._open()
        self._csv.writerows(row_of(r) for r in records)
        self._file.flush()  # a killed run keeps every sampled step it finished

    def rewind(self, last_step: int) -> None:
        """Drop the rows after ``last_step`` (a roll-back), replacing the file whole."""
        if self._file is None:
            return
        self._file.close()
        kept = _rows_through(self.path, last_step)
        tmp = self.path.with_name(self.path.name + ".tmp")
        with tmp.open("w", newline="") as f:
            csv.writer(f).writerows([list(COLUMNS), *kept])
        os.replace(tmp, self.path)
        self._file = self.path.open("a", newline="")
        self._csv = csv.writer(self._file)

    def close(self) -> None:
        if self._file is not None:
            self._file.close()


def _rows_through(path: Path, last_step: int) -> list[list[str]]:
    """The data rows of an existing file whose step is at most ``last_step`` (rows that do not parse are
    dropped: the file is a record of the run, and resuming must not fail on it)."""
    if not path.is_file():
        return []
    with path.open(newline="", encoding="utf-8", errors="replace") as f:  # a corrupt byte spoils its row only
        rows = list(csv.reader(f))[1:]
    kept = []
    for row in rows:
        try:
            if len(row) in (len(_BEFORE_FORMAT), len(COLUMNS)) and int(row[0]) <= last_step:
                kept.append(row + [""] * (len(COLUMNS) - len(row)))
        except ValueError:
            continue
    return kept


def read_records(path: Path, name: str = "telemetry") -> list[OperandStats]:
    """The records of a ``telemetry.csv``; a missing, malformed or corrupt file raises ``ValueError``
    naming ``name`` (the argument the path came from)."""
    path = Path(path)
    if not path.is_file():
        fail(name, f"a file {path.name} (written by lowprec train --telemetry-every N)", f"none at {str(path)!r}")
    try:
        with path.open(newline="", encoding="utf-8") as f:
            reader = csv.reader(f)
            header = next(reader, None)
            if header is None or tuple(header) not in (COLUMNS, _BEFORE_FORMAT):
                fail(name, f"{path.name} with the columns {', '.join(COLUMNS)}", f"{header!r} in {str(path)!r}")
            return [_parse(row, i, path, name, len(header)) for i, row in enumerate(reader, start=2)]
    except UnicodeDecodeError as e:
        fail(name, f"{path.name} as UTF-8 text (a CSV lowprec train wrote)", f"{str(path)!r}, whose byte "
             f"{e.start:,} is not UTF-8 (a corrupt or foreign file)")


def _parse(row: list[str], line: int, path: Path, name: str, columns: int) -> OperandStats:
    try:
        if len(row) != columns:
            raise ValueError(f"{len(row)} fields")
        figures = [float(v) for v in row[4:9]]
        step = int(row[0])
        if step < 0 or row[2] not in GEMMS or row[3] not in OPERANDS or not row[1]:
            raise ValueError("a bad step, layer, gemm or operand")
        if any(math.isnan(v) or not 0 <= v <= 1 for v in figures[2:4]):
            raise ValueError("a fraction outside [0, 1]")
        fmt = F.get(row[9]) if columns > 9 and row[9] else None
        return OperandStats(row[1], row[2], row[3], *figures, step, fmt)
    except ValueError as e:
        fail(name, f"rows of {columns} fields ({', '.join(COLUMNS[:columns])})",
             f"line {line} of {str(path)!r}: {','.join(row)!r} ({e})")
