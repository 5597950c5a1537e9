"""Outputs on the file system: whether one can be written, and the permissions it is left with."""
from __future__ import annotations

import os
import tempfile
from pathlib import Path

from lowprec._checks import fail


def check_writable(name: str, path: str | Path, *, directory: bool) -> Path:
    """``path``, an output to be written (a directory to fill with ``directory``, else a file), can be
    made: where it exists it is a directory (with ``directory``) or a file, and its nearest existing
    ancestor is a directory this process can create files in. So an unwritable output is refused naming its
    argument before any work, not met as a bare ``OSError`` at the first write. Nothing is left behind."""
    path = Path(path)
    what = "a directory" if directory else "a file"
    if path.exists() and path.is_dir() != directory:
        fail(name, f"{what} lowprec can write", f"{str(path)!r}, an existing {'file' if directory else 'directory'}",
             NotADirectoryError if directory else IsADirectoryError)
    ancestor = path if directory and path.is_dir() else path.parent
    while not ancestor.exists() and ancestor != ancestor.parent:
        ancestor = ancestor.parent
    if not ancestor.is_dir():
        fail(name, f"{what} lowprec can write", f"{str(path)!r}, under {str(ancestor)!r}, an existing file",
             NotADirectoryError)
    try:
        fd, probe = tempfile.mkstemp(dir=ancestor, prefix=".lowprec-probe-")
    except OSError as e:
        fail(name, f"{what} lowprec can write", f"{str(path)!r}: {str(ancestor)!r} takes no new file "
             f"({e.strerror or type(e).__name__})", type(e))
    os.close(fd)
    os.unlink(probe)
    return path


def with_default_mode(path: Path) -> Path:
    """Give ``path`` the permissions a plain ``open`` or ``mkdir`` would under this process's umask
    (``tempfile`` makes files 0600 and directories 0700, for their own reasons, not the output's)."""
    mask = os.umask(0)  # the umask can only be read by setting it
    os.umask(mask)
    os.chmod(path, (0o777 if path.is_dir() else 0o666) & ~mask)
    return path
