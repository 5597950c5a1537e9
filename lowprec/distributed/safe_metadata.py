"""DCP's ``.metadata`` read without running code, and a DCP reader that reads through it.

[Note: what a distributed checkpoint reads]
DCP writes a checkpoint's metadata (which tensor lies where, in which file, at which offset) as a
pickle, ``.metadata``, and its own ``FileSystemReader`` reads it back with ``pickle.load``: unpickling
calls whatever the file names, so a ``.metadata`` can run any code. The sha256 in the checkpoint's
JSON does not help, since whoever writes the files can write the JSON too.

Here ``.metadata`` is unpickled by an unpickler that resolves only the names a metadata file written
by DCP holds (found in the checkpoints lowprec's tests write with torch 2.13): the dataclasses of
``torch.distributed.checkpoint.metadata`` (``Metadata``, ``StorageMeta``, ``TensorStorageMetadata``,
``ChunkStorageMetadata``, ``TensorProperties``, ``MetadataIndex`` and the ``_MEM_FORMAT_ENCODING``
enum), ``torch.distributed.checkpoint.filesystem._StorageInfo``, ``torch.Size``, torch's dtypes,
``torch.serialization._get_layout`` (a layout from its name) and ``pathlib``'s path classes (where it
was saved); dicts, lists, tuples, strings and numbers need no names. Any other name is refused before
it is imported or called. None of these runs more than a constructor, a table look-up or a
dataclass's ``__setstate__``.

What was read must then have a DCP metadata's shape: every entry a tensor (lowprec saves tensors
alone; DCP would read a non-tensor entry, ``BytesStorageMetadata``, with ``torch.load(weights_only=False)``,
so that class is not admitted and :class:`MetadataReader` refuses byte reads too), every piece in a
file of the checkpoint's own directory (a bare file name, one whose sha256 was verified when the
reader is given those), read as stored (no stream transforms).

The tensors themselves (``__<rank>_0.distcp``) are read by DCP's ``FileSystemReader.read_data``, each
piece through ``torch.load(..., weights_only=True)``: torch's own restricted unpickler, which rebuilds
tensors and their storages and refuses any other name.
"""
from __future__ import annotations

import pathlib
import pickle
from collections.abc import Collection
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import torch
import torch.serialization
from torch.distributed.checkpoint import metadata as dcp_metadata
from torch.distributed.checkpoint.filesystem import FileSystemReader, _StorageInfo
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner

from lowprec._checks import fail
from lowprec.state.files import CheckpointError

METADATA_FILE = ".metadata"


def _admitted() -> dict[tuple[str, str], Any]:
    """Every name a ``.metadata`` may resolve, keyed as pickle writes it (module, name)."""
    classes = [dcp_metadata.Metadata, dcp_metadata.StorageMeta, dcp_metadata.TensorStorageMetadata,
               dcp_metadata.ChunkStorageMetadata, dcp_metadata.TensorProperties, dcp_metadata.MetadataIndex,
               dcp_metadata._MEM_FORMAT_ENCODING, _StorageInfo, torch.Size, torch.serialization._get_layout]
    table = {(c.__module__, c.__qualname__): c for c in classes}
    table.update({("torch", name): v for name, v in vars(torch).items() if isinstance(v, torch.dtype)})
    for cls in (pathlib.PurePosixPath, pathlib.PosixPath, pathlib.PureWindowsPath, pathlib.WindowsPath):
        # a path pickled by another Python names the module it was defined in there
        table[("pathlib", cls.__name__)] = table[(cls.__module__, cls.__name__)] = cls
    return table


ADMITTED = _admitted()


class _RestrictedUnpickler(pickle.Unpickler):
    def __init__(self, file: Any, where: str) -> None:
        super().__init__(file)
        self._where = where

    def find_class(self, module: str, name: str) -> Any:
        found = ADMITTED.get((module, name))
        if found is None:
            fail("checkpoint", f"DCP's metadata classes alone in {self._where}",
                 f"{module}.{name}, refused (unpickling it could run code)", CheckpointError)
        return found

    def persistent_load(self, pid: Any) -> Any:
        fail("checkpoint", f"DCP's metadata classes alone in {self._where}", "a persistent id, refused",
             CheckpointError)


def read_metadata(path: str | Path, files: Collection[str] | None = None) -> dcp_metadata.Metadata:
    """The DCP ``Metadata`` in the file ``path``, unpickled through the names in :data:`ADMITTED` alone and
    checked for shape (see [Note: what a distributed checkpoint reads]).

    ``files``: the names of the checkpoint's files whose sha256 was verified; every piece must lie in
    one of them (without it, in any file of ``path``'s directory). Anything else is a one-line
    :class:`CheckpointError` naming ``path``.
    """
    where = repr(str(path))
    try:
        with open(path, "rb") as f:
            meta = _RestrictedUnpickler(f, where).load()
    except CheckpointError:
        raise
    except OSError as e:
        raise CheckpointError(f"checkpoint: expected a readable DCP metadata file, got {where} "
                              f"({e.strerror or e})") from e
    except Exception as e:  # a damaged pickle, or an admitted constructor given arguments it refuses
        raise CheckpointError(f"checkpoint: expected DCP's metadata in {where}, got {type(e).__name__}: "
                              f"{str(e).splitlines()[0] if str(e) else 'no message'}") from e
    _check_shape(meta, where, files)
    return meta


def _check_shape(meta: Any, where: str, files: Collection[str] | None) -> None:
    """``meta`` is what DCP writes for a state dict of tensors, each piece in a plain file beside it."""
    def refuse(expected: str, got: str) -> None:
        fail("checkpoint", f"{expected} in {where}", got, CheckpointError)

    if not isinstance(meta, dcp_metadata.Metadata):
        refuse("a DCP Metadata", type(meta).__name__)
    if not isinstance(meta.state_dict_metadata, dict) or not isinstance(meta.storage_data, dict):
        refuse("a Metadata of dicts", f"{type(meta.state_dict_metadata).__name__} and "
                                      f"{type(meta.storage_data).__name__}")
    for key, md in meta.state_dict_metadata.items():
        if not isinstance(key, str) or not _is_tensor(md):
            refuse("a tensor (dtype, torch.Size, chunks) under each key", f"{type(md).__name__} under {key!r}")
    for index, info in meta.storage_data.items():
        if not isinstance(index, dcp_metadata.MetadataIndex) or not isinstance(info, _StorageInfo):
            refuse("a _StorageInfo for each MetadataIndex", f"{type(info).__name__} for {type(index).__name__}")
        name = info.relative_path
        if not isinstance(name, str) or name in ("", ".", "..") or Path(name).name != name:
            refuse("pieces in files of the checkpoint's directory", f"{name!r}")
        if files is not None and name not in files:
            refuse("pieces in files whose sha256 was verified", f"{name!r}, not among them")
        if not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in (info.offset, info.length)):
            refuse("a piece's offset and length as counts of bytes", f"{info.offset!r}, {info.length!r}")
        if info.transform_descriptors:
            refuse("pieces stored as written (no stream transforms)", f"{info.transform_descriptors!r}")


def _is_tensor(md: Any) -> bool:
    return (isinstance(md, dcp_metadata.TensorStorageMetadata)
            and isinstance(md.properties, dcp_metadata.TensorProperties)
            and isinstance(md.properties.dtype, torch.dtype) and isinstance(md.size, torch.Size)
            and isinstance(md.chunks, list)
            and all(isinstance(c, dcp_metadata.ChunkStorageMetadata) for c in md.chunks))


class MetadataReader(FileSystemReader):
    """DCP's ``FileSystemReader`` with ``.metadata`` read by :func:`read_metadata` (once: every later call,
    DCP's own in ``dcp.load`` included, returns what was checked) and byte items refused.

    ``files``: as for :func:`read_metadata`. Only the checkpoint's global ``.metadata`` is read, never a
    rank's own (``__<rank>.metadata``, which lowprec does not write).
    """

    def __init__(self, path: str | Path, files: Collection[str] | None = None) -> None:
        super().__init__(path)
        self._files = None if files is None else frozenset(files)
        self._metadata: dcp_metadata.Metadata | None = None

    def read_metadata(self) -> dcp_metadata.Metadata:  # no ``kwargs``: DCP then asks for no rank's own file
        if self._metadata is None:
            self._metadata = read_metadata(Path(self.path) / METADATA_FILE, self._files)
        if self._metadata.storage_meta is None:
            self._metadata.storage_meta = dcp_metadata.StorageMeta()
        self._metadata.storage_meta.load_id = self.load_id
        return self._metadata

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        byte_items = [item for item in plan.items if item.type == LoadItemType.BYTE_IO]
        if byte_items:
            # DCP's planner would torch.load them with weights_only=False
            fail("checkpoint", f"tensors alone in {str(self.path)!r}",
                 f"a non-tensor entry {byte_items[0].dest_index.fqn!r}", CheckpointError)
        return super().read_data(plan, planner)
