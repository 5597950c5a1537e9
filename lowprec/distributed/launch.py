"""Training on many processes through torchrun: the process group, each rank's device, the wrapped model.

[Note: one process per device, one model per process]
``torchrun --nproc-per-node N`` starts N copies of the command, one per GPU (or N CPU processes).
Each copy (a rank) builds the same model from the same seed and converts it with
``lowprec.convert`` *before* wrapping, so the wrapper sees lowprec Linears and their parameters:

* ``ddp``: ``DistributedDataParallel``. Every rank holds every weight; backward all-reduces the
  gradients (their mean over the ranks), so every rank takes the same optimizer step.
* ``fsdp2``: ``fully_shard`` on each transformer block, then on the root. Every rank holds 1/N of
  each weight (a ``DTensor`` shard) and of its optimizer state; a block's weights are all-gathered
  for its forward and backward, and its gradients reduce-scattered, so a rank steps its own shard.

Each rank trains on its own rows of every micro-batch (see ``TokenData.train_batch``): the
union over the ranks of one step is the batch one process would see, so N ranks train like one
process on the same global batch. The process group uses NCCL on CUDA and gloo on the CPU.
"""
from __future__ import annotations

import contextlib
import gc
import os
from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from lowprec._checks import Choice, fail
from lowprec.distributed.fp8_weight_shards import finish_fp8_weight_shards, shard_fp8_weights
from lowprec.distributed.fp8_weights import fp8_all_gather
from lowprec.distributed.grad_comm import GradComm, fsdp_reduce_dtype, register_ddp, register_fsdp
from lowprec.ranks import is_dtensor


class Parallel(Choice):
    """How a model is spread over the ranks."""

    NONE = "none"
    """One process, no process group."""
    DDP = "ddp"
    """``DistributedDataParallel``: weights replicated, gradients all-reduced."""
    FSDP2 = "fsdp2"
    """``fully_shard`` per transformer block and on the root: weights, gradients and optimizer state sharded."""

    @classmethod
    def parse(cls, value: str | Parallel, name: str = "parallel") -> Parallel:
        return super().parse(value, name)


@dataclass(frozen=True, slots=True)
class Ranks:
    """Where this process stands among the ranks of a run."""

    rank: int = 0
    world_size: int = 1
    distributed: bool = False
    """A process group is in use (``--parallel ddp|fsdp2``), even with one rank."""
    tp: int = 1
    """Ranks in each tensor-parallel group (``--tp``): they train on the same rows."""

    @property
    def data_rank(self) -> int:
        """Which rows of each batch this rank trains on: its data-parallel replica's index."""
        return self.rank // self.tp

    @property
    def data_world(self) -> int:
        """Data-parallel replicas: the ranks that train on different rows."""
        return self.world_size // self.tp

    @property
    def is_main(self) -> bool:
        """Rank 0: the one that writes logs, progress, reports and checkpoint metadata."""
        return self.rank == 0

    @staticmethod
    def of(parallel: str | Parallel, tp: int = 1) -> Ranks:
        """The ranks of a run with ``parallel`` and ``tp`` ranks per tensor-parallel group; a parallel run needs an
        initialized process group."""
        if Parallel.parse(parallel) is Parallel.NONE:
            return Ranks()
        if not dist.is_initialized():
            fail("parallel", f"an initialized process group for {Parallel.parse(parallel).value!r} (launch "
                 "through torchrun and call lowprec.distributed.launch.process_group, or "
                 "torch.distributed.init_process_group)", "none")
        return Ranks(dist.get_rank(), dist.get_world_size(), True, tp)


def launched_by_torchrun() -> bool:
    return dist.is_available() and dist.is_torchelastic_launched()


def torchrun_rank() -> int | None:
    """This process's rank when torchrun started it (the ``RANK`` torchrun sets), before or without a
    process group; None in a process torchrun did not start."""
    return int(os.environ.get("RANK", "0")) if launched_by_torchrun() else None


def check_launch(parallel: str | Parallel, command: str) -> None:
    """Refuse ``--parallel ddp|fsdp2`` in a process torchrun did not start, saying how to launch."""
    p = Parallel.parse(parallel)
    if p is not Parallel.NONE and not launched_by_torchrun():
        fail("--parallel", f"a launch through torchrun (torchrun --nproc-per-node N -m lowprec {command} "
             f"--parallel {p.value} ...)", "a single process")


def rank_device(device: str) -> str:
    """``cuda`` without an index becomes this rank's GPU (its local rank); other devices stay as given."""
    d = torch.device(device)
    if d.type == "cuda" and d.index is None:
        return f"cuda:{dist.get_node_local_rank()}"
    return device


@contextlib.contextmanager
def process_group(parallel: str | Parallel, device: str, command: str = "train") -> Iterator[str]:
    """Under torchrun: join the process group (NCCL on CUDA, gloo on the CPU) and leave it on exit.

    Yields the device this rank trains on. Outside torchrun it does nothing with ``parallel``
    none, and refuses ``ddp``/``fsdp2`` naming ``command`` in how to launch. Under torchrun,
    ``parallel`` none is refused when there is more than one rank (each rank would train alone
    and write the same files).
    """
    p = Parallel.parse(parallel)
    check_launch(p, command)
    if not launched_by_torchrun():
        yield device
        return
    device = rank_device(device)
    cuda = torch.device(device).type == "cuda"
    if cuda:
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if cuda else "gloo", device_id=torch.device(device) if cuda else None)
    # every rank connected before any goes on: a rank refusing its arguments at once and leaving would
    # otherwise close its connections while another is still making its own (gloo then raises there)
    dist.barrier()
    try:
        if p is Parallel.NONE and dist.get_world_size() > 1:
            fail("--parallel", f"ddp or fsdp2 when torchrun starts {dist.get_world_size()} processes (each would "
                 "otherwise train alone and write the same files)", "none")
        yield device
    except BaseException:
        dist.destroy_process_group()
        raise
    leave_together()


def leave_together() -> None:
    """Leave the process group after a run that ended well on every rank: free what still holds the
    group (a DDP reducer sits in reference cycles), wait until no rank has work in flight, then destroy it.

    Destroying it with a wrapper's last reference still alive left gloo's worker threads to interpreter
    shutdown, where one rank in many aborted (``terminate called without an active exception``).
    """
    gc.collect()
    dist.barrier()
    dist.destroy_process_group()


def transformer_blocks(model: nn.Module) -> list[nn.Module]:
    """The modules of the model's longest ``nn.ModuleList``: the decoder blocks (``layers`` of the
    reference model and of Llama-style Hugging Face models, ``h`` of GPT-2)."""
    lists = [m for m in model.modules() if isinstance(m, nn.ModuleList)]
    return list(max(lists, key=len)) if lists else []


def share_fp8_initials(model: nn.Module) -> None:
    """Before DDP's first broadcast: every FP8 primary weight takes rank 0's high-precision initial value
    (and its codes), so that DDP's broadcast of rank 0's weights writes the codes each rank holds already and
    every rank's optimizer takes the same FP32 master from it (see [Note: FP8 primary weights])."""
    from lowprec.nn.fp8_weight import FP8Weight

    for q in model.parameters():
        if isinstance(q, FP8Weight) and q.initial is not None:
            initial = q.initial.clone(memory_format=torch.contiguous_format)  # broadcast takes contiguous tensors
            dist.broadcast(initial, 0)
            q.share_initial_(initial)


def reshard_after_forward(index: int, n_blocks: int) -> bool:
    """FSDP2's ``reshard_after_forward`` for block ``index`` of ``n_blocks``: every block frees its gathered
    weights after its forward and gathers them again for its backward, but the last, whose backward comes
    right after the forward (freed only to be gathered at once). At world size 1 on one H200 (1B,
    fp8-current, compiled blocks) resharding every block or none ran alike, within the noise between rounds
    (0.94-0.98x of DDP's speed either way)."""
    return index < n_blocks - 1


def wrap(model: nn.Module, parallel: str | Parallel, grad_comm: str | GradComm = GradComm.FP32,
         fp8_weights: bool = False, mesh=None) -> nn.Module:
    """``model`` (converted, on this rank's device) wrapped for ``parallel``; the model itself for none.

    FSDP2 shards in place: ``fully_shard`` on each transformer block then on the root, so a
    block's weights are gathered just before it runs and freed after (as :func:`reshard_after_forward`
    says); its gradients reach the
    reduce-scatter in the dtype ``grad_comm`` sends (see :func:`apply_grad_comm`, called next).
    With ``fp8_weights`` the weights of per-tensor FP8 layers are all-gathered in E4M3
    (:func:`lowprec.distributed.fp8_weights.fp8_all_gather`; call ``precompute_fp8_scales`` after
    each optimizer step). FP8 primary weights (``lowprec.convert(..., fp8_weights=True)``) are sharded
    and all-gathered as their codes whatever ``fp8_weights`` says (see [Note: FP8 primary weights under
    FSDP2] in :mod:`lowprec.distributed.fp8_weight_shards`).

    Parameters that are DTensors already (experts split by expert parallelism, see
    :mod:`lowprec.distributed.expert_parallel`; weights split by tensor parallelism) are left out of both
    wrappers: their layout is their own, but FSDP2 shards tensor-parallel weights further over the
    data-parallel ``mesh`` (a ``DeviceMesh`` of the replicas of tensor-parallel groups; None: every rank; DDP
    takes its group).
    """
    p = Parallel.parse(parallel)
    placed = {name: q for name, q in model.named_parameters() if is_dtensor(q)}
    group = mesh.get_group() if mesh is not None else None
    if p is Parallel.DDP:
        share_fp8_initials(model)
        device = next(model.parameters()).device
        DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(model, list(placed))
        return DistributedDataParallel(model, device_ids=[device] if device.type == "cuda" else None,
                                       process_group=group)
    if p is Parallel.FSDP2:
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        policy = MixedPrecisionPolicy(reduce_dtype=fsdp_reduce_dtype(grad_comm))
        if fp8_weights:
            fp8_all_gather(model)
        pending = shard_fp8_weights(model, mesh)  # FP8 primary weights: sharded as codes, gathered as codes
        ignored = {q for q in placed.values() if not getattr(q, "_lowprec_tensor_parallel", False)} or None
        blocks = transformer_blocks(model)
        for i, block in enumerate(blocks):
            fully_shard(block, mesh=mesh, mp_policy=policy, ignored_params=ignored,
                        reshard_after_forward=reshard_after_forward(i, len(blocks)))
        fully_shard(model, mesh=mesh, mp_policy=policy, ignored_params=ignored)  # FSDP2 keeps the root gathered
        finish_fp8_weight_shards(pending)
    return model


def reshard(model: nn.Module) -> None:
    """Put FSDP2's sharded parameters back in place of any gathered ones (the root keeps its gathered
    weights after a forward without backward, such as evaluation's), so that the model's parameters
    are the ones its optimizer holds; a no-op for other models."""
    for m in model.modules():
        if _is_fsdp2(m):
            m.reshard()


def unwrap(model: nn.Module) -> nn.Module:
    """The model inside a DDP wrapper (its parameter names without ``module.``); others as they are."""
    return model.module if isinstance(model, DistributedDataParallel) else model


def apply_grad_comm(model: nn.Module, parallel: str | Parallel, grad_comm: str | GradComm) -> None:
    """The one place a ``--grad-comm`` choice meets the wrapped model: it registers
    :func:`lowprec.distributed.register_ddp`'s communication hook or
    :func:`lowprec.distributed.register_fsdp`'s reduce-scatter (``fp32`` widens the gradients to
    float32, ``bf16`` narrows them, ``fp8`` sends FP8 with fine-grained scales, summed in float32).
    """
    g, p = GradComm.parse(grad_comm, "grad_comm"), Parallel.parse(parallel)
    if p is Parallel.NONE:
        if g is not GradComm.FP32:
            fail("grad_comm", "fp32 in a single process (there is no gradient communication)", repr(g.value))
    elif p is Parallel.DDP:
        register_ddp(model, g)
    else:
        register_fsdp(model, g)


def _is_fsdp2(model: nn.Module) -> bool:
    from torch.distributed.fsdp import FSDPModule

    return isinstance(model, FSDPModule)


@contextlib.contextmanager
def grad_sync(model: nn.Module, enabled: bool) -> Iterator[None]:
    """Gradient reduction on (the last micro-batch of a step) or off (the others: gradients only accumulate)."""
    if enabled:
        yield
    elif isinstance(model, DistributedDataParallel):
        with model.no_sync():
            yield
    elif _is_fsdp2(model):
        model.set_requires_gradient_sync(False)
        try:
            yield
        finally:
            model.set_requires_gradient_sync(True)
    else:
        yield


def mean_over_ranks(values: torch.Tensor, ranks: Ranks) -> torch.Tensor:
    """``values`` averaged over the ranks (a copy); as they are in one process."""
    if not ranks.distributed:
        return values
    out = values.detach().clone()
    dist.all_reduce(out)  # a sum: gloo has no average
    return out / ranks.world_size
