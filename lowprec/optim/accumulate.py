"""Gradient accumulation in float32 for low-precision parameters.

[Note: why accumulate in float32]
With gradient accumulation each micro-batch adds its gradient to ``param.grad``. For a BF16
parameter that sum is rounded to 8 significant bits after every micro-batch, so with many
micro-batches the small contributions are lost. A hook that runs after autograd has written a
low-precision parameter's gradient folds it into a float32 buffer and frees the low-precision one,
so each micro-batch is rounded to BF16 once (by autograd) and the sum is kept in float32.
Float32 parameters need nothing: autograd already accumulates their gradients in float32.

The hooks hold the accumulator only weakly: once the optimizer owning it is gone, the model's
gradients go back to plain ``param.grad``.
"""
from __future__ import annotations

import weakref
from collections.abc import Callable

import torch

LOW_PRECISION = (torch.bfloat16, torch.float16)


def is_low_precision(p: torch.Tensor) -> bool:
    return p.dtype in LOW_PRECISION


def _fold_hook(ref: weakref.ref, i: int) -> Callable[[torch.Tensor], None]:
    def hook(p: torch.Tensor) -> None:
        acc = ref()
        if acc is not None:
            acc.fold(i, p)

    return hook


class GradAccumulator:
    """Float32 gradients for a list of parameters, however many backward passes contributed."""

    def __init__(self) -> None:
        self.params: list[torch.Tensor] = []
        self._buffers: list[torch.Tensor | None] = []
        self._handles: list = []

    def add(self, params: list[torch.Tensor]) -> None:
        """Start accumulating for ``params`` (appended after those already added)."""
        ref = weakref.ref(self)
        for p in params:
            i = len(self.params)
            self.params.append(p)
            self._buffers.append(None)
            if is_low_precision(p) and p.requires_grad:
                self._handles.append(p.register_post_accumulate_grad_hook(_fold_hook(ref, i)))

    def fold(self, i: int, p: torch.Tensor) -> None:
        """Add ``p.grad`` (just written by autograd) to the float32 buffer ``i`` and free it."""
        g = p.grad
        p.grad = None
        if g is None:
            return
        buf = self._buffers[i]
        if buf is None:
            self._buffers[i] = g.float()  # a new float32 tensor: g is bf16/fp16
        else:
            buf.add_(g)

    def grads(self) -> list[torch.Tensor | None]:
        """The float32 gradient of each parameter (``None`` where none was computed), in order.

        Float32 parameters' entries are their ``.grad`` itself, so changing an entry in place
        changes the gradient autograd accumulates into.
        """
        return [buf if is_low_precision(p) else p.grad for p, buf in zip(self.params, self._buffers)]

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
