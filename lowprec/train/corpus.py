"""The embedded default corpus: the running Python's standard library source, as bytes.

Every machine that runs lowprec has a Python standard library, so a first run needs no download.
The corpus is the ``.py`` files of the standard library (code and docstrings), tests and bundled
third-party packages left out, read in sorted path order, line endings normalised to ``\\n``, and
cut at a size cap so that building it stays well under two seconds.

The same interpreter gives the same bytes on every run; a different Python version gives a
different corpus, which is why the reports record :attr:`Corpus.sha256` and the version.
"""
from __future__ import annotations

import hashlib
import os
import platform
import sysconfig
from dataclasses import dataclass
from pathlib import Path

from lowprec._checks import check_positive_int, fail

DEFAULT_CAP_BYTES = 4 << 20
"""4 MiB: ~2,000 training steps of 2,048 tokens before a byte repeats, built in ~0.1 s."""

_SKIPPED_DIRS = frozenset({
    "test", "tests", "idle_test", "idlelib", "site-packages", "dist-packages", "__pycache__",
    "lib2to3", "turtledemo", "ensurepip", "pydoc_data", "encodings",
})
"""Tests, installed third-party code, generated text and codec tables (repetitive data, not prose or code)."""


@dataclass(frozen=True, slots=True)
class Corpus:
    data: bytes
    """The text as UTF-8 bytes: byte ``b`` is token ``b`` (vocabulary 256)."""
    sha256: str
    python_version: str
    """The interpreter whose standard library this is; another version gives other bytes."""
    n_files: int


def stdlib_root() -> Path:
    root = Path(sysconfig.get_paths()["stdlib"])
    if not (root / "os.py").is_file():
        fail("stdlib", "a standard library directory holding os.py (the embedded corpus is built from it)",
             str(root), FileNotFoundError)
    return root


def _source_files(root: Path) -> list[Path]:
    """Every kept ``.py`` file under ``root``, in sorted order of its relative POSIX path."""
    found: list[tuple[str, Path]] = []
    for dirpath, dirnames, filenames in os.walk(root):
        # pruning in place keeps os.walk out of the test suites and site-packages entirely
        dirnames[:] = [d for d in dirnames if d not in _SKIPPED_DIRS and not d.startswith((".", "config-"))]
        for name in filenames:
            if name.endswith(".py"):
                path = Path(dirpath, name)
                found.append((path.relative_to(root).as_posix(), path))
    return [path for _, path in sorted(found)]


def build_corpus(cap_bytes: int = DEFAULT_CAP_BYTES) -> Corpus:
    """The first ``cap_bytes`` bytes of the standard library's source, files joined by a blank line."""
    check_positive_int("cap_bytes", cap_bytes)
    parts: list[bytes] = []
    size = n_files = 0
    for path in _source_files(stdlib_root()):
        text = path.read_bytes().replace(b"\r\n", b"\n") + b"\n\n"
        parts.append(text[: cap_bytes - size])
        size += len(parts[-1])
        n_files += 1
        if size >= cap_bytes:
            break
    data = b"".join(parts)
    return Corpus(data=data, sha256=hashlib.sha256(data).hexdigest(),
                  python_version=platform.python_version(), n_files=n_files)
