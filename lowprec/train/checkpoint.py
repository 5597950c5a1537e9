"""Checkpoints: atomic, checksummed, the last K kept.

[Note: what makes a checkpoint valid]
A checkpoint of step ``n`` is a pair of files in one directory:

* ``step_0000000n.safetensors``: every tensor of the saved state, under its path in the state;
* ``step_0000000n.json``: everything else (numbers, strings, the structure, with each tensor
  replaced by ``{"__tensor__": key}``) and the sha256 of the safetensors file.

Each file is written to a hidden temporary name, flushed to disk, then renamed into place;
the JSON goes last. So the JSON's presence marks a complete checkpoint: a process killed at any
moment leaves either no JSON for the new step (the pair is ignored, the previous checkpoint is
the latest) or a complete pair. Corruption after the fact (a truncated or altered file) is found
by the checksum on load and reported with the file's name; it is never loaded, and no older
checkpoint is silently used instead.
"""
from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
from pathlib import Path
from typing import Any

import safetensors.torch
import torch

from lowprec._checks import check_positive_int, fail

FORMAT_VERSION = 1
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
    """Whether a checkpoint JSON was written by :mod:`lowprec.distributed.checkpoint` (False if unreadable)."""
    try:
        return json.loads(Path(json_path).read_bytes()).get("format") == DISTRIBUTED_FORMAT
    except (OSError, ValueError, AttributeError):
        return False


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
    write_atomically(json_path, json.dumps(meta, indent=1).encode())
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


def load_checkpoint(path: str | Path) -> tuple[int, dict[str, Any]]:
    """``(step, state)`` from a checkpoint's JSON file, or the newest one in a directory; verified first."""
    path = Path(path)
    if path.is_dir():
        latest = latest_checkpoint(path)
        if latest is None:
            fail("checkpoint", "a directory holding a complete checkpoint (step_*.json)", repr(str(path)),
                 CheckpointError)
        path = latest
    if not path.is_file():
        fail("checkpoint", "an existing checkpoint file", repr(str(path)), CheckpointError)
    try:
        meta = json.loads(path.read_bytes())
        distributed = meta.get("format") == DISTRIBUTED_FORMAT
        if not distributed:
            version, tensors_file, digest = meta["format_version"], meta["tensors_file"], meta["tensors_sha256"]
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        raise CheckpointError(f"checkpoint: expected valid checkpoint JSON, got a corrupt or truncated "
                              f"file {str(path)!r} ({e})") from e
    if distributed:
        fail("checkpoint", "a single-process checkpoint", f"one saved by {meta.get('world_size')} ranks through "
             f"torch.distributed.checkpoint in {str(path)!r} (lowprec.train.train resumes it with resume=True)",
             CheckpointError)
    if version != FORMAT_VERSION:
        fail("checkpoint", f"format version {FORMAT_VERSION}", f"{version} in {str(path)!r}", CheckpointError)
    tensors_path = path.parent / tensors_file
    if not tensors_path.is_file():
        fail("checkpoint", f"the tensors file beside {str(path)!r}", f"no {str(tensors_path)!r}", CheckpointError)
    blob = tensors_path.read_bytes()
    actual = hashlib.sha256(blob).hexdigest()
    if actual != digest:
        fail("checkpoint", f"sha256 {digest[:16]}... recorded for {str(tensors_path)!r}",
             f"{actual[:16]}... (the file is corrupt or truncated; delete this checkpoint to resume from an "
             "older one)", CheckpointError)
    return meta["step"], _unflatten(meta["state"], safetensors.torch.load(blob))
