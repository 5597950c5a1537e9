"""Rank agreement: the data-parallel group, and the group's verdict on this rank's values in one collective.

[Note: ranks agree]
Under data parallelism every rank must take the same decision about anything that changes numerics
(skip a step, clip by a norm, take a delayed scale), or the replicas drift apart for good. Each rank
therefore puts what it knows into one small float32 vector and the group all-reduces it once; every
rank then decides from the same reduced numbers. A SUM carries counts and flags as well as sums: a
flag is 1.0 where set, and "on any rank" is a reduced value above zero. A SUM also carries
non-finite values through, since inf or NaN plus anything is inf or NaN, so "not finite anywhere"
needs no flag of its own. A MAX reduces amaxes.

Gradients of FSDP2 (``fully_shard``) parameters are ``DTensor`` shards: a norm over them is the sum
of every rank's local squares, while gradients of replicated parameters (DDP) are equal on every
rank and count once. :func:`local`, :func:`is_sharded` and :func:`replicas` tell them apart without the
caller importing DTensor.
"""
from __future__ import annotations

import math
import sys
from collections.abc import Sequence

import torch
import torch.distributed as dist

from lowprec._checks import describe, fail


def is_initialized() -> bool:
    """Whether a default process group exists in this process."""
    return dist.is_available() and dist.is_initialized()


def world_size(group: dist.ProcessGroup | None = None) -> int:
    """Ranks in ``group`` (the default group for ``None``); 1 when torch.distributed is not initialized."""
    return dist.get_world_size(group) if is_initialized() else 1


def rank(group: dist.ProcessGroup | None = None) -> int:
    """This process's rank in ``group`` (the default group for ``None``); 0 when not initialized."""
    return dist.get_rank(group) if is_initialized() else 0


def is_distributed(group: dist.ProcessGroup | None = None) -> bool:
    """Whether there is more than one rank to agree with: initialized, and ``group`` holds two or more."""
    return world_size(group) > 1


def data_parallel_group(data_parallel: bool | None = None,
                        group: dist.ProcessGroup | None = None) -> dist.ProcessGroup | None:
    """The group gradients are reduced over, or ``None`` for a single process.

    ``data_parallel``: ``None`` decides from torch.distributed (initialized with more than one rank in
    ``group``), ``True`` requires that, ``False`` means one process whatever is initialized.
    ``group``: the data-parallel group; ``None`` is the default group.
    """
    if data_parallel is not None and not isinstance(data_parallel, bool):
        fail("data_parallel", "None, True or False", describe(data_parallel), TypeError)
    if group is not None and not isinstance(group, dist.ProcessGroup):
        fail("group", "a torch.distributed.ProcessGroup or None", describe(group), TypeError)
    if data_parallel is False:
        return None
    if not is_distributed(group):
        if data_parallel:
            fail("data_parallel", "an initialized torch.distributed process group of two or more ranks "
                 "(launch with torchrun)", f"world size {world_size(group)}")
        return None
    return group if group is not None else dist.group.WORLD


def collective_device(group: dist.ProcessGroup | None = None) -> torch.device:
    """Where a tensor made only for a collective lives: the current GPU when the group's backend has
    no CPU support (NCCL alone), else the CPU."""
    if is_initialized() and "gloo" not in dist.get_backend(group) and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _dtensor_module():
    """``torch.distributed.tensor`` if something imported it, else None: no DTensor can exist before
    its module is imported, and importing it here would add about a second to ``import lowprec``."""
    return sys.modules.get("torch.distributed.tensor")


def is_dtensor(t: torch.Tensor) -> bool:
    mod = _dtensor_module()
    return mod is not None and isinstance(t, mod.DTensor)


def like(p: torch.Tensor, part: torch.Tensor, shape: Sequence[int] | None = None) -> torch.Tensor:
    """``part`` (this rank's part of a tensor laid out as ``p``, of global ``shape``, default ``p``'s) as a
    DTensor of ``p``'s mesh and placements, contiguous; ``part`` itself where ``p`` is no DTensor."""
    if not is_dtensor(p):
        return part
    shape = torch.Size(p.shape if shape is None else shape)
    stride = tuple(math.prod(shape[i + 1:]) for i in range(len(shape)))
    return _dtensor_module().DTensor.from_local(part, p.device_mesh, p.placements, run_check=False, shape=shape,
                                                stride=stride)


def local(t: torch.Tensor) -> torch.Tensor:
    """This rank's part of ``t``: a DTensor's local shard (sharing its storage), a plain tensor itself."""
    return t.to_local() if is_dtensor(t) else t


def _splits(placement) -> bool:
    """Whether a DTensor placement splits the tensor over its mesh dimension: every placement but Replicate
    and Partial (FSDP2 over tensor parallelism splits one dimension twice, its first placement a
    _StridedShard, which is no Shard)."""
    return not (placement.is_replicate() or placement.is_partial())


def is_sharded(t: torch.Tensor) -> bool:
    """Whether ``t`` is a DTensor split across ranks along some dimension of its mesh (FSDP2's shards,
    tensor or expert parallelism's parts, both on a data-parallel x tensor-parallel mesh): each rank holds
    a different part of it (a Replicate or Partial placement splits nothing). :func:`replicas` says how many
    ranks hold each part."""
    return is_dtensor(t) and any(_splits(p) for p in t.placements)


def replicas(t: torch.Tensor, group: dist.ProcessGroup | None = None) -> int:
    """How many ranks of ``group`` hold each part of ``t``: 0 for a tensor that is not split (every rank
    holds it whole), else the group's size over the mesh's: 1 for FSDP2's shards over the whole group,
    the data-parallel degree for tensor-parallel shards on data-parallel x tensor-parallel ranks. A norm
    over the group counts each part's square once: divided by this."""
    if not is_dtensor(t):
        return 0
    parts = math.prod(t.device_mesh.size(i) for i, p in enumerate(t.placements) if _splits(p))
    return 0 if parts == 1 else max(world_size(group) // parts, 1)


def agree(values: Sequence[torch.Tensor | float], group: dist.ProcessGroup | None = None, *,
          op: dist.ReduceOp.RedOpType = dist.ReduceOp.SUM, device: torch.device | None = None) -> torch.Tensor:
    """The group's ``op`` (SUM or MAX) of each of this rank's ``values``, from one all-reduce.

    ``values`` are numbers or one-element tensors; they are stacked into one float32 vector on
    ``device`` (else the first tensor's device, else :func:`collective_device`) and reduced in a
    single collective.
    Returns the reduced vector on that device without reading it on the host, so the caller decides
    when to synchronise. With a single rank it returns the stacked values.
    """
    if op not in (dist.ReduceOp.SUM, dist.ReduceOp.MAX):
        fail("op", "torch.distributed.ReduceOp.SUM or ReduceOp.MAX", describe(op))
    if not values:
        fail("values", "at least one value", "an empty sequence")
    if device is None:
        tensors = [v for v in values if isinstance(v, torch.Tensor)]
        device = tensors[0].device if tensors else collective_device(group)
    parts = [v.detach().reshape(()).to(device, torch.float32) if isinstance(v, torch.Tensor)
             else torch.tensor(float(v), device=device) for v in values]
    vec = torch.stack(parts)  # (n,)
    if is_distributed(group):
        dist.all_reduce(vec, op=op, group=group)
    return vec


def agree_any(flags: Sequence[bool], group: dist.ProcessGroup | None = None,
              device: torch.device | None = None) -> list[bool]:
    """For each of this rank's ``flags``, whether it is set on any rank of the group (one collective,
    one host read): a decision every rank takes alike."""
    summed = agree([1.0 if f else 0.0 for f in flags], group, device=device)
    return [v > 0 for v in summed.tolist()]
