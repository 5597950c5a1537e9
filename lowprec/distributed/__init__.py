"""DDP / FSDP2 glue on torch.distributed: rank-agreed decisions, delayed-scaling amaxes reduced across
ranks, gradient communication in FP32, BF16 or FP8, experts split over ranks with FP8 dispatch. See
``docs/distributed.md``."""
from lowprec.distributed.agree import (
    agree,
    agree_any,
    data_parallel_group,
    is_distributed,
    is_dtensor,
    is_sharded,
    local,
    rank,
    world_size,
)
from lowprec.distributed.amax import delayed_states, reduce_amax_histories, sync_amaxes
from lowprec.distributed.expert_parallel import ExpertParallel, expert_parallel, shard_grouped
from lowprec.distributed.grad_comm import (
    FSDPReduceScatter,
    GradComm,
    GradCommState,
    all_reduce_mean,
    ddp_comm_hook,
    fsdp_reduce_dtype,
    register_ddp,
    register_fsdp,
)

__all__ = [
    "ExpertParallel", "FSDPReduceScatter", "GradComm", "GradCommState", "agree", "agree_any", "all_reduce_mean",
    "data_parallel_group", "ddp_comm_hook", "delayed_states", "expert_parallel", "fsdp_reduce_dtype",
    "is_distributed", "is_dtensor", "is_sharded", "local", "rank", "reduce_amax_histories", "register_ddp",
    "register_fsdp", "shard_grouped", "sync_amaxes", "world_size",
]
