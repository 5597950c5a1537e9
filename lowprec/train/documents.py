"""Documents to token ids: which source a ``--data`` names, tokenized (or cached) with its tokenizer.

:func:`lowprec.train.data.load_data` calls this for jsonl, parquet, arrow and Hugging Face data, and for text
given with a tokenizer; it splits the tokens and settles the vocabulary. See [Note: the token cache] in
:mod:`lowprec.train.token_cache` for where the tokens are kept.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from lowprec.train.hf_source import HF_PREFIX, hf_source, is_saved_dataset
from lowprec.train.text_sources import DEFAULT_TEXT_FIELD, DocumentSource, SourceKind, document_kind, file_source
from lowprec.train.text_tokenizer import resolve_tokenizer
from lowprec.train.token_cache import cached_tokens


@dataclass(frozen=True, slots=True)
class Tokenized:
    """A source's documents as one stream of token ids."""

    tokens: np.ndarray
    """1-D ids, memory-mapped from the cache."""
    vocab_size: int
    """The tokenizer's vocabulary (256 for bytes): every id is below it."""
    source: str
    """What the tokens are: the data, the tokenizer, the separator, the counts and the fingerprint."""
    fingerprint: str
    """The cache key: it changes with any file, the text field or the tokenizer."""


def is_hf(path: str | Path) -> bool:
    """Whether ``--data`` names a Hugging Face dataset (``hf:...``)."""
    return isinstance(path, str) and path.startswith(HF_PREFIX)


def document_source(path: str | Path, text_field: str | None, tokenizer: str | Path | None) -> DocumentSource | None:
    """The documents ``path`` holds: ``hf:...``, a saved dataset's directory, a jsonl/parquet/arrow file or
    directory, or (with a tokenizer) text. None for text without a tokenizer, which stays byte-level as it was
    (:func:`lowprec.train.data.text_data`). ``path`` must exist unless it is ``hf:...``."""
    field = text_field or DEFAULT_TEXT_FIELD
    if is_hf(path) or is_saved_dataset(Path(path)):
        return hf_source(path, field)
    p = Path(path)
    kind = document_kind(p)
    if kind is not None:
        return file_source(p, kind, field)
    return file_source(p, SourceKind.TEXT, field) if tokenizer is not None else None


def tokenized_documents(source: DocumentSource, tokenizer: str | Path | None) -> Tokenized:
    """The source's documents, each followed by the tokenizer's EOS (see :mod:`lowprec.train.text_tokenizer`),
    from the token cache, which is built first if needed; bytes without a tokenizer."""
    ref = resolve_tokenizer(tokenizer)
    cached = cached_tokens(source, ref)
    meta = cached.meta
    how = "bytes" if tokenizer is None else f"tokenizer {ref.name} (sha256 {ref.identity[:12]}, vocabulary " \
                                           f"{meta.vocab_size:,})"
    description = (f"{source.description}: {meta.n_documents:,} documents, {how}, each followed by "
                   f"{meta.separator}; {meta.n_tokens:,} tokens, fingerprint {meta.key[:12]}")
    return Tokenized(cached.tokens, meta.vocab_size, description, meta.key)
