"""``lowprec.nn.SwiGLU``: ``silu(gate) * up`` whose backward keeps only gate and up, as they are or in FP8.

The feed-forward of Llama is ``w2(silu(w1 x) * w3 x)``; this is the product in the middle. Eager
PyTorch keeps ``gate`` for silu's backward and ``silu(gate)`` and ``up`` for the product's: three
tensors of the hidden width. This keeps two, and can keep them in FP8 (see [Note: saved
activations] in ``lowprec.nn.saved``). Backward, in FP32, with ``s = sigmoid(gate)``:
``dgate = dh * up * s * (1 + gate * (1 - s))`` and ``dup = dh * gate * s``.
"""
from __future__ import annotations

import torch
import torch.nn.functional as nnf
from torch import nn

from lowprec._checks import describe, fail
from lowprec.nn.saved import SavedActivations, check_saved, pack, unpack


class SwiGLUFunction(torch.autograd.Function):
    """``silu(gate) * up``, saving both inputs as ``saved`` says."""

    @staticmethod
    def forward(ctx, gate, up, saved: SavedActivations | None):
        h = nnf.silu(gate) * up
        g_tensors, g_meta = pack(gate, saved)
        u_tensors, u_meta = pack(up, saved)
        ctx.save_for_backward(*g_tensors, *u_tensors)
        ctx.meta, ctx.split = (g_meta, u_meta), len(g_tensors)
        return h

    @staticmethod
    def backward(ctx, dh):
        saved = ctx.saved_tensors
        g_meta, u_meta = ctx.meta
        gate, up = unpack(saved[:ctx.split], g_meta), unpack(saved[ctx.split:], u_meta)
        with torch.autocast(dh.device.type, enabled=False):
            g, u, d = gate.float(), up.float(), dh.float()
            s = torch.sigmoid(g)
            dgate = d * u * s * (1 + g * (1 - s)) if ctx.needs_input_grad[0] else None
            dup = d * g * s if ctx.needs_input_grad[1] else None
        return (dgate.to(gate.dtype) if dgate is not None else None,
                dup.to(up.dtype) if dup is not None else None, None)


def swiglu(gate: torch.Tensor, up: torch.Tensor, saved: SavedActivations | None = None) -> torch.Tensor:
    """``silu(gate) * up``, saving both for backward as ``saved`` says (None: as they are)."""
    for name, t in (("gate", gate), ("up", up)):
        if not isinstance(t, torch.Tensor) or not t.dtype.is_floating_point or t.dtype.itemsize < 2:
            fail(name, "a float32, bfloat16 or float16 tensor", describe(t), TypeError)
    if gate.shape != up.shape:
        fail("up", f"gate's shape {tuple(gate.shape)}", describe(up))
    if torch.is_grad_enabled() and (gate.requires_grad or up.requires_grad):
        return SwiGLUFunction.apply(gate, up, saved)
    return nnf.silu(gate) * up


class SwiGLU(nn.Module):
    """``silu(gate) * up`` as a module without parameters, so that ``lowprec.convert`` can set how it
    saves its inputs (``saved``). In a feed-forward: ``w2(self.act(w1(x), w3(x)))``."""

    def __init__(self, *, saved: SavedActivations | None = None) -> None:
        super().__init__()
        self.saved = check_saved(saved)

    def forward(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        return swiglu(gate, up, self.saved)

    def extra_repr(self) -> str:
        return f"saved={self.saved}"
