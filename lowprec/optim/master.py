"""Float32 master weights for BF16/FP16 parameters.

[Note: master weights]
An optimizer update is often far smaller than the spacing of BF16 numbers around the weight
(BF16 keeps 8 significant bits: near 1.0 the spacing is 2^-7), so applied to a BF16 weight it
rounds away and the weight never moves. A float32 master copy takes the update instead; the
model's low-precision weight is the master rounded to nearest after every step. The inner
optimizer is built over the masters, so its state (moments) is float32 too.

The master of an FSDP2 parameter (a DTensor shard) is a float32 DTensor with the same mesh and
placements: each rank holds a float32 copy of its own shard only, and rounds it into that shard.

An FP8 primary weight (:class:`lowprec.nn.fp8_weight.FP8Weight`) always has a master, whatever
``enabled`` says: its codes cannot take an update. The master starts from the high-precision weight
the FP8 one was made from (handed over once), and after each step is quantized into the codes in place.
Under FSDP2 the parameter is a DTensor whose local shard is the FP8 weight (its rows, with the whole
weight's scale): the master is a float32 DTensor of the same rows.
"""
from __future__ import annotations

from collections import defaultdict
from typing import Any

import torch

from lowprec._checks import describe, fail
from lowprec.nn.fp8_requantize import requantize_all
from lowprec.nn.fp8_weight import FP8Weight
from lowprec.optim.accumulate import is_low_precision
from lowprec.ranks import is_dtensor, like, local


def fp8_weight(p: torch.Tensor) -> FP8Weight | None:
    """``p`` if it is an FP8 primary weight, or its local shard if that is one (FSDP2); else None."""
    q = p._local_tensor if is_dtensor(p) else p  # the shard itself (to_local() views it under autograd)
    return q if isinstance(q, FP8Weight) else None


class MasterWeights:
    """For each parameter, the tensor the optimizer updates: a float32 master or the parameter itself."""

    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled
        self.params: list[torch.Tensor] = []
        self.masters: list[torch.Tensor | None] = []

    def add(self, params: list[torch.Tensor]) -> list[torch.Tensor]:
        """Adopt ``params``; returns what the inner optimizer should hold in their place."""
        for p in params:
            self.params.append(p)
            fp8 = fp8_weight(p)
            if fp8 is not None:  # the only high-precision copy of the weight from now on
                self.masters.append(like(p, fp8.take_initial().float().clone()))
                continue
            # a DTensor's float() is a DTensor of the same placements: the master is sharded like p
            self.masters.append(p.detach().float().clone() if self.enabled and is_low_precision(p) else None)
        return [self.target(i) for i in range(len(self.params) - len(params), len(self.params))]

    def target(self, i: int) -> torch.Tensor:
        m = self.masters[i]
        return self.params[i] if m is None else m

    def set_grads(self, grads: list[torch.Tensor | None]) -> None:
        """Hand float32 gradients to the tensors the optimizer updates.

        A low-precision parameter without a master gets its gradient cast to its own dtype, unless
        it has been widened to float32 for the step (stochastic rounding).
        """
        for p, m, g in zip(self.params, self.masters, grads):
            if m is not None:
                m.grad = g
            elif g is not None:
                p.grad = g if g.dtype == p.dtype else g.to(p.dtype)

    def clear_grads(self) -> None:
        for m in self.masters:
            if m is not None:
                m.grad = None

    @torch.no_grad()
    def copy_to_params(self) -> None:
        """Round each master to nearest onto its parameter's dtype."""
        groups: dict[tuple, tuple[list, list]] = defaultdict(lambda: ([], []))
        fp8: tuple[list, list] = ([], [])
        for p, m in zip(self.params, self.masters):
            w = fp8_weight(p)
            if w is not None:
                dst, src = fp8
                p, m = w, local(m)  # FSDP2's shard: its rows, with the whole weight's scale
            elif m is not None:
                dst, src = groups[(p.device, p.dtype)]
                p, m = local(p), local(m)  # in place into the shard FSDP2 all-gathers from
            else:
                continue
            dst.append(p)
            src.append(m)
        if fp8[0]:  # rounded to p's dtype, then quantized: see [Note: FP8 primary weights]
            requantize_all(*fp8)
        for dst, src in groups.values():
            torch._foreach_copy_(dst, src)

    def state_dict(self) -> list[torch.Tensor | None]:
        return list(self.masters)

    def check_state(self, masters: Any) -> None:
        """Raise unless ``masters`` (from :meth:`state_dict`) fits these parameters."""
        name = "state_dict['master_weights']"
        if not isinstance(masters, (list, tuple)) or len(masters) != len(self.masters):
            fail(name, f"a list of {len(self.masters)} entries (one per parameter)", describe(masters))
        for i, (mine, saved) in enumerate(zip(self.masters, masters)):
            if (mine is None) != (saved is None):
                want = "a float32 master tensor" if mine is not None else "None (no master for this parameter)"
                fail(f"{name}[{i}]", want, describe(saved))
            if mine is not None and (
                not isinstance(saved, torch.Tensor) or saved.shape != mine.shape or saved.dtype != torch.float32
            ):
                fail(f"{name}[{i}]", f"a float32 tensor of shape {tuple(mine.shape)}", describe(saved))

    @torch.no_grad()
    def load_state_dict(self, masters: Any) -> None:
        """Copy saved masters in and set the parameters from them, so model and masters agree."""
        self.check_state(masters)
        for mine, saved in zip(self.masters, masters):
            if mine is not None:
                mine.copy_(saved)
        self.copy_to_params()
