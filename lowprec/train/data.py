"""Training data: the embedded corpus, text files and directories, token files, jsonl/parquet/arrow files and
Hugging Face datasets; batches from them.

Every source becomes one 1-D array of token ids, split once into a training part (the head) and a
validation part (the last ``val_fraction``). Text is byte-level (token = byte, vocabulary 256) unless a
tokenizer is given; token files (``.npy``, or raw ``.bin`` of uint16/uint32) are memory-mapped, never read
whole. Documents (jsonl, parquet, arrow, ``hf:``, and text with a tokenizer) are tokenized once into a
memory-mapped cache (:mod:`lowprec.train.token_cache`) by :mod:`lowprec.train.documents`.

Batches are a pure function of ``(seed, step)``: the run that resumes at step k draws exactly the
batches the uninterrupted run drew, and every recipe of a comparison sees the same data in the
same order. Under torchrun each rank takes its share of the rows of that same batch, so the data
position is the step whatever the number of ranks, and a run resumed on another number of ranks
goes on with the batches the first one would have drawn.
"""
from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import torch

from lowprec._checks import check_choice, check_positive_int, describe, fail
from lowprec.train.corpus import DEFAULT_CAP_BYTES, build_corpus
from lowprec.train.documents import document_source, is_hf, tokenized_documents
from lowprec.train.fingerprint import file_fingerprint
from lowprec.train.text_sources import DocumentSource, visible_files
from lowprec.train.text_tokenizer import BYTE_VOCAB

TOKEN_DTYPES = {"uint16": np.uint16, "uint32": np.uint32}
DEFAULT_VAL_FRACTION = 0.05
MAX_INFERRED_VOCAB = 1 << 18
"""The largest vocabulary taken from a token file's largest id without ``vocab_size``: 262,144, the size
of the largest common tokenizers'. One stray id above it (a corrupt file) would otherwise build an
embedding and LM head of that many rows; a larger vocabulary must be given."""
VOCAB_MULTIPLE = 32
"""An inferred vocabulary (a token file's, a tokenizer's) is rounded up to a multiple of this, so that the LM
head tiles into 32-wide blocks; the extra rows are never a target."""


@dataclass(frozen=True, slots=True)
class TokenData:
    """A token stream split into training and validation parts."""

    train: np.ndarray
    """1-D token ids (possibly a read-only memory map)."""
    val: np.ndarray
    vocab_size: int
    """Token ids are below this; the model's vocabulary must be at least as large."""
    source: str
    """What the tokens came from, for logs and reports."""
    fingerprint: str
    """sha256 identifying the data, checked when a run resumes."""
    val_fraction: float = DEFAULT_VAL_FRACTION
    """The share of the tokens in the validation part (at least one token)."""

    def train_batch(self, seed: int, step: int, n_micro: int, batch_size: int, seq_len: int, *,
                    rank: int = 0, world_size: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
        """The inputs and next-token targets of training step ``step``, each (n_micro, B / world_size, T), int64.

        Window starts are drawn uniformly from a generator seeded with ``(seed, step)`` alone. With
        ``world_size`` ranks, ``batch_size`` is the global micro-batch and rank ``r`` gets its rows
        ``r*B/W .. (r+1)*B/W - 1``: the ranks' slices of a step are, together, the batch one process
        draws, and only this rank's windows are read from the tokens.
        """
        check_sequence_fits(self, seq_len)
        rows = _rank_rows(batch_size, rank, world_size)
        rng = np.random.default_rng([seed, step])
        starts = rng.integers(0, len(self.train) - seq_len, size=n_micro * batch_size)  # (M*B,)
        starts = starts.reshape(n_micro, batch_size)[:, rows].reshape(-1)  # (M*B/W,)
        windows = _windows(self.train, starts, seq_len).view(n_micro, -1, seq_len + 1)  # (M, B/W, T+1)
        return windows[..., :-1], windows[..., 1:]

    def val_batches(self, n_batches: int, batch_size: int, seq_len: int, *, rank: int = 0,
                    world_size: int = 1) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """A fixed validation set: ``n_batches`` (inputs, targets) pairs of (B / world_size, T), windows evenly
        spaced; with ``world_size`` ranks, each batch's rows are split as in :meth:`train_batch`."""
        check_positive_int("val_batches", n_batches)
        check_sequence_fits(self, seq_len)
        rows = _rank_rows(batch_size, rank, world_size)
        n = n_batches * batch_size
        starts = np.linspace(0, len(self.val) - seq_len - 1, n).astype(np.int64)  # (N,)
        starts = starts.reshape(n_batches, batch_size)[:, rows].reshape(-1)  # (N/W,)
        windows = _windows(self.val, starts, seq_len).view(n_batches, -1, seq_len + 1)  # (N/B, B/W, T+1)
        return [(w[:, :-1], w[:, 1:]) for w in windows]


def _rank_rows(batch_size: int, rank: int, world_size: int) -> slice:
    """The rows of a global batch that rank ``rank`` of ``world_size`` trains on."""
    check_positive_int("world_size", world_size)
    if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < world_size:
        fail("rank", f"an int in [0, {world_size})", describe(rank))
    if batch_size % world_size:
        fail("batch_size", f"a multiple of the number of ranks {world_size} (each rank takes an equal share of "
             "every micro-batch)", batch_size)
    per_rank = batch_size // world_size
    return slice(rank * per_rank, (rank + 1) * per_rank)


def longest_sequence(data: TokenData) -> int:
    """The longest ``seq_len`` the data takes: a window is a sequence and its next token's target, and the
    training split draws its starts from at least two places."""
    return min(len(data.train), len(data.val)) - 2


def tokens_needed(seq_len: int, val_fraction: float) -> int:
    """The fewest tokens a source needs so that both its splits hold one window of ``seq_len``."""
    n = max(2 * (seq_len + 2), math.ceil((seq_len + 2) / val_fraction))
    while int(n * val_fraction) < seq_len + 2:  # the float product may round under
        n += 1
    return n


def check_sequence_fits(data: TokenData, seq_len: int, max_positions: int | None = None, *,
                        names: tuple[str, str] = ("data", "seq_len")) -> None:
    """Refuses a ``seq_len`` the data (or the model, ``max_positions``) cannot take, naming every limit at
    once; data too small for one sequence is refused as such. ``names``: the data's and seq_len's options."""
    data_name, seq_name = names
    total, longest, needed = len(data.train) + len(data.val), longest_sequence(data), tokens_needed(
        seq_len, data.val_fraction)
    over_model = max_positions is not None and seq_len > max_positions
    if longest < 1:  # no seq_len fits: the data is what to change
        model = f"; {seq_name} {seq_len:,} is also over the model's {max_positions:,} positions" if over_model else ""
        fail(data_name, f"at least {needed:,} tokens, for one sequence of {seq_name} {seq_len:,} in each of the "
             f"training and validation (last {data.val_fraction:.0%}) splits",
             f"{data.source}: {total:,} tokens{model}")
    if seq_len > longest or over_model:
        more = f"; {seq_len:,} needs at least {needed:,} tokens" if seq_len > longest else ""
        limits = [f"{longest:,} ({data_name} {data.source}: {total:,} tokens, its validation split "
                  f"{len(data.val):,}{more})"]
        if max_positions is not None:
            limits.append(f"{max_positions:,} (the model's max positions)")
        fail(seq_name, f"at most {min(longest, max_positions or longest):,}, the least of " + " and ".join(limits)
             if len(limits) > 1 else f"at most {limits[0]}", f"{seq_len:,}")


def _windows(tokens: np.ndarray, starts: np.ndarray, seq_len: int) -> torch.Tensor:
    rows = np.stack([np.asarray(tokens[s: s + seq_len + 1], dtype=np.int64) for s in starts])  # (N, T+1)
    return torch.from_numpy(rows)


def _split(tokens: np.ndarray, val_fraction: float, vocab_size: int, source: str, fingerprint: str) -> TokenData:
    if not 0.0 < val_fraction < 1.0:
        fail("val_fraction", "a number strictly between 0 and 1", describe(val_fraction))
    cut = len(tokens) - max(1, int(len(tokens) * val_fraction))
    return TokenData(train=tokens[:cut], val=tokens[cut:], vocab_size=vocab_size, source=source,
                     fingerprint=fingerprint, val_fraction=val_fraction)


def corpus_data(cap_bytes: int = DEFAULT_CAP_BYTES, val_fraction: float = DEFAULT_VAL_FRACTION) -> TokenData:
    """The embedded corpus (:mod:`lowprec.train.corpus`) as byte tokens."""
    corpus = build_corpus(cap_bytes)
    tokens = np.frombuffer(corpus.data, dtype=np.uint8)
    source = f"embedded corpus (Python {corpus.python_version} standard library, {corpus.n_files} files)"
    return _split(tokens, val_fraction, BYTE_VOCAB, source, corpus.sha256)


def _plural(n: int, word: str) -> str:
    return f"{n:,} {word}" + ("" if n == 1 else "s")


def text_data(path: Path, val_fraction: float = DEFAULT_VAL_FRACTION) -> TokenData:
    """A UTF-8 text file, or every UTF-8 file under a directory (sorted, hidden ones skipped, symbolic
    links to files followed), as bytes."""
    files = visible_files(path) if path.is_dir() else [path]
    parts, links = [], 0
    for f in files:
        raw = f.read_bytes()
        try:
            raw.decode("utf-8")
        except UnicodeDecodeError:
            if not path.is_dir():
                fail("data", "a UTF-8 text file, a directory of them, or a .npy/.bin token file",
                     f"{str(path)!r}, which is not UTF-8 text")
            continue  # binaries in a directory of text are not training data
        parts.append(raw.replace(b"\r\n", b"\n"))
        links += path.is_dir() and f.is_symlink()
    data = b"\n\n".join(parts)
    if len(data) == 0:
        fail("data", "text to train on", f"no UTF-8 text in {str(path)!r}")
    tokens = np.frombuffer(data, dtype=np.uint8)
    digest = hashlib.sha256(data).hexdigest()
    # size and hash in the description: a resumed run on changed data is told what changed
    linked = f", {links:,} through symbolic links" if links else ""
    source = f"text: {path} ({_plural(len(parts), 'file')}{linked}, {_plural(len(data), 'byte')}, sha256 {digest[:12]})"
    return _split(tokens, val_fraction, BYTE_VOCAB, source, digest)


def token_file_data(path: Path, token_dtype: str = "uint16", val_fraction: float = DEFAULT_VAL_FRACTION,
                    vocab_size: int | None = None) -> TokenData:
    """Pre-tokenized ids, memory-mapped: a 1-D integer ``.npy``, or a raw ``.bin`` of ``token_dtype``;
    every id below ``vocab_size`` (see :func:`load_data`)."""
    _check_vocab_size(vocab_size)
    if path.suffix == ".npy":
        try:
            tokens = np.load(path, mmap_mode="r")  # allow_pickle stays off: a token file holds no objects
        except (ValueError, OSError, EOFError) as e:
            why = str(e).split(". ")[0].split("\n")[0]  # numpy's first sentence: "mmap length is greater ..."
            fail("data", "a .npy file of token ids, as numpy.save writes it", f"{str(path)!r}, which numpy "
                 f"cannot read ({why})")
        if tokens.ndim != 1 or tokens.dtype.kind not in "iu":
            fail("data", "a 1-D integer array in the .npy file", f"dtype {tokens.dtype}, shape {tokens.shape}")
    else:
        dtype = TOKEN_DTYPES[check_choice("token_dtype", token_dtype, TOKEN_DTYPES)]
        if path.stat().st_size % np.dtype(dtype).itemsize:
            fail("data", f"a .bin file whose size is a multiple of {np.dtype(dtype).itemsize} ({token_dtype})",
                 f"{path.stat().st_size} bytes")
        tokens = np.memmap(path, dtype=dtype, mode="r")
    if len(tokens) == 0:
        fail("data", "at least one token", f"an empty file {str(path)!r}")
    low = int(tokens.min())
    if low < 0:
        fail("data", "non-negative token ids", f"{low} at position {int(np.argmin(tokens)):,} of {str(path)!r}")
    fingerprint = file_fingerprint(path)
    source = (f"tokens: {path} ({len(tokens):,} {tokens.dtype}, {_plural(path.stat().st_size, 'byte')}, "
              f"fingerprint {fingerprint[:12]})")
    return _split(tokens, val_fraction, _token_vocab(tokens, path, vocab_size), source, fingerprint)


def _token_vocab(tokens: np.ndarray, path: Path, vocab_size: int | None) -> int:
    """``vocab_size`` if every id is below it; without it, the largest id + 1 rounded up to a multiple of 32
    (so the LM head tiles into 32-wide blocks), up to :data:`MAX_INFERRED_VOCAB`."""
    top = int(tokens.max())
    if vocab_size is None and top < MAX_INFERRED_VOCAB:
        return padded_vocab(top + 1)
    # the position makes a stray id findable; looked for only when refusing (a second pass over the file)
    where = f"{top:,} at position {int(np.argmax(tokens)):,} of {str(path)!r}"
    if vocab_size is None:
        fail("data", f"token ids below {MAX_INFERRED_VOCAB:,} (the largest vocabulary inferred from the data; "
             "if the ids are right, give the vocabulary: vocab_size, --vocab-size)", where)
    if top >= vocab_size:
        fail("data", f"token ids below the vocabulary size {vocab_size:,}", where)
    return vocab_size


def padded_vocab(n: int) -> int:
    """``n`` rounded up to a multiple of :data:`VOCAB_MULTIPLE`."""
    return -(-n // VOCAB_MULTIPLE) * VOCAB_MULTIPLE


def _check_vocab_size(vocab_size: int | None) -> int | None:
    if vocab_size is not None:
        check_positive_int("vocab_size", vocab_size)
    return vocab_size


def load_data(path: str | Path | None = None, *, token_dtype: str = "uint16",
              val_fraction: float = DEFAULT_VAL_FRACTION, vocab_size: int | None = None,
              tokenizer: str | Path | None = None, text_field: str | None = None) -> TokenData:
    """The embedded corpus (``path=None``), a text file or directory, a ``.npy``/``.bin`` token file, a
    jsonl/parquet/arrow file or directory of one kind, or a Hugging Face dataset (``hf:...``, see
    :mod:`lowprec.train.hf_source`).

    ``tokenizer``: a tokenizer.json, a directory or name transformers.AutoTokenizer loads (see
    :mod:`lowprec.train.text_tokenizer`); without it text is bytes. ``text_field``: the field or column holding
    the text of jsonl, parquet, arrow and hf: data (default ``text``).
    ``vocab_size``: the model's vocabulary; every token id must be below it. Without it, text has 256,
    tokenized text the tokenizer's vocabulary, and a token file its largest id + 1, each rounded up to 32
    (a token file's at most :data:`MAX_INFERRED_VOCAB`).
    """
    _check_vocab_size(vocab_size)
    if path is None:
        _refuse_text_options(tokenizer, text_field, "the embedded corpus, byte-level text (give --data)")
        return _with_vocab(corpus_data(val_fraction=val_fraction), vocab_size, BYTE_VOCAB, None)
    if not is_hf(path):
        p = Path(path)
        if not p.exists():
            fail("data", "an existing file or directory", repr(str(path)), FileNotFoundError)
        if p.is_file() and p.suffix in (".npy", ".bin"):
            _refuse_text_options(tokenizer, text_field, f"the token file {str(p)!r}, which holds ids already")
            return token_file_data(p, token_dtype, val_fraction, vocab_size)
    source = document_source(path, text_field, tokenizer)
    if source is None:
        _refuse_text_options(None, text_field, f"the text {str(path)!r}")
        return _with_vocab(text_data(Path(path), val_fraction), vocab_size, BYTE_VOCAB, None)
    return documents_data(source, tokenizer, val_fraction, vocab_size)


def documents_data(source: DocumentSource, tokenizer: str | Path | None = None,
                   val_fraction: float = DEFAULT_VAL_FRACTION, vocab_size: int | None = None) -> TokenData:
    """A source's documents tokenized (from the token cache when it holds them), split; the vocabulary
    ``vocab_size``, at least the tokenizer's, or by default the tokenizer's rounded up to 32 (bytes: 256)."""
    tokens = tokenized_documents(source, tokenizer)
    data = _split(tokens.tokens, val_fraction, padded_vocab(tokens.vocab_size), tokens.source, tokens.fingerprint)
    return _with_vocab(data, vocab_size, tokens.vocab_size, tokenizer)


def _refuse_text_options(tokenizer: str | Path | None, text_field: str | None, source: str) -> None:
    """A tokenizer or a text field given with data that has no use for it is refused, not ignored."""
    if tokenizer is not None:
        fail("tokenizer", "text to tokenize (a text, jsonl, parquet or arrow file or directory, or hf:...)",
             f"{str(tokenizer)!r} with {source}")
    if text_field is not None:
        fail("text_field", "jsonl, parquet, arrow or hf: data, whose records have fields",
             f"{text_field!r} with {source}")


def _with_vocab(data: TokenData, vocab_size: int | None, least: int, tokenizer: str | Path | None) -> TokenData:
    """``data`` with the model's vocabulary ``vocab_size`` (None: the data's own), which must hold every id of
    a vocabulary of ``least``."""
    if vocab_size is None:
        return data
    if vocab_size < least:
        fail("vocab_size", f"at least {least:,} for byte-level text (token = byte)" if tokenizer is None else
             f"at least {least:,}, the vocabulary of tokenizer {str(tokenizer)!r}", vocab_size)
    return replace(data, vocab_size=vocab_size)


def data_passes(data: TokenData, steps: int, batch_size: int, seq_len: int, grad_accum: int = 1) -> float:
    """How many times over a run of ``steps`` reads the training split: the tokens its batches draw
    (``steps x grad_accum x batch_size x seq_len``) over the split's tokens. Windows are drawn at random,
    so a run reads some text twice well before one pass; past one pass it certainly repeats."""
    return steps * grad_accum * batch_size * seq_len / max(1, len(data.train))


def repetition_warning(data: TokenData, steps: int, batch_size: int, seq_len: int, grad_accum: int = 1) -> str | None:
    """One line for ``train`` and ``compare`` when a run reads its training data more than once, else None."""
    passes = data_passes(data, steps, batch_size, seq_len, grad_accum)
    if passes <= 1:
        return None
    return (f"warning: {steps:,} steps of {grad_accum * batch_size * seq_len:,} tokens read the "
            f"{len(data.train):,} training tokens {passes:.1f} times over: validation then measures memorization; "
            "pass --data with more text, or fewer --steps")
