"""Checkpoints: atomic, checksummed byte for byte, the last K kept.

[Note: what makes a checkpoint valid]
A checkpoint of step ``n`` is a pair of files in one directory:

* ``step_0000000n.safetensors``: every tensor of the saved state, under its path in the state;
* ``step_0000000n.json``: everything else (numbers, strings, the structure, with each tensor
  replaced by ``{"__tensor__": key}``) and the sha256 of the safetensors file.

Each file is written to a hidden temporary name, flushed to disk, then renamed into place;
the JSON goes last. So the JSON's presence marks a complete checkpoint: a process killed at any
moment leaves either no JSON for the new step (the pair is ignored, the previous checkpoint is
the latest) or a complete pair. Corruption after the fact (a truncated or altered file) is found
by the checksums on load and reported with the file's name; it is never loaded, and no older
checkpoint is silently used instead.

[Note: a JSON that checks itself]
Resuming reads the JSON as much as the tensors (optimizer settings, the history the log is
rewritten from, the data position, the schedule), so every byte of it is checksummed too. The file
is ``{"sha256": "<hex>", "checkpoint": <body>}`` where ``<hex>`` is the sha256 of the exact bytes of
``<body>``: still JSON for any reader, and any edit of the body (a digit, a space) or of the recorded
sum is refused on load (:func:`read_meta`), naming the file. The body holds the sha256 of every
other file of the checkpoint, so one verified JSON vouches for the whole checkpoint.
"""
from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
from pathlib import Path
from typing import Any

import safetensors
import safetensors.torch
import torch

from lowprec._checks import check_positive_int, fail

FORMAT_VERSION = 2
"""2: the JSON holds the sha256 of its own body (1 had none, and is refused).

The distributed checkpoints of :mod:`lowprec.distributed.checkpoint` share the version and the JSON's form."""
DISTRIBUTED_FORMAT = "torch.distributed.checkpoint"
"""The ``format`` of a checkpoint JSON written by :mod:`lowprec.distributed.checkpoint`."""
PARTIAL_SUFFIX = ".partial"
"""A distributed save writes its shards into ``.step_<n>.partial/`` until every rank is done."""
_NAME = re.compile(r"^step_(\d{8,})\.json$")


class CheckpointError(ValueError):
    """A checkpoint that is missing, truncated, altered or of another format."""


def _flatten(obj: Any, path: str, tensors: dict[str, torch.Tensor], copy: bool = True) -> Any:
    """``obj`` as JSON, its tensors moved into ``tensors`` under their path in ``obj``.

    ``copy``: contiguous CPU copies, as safetensors wants (tensors that do not share storage);
    else the tensors themselves.
    """
    if isinstance(obj, torch.Tensor):
        if path in tensors:
            raise ValueError(f"state: expected distinct paths for tensors, got {path!r} twice")
        tensors[path] = obj.detach().to("cpu", copy=True).contiguous() if copy else obj
        return {"__tensor__": path}
    if isinstance(obj, dict):
        if all(isinstance(k, str) for k in obj):
            return {k: _flatten(v, f"{path}/{k}", tensors, copy) for k, v in obj.items()}
        # torch optimizers key their state by int; JSON objects would turn those into strings
        return {"__items__": [[k, _flatten(v, f"{path}/{k}", tensors, copy)] for k, v in obj.items()]}
    if isinstance(obj, (list, tuple)):
        items = [_flatten(v, f"{path}/{i}", tensors, copy) for i, v in enumerate(obj)]
        return {"__tuple__": items} if isinstance(obj, tuple) else items
    if obj is None or isinstance(obj, (bool, int, float, str)):
        return obj
    fail("state", "tensors, numbers, strings, None and dicts/lists/tuples of them", f"{type(obj).__name__} at {path!r}",
         TypeError)


def split_tensors(state: Any, prefix: str) -> tuple[Any, dict[str, torch.Tensor]]:
    """``state`` as JSON with each tensor replaced by its key ``prefix/<path>``, and the tensors by key
    (themselves, not copies). :func:`join_tensors` puts them back."""
    tensors: dict[str, torch.Tensor] = {}
    return _flatten(state, prefix, tensors, copy=False), tensors


def join_tensors(encoded: Any, tensors: dict[str, torch.Tensor]) -> Any:
    """The state :func:`split_tensors` took apart, with the tensors of ``tensors`` in their places."""
    return _unflatten(encoded, tensors)


def _unflatten(obj: Any, tensors: dict[str, torch.Tensor]) -> Any:
    if isinstance(obj, list):
        return [_unflatten(v, tensors) for v in obj]
    if isinstance(obj, dict):
        if "__tensor__" in obj:
            return tensors[obj["__tensor__"]]
        if "__items__" in obj:
            return {k: _unflatten(v, tensors) for k, v in obj["__items__"]}
        if "__tuple__" in obj:
            return tuple(_unflatten(v, tensors) for v in obj["__tuple__"])
        return {k: _unflatten(v, tensors) for k, v in obj.items()}
    return obj


_HASH_CHUNK = 16 << 20
"""Bytes read at a time when hashing a file: a file of gigabytes is never read whole."""


def file_sha256(path: Path) -> str:
    """The sha256 of the file at ``path``, read in chunks."""
    h = hashlib.sha256()
    with Path(path).open("rb") as f:
        while chunk := f.read(_HASH_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def write_atomically(path: Path, data: bytes) -> None:
    """Write ``data`` to a hidden temporary name, flush it to disk, then rename it to ``path``."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())  # the bytes reach the disk before the name does
    os.replace(tmp, path)


def fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def list_checkpoints(directory: str | Path) -> list[tuple[int, Path]]:
    """``(step, json_path)`` of every complete checkpoint in ``directory``, oldest first."""
    directory = Path(directory)
    if not directory.is_dir():
        return []
    found = [(int(m.group(1)), directory / m.group(0)) for m in map(_NAME.match, os.listdir(directory)) if m]
    return sorted(found)


def is_distributed_checkpoint(json_path: str | Path) -> bool:
    """Whether a checkpoint JSON was written by :mod:`lowprec.distributed.checkpoint` (False if unreadable;
    not verified: :func:`read_meta` does that)."""
    try:
        return json.loads(Path(json_path).read_bytes())["checkpoint"].get("format") == DISTRIBUTED_FORMAT
    except (OSError, ValueError, AttributeError, KeyError, TypeError):
        return False


# -- the JSON, checksummed (see [Note: a JSON that checks itself]) --------------------------------
_HEAD = b'{"sha256": "'
_MIDDLE = b'", "checkpoint": '
_TAIL = b"}\n"
_HEX_DIGITS = 64


def encode_meta(meta: dict[str, Any]) -> bytes:
    """The bytes of a checkpoint JSON holding ``meta`` and the sha256 of its text."""
    body = json.dumps(meta, indent=1).encode()
    return _HEAD + hashlib.sha256(body).hexdigest().encode() + _MIDDLE + body + _TAIL


def _old_version(data: bytes) -> Any:
    """The ``format_version`` of a JSON written before checkpoints checked their JSON, else None."""
    try:
        meta = json.loads(data)
        return meta.get("format_version") if isinstance(meta, dict) and "checkpoint" not in meta else None
    except ValueError:
        return None


def _check_sha256(data: bytes, recorded: str, where: str, damage: str) -> None:
    """:class:`CheckpointError` unless ``data`` hashes to the ``recorded`` sha256."""
    actual = hashlib.sha256(data).hexdigest()
    if actual != recorded:
        fail("checkpoint", f"sha256 {str(recorded)[:16]}... recorded {where}",
             f"{actual[:16]}... (the file {damage}; delete this checkpoint to resume from an older one)",
             CheckpointError)


def read_meta(path: str | Path) -> dict[str, Any]:
    """The body of a checkpoint JSON (single-process or distributed) once its sha256 and version hold.

    :class:`CheckpointError` naming the file for anything else: altered, truncated, not a checkpoint
    JSON, or of another format version.
    """
    path = Path(path)
    try:
        data = path.read_bytes()
    except OSError as e:
        raise CheckpointError(f"checkpoint: expected a readable checkpoint file, got {str(path)!r} "
                              f"({e.strerror or e})") from e
    split = len(_HEAD) + _HEX_DIGITS
    body = data[split + len(_MIDDLE):-len(_TAIL)]
    if not (data.startswith(_HEAD) and data[split:split + len(_MIDDLE)] == _MIDDLE and data.endswith(_TAIL)
            and len(data) >= split + len(_MIDDLE) + len(_TAIL)):
        if (version := _old_version(data)) is not None:
            fail("checkpoint", f"format version {FORMAT_VERSION} (a JSON holding its own sha256)",
                 f"format version {version!r} in {str(path)!r}, written by an earlier lowprec without a checksum "
                 "of its JSON (resume it with that version, or start the run anew)", CheckpointError)
        fail("checkpoint", "a checkpoint JSON (its sha256, then its body)",
             f"a corrupt or truncated file {str(path)!r}", CheckpointError)
    recorded = data[len(_HEAD):split].decode("ascii", errors="replace")
    _check_sha256(body, recorded, f"in {str(path)!r}", "was altered or damaged")
    try:
        meta = json.loads(body)
        version, step = meta["format_version"], meta["step"]
    except (ValueError, KeyError, TypeError) as e:  # a body that checks out but is no checkpoint's
        raise CheckpointError(f"checkpoint: expected a checkpoint JSON, got {str(path)!r} ({e!r})") from e
    if version != FORMAT_VERSION:
        fail("checkpoint", f"format version {FORMAT_VERSION}", f"{version!r} in {str(path)!r}", CheckpointError)
    named = _NAME.match(path.name)
    if named and int(named.group(1)) != step:  # a checkpoint renamed would resume at the wrong step
        fail("checkpoint", f"step {int(named.group(1))} as its name says", f"step {step!r} in {str(path)!r}",
             CheckpointError)
    return meta


def latest_checkpoint(directory: str | Path) -> Path | None:
    """The JSON file of the newest complete checkpoint, or None."""
    found = list_checkpoints(directory)
    return found[-1][1] if found else None


def save_checkpoint(directory: str | Path, step: int, state: dict[str, Any], keep: int = 3) -> Path:
    """Write ``state`` as the checkpoint of ``step`` atomically; keep the newest ``keep``. Returns the JSON path."""
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        fail("step", "a non-negative int", repr(step))
    check_positive_int("keep", keep)
    tensors: dict[str, torch.Tensor] = {}
    encoded = _flatten(state, "", tensors)
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    blob = safetensors.torch.save(tensors)
    stem = f"step_{step:08d}"
    write_atomically(directory / f"{stem}.safetensors", blob)
    meta = {"format_version": FORMAT_VERSION, "step": step, "tensors_file": f"{stem}.safetensors",
            "tensors_sha256": hashlib.sha256(blob).hexdigest(), "state": encoded}
    json_path = directory / f"{stem}.json"
    write_atomically(json_path, encode_meta(meta))
    fsync_dir(directory)
    prune_checkpoints(directory, keep)
    return json_path


def prune_checkpoints(directory: Path, keep: int) -> None:
    """Delete all but the newest ``keep`` checkpoints (single-process files or distributed directories) and
    what interrupted saves left. Run by the one process that saves, after its save is complete."""
    for _, json_path in list_checkpoints(directory)[:-keep]:
        # the JSON first: a checkpoint half deleted is then incomplete, not corrupt
        json_path.unlink()
        json_path.with_suffix(".safetensors").unlink(missing_ok=True)
        shutil.rmtree(json_path.with_suffix(""), ignore_errors=True)  # a distributed checkpoint's shards
    for name in os.listdir(directory):
        path = directory / name
        if name.startswith(".step_") and ".tmp-" in name and not path.is_dir():
            path.unlink(missing_ok=True)  # left by a process killed while saving
        elif name.startswith(".step_") and name.endswith(PARTIAL_SUFFIX) and path.is_dir():
            shutil.rmtree(path, ignore_errors=True)  # the shards of a distributed save that was killed


def resolve_checkpoint(path: str | Path) -> Path:
    """The JSON of a checkpoint given as its JSON file, or as a directory (its newest complete one)."""
    path = Path(path)
    if path.is_dir():
        latest = latest_checkpoint(path)
        if latest is None:
            fail("checkpoint", "a directory holding a complete checkpoint (step_*.json)", repr(str(path)),
                 CheckpointError)
        path = latest
    if not path.is_file():
        fail("checkpoint", "an existing checkpoint file", repr(str(path)), CheckpointError)
    return path


def load_checkpoint(path: str | Path) -> tuple[int, dict[str, Any]]:
    """``(step, state)`` from a checkpoint's JSON file, or the newest one in a directory; verified first."""
    path = resolve_checkpoint(path)
    meta = read_meta(path)
    if meta.get("format") == DISTRIBUTED_FORMAT:
        fail("checkpoint", "a single-process checkpoint", f"one saved by {meta.get('world_size')} ranks through "
             f"torch.distributed.checkpoint in {str(path)!r} (lowprec.train.train resumes it with resume=True)",
             CheckpointError)
    try:
        tensors_file, digest = str(meta["tensors_file"]), meta["tensors_sha256"]
    except KeyError as e:
        raise CheckpointError(f"checkpoint: expected a single-process checkpoint JSON, got no {e} in "
                              f"{str(path)!r}") from e
    tensors_path = path.parent / tensors_file
    if not tensors_path.is_file():
        fail("checkpoint", f"the tensors file beside {str(path)!r}", f"no {str(tensors_path)!r}", CheckpointError)
    blob = tensors_path.read_bytes()
    _check_sha256(blob, digest, f"for {str(tensors_path)!r}", "is corrupt or truncated")
    try:
        tensors = safetensors.torch.load(blob)
        return meta["step"], _unflatten(meta["state"], tensors)
    except (KeyError, TypeError, ValueError, safetensors.SafetensorError) as e:  # sums hold, contents disagree
        raise CheckpointError(f"checkpoint: expected tensors that match {str(path)!r}, got {e!r}") from e
