"""Documents from files: jsonl, parquet and arrow files (one text field or column), text files; and what
identifies them for the token cache.

A source is a file, or a directory whose visible files (sorted, hidden ones skipped) are all of one kind:
``.jsonl``, ``.parquet`` or ``.arrow`` (an Arrow IPC file or stream, as ``datasets`` writes). A directory
mixing those kinds is refused; one holding none of them is a directory of text files. Every file is
identified by its content fingerprint, so the cache a source's tokens go to changes when a file does.
"""
from __future__ import annotations

import enum
import json
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from lowprec._checks import describe, fail
from lowprec.train.fingerprint import file_fingerprint

DEFAULT_TEXT_FIELD = "text"


class SourceKind(enum.Enum):
    """What a data file holds."""

    TEXT = "text"
    """UTF-8 text: each file is a document."""
    JSONL = "jsonl"
    """One JSON object a line; its text field is a document."""
    PARQUET = "parquet"
    """A table; each row's text column is a document."""
    ARROW = "arrow"
    """An Arrow IPC file or stream (datasets' shards): each row's text column is a document."""


DOCUMENT_SUFFIXES = {".jsonl": SourceKind.JSONL, ".parquet": SourceKind.PARQUET, ".arrow": SourceKind.ARROW}
_BATCH_ROWS = 1024


class DocumentSource(Protocol):
    """Where documents come from: files here, or a Hugging Face dataset (:mod:`lowprec.train.hf_source`)."""

    @property
    def description(self) -> str:
        """What the documents are, in a few words, for logs and reports."""

    @property
    def identity(self) -> dict[str, Any]:
        """What the tokens depend on besides the tokenizer, as JSON: the token cache's key holds it."""

    @property
    def cache_home(self) -> Path | None:
        """The directory the ``.lowprec-cache`` goes in; None: the user's cache directory only."""

    def documents(self) -> Iterator[str]:
        """Every document, in a fixed order."""


def visible_files(path: Path) -> list[Path]:
    """The files under ``path``, sorted, hidden ones (and those in hidden directories, the token cache's among
    them) skipped. A symbolic link to a file is followed; one to a directory is not descended into."""
    return sorted(p for p in path.rglob("*") if p.is_file()
                  and not any(part.startswith(".") for part in p.relative_to(path).parts))


def document_kind(path: Path) -> SourceKind | None:
    """The kind of a jsonl/parquet/arrow file or directory of them; None for anything else (text, token files).
    A directory mixing those kinds, or one of them with other files, is refused."""
    if not path.is_dir():
        return DOCUMENT_SUFFIXES.get(path.suffix)
    counts = Counter(kind.value if (kind := DOCUMENT_SUFFIXES.get(f.suffix)) else "other"
                     for f in visible_files(path))
    if not counts.keys() - {"other"}:
        return None
    if len(counts) > 1:
        found = ", ".join(f"{n:,} {k}" for k, n in sorted(counts.items()))
        fail("data", "a directory whose files are all of one kind (.jsonl, .parquet or .arrow), or all text",
             f"{str(path)!r} holding {found} files")
    return SourceKind(next(iter(counts)))


@dataclass(frozen=True, slots=True)
class FileSource:
    """Documents in a file or a directory of files of one kind."""

    kind: SourceKind
    path: Path
    """As given: a file or a directory."""
    files: tuple[Path, ...]
    fingerprints: tuple[str, ...]
    """Each file's :func:`file_fingerprint`, in order."""
    text_field: str
    """The field (jsonl) or column (parquet, arrow) holding the text; unused for text files."""

    @property
    def description(self) -> str:
        field = "" if self.kind is SourceKind.TEXT else f", field {self.text_field!r}"
        n = len(self.files)
        return f"{self.kind.value}: {self.path} ({n:,} file{'' if n == 1 else 's'}{field})"

    @property
    def identity(self) -> dict[str, Any]:
        root = self.path if self.path.is_dir() else self.path.parent
        return {"kind": self.kind.value, "text_field": None if self.kind is SourceKind.TEXT else self.text_field,
                "files": [[f.relative_to(root).as_posix(), h] for f, h in zip(self.files, self.fingerprints)]}

    @property
    def cache_home(self) -> Path:
        return self.path if self.path.is_dir() else self.path.parent

    def documents(self) -> Iterator[str]:
        return _READERS[self.kind](self.files, self.text_field, self.path.is_dir())


def file_source(path: Path, kind: SourceKind, text_field: str = DEFAULT_TEXT_FIELD) -> FileSource:
    """The documents of ``path`` (a file, or a directory of files) of ``kind``, fingerprinted now."""
    files = tuple(visible_files(path)) if path.is_dir() else (path,)
    if not files:
        fail("data", "a file or a directory with files in it", f"{str(path)!r}, an empty directory")
    return FileSource(kind, path, files, tuple(file_fingerprint(f) for f in files), text_field)


def _text_documents(files: tuple[Path, ...], _field: str, in_directory: bool) -> Iterator[str]:
    """Each UTF-8 file, line endings normalised; in a directory, files that are not UTF-8 are skipped."""
    for f in files:
        try:
            text = f.read_bytes().decode("utf-8")
        except UnicodeDecodeError:
            if not in_directory:
                fail("data", "a UTF-8 text file, a directory of them, a .jsonl/.parquet/.arrow file or directory, "
                     "or a .npy/.bin token file", f"{str(f)!r}, which is not UTF-8 text")
            continue
        yield text.replace("\r\n", "\n")


def _jsonl_documents(files: tuple[Path, ...], field: str, _in_directory: bool) -> Iterator[str]:
    """The ``field`` of every line's object; blank lines are skipped."""
    for f in files:
        with f.open("rb") as lines:
            for n, line in enumerate(lines, 1):
                if not line.strip():
                    continue
                try:
                    row = json.loads(line)
                except ValueError as e:  # UnicodeDecodeError is one too
                    fail("data", "a JSON object on every line of a jsonl file", f"{f}, line {n}: {e}")
                if not isinstance(row, dict):
                    fail("data", "a JSON object on every line of a jsonl file", f"{f}, line {n}: a "
                         f"{type(row).__name__}")
                if field not in row:
                    fail("text_field", f"a field {field!r} on every line", f"{f}, line {n}, whose fields are "
                         + (", ".join(map(repr, list(row)[:10])) or "none"))
                yield _text(row[field], field, f"{f}, line {n}")


def _text(value: Any, field: str, where: str) -> str:
    if not isinstance(value, str):
        fail("text_field", f"a string in {field!r}", f"{where}: {describe(value)[:200]}")
    return value


def _import_pyarrow() -> Any:
    try:
        import pyarrow
        import pyarrow.parquet  # the submodule is not imported with the package
    except ImportError:
        fail("data", "the pyarrow package for parquet and arrow files (pip install 'lowprec[data]')",
             "it is not installed", ImportError)
    return pyarrow


def _check_column(schema: Any, field: str, f: Path, kind: str) -> None:
    pa = _import_pyarrow()
    if field not in schema.names:
        fail("text_field", f"a column {field!r} in every {kind} file", f"{f}, whose columns are "
             + ", ".join(map(repr, schema.names[:10])))
    column = schema.field(field).type
    if not (pa.types.is_string(column) or pa.types.is_large_string(column) or pa.types.is_string_view(column)):
        fail("text_field", f"a string column {field!r}", f"{f}: a {column} column")


def _column_texts(batches: Iterator[Any], field: str, f: Path) -> Iterator[str]:
    row = 0
    for batch in batches:
        for i, value in enumerate(batch.column(field).to_pylist()):
            yield _text(value, field, f"{f}, row {row + i:,}")
        row += batch.num_rows


def _parquet_documents(files: tuple[Path, ...], field: str, _in_directory: bool) -> Iterator[str]:
    pa = _import_pyarrow()
    for f in files:
        try:
            table = pa.parquet.ParquetFile(f)
        except (pa.ArrowException, OSError) as e:
            fail("data", "a parquet file", f"{str(f)!r}: {str(e).splitlines()[0] if str(e) else type(e).__name__}")
        _check_column(table.schema_arrow, field, f, "parquet")
        yield from _column_texts(table.iter_batches(batch_size=_BATCH_ROWS, columns=[field]), field, f)


def _arrow_documents(files: tuple[Path, ...], field: str, _in_directory: bool) -> Iterator[str]:
    pa = _import_pyarrow()
    for f in files:
        with pa.memory_map(str(f)) as mapped:
            try:  # the IPC file format (random access) first, then the stream format datasets writes
                reader = pa.ipc.open_file(mapped)
                batches = (reader.get_batch(i) for i in range(reader.num_record_batches))
            except pa.ArrowInvalid:
                mapped.seek(0)
                try:
                    reader = pa.ipc.open_stream(mapped)
                except pa.ArrowInvalid as e:
                    fail("data", "an Arrow IPC file or stream in a .arrow file", f"{str(f)!r}: {e}")
                batches = iter(reader)
            _check_column(reader.schema, field, f, "arrow")
            yield from _column_texts(batches, field, f)


_READERS = {SourceKind.TEXT: _text_documents, SourceKind.JSONL: _jsonl_documents,
            SourceKind.PARQUET: _parquet_documents, SourceKind.ARROW: _arrow_documents}
