"""One writer per run directory: an advisory lock that a killed process cannot leave behind.

[Note: the lock on a run directory]
Two runs writing one directory delete each other's temporary files, replace each other's
checkpoints and interleave their log rows. So a run holds ``<out>/.lowprec.lock`` locked with
``flock`` while it writes there, and a second ``train``, ``compare`` or ``--resume`` on that directory
is refused in one line naming the holder's process id. The lock belongs to the open file, not to the
file's existence: the kernel releases it when the holder exits, however it exits (``kill -9``
included), and the file left behind locks nothing. Under torchrun rank 0 alone holds it, and every
rank learns whether it got it, so all of them stop together. ``flock`` is POSIX (Linux, macOS);
on a platform without it runs go unlocked, with a warning.
"""
from __future__ import annotations

import contextlib
import os
import warnings
from collections.abc import Iterator
from pathlib import Path

import torch.distributed as dist

from lowprec._checks import fail
from lowprec._files import check_writable
from lowprec.distributed.launch import Ranks

try:
    import fcntl
except ImportError:  # Windows
    fcntl = None

LOCK_FILE = ".lowprec.lock"


class RunDirectoryLocked(OSError):
    """Another process is writing the run directory."""


def _acquire(directory: Path) -> int:
    """The descriptor of the directory's lock file, locked; :class:`RunDirectoryLocked` if another holds it."""
    check_writable("out_dir", directory, directory=True)  # mkdir's bare OSError would not say which argument
    directory.mkdir(parents=True, exist_ok=True)
    fd = os.open(directory / LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.read(fd, 32).decode("ascii", errors="replace").strip() or "unknown"
        os.close(fd)
        fail("out_dir", "a directory no other run is writing", f"{str(directory)!r}, locked by process {holder} "
             "(wait for it to end, or choose another directory)", RunDirectoryLocked)
    except OSError as e:  # a file system without flock (some network mounts)
        os.close(fd)
        fail("out_dir", "a directory that can be locked (flock)", f"{str(directory)!r} ({e.strerror or e})", OSError)
    # who holds it, for the message a second run gets; the lock is the flock, not this text
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    return fd


def _agreed(error: OSError | None, ranks: Ranks) -> OSError | None:
    """Rank 0's error, on every rank (the same type and message)."""
    if not ranks.distributed:
        return error
    verdict = [None if error is None else (isinstance(error, RunDirectoryLocked), str(error))]
    dist.broadcast_object_list(verdict, src=0)
    if verdict[0] is None:
        return None
    locked, message = verdict[0]
    return RunDirectoryLocked(message) if locked else OSError(message)


@contextlib.contextmanager
def run_directory_lock(directory: str | Path, ranks: Ranks | None = None) -> Iterator[None]:
    """Hold ``directory``'s lock for the region (see [Note: the lock on a run directory]); every rank of
    ``ranks`` raises :class:`RunDirectoryLocked` if another process holds it."""
    ranks = ranks or Ranks()
    fd: int | None = None
    error: OSError | None = None
    if ranks.is_main and fcntl is None:
        warnings.warn("lowprec: no file locks on this platform; nothing stops a second run from writing "
                      f"{str(directory)!r} at the same time", stacklevel=3)
    elif ranks.is_main:
        try:
            fd = _acquire(Path(directory))
        except OSError as e:  # locked, or a directory that cannot be made: every rank stops
            error = e
    agreed = _agreed(error, ranks)
    if agreed is not None:
        raise agreed
    try:
        yield
    finally:
        if fd is not None:
            os.close(fd)  # closing the last descriptor of the open file releases the lock
