"""AdamWLP's step over many parameters at once: a few kernels per bucket instead of per parameter.

[Note: the batched step]
Parameters of one device and dtype (of the parameter and of its gradient), one param group and one
step count are updated together, up to :data:`BUCKET` elements at a time. Their gradients and
parameters are concatenated into flat vectors, each moment decoded from all their codes at once (the
per-group scales of FP8 and 8-bit moments are rows of one table: each parameter's groups are its own,
zero-padded as :func:`lowprec.optim.states.store` pads them), updated by the same elementwise ops as
the per-parameter step, encoded again, and copied back into each parameter's own state tensors, so
the state_dict is unchanged. Every op is elementwise or reduces within one group, so each value is
the per-parameter step's bit for bit. A bucket's working copies take about ``28 x BUCKET`` bytes at
most: four float32 vectors (gradient, parameter, both moments), the update's float32 temporaries and
the float64 copy its square root is taken in (a larger parameter alone takes its own size, as in the
per-parameter step). CUDA parameters with FP32, BF16 or 8-bit moments take the fused kernel instead.

[Note: the AdamW update]
torch's AdamW formulas (decoupled weight decay, bias correction, ``eps`` added to the corrected
root), written as single IEEE operations on float32 (products, sums, one division, one square root
correctly rounded by ``states.sqrt_rn``, scalars rounded to float32), each its own kernel so nothing
contracts into an FMA:
``p = p * (1 - lr wd)``; ``m = m * b1 + g * (1 - b1)``; ``v = v * b2 + (g * g) * (1 - b2)``;
``p = p - m / (sqrt(v) * (1 / sqrt(1 - b2^t)) + eps) * (lr / (1 - b1^t))``. torch's own ops for
this (``lerp_``, ``addcmul_``, ``addcdiv_``, a division by a scalar) round differently on CPU and CUDA
(one contracts into FMAs, the other multiplies by a reciprocal), so written this way the step gives
the same bits on every device and in the fused kernel; it stays within a few float32 ulps of
``torch.optim.AdamW``.
"""
from __future__ import annotations

import torch

from lowprec.optim.states import Moment, StateFormat, load, sqrt_rn, store

BUCKET = 1 << 22
"""Most elements updated together (a larger parameter alone is a bucket): about 112 MiB of working
copies, small against the moments' savings, and enough to make launches rare."""


def buckets(params: list[torch.Tensor], steps: list[float], limit: int = BUCKET) -> list[list[int]]:
    """Indices of ``params`` split into buckets of one device, dtypes and step count, ``limit`` elements
    at most each (a larger parameter alone)."""
    open_: dict[tuple, list[int]] = {}
    sizes: dict[tuple, int] = {}
    out: list[list[int]] = []
    for i, p in enumerate(params):
        key = (p.device, p.dtype, p.grad.dtype, steps[i])
        if key in open_ and sizes[key] + p.numel() > limit:
            out.append(open_.pop(key))
        if key not in open_:
            open_[key], sizes[key] = [], 0
        open_[key].append(i)
        sizes[key] += p.numel()
    return out + list(open_.values())


def _flat_groups(states: list[dict], fmt: StateFormat, key: str) -> dict[str, torch.Tensor]:
    """One state dict holding every parameter's codes zero-padded to whole groups, and their scales."""
    size = fmt.group
    codes = [s[key].reshape(-1) for s in states]
    pads = [-c.numel() % size for c in codes]
    zeros = codes[0].new_zeros(max(pads))
    pieces = [t for c, pad in zip(codes, pads) for t in (c, zeros[:pad]) if t.numel()]
    out = {key: torch.cat(pieces)}
    out.update({key + s: torch.cat([st[key + s] for st in states]) for s in fmt.group_keys})
    return out


def load_flat(states: list[dict], fmt: StateFormat, moment: Moment, numels: list[int]) -> torch.Tensor:
    """Every parameter's float32 moment, concatenated (``load`` of each, in one go)."""
    key = moment.value
    if fmt.group is None:
        return torch.cat([s[key].reshape(-1) for s in states]).float()
    padded = load(_flat_groups(states, fmt, key), fmt, moment)
    sizes = [-(-n // fmt.group) * fmt.group for n in numels]
    return torch.cat([part[:n] for part, n in zip(padded.split(sizes), numels)])


def store_flat(x: torch.Tensor, states: list[dict], fmt: StateFormat, moment: Moment, numels: list[int]) -> None:
    """``store`` of each parameter's part of ``x`` into its state tensors (same bits, fewer kernels)."""
    key = moment.value
    parts = x.split(numels)
    if fmt.group is None:
        new = store(x, fmt, moment)[key].split(numels)
        torch._foreach_copy_([s[key] for s in states], [n.view(s[key].shape) for n, s in zip(new, states)])
        return
    pads = [-n % fmt.group for n in numels]
    zeros = x.new_zeros(max(pads))
    joined = torch.cat([t for part, pad in zip(parts, pads) for t in (part, zeros[:pad]) if t.numel()])
    new = store(joined, fmt, moment)
    codes = new[key].split([n + pad for n, pad in zip(numels, pads)])
    dst = [s[key] for s in states]
    torch._foreach_copy_(dst, [c[:n].view(d.shape) for c, n, d in zip(codes, numels, dst)])
    for suffix in fmt.group_keys:
        groups = [s[key + suffix].numel() for s in states]
        torch._foreach_copy_([s[key + suffix] for s in states], list(new[key + suffix].split(groups)))


def constants(group: dict, step: float) -> dict[str, float]:
    """The update's scalars for ``group`` at ``step`` (Python floats; each op rounds them to float32)."""
    beta1, beta2 = group["betas"]
    lr = group["lr"]
    return {"decay": 1 - lr * group["weight_decay"], "beta1": beta1, "omb1": 1 - beta1, "beta2": beta2,
            "omb2": 1 - beta2, "inv_bc2": 1 / (1 - beta2**step) ** 0.5, "eps": group["eps"],
            "step_size": lr / (1 - beta1**step)}


def adamw_math(p: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor,
               group: dict, step: float) -> None:
    """One AdamW update of ``p`` and the float32 moments in place (see [Note: the AdamW update]): what the
    per-parameter, the batched and the fused step (``lowprec.optim.fused``) all run."""
    c = constants(group, step)
    p.mul_(c["decay"])
    exp_avg.mul_(c["beta1"]).add_(grad * c["omb1"])
    exp_avg_sq.mul_(c["beta2"]).add_(grad.square().mul_(c["omb2"]))
    denom = sqrt_rn(exp_avg_sq).mul_(c["inv_bc2"]).add_(c["eps"])
    p.sub_(exp_avg.div(denom).mul_(c["step_size"]))


def update(params: list[torch.Tensor], states: list[dict], fmt: StateFormat, group: dict, step: float) -> None:
    """One AdamW step of ``params`` (one bucket, see [Note: the batched step]), their counts already
    at ``step``: :func:`adamw_math` on the concatenated tensors."""
    numels = [p.numel() for p in params]
    grad = torch.cat([p.grad.reshape(-1) for p in params])
    grad = grad if grad.dtype == torch.float32 else grad.float()
    flat = torch.cat([p.reshape(-1) for p in params])
    exp_avg, exp_avg_sq = (load_flat(states, fmt, m, numels) for m in Moment)
    adamw_math(flat, grad, exp_avg, exp_avg_sq, group, step)
    torch._foreach_copy_(params, [part.view(p.shape) for part, p in zip(flat.split(numels), params)])
    store_flat(exp_avg, states, fmt, Moment.FIRST, numels)
    store_flat(exp_avg_sq, states, fmt, Moment.SECOND, numels)
