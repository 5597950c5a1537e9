"""Expert parallelism: each rank holds a slice of every MoE layer's experts, and tokens travel to their
expert's rank by all-to-all, dispatched in FP8 and combined in the model's dtype.

[Note: expert parallelism]
With ``W`` ranks in the expert-parallel group and ``E`` experts per layer (``E`` divisible by ``W``), rank
``r`` holds experts ``r*E/W .. (r+1)*E/W - 1`` of every ``lowprec.nn.GroupedLinear``: the weights become
DTensors split by experts (``Shard(0)``), so ``torch.distributed.checkpoint`` saves and loads them
like FSDP2's shards, the optimizer's norm sums their squares over the ranks, and FSDP2 or DDP leave them
alone (``lowprec.distributed.launch.wrap`` ignores parameters that are DTensors already). Each rank routes
its own tokens; one MoE layer's forward is then:

1. the ``(E,)`` token counts per expert go by one small all-to-all, so that each rank learns how many rows
   every rank sends to each of its experts (the host reads them: the splits of the next exchange);
2. **dispatch**: the rows, grouped by expert, go to their experts' ranks by ``all_to_all_single``. With
   ``fp8`` each row is quantized in 1x128 E4M3 blocks with a float32 scale per block (DeepSeek-V3's dispatch;
   the packing of ``lowprec.distributed.fp8_comm``, 132 bytes per 128 values against 256 in BF16) and
   dequantized on arrival to the input's dtype; the experts' GEMMs then cast them as the recipe says. For
   ``fp8-blockwise``, whose activation cast is the same 1x128 E4M3 block, the second cast is exact; for other
   recipes it rounds twice. Backward sends the rows' gradients back in their own dtype (the quantization's
   gradient is taken as the identity, as every lowprec cast's is);
3. the received rows, in (source rank, local expert) order, are regrouped by local expert (a stable
   permutation: each expert sees rank 0's rows first, then rank 1's, as one process sorting the whole batch
   would), run through the local experts, and put back;
4. **combine**: the outputs go back to the tokens' ranks by the reverse all-to-all, in their own dtype
   (BF16 in a BF16 run; a reduced-precision combine would round the MoE layer's output itself).

Gradients: an expert's weight gradient collects the gradients of every rank's tokens (they come back
through the dispatch's backward), the sum over the ranks of their losses' gradients. Data parallelism
averages the other parameters' gradients over the ranks, so the experts' are divided by ``W`` (a hook on
each expert parameter) and every parameter moves as one process moves it on the whole batch.

Replicas (``dp x ep``): with ``N`` ranks and ``W`` dividing ``N``, consecutive ranks form ``N / W`` expert
groups, each holding every expert once; rank ``r``'s replicas are the ranks holding the same experts
(``r mod W`` alike). Every rank still routes its own rows, within its group. The hook then sums an expert's
gradient over its replicas (one all-reduce per expert parameter) and divides by ``N``: the mean over every
rank, as DDP or FSDP2 averages the other parameters over all ``N``. A gradient norm counts each expert slice
once, not once per replica (``lowprec.ranks.replicas``).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as nnf
from torch import nn

from lowprec._checks import describe, fail
from lowprec.distributed.fp8_comm import BLOCK, PACKED_ROW, pack, padded_len, unpack
from lowprec.distributed.replica_grads import summed_over
from lowprec.distributed.traffic import labelled
from lowprec.nn import GroupedLinear
from lowprec.nn.dispatch import combine, dispatch, expert_order, inverse_permutation
from lowprec.nn.routing import outside_graphs


def pack_rows(x: torch.Tensor) -> torch.Tensor:
    """Rows of ``x`` (n, D) as FP8 bytes: each row padded to whole 128-value blocks, every block 128 E4M3
    codes then its float32 scale; ``(n, Dp/128 * 132)`` uint8, one row per row of ``x``."""
    n, d = x.shape
    dp = padded_len(d)
    padded = nnf.pad(x.detach().float(), (0, dp - d)) if dp != d else x.detach().float()
    return pack(padded.reshape(-1)).view(n, dp // BLOCK * PACKED_ROW)


def unpack_rows(packed: torch.Tensor, d: int, dtype: torch.dtype) -> torch.Tensor:
    """:func:`pack_rows`'s rows back as ``(n, d)`` values of ``dtype``."""
    n = packed.shape[0]
    return unpack(packed.reshape(-1, PACKED_ROW)).view(n, padded_len(d))[:, :d].to(dtype)  # n may be 0


def _exchange(x: torch.Tensor, send: list[int], recv: list[int], group, label: str) -> torch.Tensor:
    """Rows of ``x``: ``send[j]`` of them to rank ``j``, ``recv[i]`` arriving from rank ``i``, in rank order;
    counted by ``lowprec.distributed.count_traffic`` as ``all_to_all:<label>``."""
    out = x.new_empty((sum(recv), *x.shape[1:]))
    with labelled(label):
        dist.all_to_all_single(out, x.contiguous(), recv, send, group=group)
    return out


class _AllToAll(torch.autograd.Function):
    """Rows to the ranks ``send`` says (FP8 on the wire with ``fp8``); backward sends the gradients back in
    their own dtype. ``label`` names the bytes (``ep_dispatch``, ``ep_combine``; backward's get ``_grad``).
    See [Note: expert parallelism]."""

    @staticmethod
    def forward(ctx, x, send: list[int], recv: list[int], group, fp8: bool, label: str):
        ctx.splits, ctx.group, ctx.label = (send, recv), group, label
        if not fp8:
            return _exchange(x, send, recv, group, label)
        return unpack_rows(_exchange(pack_rows(x), send, recv, group, label), x.shape[1], x.dtype)

    @staticmethod
    def backward(ctx, grad):
        send, recv = ctx.splits
        return _exchange(grad, recv, send, ctx.group, ctx.label + "_grad"), None, None, None, None, None


@dataclass(frozen=True, slots=True, eq=False)
class ExpertParallel:
    """One expert-parallel group: its process group, its size, and whether dispatch sends FP8.
    See [Note: expert parallelism]."""

    group: dist.ProcessGroup
    size: int
    fp8: bool
    replicas: dist.ProcessGroup | None = None
    """The ranks holding this rank's experts in the other groups (None: one group of every rank)."""

    @outside_graphs  # the all-to-all's sizes are read on the host: see [Note: experts under torch.compile]
    def run(self, experts, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """``experts(rows, offsets)`` (this rank's local experts, offsets per local expert) applied to the
        rows ``x`` (T, D) grouped by global expert with ``counts`` (E,) rows each: the rows go to their
        experts' ranks and their outputs come back, in ``x``'s order."""
        w = self.size
        local = counts.numel() // w
        sent = counts.to(torch.int64).view(w, local)  # (W, E/W): row j for rank j's experts
        got = _exchange(sent, [1] * w, [1] * w, self.group, "ep_counts")  # (W, E/W): row i from rank i
        send, recv = sent.sum(1).tolist(), got.sum(1).tolist()
        # (R, D) ordered by source rank, then local expert
        rows = _AllToAll.apply(x, send, recv, self.group, self.fp8, "ep_dispatch")
        expert_of = torch.arange(local, device=x.device).repeat(w).repeat_interleave(got.flatten())
        order = expert_order(expert_of, local)  # (R,) grouped by local expert, each in rank order
        inverse = inverse_permutation(order)  # gathers both ways (see [Note: dispatch and combine])
        y = combine(experts(dispatch(rows, order, inverse, 1), got.sum(0).cumsum(0)), order, inverse)  # by source rank
        return _AllToAll.apply(y, recv, send, self.group, False, "ep_combine")  # (T, D_out) in x's order


def shard_grouped(layer: GroupedLinear, group: dist.ProcessGroup, replicas: dist.ProcessGroup | None = None) -> None:
    """Keep this rank's slice of ``layer``'s experts: weight and bias become DTensors split by experts over
    ``group`` (see :func:`shard_experts`). Experts under delayed scaling are refused: each keeps an amax
    history, which the ranks' reduction of histories would mix."""
    if layer.recipe is not None and layer.recipe.uses_delayed_scaling:
        fail("recipe", "experts under current scaling with expert parallelism (delayed scaling keeps an amax "
                       "history per expert)", layer.recipe.name)
    shard_experts(layer, ("weight", "bias"), layer.num_experts, group, replicas)


def shard_experts(module: nn.Module, names: tuple[str, ...], num_experts: int, group: dist.ProcessGroup,
                  replicas: dist.ProcessGroup | None = None) -> None:
    """Keep this rank's slice of the experts of ``module``'s parameters ``names`` (each stacked by expert
    along dim 0; a name whose parameter is None is passed over): they become DTensors split by experts over
    ``group`` (each rank's slice taken from its own copy of the whole, identical on every rank as the model
    is built from one seed), their gradients divided by the group's size, or summed over ``replicas`` (the
    ranks holding the same slice) and divided by every rank's count (see [Note: expert parallelism])."""
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import DTensor, Shard

    w, rank = dist.get_world_size(group), dist.get_rank(group)
    if num_experts % w:
        fail("ep", f"a number of ranks that divides every MoE layer's experts ({num_experts})", w)
    n = num_experts // w
    meshes: dict[str, DeviceMesh] = {}  # one per device type
    for name in names:
        p = getattr(module, name)
        if p is None:
            continue
        if p.shape[0] != num_experts:
            fail(name, f"a parameter stacked by expert along dim 0 ({num_experts} experts)", describe(p))
        if p.device.type not in meshes:
            meshes[p.device.type] = DeviceMesh.from_group(group, p.device.type)
        mesh = meshes[p.device.type]
        shard = DTensor.from_local(p.detach()[rank * n:(rank + 1) * n].clone(), mesh, [Shard(0)], run_check=False)
        param = nn.Parameter(shard, requires_grad=p.requires_grad)
        param.register_hook((lambda g, w=w: g / w) if replicas is None else
                            summed_over(replicas, w * dist.get_world_size(replicas)))
        setattr(module, name, param)


def expert_parallel(size: int, fp8: bool, group: dist.ProcessGroup | None = None) -> ExpertParallel:
    """This rank's expert-parallel group of ``size`` ranks: ``group`` (its size must be ``size``), else the
    whole default group when it has ``size`` ranks, else consecutive ranks of it, ``size`` dividing the number
    of ranks, with their replicas (see [Note: expert parallelism]). Every rank must call it alike."""
    if isinstance(size, bool) or not isinstance(size, int) or size < 2:
        fail("ep", "an int of at least 2 (the ranks experts are split over)", describe(size))
    if not (dist.is_available() and dist.is_initialized()):
        fail("ep", "an initialized process group (launch through torchrun with --parallel ddp or fsdp2)", size)
    if group is not None:
        if dist.get_world_size(group) != size:
            fail("ep", f"the size of the given group ({dist.get_world_size(group)})", size)
        return ExpertParallel(group, size, fp8)
    world = dist.get_world_size()
    if world == size:
        return ExpertParallel(dist.group.WORLD, size, fp8)
    if world % size:
        fail("ep", f"a divisor of the number of ranks ({world})", size)
    # every rank makes every group, in the same order (torch.distributed's rule for new groups)
    mine = replicas = None
    for start in range(0, world, size):
        g = dist.new_group(list(range(start, start + size)))
        mine = g if start <= dist.get_rank() < start + size else mine
    for offset in range(size):
        g = dist.new_group(list(range(offset, world, size)))
        replicas = g if dist.get_rank() % size == offset else replicas
    return ExpertParallel(mine, size, fp8, replicas)


__all__ = ["ExpertParallel", "expert_parallel", "pack_rows", "shard_grouped", "unpack_rows"]
