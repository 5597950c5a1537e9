"""Rank agreement: the names of ``lowprec.ranks`` (see [Note: ranks agree] there), which holds them below
``optim`` and ``telemetry`` so that both may agree across ranks without importing the distributed glue."""
from __future__ import annotations

from lowprec.ranks import (
    agree,
    agree_any,
    collective_device,
    data_parallel_group,
    is_distributed,
    is_dtensor,
    is_initialized,
    is_sharded,
    local,
    rank,
    world_size,
)

__all__ = ["agree", "agree_any", "collective_device", "data_parallel_group", "is_distributed", "is_dtensor",
           "is_initialized", "is_sharded", "local", "rank", "world_size"]
