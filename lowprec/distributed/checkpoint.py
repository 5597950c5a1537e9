"""Distributed checkpoints through ``torch.distributed.checkpoint`` (DCP): saved on N ranks, loaded on M.

[Note: a distributed checkpoint]
The checkpoint of step ``n`` saved by N ranks is, beside the single-process ones of
:mod:`lowprec.train.checkpoint` (same names, same rule for the newest):

* ``step_0000000n/``: a DCP checkpoint, tensors only, each under a key:
  ``model/<fqn>`` the model's state dict as ``torch.distributed.checkpoint.state_dict`` gives it
  (names without wrapper prefixes; FSDP2's DTensor shards as shards; delayed-scaling histories);
  ``optim/...`` the state of :class:`lowprec.optim.Optimizer` keyed by each parameter's name rather
  than its position (moments, step counts, FP32 master weights), sharded like the parameter;
  ``rng/<rank>/...`` each rank's generator states.
* ``step_0000000n.json``: written by rank 0, last: the format, step and number of ranks, the sha256
  of every file of the directory, and the state that is not tensors (param-group settings, loss
  scale, step guard; the run's history and settings), each tensor in it replaced by its key; checksummed
  itself as a single-process checkpoint's JSON is (see [Note: a JSON that checks itself] in
  :mod:`lowprec.train.checkpoint`).

Saving: every rank writes into ``.step_0000000n.partial/``; after a barrier the ranks hash the files
(each its share), rank 0 renames the directory into place and writes the JSON. As for one process,
the JSON's presence marks a complete checkpoint: a process killed at any moment before leaves the
previous checkpoint the newest, and the partial directory is deleted by the next save.

Loading verifies the JSON and every file's sha256, reads DCP's metadata without running code (see
[Note: what a distributed checkpoint reads] in :mod:`lowprec.distributed.safe_metadata`), checks from
it that what was saved fits this run's model and optimizer (:mod:`lowprec.train.state_checks`, as for
one process), then asks for each tensor in this run's layout (a DTensor shard like the parameter it
belongs to under FSDP2, a whole tensor otherwise); DCP reads the pieces it needs through the same
reader, so a checkpoint saved on N ranks loads on M, under DDP, FSDP2 or in one
process without a process group.
"""
from __future__ import annotations

import contextlib
import os
import shutil
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, set_model_state_dict
from torch.distributed.tensor import DTensor, distribute_tensor

from lowprec._checks import fail
from lowprec.distributed.launch import Ranks, reshard
from lowprec.distributed.named_state import optimizer_state_by_name, optimizer_state_by_position, optimizer_targets
from lowprec.distributed.safe_metadata import MetadataReader
from lowprec.optim import Optimizer
from lowprec.state.checks import (
    check_model_state,
    check_optimizer_shapes,
    check_rng_state,
    set_cuda_rng_state,
)
from lowprec.state.files import (
    DISTRIBUTED_FORMAT,
    FORMAT_VERSION,
    PARTIAL_SUFFIX,
    CheckpointError,
    encode_meta,
    file_sha256,
    fsync_dir,
    join_tensors,
    prune_checkpoints,
    read_meta,
    split_tensors,
    write_atomically,
)


# -- each rank's generators ---------------------------------------------------------------------
def rank_rng_state(device: torch.device) -> dict[str, torch.Tensor]:
    """This rank's generator states: the CPU's and, on CUDA, its own GPU's (never the other ranks' GPUs)."""
    state = {"cpu": torch.get_rng_state()}
    if device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device)
    return state


def set_rank_rng_state(state: dict[str, torch.Tensor], device: torch.device, where: str = "the checkpoint") -> None:
    """Set this rank's generators from :func:`rank_rng_state`'s; a state torch refuses is a :class:`CheckpointError`
    naming ``where``, raised before any generator is set."""
    if "cpu" not in state:
        fail("checkpoint", f"this rank's CPU generator state in {where}", "none", CheckpointError)
    torch.set_rng_state(check_rng_state(state["cpu"], "CPU", where))
    if device.type == "cuda" and "cuda" in state:
        set_cuda_rng_state(lambda: torch.cuda.set_rng_state(state["cuda"], device), where)


# -- agreement between ranks --------------------------------------------------------------------
def _barrier(ranks: Ranks) -> None:
    if ranks.distributed:
        dist.barrier()


def _gathered(value: Any, ranks: Ranks) -> list[Any]:
    """``value`` of every rank, in rank order."""
    if not ranks.distributed:
        return [value]
    out: list[Any] = [None] * ranks.world_size
    dist.all_gather_object(out, value)
    return out


@contextlib.contextmanager
def _single_process_quiet(ranks: Ranks) -> Iterator[None]:
    """Without a process group DCP warns that it assumes one process, which is what was asked."""
    with warnings.catch_warnings():
        if not ranks.distributed:
            warnings.filterwarnings("ignore", message="torch.distributed is .*single process")
        yield


def _hash_files(directory: Path, names: list[str], ranks: Ranks) -> dict[str, str]:
    """The sha256 of each file, every rank hashing its share; the whole table on every rank."""
    mine = {n: file_sha256(directory / n) for n in names[ranks.rank::ranks.world_size]}
    return {n: d for part in _gathered(mine, ranks) for n, d in part.items()}


# -- save ------------------------------------------------------------------------------------------
def save(directory: str | Path, step: int, model: nn.Module, opt: Optimizer, ranks: Ranks, *,
         state: dict[str, Any], rng: dict[str, torch.Tensor], keep: int = 3) -> Path:
    """Save the checkpoint of ``step`` from every rank (a collective call); keep the newest ``keep``.

    ``state``: JSON-able run state (history, settings) that rank 0 writes into the JSON; ``rng``:
    this rank's generator states. Returns the JSON's path.
    """
    directory = Path(directory)
    stem = f"step_{step:08d}"
    partial = directory / f".{stem}{PARTIAL_SUFFIX}"
    reshard(model)  # the saved parameters are the optimizer's shards, not gathered copies
    if ranks.is_main:
        directory.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(partial, ignore_errors=True)  # left by a save of this step that was killed
    _barrier(ranks)
    optim_json, tensors = split_tensors(optimizer_state_by_name(model, opt), "optim")
    tensors.update({f"model/{k}": v for k, v in get_model_state_dict(model).items()})
    tensors.update({f"rng/{ranks.rank}/{k}": v for k, v in rng.items()})
    with _single_process_quiet(ranks):
        dcp.save(tensors, checkpoint_id=partial, no_dist=not ranks.distributed)
    _barrier(ranks)  # every rank's shards are on disk
    digests = _hash_files(partial, sorted(os.listdir(partial)), ranks)
    json_path = directory / f"{stem}.json"
    if ranks.is_main:
        meta = {"format": DISTRIBUTED_FORMAT, "format_version": FORMAT_VERSION, "step": step,
                "world_size": ranks.world_size, "directory": stem, "files_sha256": digests,
                "optimizer": optim_json, "state": state}
        _publish(partial, json_path, encode_meta(meta))
        prune_checkpoints(directory, keep)
    _barrier(ranks)  # no rank goes on (or reads checkpoints) before the JSON is there
    return json_path


def _publish(partial: Path, json_path: Path, meta: bytes) -> None:
    """Rank 0: the finished shards' directory renamed into place, then the JSON that marks it complete."""
    final = json_path.with_suffix("")
    json_path.unlink(missing_ok=True)  # saving a step again: the old one is incomplete from here on
    if final.exists():
        shutil.rmtree(final)  # shards of an earlier save of this step, never completed or now replaced
    os.replace(partial, final)
    fsync_dir(final.parent)
    write_atomically(json_path, meta)
    fsync_dir(final.parent)


# -- load ------------------------------------------------------------------------------------------
def read(json_path: str | Path, ranks: Ranks) -> dict[str, Any]:
    """The JSON of a distributed checkpoint, itself and its shards verified against their sha256 (a collective
    call: each rank checks its share of the shards, and all raise the same :class:`CheckpointError` if one fails)."""
    json_path = Path(json_path)
    meta = read_meta(json_path)
    try:
        if meta["format"] != DISTRIBUTED_FORMAT:
            raise ValueError(f"format {meta['format']!r}")
        directory, digests = json_path.parent / meta["directory"], dict(meta["files_sha256"])
    except (ValueError, KeyError, TypeError) as e:
        raise CheckpointError(f"checkpoint: expected a distributed checkpoint JSON, got {str(json_path)!r} "
                              f"({e!r})") from e
    names = sorted(digests)
    errors = []
    for name in names[ranks.rank::ranks.world_size]:
        path = directory / name
        if not path.is_file():
            errors.append(f"no {str(path)!r}")
        elif (actual := file_sha256(path)) != digests[name]:
            errors.append(f"sha256 {actual[:16]}... for {str(path)!r}, recorded {digests[name][:16]}... (the file "
                          "is corrupt or truncated; delete this checkpoint to resume from an older one)")
    found = [e for part in _gathered(errors, ranks) for e in part]
    if found:
        fail("checkpoint", f"every shard of {str(json_path)!r} as saved", found[0], CheckpointError)
    return meta


def load(json_path: str | Path, meta: dict[str, Any], model: nn.Module, opt: Optimizer,
         ranks: Ranks) -> dict[str, torch.Tensor]:
    """Load the model and optimizer state of a checkpoint :func:`read` verified, in this run's layout, once
    DCP's metadata says it fits them (:mod:`lowprec.train.state_checks`).

    Returns this rank's generator states (those of rank ``rank % saved ranks``).
    """
    where = repr(str(json_path))
    directory = Path(json_path).parent / meta["directory"]
    reshard(model)
    # DCP's metadata through the restricted unpickler; dcp.load below reads with the same reader
    reader = MetadataReader(directory, files=meta["files_sha256"])
    saved = reader.read_metadata().state_dict_metadata
    model_sd = get_model_state_dict(model)
    check_model_state({k: tuple(v.shape) for k, v in model_sd.items()},
                      {k[len("model/"):]: _saved_shape(md, k, where) for k, md in saved.items()
                       if k.startswith("model/")}, where)
    optim_json = meta["optimizer"]
    targets = optimizer_targets(model, opt)

    def shape_of(leaf: Any) -> tuple[int, ...] | None:
        key = leaf.get("__tensor__") if isinstance(leaf, dict) else None
        return None if key is None else _saved_shape(saved.get(key), key, where)

    check_optimizer_shapes(optim_json, {n: tuple(t.shape) for n, t in targets.items()}, shape_of, where)
    dests = {f"model/{k}": v for k, v in model_sd.items() if f"model/{k}" in saved}
    # extra state saved, not yet made here (a fresh delayed layer): loaded whole
    dests.update({k: _plain(md) for k, md in saved.items() if k.startswith("model/") and k not in dests})
    dests.update(_optimizer_dests(optim_json, targets, saved))
    source_rank = ranks.rank % meta["world_size"]
    rng_keys = {k: f"rng/{source_rank}/{k}" for k in ("cpu", "cuda") if f"rng/{source_rank}/{k}" in saved}
    dests.update({key: _plain(saved[key]) for key in rng_keys.values()})
    with _single_process_quiet(ranks):
        dcp.load(dests, storage_reader=reader, no_dist=not ranks.distributed)
    _set_model_state(model, {k[len("model/"):]: v for k, v in dests.items() if k.startswith("model/")})
    by_name = join_tensors(optim_json, {k: v for k, v in dests.items() if k.startswith("optim/")})
    opt.load_state_dict(optimizer_state_by_position(model, opt, by_name))
    return {k: dests[key] for k, key in rng_keys.items()}


def _saved_shape(md: Any, key: str, where: str) -> tuple[int, ...]:
    if not isinstance(md, TensorStorageMetadata):
        fail("checkpoint", f"a tensor {key!r} in {where}", "none" if md is None else type(md).__name__,
             CheckpointError)
    return tuple(md.size)


def load_whole(model: nn.Module, opt: Optimizer, model_state: dict[str, torch.Tensor],
               optimizer_state: dict[str, Any]) -> None:
    """Load a single-process checkpoint's state (whole tensors, on every rank) into a wrapped model and its
    optimizer: under FSDP2 each rank keeps its shard of every tensor shaped like a parameter."""
    reshard(model)
    _set_model_state(model, model_state, whole=True)
    targets = optimizer_targets(model, opt)
    by_name = optimizer_state_by_name(model, opt, optimizer_state)
    for name, entry in by_name["optimizer"]["state"].items():
        by_name["optimizer"]["state"][name] = {k: _shard_like(v, targets[name]) for k, v in entry.items()}
    by_name["master_weights"] = {n: _shard_like(m, targets[n]) for n, m in by_name["master_weights"].items()}
    opt.load_state_dict(optimizer_state_by_position(model, opt, by_name))


def _shard_like(value: Any, target: torch.Tensor) -> Any:
    """A whole tensor of ``target``'s (global) shape as ``target`` is laid out: this rank's shard of a DTensor."""
    if isinstance(value, torch.Tensor) and isinstance(target, DTensor) and value.shape == target.shape:
        # every rank holds the whole tensor: each keeps its shard, nothing is sent
        return distribute_tensor(value.to(target.device), target.device_mesh, target.placements, src_data_rank=None)
    return value


def _set_model_state(model: nn.Module, state: dict[str, torch.Tensor], whole: bool = False) -> None:
    # not strict: torch's strict check under DDP asks for every lowprec Linear's extra state, which a
    # layer without delayed-scaling history leaves out; every other key is checked here
    options = StateDictOptions(strict=False, full_state_dict=whole)
    keys = set_model_state_dict(model, state, options=options)
    bad = [f"no {k!r} in the checkpoint" for k in keys.missing_keys if not k.endswith("_extra_state")]
    bad += [f"{k!r}, which the model does not have" for k in keys.unexpected_keys]
    if bad:
        fail("checkpoint", "the state of this model", bad[0], CheckpointError)


def _plain(md: Any) -> torch.Tensor:
    """A whole CPU tensor to load a saved tensor into."""
    if not isinstance(md, TensorStorageMetadata):
        fail("checkpoint", "a tensor", f"{type(md).__name__}", CheckpointError)
    return torch.empty(md.size, dtype=md.properties.dtype)


def _like(target: torch.Tensor, md: Any) -> torch.Tensor:
    """Where to load a saved tensor belonging to ``target``: laid out (sharded) like it when of its shape."""
    if isinstance(md, TensorStorageMetadata) and tuple(md.size) == tuple(target.shape):
        return torch.empty_like(target, dtype=md.properties.dtype)
    return _plain(md)


def _optimizer_dests(optim_json: dict[str, Any], targets: dict[str, torch.Tensor],
                     saved: dict[str, Any]) -> dict[str, torch.Tensor]:
    """A tensor for each of the optimizer's saved tensors: per-parameter state and masters shaped and
    sharded like the parameter's master (or the parameter), other state whole."""
    def ref(leaf: Any) -> str | None:
        return leaf.get("__tensor__") if isinstance(leaf, dict) else None

    owner: dict[str, str] = {}
    for name, entry in optim_json["optimizer"]["state"].items():
        for leaf in entry.values():
            if ref(leaf) is not None:
                owner[ref(leaf)] = name
    for name, leaf in optim_json["master_weights"].items():
        if ref(leaf) is not None:
            owner[ref(leaf)] = name
    dests = {}
    for key, md in saved.items():
        if key.startswith("optim/"):
            name = owner.get(key)
            dests[key] = _like(targets[name], md) if name in targets else _plain(md)
    return dests
