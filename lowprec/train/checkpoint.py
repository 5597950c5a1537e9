"""Checkpoints of a training run (atomic, checksummed, the last K kept): the names of
``lowprec.state.files``, which holds them below ``optim`` and ``distributed`` so that the distributed
checkpoint may use them without importing the trainer."""
from __future__ import annotations

from lowprec.state.files import (
    DISTRIBUTED_FORMAT,
    FORMAT_VERSION,
    PARTIAL_SUFFIX,
    CheckpointError,
    encode_meta,
    fsync_dir,
    is_distributed_checkpoint,
    join_tensors,
    latest_checkpoint,
    list_checkpoints,
    load_checkpoint,
    prune_checkpoints,
    read_meta,
    resolve_checkpoint,
    save_checkpoint,
    split_tensors,
    write_atomically,
)

__all__ = ["CheckpointError", "DISTRIBUTED_FORMAT", "FORMAT_VERSION", "PARTIAL_SUFFIX", "encode_meta", "fsync_dir",
           "is_distributed_checkpoint", "join_tensors", "latest_checkpoint", "list_checkpoints", "load_checkpoint",
           "prune_checkpoints", "read_meta", "resolve_checkpoint", "save_checkpoint", "split_tensors",
           "write_atomically"]
