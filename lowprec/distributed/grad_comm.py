"""Gradient communication in FP32, BF16 or FP8: a DDP communication hook and an FSDP2 reduce-scatter.

[Note: what each mode puts on the wire]
``fp32``: the gradients are widened to float32, summed by the backend in float32, and divided by
the world size. ``bf16``: they are narrowed to bfloat16 and summed by the backend in bfloat16 (the
behaviour of DDP on BF16 parameters, and of FSDP2 with ``reduce_dtype=torch.bfloat16``).
``fp8``: see [Note: FP8 on the wire, never summed in FP8] in ``lowprec.distributed.fp8_comm`` --
E4M3 codes with a float32 scale per 128 values; sums in float32.

Under DDP (:func:`register_ddp`) each bucket is all-reduced. In ``fp8`` that is a reduce-scatter
done as an all-to-all (each rank sums its shard in float32), the shard divided by the world size in
float32, then an FP8 all-gather of the shards: per rank ``2 (W-1)/W * N * 132/128`` bytes for ``N``
values, against ``2 (W-1)/W * N * 2`` for a BF16 ring all-reduce, a ratio of 33/64 = 0.52.
The all-gather is in FP8 as well because a BF16 one alone would cost as much as the whole FP8
exchange plus half of it (a ratio of 0.76); its second rounding is bounded the same way.

Under FSDP2 (:func:`register_fsdp`) the reduce-scatter is all there is (the result stays sharded),
replaced through ``FSDPModule.set_custom_reduce_scatter``, the extension point torch 2.13's
``fully_shard`` gives for it; FSDP2 hands it the flat input in its reduce dtype, chunk ``j`` for
rank ``j``, and an op, AVG or SUM (with a post-division it does itself). The ``fp8`` ratio to a
BF16 reduce-scatter is again 33/64. Choose FSDP2's ``MixedPrecisionPolicy(reduce_dtype=...)`` with
:func:`fsdp_reduce_dtype`, so the input arrives in the dtype the mode sends (no extra copy).

[Note: counting bytes]
Each hook adds to ``GradCommState.bytes_sent`` the bytes this rank sends under the
bandwidth-optimal schedule of each collective it calls: ``(W-1)/W`` of the input of an all-to-all
or a reduce-scatter, ``W-1`` times the input of an all-gather, ``2 (W-1)/W`` of an all-reduce. The
sizes are those of the tensors handed to torch.distributed, padding and scales included, so the
figure is counted, not estimated; :meth:`GradCommState.take` reads and resets it once per step.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn as nn

from lowprec._checks import Choice, describe, fail
from lowprec.distributed import fp8_comm


class GradComm(Choice):
    """What gradients travel as; see [Note: what each mode puts on the wire]."""

    FP32 = "fp32"
    BF16 = "bf16"
    FP8 = "fp8"

    @classmethod
    def parse(cls, mode: str | GradComm, name: str = "mode") -> GradComm:
        return super().parse(mode, name)


_WIRE_DTYPE = {GradComm.FP32: torch.float32, GradComm.BF16: torch.bfloat16}


@dataclass(slots=True)
class GradCommState:
    """A hook's mode and group, and the bytes it has sent; see [Note: counting bytes]."""

    mode: GradComm
    group: dist.ProcessGroup | None = None
    """The group gradients are reduced over (``None``: the default group)."""
    bytes_sent: int = 0
    """Bytes this rank has sent since the last :meth:`take`."""
    calls: int = 0
    """Buckets (DDP) or reduce-scatters (FSDP2) communicated since the last :meth:`take`."""

    def take(self) -> int:
        """The bytes sent since the last call (one optimizer step's, when called once per step); resets."""
        sent, self.bytes_sent, self.calls = self.bytes_sent, 0, 0
        return sent


def all_reduce_mean(x: torch.Tensor, state: GradCommState) -> torch.Tensor:
    """The mean over ranks of the flat ``x``, communicated as ``state.mode`` says, in ``x``'s dtype.
    All ranks get identical values."""
    group = state.group
    w = dist.get_world_size(group)
    if state.mode is GradComm.FP8:
        n = x.numel()
        s = fp8_comm.padded_len(-(-n // w))  # shard length: whole blocks, W shards cover x
        flat = x.detach().reshape(-1).float()
        padded = torch.cat([flat, flat.new_zeros(w * s - n)]) if w * s != n else flat  # (W * S,)
        shard, sent_rs = fp8_comm.fp8_reduce_scatter(padded, group)
        gathered, sent_ag = fp8_comm.fp8_all_gather(shard.div_(w), group)  # divided in float32 before the second cast
        out = gathered[:n].to(x.dtype)
        sent = sent_rs + sent_ag
    else:
        out = x.detach().to(_WIRE_DTYPE[state.mode], copy=True)
        sent = fp8_comm.all_reduce(out, group)
        out = out.div_(w).to(x.dtype)
    state.bytes_sent += sent
    state.calls += 1
    return out.view_as(x)


def ddp_comm_hook(state: GradCommState, bucket):
    """A DDP communication hook: the bucket's gradients (a ``dist.GradBucket``) become their mean over
    ranks, sent as ``state.mode``; returns a ``torch.futures.Future`` of the bucket. Register with
    :func:`register_ddp` (or ``ddp.register_comm_hook(state, ddp_comm_hook)``). Left unannotated: DDP
    compares a hook's annotations with its own types, and postponed annotations are strings.

    The collectives are issued in order from the hook and the returned future is already complete:
    on GPUs they run on their streams in that order, on the CPU (gloo) they block as any gloo call.
    """
    buf = bucket.buffer()
    buf.copy_(all_reduce_mean(buf, state))
    # a future holding CUDA tensors must name their devices (it then syncs streams for its waiters)
    fut: torch.futures.Future[torch.Tensor] = torch.futures.Future(devices=[buf.device] if buf.is_cuda else None)
    fut.set_result(buf)
    return fut


def register_ddp(ddp_model: nn.parallel.DistributedDataParallel, mode: str | GradComm) -> GradCommState:
    """Make ``ddp_model`` communicate its gradients as ``mode`` (``"fp32"``, ``"bf16"`` or ``"fp8"``);
    returns the hook's state, whose ``take()`` gives the bytes sent per step. Call before the first backward."""
    if not isinstance(ddp_model, nn.parallel.DistributedDataParallel):
        fail("ddp_model", "a torch.nn.parallel.DistributedDataParallel", describe(ddp_model), TypeError)
    state = GradCommState(GradComm.parse(mode), ddp_model.process_group)
    ddp_model.register_comm_hook(state, ddp_comm_hook)
    return state


class FSDPReduceScatter:
    """FSDP2's gradient reduce-scatter, sent as the state's mode (``set_custom_reduce_scatter``).

    It has the two methods of FSDP2's ``ReduceScatter`` interface, which FSDP2 calls by name; the
    interface class itself lives in a private module, so it is not subclassed."""

    def __init__(self, state: GradCommState) -> None:
        self.state = state

    def allocate(self, size: Sequence[int], *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: dist.ProcessGroup,
                 op, async_op: bool = False) -> None:
        if op not in (dist.ReduceOp.AVG, dist.ReduceOp.SUM):
            fail("op", "ReduceOp.AVG or ReduceOp.SUM (no custom gradient divide factor with lowprec's "
                 "reduce-scatter; FSDP2 then divides after it)", describe(op))
        w = dist.get_world_size(group)
        if self.state.mode is GradComm.FP8:
            summed, sent = fp8_comm.fp8_reduce_scatter(input_tensor, group)
        else:
            wire = _WIRE_DTYPE[self.state.mode]
            summed = output_tensor.new_empty(output_tensor.shape, dtype=wire)
            sent = fp8_comm.reduce_scatter(summed, input_tensor.to(wire), group)
        if op == dist.ReduceOp.AVG:
            summed = summed.float().div_(w)
        output_tensor.copy_(summed)
        self.state.bytes_sent += sent
        self.state.calls += 1


def fsdp_reduce_dtype(mode: str | GradComm) -> torch.dtype | None:
    """The ``reduce_dtype`` of FSDP2's ``MixedPrecisionPolicy`` for ``mode``: float32 or bfloat16, and
    ``None`` (the gradients' own dtype, quantized from directly) for ``fp8``."""
    return _WIRE_DTYPE.get(GradComm.parse(mode))


def register_fsdp(model: nn.Module, mode: str | GradComm) -> GradCommState:
    """Make every ``fully_shard``-ed module of ``model`` reduce-scatter its gradients as ``mode``;
    returns the shared state, whose ``take()`` gives the bytes sent per step."""
    if not isinstance(model, nn.Module):
        fail("model", "a torch.nn.Module", describe(model), TypeError)
    from torch.distributed.fsdp import FSDPModule  # here: importing FSDP costs a second at startup

    fsdp_modules = [m for m in model.modules() if isinstance(m, FSDPModule)]
    if not fsdp_modules:
        fail("model", "a model with fully_shard applied (torch.distributed.fsdp.fully_shard)", type(model).__name__)
    state = GradCommState(GradComm.parse(mode))
    comm = FSDPReduceScatter(state)
    for m in fsdp_modules:
        m.set_custom_reduce_scatter(comm)
    return state
