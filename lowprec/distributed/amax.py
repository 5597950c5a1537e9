"""Delayed scaling across ranks: every layer's amax history reduced (max) over the group in one collective.

[Note: delayed scales under data parallelism]
A delayed scale is taken from a layer's amax history (``lowprec.nn.delayed``). Each rank records
the amaxes of its own micro-batches, so without agreement the histories -- and the scales -- drift
apart from rank to rank: the replicas would quantize their weights and activations differently.
:func:`sync_amaxes` makes every rank's history the element-wise max over the group. It is called
once per optimizer step, after the step's last backward (the train loop calls it just before
``optimizer.step``), so the next step's scales come from the same history on every rank: the max
of everyone's amaxes, which is the amax the whole global batch would have recorded in one process.

All layers go in one collective: their histories, already one tensor per device (the model's bank,
``lowprec.nn.delayed_bank``), with the amaxes still pending folded in, are reduced with MAX and copied
back, and the scales computed again from them. Reducing whole histories rather than the rows written since the last
call is correct because max is idempotent: a row that already holds the group's max keeps it. It
costs ``history_len * 3 * 4`` bytes per layer (12 KiB at the default length of 1024), small
beside the gradients. The per-role ``count`` needs no reduction: every rank runs the same forwards
and backwards, so the counts advance alike.

Within a step of several micro-batches, the second and later micro-batches take their scales from
histories that already hold this rank's own earlier amaxes of the step, not yet reduced; ranks may
then differ by those amaxes until the step's sync. That changes only each rank's local gradient
(never the weights, which all ranks update from the same reduced gradient). Calling
:func:`sync_amaxes` after every micro-batch removes even that, at one collective per micro-batch.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn

from lowprec._checks import describe, fail
from lowprec.distributed.agree import is_distributed
from lowprec.nn.delayed import DelayedState, delayed_states_of


def delayed_states(model: nn.Module) -> list[DelayedState]:
    """Every delayed-scaling state of ``model`` (each converted linear's, each expert's), in module order."""
    if not isinstance(model, nn.Module):
        fail("model", "a torch.nn.Module", describe(model), TypeError)
    return [state for _, state in delayed_states_of(model)]


@torch.no_grad()
def reduce_amax_histories(model: nn.Module, group: dist.ProcessGroup | None = None) -> int:
    """Replace every delayed-scaling amax history of ``model`` by its element-wise max over ``group``
    (the default group for ``None``), in one all-reduce for all layers; returns how many layers took
    part. Every rank must call it (with the same model structure). See [Note: delayed scales under
    data parallelism]."""
    states = delayed_states(model)
    if not states:
        return 0
    banks = list({id(s.bank): s.bank for s in states}.values())  # one per device, in the layers' order
    for bank in banks:
        bank.fold()  # the amaxes still pending join the histories before they are reduced
    device = banks[0].device
    # every row of every bank, a layer's or a free one: the same shapes on every rank
    flat = torch.cat([b.history.reshape(-1).to(device) for b in banks])  # (rows * 3 * L,)
    dist.all_reduce(flat, op=dist.ReduceOp.MAX, group=group)
    for bank, reduced in zip(banks, flat.split([b.history.numel() for b in banks]), strict=True):
        bank.history.copy_(reduced.view_as(bank.history))
        bank.fold()  # nothing pending: the scales follow the reduced histories
    return len(states)


def sync_amaxes(model: nn.Module, group: dist.ProcessGroup | None = None) -> int:
    """Make the delayed-scaling histories of ``model`` agree across the data-parallel ``group``.

    Call once per optimizer step, after the last backward and before ``optimizer.step`` (the
    training loop's place for it). Without torch.distributed, or with one rank, it does nothing and
    returns 0; otherwise as :func:`reduce_amax_histories`. Works on the model as wrapped by DDP or
    FSDP2, or on the module inside: the converted layers are found either way.
    """
    if not is_distributed(group):
        delayed_states(model)  # still check the argument
        return 0
    return reduce_amax_histories(model, group)
