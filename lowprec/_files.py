"""Outputs on the file system: whether one can be written, and the permissions it is left with."""
from __future__ import annotations

import os
import tempfile
from pathlib import Path

from lowprec._checks import fail


def check_writable(name: str, path: str | Path, *, directory: bool, beside: bool = False) -> Path:
    """``path``, an output to be written (a directory to fill with ``directory``, else a file), can be
    made: where it exists it is a directory (with ``directory``) or a file, and the directory its files are
    created in can take a new file: ``path`` itself for an existing directory, else (and always with
    ``beside``: a directory made beside ``path`` and renamed into place) its nearest existing ancestor. So an
    unwritable output is refused naming its argument before any work, not met as a bare ``OSError`` at the
    first write. Nothing is left behind."""
    path = Path(path)
    what = "a directory" if directory else "a file"

    def refuse(why: str, exc: type[Exception]) -> None:
        fail(name, f"{what} lowprec can write", f"{str(path)!r}{why}", exc)

    at = None
    try:  # an OSError on the way (a directory this process may not enter, the probe): said naming ``name``
        if path.exists() and path.is_dir() != directory:
            wrong = "file" if directory else "directory"
        else:
            wrong = None
            ancestor = path if directory and not beside and path.is_dir() else path.parent
            while not ancestor.exists() and ancestor != ancestor.parent:
                ancestor = ancestor.parent
            if ancestor.is_dir():
                at = ancestor  # the probe's error names its temporary file: the directory is what matters
                fd, probe = tempfile.mkstemp(dir=ancestor, prefix=".lowprec-probe-")
    except OSError as e:
        where = at if at is not None else (e.filename or path)
        refuse(f": {str(where)!r} takes no new file ({e.strerror or type(e).__name__})", type(e))
    if wrong is not None:
        refuse(f", an existing {wrong}", NotADirectoryError if directory else IsADirectoryError)
    if not ancestor.is_dir():
        refuse(f", under {str(ancestor)!r}, an existing file", NotADirectoryError)
    os.close(fd)
    os.unlink(probe)
    return path


def umask() -> int:
    """This process's umask: from ``/proc/self/status`` where the kernel says it (Linux), else by setting it
    and setting it back, which leaves a moment in which another thread's new file would take mode 0666."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except OSError:
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def with_default_mode(path: Path, mask: int | None = None) -> Path:
    """Give ``path`` the permissions a plain ``open`` or ``mkdir`` would under the umask ``mask`` (None: this
    process's): ``tempfile`` makes files 0600 and directories 0700, for its own reasons, not the output's."""
    mask = umask() if mask is None else mask
    os.chmod(path, (0o777 if path.is_dir() else 0o666) & ~mask)
    return path
