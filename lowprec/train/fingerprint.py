"""A file's fingerprint: its size and the hash of its two ends, cheap enough to take on every start.

Hashing gigabytes of data each time a run starts would be slow; a file's size and its first and last
megabyte tell a changed file apart in practice (a file of up to 2 MiB is hashed whole). The token
files' description, the resume check and the token cache's key all use it.
"""
from __future__ import annotations

import hashlib
from pathlib import Path

FINGERPRINT_SPAN = 1 << 20
"""Bytes hashed at each end of a file."""


def file_fingerprint(path: Path) -> str:
    """sha256 of ``path``'s size, first and last :data:`FINGERPRINT_SPAN` bytes, in hex."""
    size = path.stat().st_size
    h = hashlib.sha256(str(size).encode())
    with path.open("rb") as f:
        h.update(f.read(FINGERPRINT_SPAN))
        f.seek(max(0, size - FINGERPRINT_SPAN))
        h.update(f.read(FINGERPRINT_SPAN))
    return h.hexdigest()
