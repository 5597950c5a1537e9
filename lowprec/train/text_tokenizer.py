"""Tokenizers for text data: bytes (no tokenizer), a Hugging Face ``tokenizer.json`` through ``tokenizers``,
or a tokenizer that ``transformers.AutoTokenizer`` loads (a directory or a model name).

A tokenizer is first *resolved*: its name and identity, which the token cache is keyed by. It is *loaded*
only when text must be encoded, so a run whose tokens are cached never loads a ``tokenizer.json``.

Documents are encoded one by one, with the special tokens the tokenizer adds by default (a Llama
tokenizer's BOS, say), and each is followed by the tokenizer's EOS token, unless its ids already end with
it (a post-processor that appends EOS). A tokenizer without an EOS token puts the documents back to back
and says so. Bytes (no tokenizer) follow each document with ``"\\n\\n"``, as text files are joined.
"""
from __future__ import annotations

import hashlib
import json
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from lowprec._checks import fail

BYTE_VOCAB = 256
"""Text without a tokenizer is byte-level: token = byte."""
EOS_NAMES = ("<|endoftext|>", "</s>", "<|end_of_text|>", "<eos>", "<|eos|>", "[EOS]")
"""The special tokens a bare ``tokenizer.json`` (which has no notion of EOS) is taken to end documents with,
in this order, unless a ``tokenizer_config.json`` beside it names its ``eos_token``."""
_EXPECTED = ("a tokenizer.json file, a tokenizer directory transformers.AutoTokenizer loads, or a Hugging Face "
             "model name (from the local cache; from the Hub when online)")


@dataclass(frozen=True, slots=True)
class Encoder:
    """A loaded tokenizer: what turning documents into token ids needs."""

    encode_batch: Callable[[list[str]], Sequence[Sequence[int]]]
    """The ids of each of a batch of documents, with the special tokens the tokenizer adds by default."""
    vocab_size: int
    """Every id is below it (special tokens included)."""
    separator: tuple[int, ...]
    """Follows every document whose ids do not already end with it: the EOS id, ``"\\n\\n"`` for bytes, or ()."""
    separator_name: str
    """The separator in words, for the data's description."""


@dataclass(frozen=True, slots=True)
class TokenizerRef:
    """A tokenizer resolved but not necessarily loaded."""

    name: str
    """As the user gave it (``bytes`` without a tokenizer)."""
    identity: str
    """sha256 of what decides its ids (a tokenizer.json's bytes, a transformers tokenizer's serialized form)."""
    load: Callable[[], Encoder]


def resolve_tokenizer(name: str | Path | None) -> TokenizerRef:
    """A ``tokenizer.json`` file, a directory AutoTokenizer loads, or a model name (the local Hugging Face
    cache first; the Hub unless ``huggingface_hub`` is offline, ``HF_HUB_OFFLINE=1``); None: bytes."""
    if name is None:
        return TokenizerRef("bytes", hashlib.sha256(b"bytes").hexdigest(), _byte_encoder)
    path = Path(name)
    if path.is_file():
        return _tokenizer_json(path)
    if not path.is_dir() and (path.suffix == ".json" or str(name).startswith(("/", ".", "~"))):
        fail("tokenizer", _EXPECTED, f"{str(name)!r}, a path that does not exist")  # not a name to ask the Hub for
    return _transformers_tokenizer(str(name), local_only=path.is_dir())


def _byte_encoder() -> Encoder:
    def encode(texts: list[str]) -> list[np.ndarray]:
        return [np.frombuffer(t.encode("utf-8"), dtype=np.uint8) for t in texts]

    return Encoder(encode, BYTE_VOCAB, (10, 10), "'\\n\\n'")


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return (text.splitlines()[0] if text else type(e).__name__)[:300]


def _import(module: str) -> Any:
    try:
        return __import__(module)
    except ImportError:
        fail("tokenizer", f"the {module} package (pip install 'lowprec[data]')", "it is not installed", ImportError)


def _tokenizer_json(path: Path) -> TokenizerRef:
    """A ``tokenizer.json``; a ``tokenizer_config.json`` beside it, if any, names its EOS token."""
    config = path.with_name("tokenizer_config.json")
    parts = [path.read_bytes()] + ([config.read_bytes()] if config.is_file() else [])
    identity = hashlib.sha256(b"tokenizers\0" + b"\0".join(parts)).hexdigest()

    def load() -> Encoder:
        tokenizers = _import("tokenizers")
        try:
            tok = tokenizers.Tokenizer.from_file(str(path))
        except Exception as e:  # the Rust loader raises plain Exceptions
            fail("tokenizer", _EXPECTED, f"{str(path)!r}, which tokenizers cannot load: {_first_line(e)}")
        eos = _config_eos(config, path) or _known_eos(tok)

        def encode(texts: list[str]) -> list[list[int]]:
            return [e.ids for e in tok.encode_batch(texts)]

        return _encoder(encode, tok.get_vocab_size(with_added_tokens=True), eos, tok.token_to_id, str(path))

    return TokenizerRef(str(path), identity, load)


def _config_eos(config: Path, path: Path) -> str | None:
    """The ``eos_token`` of a ``tokenizer_config.json`` beside ``path``, if there is one."""
    if not config.is_file():
        return None
    try:
        eos = json.loads(config.read_text(encoding="utf-8")).get("eos_token")
    except (ValueError, AttributeError) as e:
        fail("tokenizer", "a tokenizer_config.json holding a JSON object", f"{str(config)!r}: {_first_line(e)}")
    return eos.get("content") if isinstance(eos, dict) else eos


def _known_eos(tok: Any) -> str | None:
    special = {t.content for t in tok.get_added_tokens_decoder().values() if t.special}
    return next((name for name in EOS_NAMES if name in special), None)


def _encoder(encode: Callable[[list[str]], Sequence[Sequence[int]]], vocab_size: int, eos: str | None,
             token_id: Callable[[str], int | None], name: str) -> Encoder:
    """The encoder of a tokenizer whose EOS token is ``eos`` (None: it has none, and documents go back to back,
    with a warning)."""
    if eos is None:
        warnings.warn(f"tokenizer {name} has no EOS token: documents are put back to back, their boundaries "
                      "unmarked", stacklevel=3)
        return Encoder(encode, vocab_size, (), "nothing (no EOS token)")
    eos_id = token_id(eos)
    if eos_id is None:
        fail("tokenizer", "an EOS token in its vocabulary", f"{eos!r}, which {name} does not hold")
    return Encoder(encode, vocab_size, (int(eos_id),), f"EOS {eos!r} (id {eos_id})")


def _transformers_tokenizer(name: str, *, local_only: bool) -> TokenizerRef:
    """A tokenizer AutoTokenizer loads: from local files first, from the Hub only when not ``local_only`` and
    ``huggingface_hub`` is online. It is loaded now: its identity is its serialized form."""
    tok = _auto_tokenizer(name, local_only)
    eos = tok.eos_token if isinstance(tok.eos_token, str) else None

    def encode(texts: list[str]) -> list[list[int]]:
        return tok(texts, add_special_tokens=True, verbose=False)["input_ids"]

    encoder = _encoder(encode, len(tok), eos, tok.convert_tokens_to_ids, name)
    return TokenizerRef(name, _transformers_identity(tok, eos), lambda: encoder)


def _auto_tokenizer(name: str, local_only: bool) -> Any:
    transformers = _import("transformers")
    load = transformers.AutoTokenizer.from_pretrained
    try:
        return load(name, local_files_only=True)
    except Exception as e:  # transformers raises OSError, ValueError, and others for what it cannot load
        local_error = e
    from huggingface_hub import is_offline_mode

    if local_only or is_offline_mode():
        where = "a directory AutoTokenizer cannot load" if local_only else (
            "not a file or directory, nor in the local Hugging Face cache (offline: HF_HUB_OFFLINE is set)")
        fail("tokenizer", _EXPECTED, f"{name!r}, {where}: {_first_line(local_error)}")
    try:
        return load(name)
    except Exception as e:
        fail("tokenizer", _EXPECTED, f"{name!r}, which is not a file or directory and the Hub does not give: "
             f"{_first_line(e)}")


def _transformers_identity(tok: Any, eos: str | None) -> str:
    """sha256 of a transformers tokenizer's class, its serialized tokenizer.json (or its vocabulary and special
    tokens, for one that is not backed by ``tokenizers``) and its EOS token."""
    backend = getattr(tok, "backend_tokenizer", None)
    if backend is not None:
        form = backend.to_str()
    else:
        form = json.dumps([sorted(tok.get_vocab().items()), sorted(map(str, tok.all_special_tokens))])
    return hashlib.sha256(json.dumps([type(tok).__name__, form, eos]).encode()).hexdigest()
