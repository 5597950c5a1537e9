"""The token cache: documents tokenized once into a memory-mapped file, reused while nothing they depend on
changes.

[Note: the token cache] A source's tokens go to ``tokens-<key>.bin`` (raw ids, uint16 when the
vocabulary fits, else uint32) with ``tokens-<key>.json`` beside it: its size, sha256, dtype, token and
document counts, vocabulary and separator. The key is the sha256 of the source's identity (its files'
fingerprints and the text field, or a dataset's fingerprint) and the tokenizer's, so a changed file, field or
tokenizer gets another cache. Both files are written under temporary names and renamed into place, the
JSON last: a run killed while tokenizing leaves no file that passes for a whole cache. A cache whose
file does not match its JSON (truncated, overwritten) is rebuilt with a warning.

The cache lives in ``.lowprec-cache/`` beside the data (next to a file, inside a directory). Where that
cannot be written, and for data streamed from the Hub, it goes to the directory ``LOWPREC_CACHE_DIR``
names, else ``~/.cache/lowprec``, with a warning saying so. Delete either at any time: it is rebuilt.
"""
from __future__ import annotations

import hashlib
import itertools
import json
import os
import uuid
import warnings
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

from lowprec._checks import fail
from lowprec.state.files import file_sha256
from lowprec.train.text_sources import DocumentSource
from lowprec.train.text_tokenizer import Encoder, TokenizerRef

CACHE_DIR_NAME = ".lowprec-cache"
CACHE_ENV = "LOWPREC_CACHE_DIR"
"""Names the cache directory used where the data's own directory cannot be written."""
CACHE_FORMAT = 1
"""Bumped when the layout or the way documents are joined changes, so that older caches are not read."""
_BATCH_DOCUMENTS = 1024


@dataclass(frozen=True, slots=True)
class CacheMeta:
    """The JSON beside a cache's tokens: what they are and how to check them."""

    format: int
    key: str
    dtype: str
    n_tokens: int
    n_bytes: int
    sha256: str
    n_documents: int
    vocab_size: int
    """The tokenizer's vocabulary: every id is below it."""
    separator: str
    """What follows each document, in words."""
    tokenizer: str


@dataclass(frozen=True, slots=True)
class CachedTokens:
    tokens: np.ndarray
    """1-D ids, a read-only memory map."""
    meta: CacheMeta
    path: Path


def cache_key(source: DocumentSource, tokenizer: TokenizerRef) -> str:
    """sha256 of everything the tokens depend on: the cache's name and the data's fingerprint."""
    identity = {"format": CACHE_FORMAT, "source": source.identity, "tokenizer": tokenizer.identity}
    return hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()


def user_cache_dir() -> Path:
    """Where caches go when the data's directory cannot take one: ``$LOWPREC_CACHE_DIR`` or ~/.cache/lowprec."""
    return Path(os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "lowprec").expanduser()


def cached_tokens(source: DocumentSource, tokenizer: TokenizerRef) -> CachedTokens:
    """The source's tokens: from a valid cache if one exists, else tokenized now into a new one."""
    key = cache_key(source, tokenizer)
    dirs = ([source.cache_home / CACHE_DIR_NAME] if source.cache_home is not None else []) + [user_cache_dir()]
    for d in dirs:
        found = _read(d, key)
        if found is not None:
            return found
    for i, d in enumerate(dirs):
        if _writable(d):
            if i > 0 and source.cache_home is not None:
                warnings.warn(f"token cache: {dirs[0]} cannot be written; the tokens of {source.description} are "
                              f"cached in {d} (set {CACHE_ENV} to choose)", stacklevel=2)
            return _build(d, key, source, tokenizer.load(), tokenizer.name)
    fail("data", f"a writable directory for the token cache ({CACHE_DIR_NAME} beside the data, or ${CACHE_ENV})",
         ", ".join(map(str, dirs)) + ": none can be written", PermissionError)


def _paths(d: Path, key: str) -> tuple[Path, Path]:
    stem = f"tokens-{key[:32]}"
    return d / f"{stem}.bin", d / f"{stem}.json"


def _writable(d: Path) -> bool:
    try:
        d.mkdir(parents=True, exist_ok=True)
        probe = d / f".probe-{uuid.uuid4().hex}"
        probe.touch()
        probe.unlink()
    except OSError:
        return False
    return True


def _read(d: Path, key: str) -> CachedTokens | None:
    """The cache of ``key`` in ``d`` if it is whole; None if there is none; a warning if one is there but
    broken (it is then rebuilt)."""
    bin_path, meta_path = _paths(d, key)
    if not meta_path.is_file():
        return None  # a .bin without its JSON is a build that did not finish: rebuilt without a word
    problem = _problem(bin_path, meta_path, key)
    if isinstance(problem, str):
        warnings.warn(f"token cache {bin_path} is corrupt ({problem}): tokenizing again", stacklevel=3)
        return None
    tokens = np.memmap(bin_path, dtype=np.dtype(problem.dtype), mode="r", shape=(problem.n_tokens,))
    return CachedTokens(tokens, problem, bin_path)


def _problem(bin_path: Path, meta_path: Path, key: str) -> CacheMeta | str:
    """The cache's metadata if its tokens match it, else what is wrong."""
    try:
        meta = CacheMeta(**json.loads(meta_path.read_text(encoding="utf-8")))
    except (ValueError, TypeError) as e:
        return f"its JSON does not read: {e}"
    if meta.format != CACHE_FORMAT or meta.key != key:
        return f"its JSON is for format {meta.format}, key {meta.key[:12]}"
    if not bin_path.is_file():
        return "its tokens are missing"
    size = bin_path.stat().st_size
    if size != meta.n_bytes or meta.n_bytes != meta.n_tokens * np.dtype(meta.dtype).itemsize:
        return f"{size:,} bytes where its JSON says {meta.n_bytes:,}"
    if file_sha256(bin_path) != meta.sha256:
        return "its sha256 differs from its JSON's"
    return meta


def _joined(ids: Sequence[int], separator: tuple[int, ...]) -> np.ndarray:
    """A document's ids followed by the separator, unless they already end with it."""
    doc = np.asarray(ids, dtype=np.int64)  # (n,)
    n = len(separator)
    if n and not (len(doc) >= n and tuple(doc[-n:].tolist()) == separator):
        doc = np.concatenate([doc, np.asarray(separator, dtype=np.int64)])
    return doc


def token_dtype(vocab_size: int) -> np.dtype:
    """uint16 when every id fits, else uint32."""
    return np.dtype(np.uint16 if vocab_size <= 1 << 16 else np.uint32)


def _batches(docs: Iterator[str]) -> Iterator[list[str]]:
    while batch := list(itertools.islice(docs, _BATCH_DOCUMENTS)):
        yield batch


def _build(d: Path, key: str, source: DocumentSource, encoder: Encoder, tokenizer: str) -> CachedTokens:
    """Tokenizes every document into ``d`` under temporary names, then renames the tokens and the JSON (last)
    into place."""
    bin_path, meta_path = _paths(d, key)
    suffix = f".tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    tmp_bin, tmp_meta = bin_path.with_name(bin_path.name + suffix), meta_path.with_name(meta_path.name + suffix)
    dtype = token_dtype(encoder.vocab_size)
    try:
        counts = _write_tokens(tmp_bin, source, encoder, dtype)
        meta = CacheMeta(format=CACHE_FORMAT, key=key, dtype=dtype.name, vocab_size=encoder.vocab_size,
                         separator=encoder.separator_name, tokenizer=tokenizer, **counts)
        tmp_meta.write_text(json.dumps(asdict(meta), indent=1), encoding="utf-8")
        os.replace(tmp_bin, bin_path)
        os.replace(tmp_meta, meta_path)
    finally:
        for tmp in (tmp_bin, tmp_meta):
            tmp.unlink(missing_ok=True)
    tokens = np.memmap(bin_path, dtype=dtype, mode="r", shape=(meta.n_tokens,))
    return CachedTokens(tokens, meta, bin_path)


def _write_tokens(path: Path, source: DocumentSource, encoder: Encoder, dtype: np.dtype) -> dict[str, Any]:
    """Every document's ids and separator into ``path``, flushed to disk; its counts and sha256."""
    h, n_tokens, n_documents = hashlib.sha256(), 0, 0
    with path.open("wb") as f:
        for batch in _batches(source.documents()):
            encoded = encoder.encode_batch(batch)
            parts = [_joined(ids, encoder.separator) for ids in encoded]
            ids = np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)  # (batch tokens,)
            if len(ids) and int(ids.max()) >= encoder.vocab_size:
                fail("tokenizer", f"ids below its vocabulary size {encoder.vocab_size:,}",
                     f"{int(ids.max()):,} in {source.description}")
            raw = ids.astype(dtype).tobytes()
            f.write(raw)
            h.update(raw)
            n_tokens, n_documents = n_tokens + len(ids), n_documents + len(batch)
        f.flush()
        os.fsync(f.fileno())
    if n_documents == 0:
        fail("data", "at least one document", f"none in {source.description}")
    if n_tokens == 0:
        fail("data", "at least one token", f"{n_documents:,} empty documents in {source.description}")
    return {"n_tokens": n_tokens, "n_bytes": n_tokens * dtype.itemsize, "sha256": h.hexdigest(),
            "n_documents": n_documents}
