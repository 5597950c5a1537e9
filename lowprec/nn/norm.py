"""``lowprec.nn.RMSNorm``: RMSNorm whose backward keeps only its input, in high precision or FP8.

Forward is Llama's: normalise in FP32, cast back to the input's dtype, multiply by the weight.
The autograd is written out so that backward keeps the input alone (eager PyTorch keeps an FP32
copy, the reciprocal RMS and the normalised tensor besides), and can keep it in FP8 (see [Note:
saved activations] in ``lowprec.nn.saved``). The gradient is computed in FP32 from the saved input:
with ``n = x * r``, ``r = 1 / rms(x)`` and ``dn = dy * weight``,
``dx = r * (dn - n * mean(dn * n))`` and ``dweight = sum(dy * n)`` over the tokens.
"""
from __future__ import annotations

import torch
from torch import nn

from lowprec._checks import describe, fail
from lowprec.nn.saved import SavedActivations, check_saved, pack, unpack


def _normalise(x: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(x * r in FP32, r) with ``r = 1 / sqrt(mean(x^2) + eps)`` per row."""
    x32 = x.float()
    r = torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)  # (..., 1)
    return x32 * r, r


def _forward(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    n = _normalise(x, eps)[0].type_as(x)
    return n * weight if weight is not None else n


class RMSNormFunction(torch.autograd.Function):
    """``rms_norm(x) * weight``, saving ``x`` as ``saved`` says and nothing else but the weight."""

    @staticmethod
    def forward(ctx, x, weight, eps: float, saved: SavedActivations | None):
        y = _forward(x, weight, eps)
        tensors, meta = pack(x, saved)
        ctx.save_for_backward(*tensors, weight)
        ctx.meta, ctx.eps = meta, eps
        return y

    @staticmethod
    def backward(ctx, dy):
        *tensors, weight = ctx.saved_tensors
        x = unpack(tensors, ctx.meta)
        with torch.autocast(dy.device.type, enabled=False):
            n32, r = _normalise(x, ctx.eps)
            n = n32.to(x.dtype)
            dweight = None
            if weight is not None:
                if ctx.needs_input_grad[1]:
                    dweight = (dy * n).reshape(-1, n.shape[-1]).sum(0).to(weight.dtype)
                dy = (dy * weight).to(n.dtype)  # the gradient reaching the cast to x's dtype
            dn = dy.float()
            dx = r * (dn - n32 * (dn * n32).mean(-1, keepdim=True))
        return dx.to(x.dtype), dweight, None, None


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float,
             saved: SavedActivations | None = None) -> torch.Tensor:
    """RMSNorm over the last dimension, saving ``x`` for backward as ``saved`` says (None: as it is)."""
    if not isinstance(x, torch.Tensor) or not x.dtype.is_floating_point or x.dtype.itemsize < 2:
        fail("input", "a float32, bfloat16 or float16 tensor", describe(x), TypeError)
    if weight is not None and (x.dim() == 0 or weight.shape != x.shape[-1:]):
        fail("input", f"a last dimension of {weight.shape[0]} (the weight's)", describe(x))
    if torch.is_grad_enabled() and (x.requires_grad or (weight is not None and weight.requires_grad)):
        return RMSNormFunction.apply(x, weight, eps, saved)
    return _forward(x, weight, eps)


class RMSNorm(nn.Module):
    """RMSNorm over the last dimension, a drop-in for Llama's and for a 1-D ``torch.nn.RMSNorm``
    (parameter ``weight``, or none without ``elementwise_affine``); its backward keeps only the input,
    as ``saved`` says (None: in its own dtype; ``lowprec.convert`` sets it from the policy)."""

    def __init__(self, dim: int, eps: float = 1e-5, *, elementwise_affine: bool = True,
                 saved: SavedActivations | None = None, device=None, dtype=None) -> None:
        super().__init__()
        if isinstance(dim, bool) or not isinstance(dim, int) or dim <= 0:
            fail("dim", "a positive int", describe(dim))
        self.dim, self.eps = dim, float(eps)
        self.weight = nn.Parameter(torch.ones(dim, device=device, dtype=dtype)) if elementwise_affine else None
        self.saved = check_saved(saved)

    @classmethod
    def from_torch(cls, norm: nn.RMSNorm) -> RMSNorm:
        """A lowprec RMSNorm sharing ``norm``'s weight; its ``eps`` None becomes the dtype's machine
        epsilon at each call, as torch's does."""
        if len(norm.normalized_shape) != 1:
            fail("norm", "a torch.nn.RMSNorm over the last dimension only", describe(norm.normalized_shape))
        new = cls.__new__(cls)
        nn.Module.__init__(new)
        new.dim, new.eps, new.weight, new.saved = norm.normalized_shape[0], norm.eps, norm.weight, None
        new.train(norm.training)
        return new

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if isinstance(x, torch.Tensor) and (x.dim() == 0 or x.shape[-1] != self.dim):
            fail("input", f"a last dimension of {self.dim}", describe(x))
        eps = self.eps if self.eps is not None else torch.finfo(x.dtype).eps
        return rms_norm(x, self.weight, eps, self.saved)

    def extra_repr(self) -> str:
        return f"{self.dim}, eps={self.eps}, saved={self.saved}"
