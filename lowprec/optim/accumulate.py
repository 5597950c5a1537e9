"""Gradient accumulation in float32 for low-precision parameters, alone or under DDP / FSDP2.

[Note: why accumulate in float32]
With gradient accumulation each micro-batch adds its gradient to ``param.grad``. For a BF16
parameter that sum is rounded to 8 significant bits after every micro-batch, so with many
micro-batches the small contributions are lost. A hook that runs after autograd has written a
low-precision parameter's gradient folds it into a float32 buffer and frees the low-precision one,
so each micro-batch is rounded to BF16 once (by autograd) and the sum is kept in float32.
Float32 parameters need nothing: autograd already accumulates their gradients in float32.

The hooks hold the accumulator only weakly: once the optimizer owning it is gone, the model's
gradients go back to plain ``param.grad``.

[Note: accumulating gradients that ranks reduce]
Master weights, loss scaling and the step guard must see the gradient averaged over the ranks,
so the float32 fold has to respect who reduces the gradient and when.

*DDP* reduces ``param.grad`` from its own hook on the parameter's gradient accumulator, which runs
right after autograd's post-accumulate hooks on the same parameter; with ``model.no_sync()`` it
skips the reduction and the micro-batches pile up in ``param.grad`` until the one backward that
syncs. Folding into a float32 buffer and freeing ``param.grad`` (the single-process way) would
hand DDP an empty gradient and keep this rank's own sum: the ranks' weights part (the reported
max difference of 17.7 after one step). So for a replicated (non-DTensor) low-precision parameter
under a data-parallel group, lowprec accumulates on the side and lets DDP reduce the result:

1. a hook on the incoming gradient (before autograd adds it to ``param.grad``) adds it to a float32
   buffer -- from the second micro-batch on; the first needs no copy, autograd stores it as it is;
2. the post-accumulate hook writes the buffer, rounded once to the parameter's dtype, into
   ``param.grad`` in place, before DDP's hook reads it;
3. ``step`` reads ``param.grad``, which the syncing backward left reduced, and widens it to float32.

So micro-batches accumulate in float32 whether or not the user calls ``no_sync()`` (and if every
micro-batch syncs, each reduction carries the running float32 sum, which also ends right), and
the sum is rounded to BF16 once, for the wire, as DDP communicates in the parameter's dtype.

*FSDP2* parameters are DTensor shards that no autograd node accumulates into: ``fully_shard``
reduce-scatters the unsharded gradient and then assigns (or adds to) the shard's ``.grad`` and
calls its post-accumulate hooks itself. The single-process fold is therefore already a fold of
reduced gradients, so it stays: each synced backward's shard is added to a float32 DTensor buffer
sharded like the parameter. Backwards run under ``set_requires_gradient_sync(False)`` accumulate in
FSDP2's unsharded gradients, in its ``reduce_dtype`` (``MixedPrecisionPolicy(reduce_dtype=
torch.float32)`` keeps that in float32), and reach the fold with the one that syncs.
"""
from __future__ import annotations

import enum
import weakref
from collections.abc import Callable

import torch

from lowprec.ranks import is_dtensor

LOW_PRECISION = (torch.bfloat16, torch.float16)


def is_low_precision(p: torch.Tensor) -> bool:
    return p.dtype in LOW_PRECISION


class GradSource(enum.Enum):
    """Where a parameter's float32 gradient comes from at ``step``; see the notes above."""

    GRAD = "grad"
    """``param.grad`` as autograd (or DDP) left it: float32 parameters."""
    FOLDED = "folded"
    """The float32 buffer the post-accumulate hook folded into: alone, or FSDP2's reduced shards."""
    REDUCED = "reduced"
    """``param.grad`` after DDP reduced it, widened; micro-batches summed on the side in float32."""


def _hook(ref: weakref.ref, method: str, i: int) -> Callable[[torch.Tensor], None]:
    """A hook calling ``method(i, tensor)`` of the accumulator ``ref`` holds weakly (nothing once it is gone)."""
    def hook(t: torch.Tensor) -> None:
        acc = ref()
        if acc is not None:
            getattr(acc, method)(i, t)

    return hook


class GradAccumulator:
    """Float32 gradients for a list of parameters, however many backward passes contributed.

    ``replicated``: low-precision parameters that are not DTensors have their gradients reduced by
    DDP (see [Note: accumulating gradients that ranks reduce]).
    """

    def __init__(self, replicated: bool = False) -> None:
        self.replicated = replicated
        self.params: list[torch.Tensor] = []
        self.sources: list[GradSource] = []
        self._buffers: list[torch.Tensor | None] = []
        self._handles: list = []

    def add(self, params: list[torch.Tensor]) -> None:
        """Start accumulating for ``params`` (appended after those already added)."""
        ref = weakref.ref(self)
        for p in params:
            i = len(self.params)
            source = self._source(p)
            self.params.append(p)
            self.sources.append(source)
            self._buffers.append(None)
            if not p.requires_grad or source is GradSource.GRAD:
                continue
            if source is GradSource.FOLDED:
                self._handles.append(p.register_post_accumulate_grad_hook(_hook(ref, "fold", i)))
            else:
                self._handles.append(p.register_hook(_hook(ref, "add_incoming", i)))
                self._handles.append(p.register_post_accumulate_grad_hook(_hook(ref, "write_back", i)))

    def _source(self, p: torch.Tensor) -> GradSource:
        if not is_low_precision(p):
            return GradSource.GRAD
        return GradSource.REDUCED if self.replicated and not is_dtensor(p) else GradSource.FOLDED

    def fold(self, i: int, p: torch.Tensor) -> None:
        """Add ``p.grad`` (just written by autograd, or by FSDP2) to the float32 buffer ``i`` and free it."""
        g = p.grad
        p.grad = None
        if g is None:
            return
        buf = self._buffers[i]
        if buf is None:
            self._buffers[i] = g.float()  # a new float32 tensor (a DTensor for a DTensor): g is bf16/fp16
        else:
            buf.add_(g)

    def add_incoming(self, i: int, grad: torch.Tensor) -> None:
        """Add a micro-batch's gradient, before autograd accumulates it, to the float32 sum ``i``."""
        p = self.params[i]
        buf = self._buffers[i]
        if buf is None:
            if p.grad is None:
                return  # the first micro-batch: autograd stores it as it is, exact
            buf = self._buffers[i] = p.grad.float()  # what the earlier micro-batches left
        buf.add_(grad)

    @torch.no_grad()
    def write_back(self, i: int, p: torch.Tensor) -> None:
        """Put the float32 sum, rounded once, into ``p.grad`` for DDP to reduce."""
        buf = self._buffers[i]
        if buf is not None and p.grad is not None:
            p.grad.copy_(buf)

    def grads(self) -> list[torch.Tensor | None]:
        """The float32 gradient of each parameter (``None`` where none was computed), in order.

        Float32 parameters' entries are their ``.grad`` itself, so changing an entry in place
        changes the gradient autograd accumulates into.
        """
        out: list[torch.Tensor | None] = []
        for p, source, buf in zip(self.params, self.sources, self._buffers):
            if source is GradSource.FOLDED:
                out.append(buf)
            elif source is GradSource.REDUCED:
                out.append(None if p.grad is None else p.grad.float())
            else:
                out.append(p.grad)
        return out

    def zero(self) -> None:
        """Drop every gradient: the float32 buffers and any ``.grad`` of the parameters."""
        self._buffers = [None] * len(self.params)
        for p in self.params:
            p.grad = None

    def remove_hooks(self) -> None:
        """Stop folding: later backward passes leave gradients in ``param.grad`` again."""
        for h in self._handles:
            h.remove()
        self._handles = []
