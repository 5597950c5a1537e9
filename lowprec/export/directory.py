"""The exported model's directory, written whole or not at all.

[Note: writing an export atomically]
Every file is written into a hidden directory beside ``out`` (``.NAME.XXXX.partial``), flushed to disk, and
the directory renamed to ``out`` at the end: a reader never sees half a model, and an export that fails
leaves nothing behind. An existing ``out`` is refused unless it is empty, or ``overwrite`` is asked for; then
the old directory is renamed aside, the new one into place, and the old one deleted (for the moment between
the two renames neither is at ``out``).
"""
from __future__ import annotations

import os
import shutil
import tempfile
import uuid
from collections.abc import Callable
from pathlib import Path

from lowprec._checks import fail
from lowprec._files import check_writable, umask, with_default_mode
from lowprec.state.files import fsync_dir


def check_out(out: Path, overwrite: bool, name: str = "out_dir") -> None:
    """Refuses ``out`` (the argument ``name``) naming a file, a directory holding files without
    ``overwrite``, or a path where no directory can be written."""
    check_writable(name, out, directory=True, beside=True)  # its files are made beside it, then renamed
    cwd, target = Path.cwd().resolve(), out.resolve()
    if target == cwd or target in cwd.parents:
        fail(name, "a directory other than the current one or one above it (an export replaces its directory "
             "whole)", f"{str(out)!r}")
    if out.is_dir() and any(out.iterdir()) and not overwrite:
        fail(name, "a new or empty directory (or overwrite=True, --overwrite)", f"{str(out)!r}, which holds "
             "files")


def _flush(directory: Path) -> None:
    for path in directory.iterdir():
        with open(path, "rb") as f:  # fsync takes a read-only descriptor: a umask without owner write is no bar
            os.fsync(f.fileno())
    fsync_dir(directory)


def write_directory(out: Path, fill: Callable[[Path], None], overwrite: bool = False) -> None:
    """Make ``out`` by calling ``fill`` on an empty directory beside it (see [Note: writing an export
    atomically])."""
    check_out(out, overwrite)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", suffix=".partial", dir=out.parent))
    try:
        fill(tmp)
        mask = umask()
        for path in (tmp, *tmp.rglob("*")):  # mkdtemp's 0700 would keep a serving engine's user out
            with_default_mode(path, mask)
        _flush(tmp)
        if out.exists():
            old = out.with_name(f".{out.name}.old-{uuid.uuid4().hex[:8]}")
            out.rename(old)
            tmp.rename(out)
            shutil.rmtree(old)
        else:
            tmp.rename(out)
        fsync_dir(out.parent)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
