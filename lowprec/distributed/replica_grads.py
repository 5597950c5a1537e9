"""Gradients of parameters split over a group of ranks that is replicated: summed over the replicas by a hook.

Expert parallelism (``dp x ep``) and tensor parallelism under DDP (``dp x tp``) split some parameters over a
group of ranks (DTensors), and run several such groups, replicas of each other, each on its own rows. The
wrappers leave DTensors alone, so the split parameters' gradients are reduced here: a hook sums each over the
ranks holding the same part (the replicas) and divides by what makes it the mean the wrapper takes of the
other parameters.
"""
from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol


def waited(t: torch.Tensor) -> torch.Tensor:
    """A functional collective's result, waited for (a plain tensor)."""
    return t.wait() if isinstance(t, funcol.AsyncCollectiveTensor) else t


def summed_over(replicas: dist.ProcessGroup, divisor: int) -> Callable[[torch.Tensor], torch.Tensor]:
    """A gradient hook for a DTensor parameter: its local part summed over ``replicas``, divided by ``divisor``."""
    from torch.distributed.tensor import DTensor

    def hook(g: torch.Tensor) -> torch.Tensor:
        local = waited(funcol.all_reduce(g.to_local(), "sum", replicas)) / divisor
        return DTensor.from_local(local, g.device_mesh, g.placements, run_check=False)

    return hook
