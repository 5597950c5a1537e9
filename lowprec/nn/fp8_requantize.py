"""The optimizer's write of its FP32 masters into the FP8 weights, all of them at once."""
from __future__ import annotations

import math

import torch

from lowprec import kernels as K
from lowprec.nn.fp8_weight import FP8Weight
from lowprec.nn.stored_codes import E4M3
from lowprec.quant.scales import amax_scale


@torch.no_grad()
def requantize_all(params: list[FP8Weight], sources: list[torch.Tensor]) -> None:
    """``p.requantize_(src)`` for every pair, the same bits, with the amaxes of the per-tensor weights
    taken together: one multi-tensor pass over their sources and one computation of their scales, so
    that no weight needs an amax pass of its own, then their casts with the given scales (one launch for
    all on the Triton route: ``lowprec.kernels.requantize_many``). The
    amax of a tensor rounded to the parameter's dtype is the rounded amax of the tensor: rounding to
    nearest is monotonic. Shards of a weight (FSDP2's, which have an ``agreement``) take the maximum of
    their amaxes over the ranks holding the other rows, in one exchange for all the shards that agree over
    the same ranks. Other weights (128x128 blocks) take ``requantize_``."""
    groups: dict[tuple, list[tuple[FP8Weight, torch.Tensor]]] = {}
    for p, src in zip(params, sources, strict=True):
        if type(src) is torch.Tensor and isinstance(p, FP8Weight) and p.granularity.per_tensor:
            groups.setdefault((src.device, src.dtype, p.dtype, p.agreement), []).append((p, src.detach()))
        else:
            p.requantize_(src)
    for (_, _, dtype, agreement), pairs in groups.items():
        params, srcs = [p for p, _ in pairs], [src for _, src in pairs]
        full = _with_rows(srcs)  # a shard with no rows takes the scale alone
        amaxes = amaxes_of(srcs, full).to(dtype).float()  # of the rounded sources
        if agreement is not None:
            agreement(amaxes)
        scales = amax_scale(amaxes, E4M3)
        if len(full) < len(srcs):
            for i in set(range(len(srcs))) - set(full):
                params[i]._scale.copy_(scales[i].reshape(params[i]._scale.shape))
            scales = scales[full]
        K.requantize_many([srcs[i] for i in full], scales, [params[i]._data for i in full],
                          [params[i]._scale for i in full], dtype)
        kept = [(p._amax, amax) for p, amax in zip(params, amaxes.unbind()) if p._amax is not None]
        if kept:
            torch._foreach_copy_([a for a, _ in kept], [b for _, b in kept])
        for p in params:
            p._stored()


def _with_rows(srcs: list[torch.Tensor]) -> list[int]:
    return [i for i, s in enumerate(srcs) if s.numel()]


def amaxes_of(srcs: list[torch.Tensor], full: list[int] | None = None) -> torch.Tensor:
    """The amax of each source, 0 for an empty one (a shard with no rows), in one multi-tensor pass;
    ``full``: the indices of the non-empty sources, where the caller knows them."""
    full = _with_rows(srcs) if full is None else full
    if len(full) == len(srcs):
        return torch.stack(torch._foreach_norm(srcs, ord=math.inf))
    out = srcs[0].new_zeros(len(srcs))
    if full:
        out[full] = torch.stack(torch._foreach_norm([srcs[i] for i in full], ord=math.inf)).to(out.dtype)
    return out
