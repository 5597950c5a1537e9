"""AdamW whose moments are stored in BF16, FP8 or 8 bits between steps (:mod:`lowprec.optim.states`).

[Note: the step]
For each parameter (many at once: see [Note: the batched step] in ``lowprec.optim.adamw_batch``), the
two moments are decoded to float32, updated by torch's AdamW formulas (decoupled weight decay, bias
correction, ``eps`` added to the corrected root; see [Note: the AdamW update] in
``lowprec.optim.adamw_batch``), the parameter updated from them, and the moments encoded again, so
only one bucket's float32 moments exist at a time. On CUDA, float32 parameters with FP32, BF16 or
8-bit moments take the fused kernel instead (``lowprec.optim.fused``: one launch for all of them, the
same bits; ``lowprec.kernels.route.fused_adamw_step`` decides whether it runs); FP8 moments and other
parameters take the batched torch step.
Build it through :class:`lowprec.optim.Optimizer` (``Optimizer(params, AdamWLP, states="fp8", ...)``):
with master weights it updates the float32 masters; without, BF16 parameters widened to float32 for
the step and rounded back stochastically.

Under DDP each rank keeps a whole replica of the moments and, given the same reduced gradients,
encodes them alike. FSDP2 parameters (DTensor shards) keep their moments as DTensors of the parameter's
layout: FP32 and BF16 elementwise; FP8 and 8-bit with their groups inside the rows of dim 0 and their
per-group tensors sharded along those rows (see [Note: moments of FSDP2 shards] in
``lowprec.optim.states``), so that distributed checkpoints reshard them between FSDP2 runs of any
number of ranks. Between FSDP2 and one process or DDP, FP8 and 8-bit moments do not reshard (their groups
lie differently where a row is not a whole number of groups): such a load is refused and says so.
One-dimensional FSDP2 parameters keep BF16 moments where FP8 or 8-bit are asked, with a warning.
"""
from __future__ import annotations

import math
import warnings
from collections.abc import Iterable
from typing import Any

import torch
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

from lowprec._checks import describe, fail
from lowprec.kernels.route import fused_adamw_step
from lowprec.optim import adamw_batch as batch
from lowprec.optim.states import PER_GROUP_KEYS, Moment, StateFormat, code_dtype, load, row_groups, store
from lowprec.ranks import is_dtensor, like
from lowprec.ranks import local as ranks_local


def update_one(p: torch.Tensor, state: dict, fmt: StateFormat, group: dict, rows: bool = False) -> None:
    """One parameter's step (its count already advanced): the reference that the batched step
    (:mod:`lowprec.optim.adamw_batch`) equals bit for bit, and the step of FSDP2 shards. With ``rows`` (an
    FSDP2 shard's FP8 or 8-bit moments) on this rank's rows alone, the codes and per-group tensors
    rewritten in place in their DTensors."""
    if rows:
        local = {k: ranks_local(v) for k, v in state.items() if k != "step"}
        p_local, grad = p.to_local(), ranks_local(p.grad).float()
        exp_avg, exp_avg_sq = (load(local, fmt, m, rows=True) for m in Moment)
        batch.adamw_math(p_local, grad, exp_avg, exp_avg_sq, group, state["step"].item())
        for m, x in ((Moment.FIRST, exp_avg), (Moment.SECOND, exp_avg_sq)):
            for k, v in store(x, fmt, m, rows=True).items():
                local[k].copy_(v)
        return
    grad = p.grad if p.grad.dtype == torch.float32 else p.grad.float()
    exp_avg, exp_avg_sq = load(state, fmt, Moment.FIRST), load(state, fmt, Moment.SECOND)
    batch.adamw_math(p, grad, exp_avg, exp_avg_sq, group, state["step"].item())
    state.update(store(exp_avg, fmt, Moment.FIRST))
    state.update(store(exp_avg_sq, fmt, Moment.SECOND))


def _sharded_like(local: torch.Tensor, p: DTensor, shape: tuple[int, ...]) -> DTensor:
    """``local`` (this rank's rows of a tensor of global ``shape``) as a DTensor laid out as ``p``."""
    return like(p, local, shape)


class AdamWLP(torch.optim.Optimizer):
    """AdamW with moments stored as ``states`` (``"fp32"``, ``"bf16"``, ``"fp8"`` or ``"int8"``)."""

    def __init__(self, params: Iterable[torch.Tensor] | Iterable[dict], lr: float = 1e-3,
                 betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8, weight_decay: float = 1e-2, *,
                 states: str | StateFormat = "bf16", fused: bool | None = None) -> None:
        if not (isinstance(lr, (int, float)) and lr >= 0):
            fail("lr", "a non-negative number", describe(lr))
        if not (isinstance(betas, (tuple, list)) and len(betas) == 2 and all(0 <= b < 1 for b in betas)):
            fail("betas", "two numbers in [0, 1)", describe(betas))
        if not (isinstance(eps, (int, float)) and eps > 0):
            fail("eps", "a positive number", describe(eps))
        if not (isinstance(weight_decay, (int, float)) and weight_decay >= 0):
            fail("weight_decay", "a non-negative number", describe(weight_decay))
        self.states = StateFormat.parse(states, "states")
        """How the moments are stored."""
        if fused not in (None, True, False):
            fail("fused", "None (on CUDA where Triton is installed), True or False", describe(fused))
        # True: CUDA parameters take the kernel (CPU ones too under Triton's interpreter, as in the tests)
        self.fused = fused_adamw_step(fused)
        """Whether CUDA parameters the kernel covers take the fused step (``lowprec.optim.fused``)."""
        super().__init__(params, {"lr": lr, "betas": tuple(betas), "eps": eps, "weight_decay": weight_decay})
        flat = [p for g in self.param_groups for p in g["params"] if self._format(p) is not self.states]
        if flat:
            warnings.warn(f"lowprec: AdamWLP keeps BF16 moments for {len(flat)} one-dimensional FSDP2 parameters "
                          f"({sum(p.numel() for p in flat)} values): a shard of one would split its "
                          f"{self.states.value} groups (see [Note: moments of FSDP2 shards])", stacklevel=2)
        for g in self.param_groups:
            for p in g["params"]:
                if self._rows(p) and any(isinstance(pl, Shard) and pl.dim != 0 for pl in p.placements):
                    fail("params", f"DTensors sharded along dim 0 for {self.states.value} moments",
                         str(p.placements))

    def _format(self, p: torch.Tensor) -> StateFormat:
        """``p``'s moments' format: BF16 for one-dimensional FSDP2 shards where FP8 or 8-bit are asked."""
        return StateFormat.BF16 if self.states.group is not None and is_dtensor(p) and p.ndim < 2 else self.states

    def _rows(self, p: torch.Tensor) -> bool:
        """Whether ``p``'s moments keep their groups inside rows (see [Note: moments of FSDP2 shards])."""
        return is_dtensor(p) and self._format(p).group is not None

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:  # type: ignore[override]
        if closure is not None:
            fail("closure", "None (AdamWLP takes no closure)", describe(closure))
        for group in self.param_groups:
            params = [p for p in group["params"] if p.grad is not None and p.numel()]  # nothing to update in empty ones
            states = [self._counted(p) for p in params]
            if any(is_dtensor(p) for p in params):  # FSDP2 shards: one at a time, each on its local values
                for p, state in zip(params, states):
                    update_one(p, state, self._format(p), group, self._rows(p))
                continue
            steps = [state["step"].item() for state in states]
            if self.fused:
                from lowprec.optim import fused  # Triton: imported only where it is used

                rest, launches = [], {}  # one launch per device, gradient dtype and step count
                for i, p in enumerate(params):
                    if (p.is_cuda or fused.INTERPRETED) and fused.covers(p, states[i], self.states):
                        launches.setdefault((p.device, p.grad.dtype, steps[i]), []).append(i)
                    else:
                        rest.append(i)
                for (*_, count), idx in launches.items():
                    fused.step([params[i] for i in idx], [states[i] for i in idx], self.states,
                               batch.constants(group, count))
                params, states, steps = [params[i] for i in rest], [states[i] for i in rest], [steps[i] for i in rest]
            for bucket in batch.buckets(params, steps):
                batch.update([params[i] for i in bucket], [states[i] for i in bucket], self.states, group,
                             steps[bucket[0]])

    def _counted(self, p: torch.Tensor) -> dict:
        """``p``'s state, made at its first step, with its step count advanced."""
        state = self.state[p]
        if not state:
            state["step"] = torch.tensor(0.0)
            fmt = self._format(p)
            for m in Moment:
                if self._rows(p):  # this rank's rows, each entry a DTensor of its global shape
                    zeros = torch.zeros_like(p.to_local(), dtype=torch.float32)
                    state.update({k: _sharded_like(v, p, tuple(p.shape) if k == m.value else row_groups(
                        tuple(p.shape), fmt)) for k, v in store(zeros, fmt, m, rows=True).items()})
                else:
                    state.update(store(torch.zeros_like(p, dtype=torch.float32), fmt, m))
        state["step"] += 1
        return state

    # -- checkpoints: torch would cast every floating-point state to the parameter's dtype ----------
    def state_bytes(self) -> int:
        """Bytes of every moment held (codes and per-group scales; not the step counts)."""
        return sum(v.numel() * v.element_size() for s in self.state.values() for k, v in s.items() if k != "step")

    def _expected(self, p: torch.Tensor) -> dict[str, tuple[torch.dtype, tuple[int, ...]]]:
        out = {"step": (torch.float32, ())}
        fmt = self._format(p)
        groups = (row_groups(tuple(p.shape), fmt) if self._rows(p) else (math.ceil(p.numel() / fmt.group),)
                  ) if fmt.group else ()
        for m in Moment:
            out[m.value] = (code_dtype(fmt, m), tuple(p.shape))
            out.update({m.value + s: (torch.float32, groups) for s in fmt.group_keys})
        return out

    def _check_state(self, state_dict: Any) -> None:
        """Raise unless every saved state entry is this format's, with this parameter's shape."""
        params = [p for g in self.param_groups for p in g["params"]]
        saved = state_dict.get("state") if isinstance(state_dict, dict) else None
        if not isinstance(saved, dict):
            fail("state_dict", "a torch optimizer state_dict with a 'state' dict", describe(state_dict))
        for i, entry in saved.items():
            name = f"state_dict['state'][{i!r}]"
            if not isinstance(i, int) or not 0 <= i < len(params):
                fail("state_dict['state']", f"parameter indices in [0, {len(params)})", repr(i))
            want = self._expected(params[i])
            fmt = self._format(params[i])
            if not isinstance(entry, dict) or set(entry) != set(want):
                got = sorted(entry) if isinstance(entry, dict) else describe(entry)
                fail(name, f"the keys of {fmt.value} moments ({', '.join(sorted(want))})", got)
            for key, (dtype, shape) in want.items():
                v = entry[key]
                if not isinstance(v, torch.Tensor) or v.dtype != dtype or tuple(v.shape) != shape:
                    layout = ""
                    if key in PER_GROUP_KEYS and isinstance(v, torch.Tensor) and tuple(v.shape) != shape:
                        layout = (" (an FSDP2 run's groups inside rows: FP8 and 8-bit moments reshard between "
                                  "FSDP2 runs only)" if self._rows(params[i]) else " (groups of the flattened "
                                  "parameter: FP8 and 8-bit moments of an FSDP2 run do not load here)")
                    fail(f"{name}[{key!r}]", f"a {dtype} tensor of shape {shape}{layout}", describe(v))

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """torch's load, checked first, with each state tensor kept in its saved dtype."""
        self._check_state(state_dict)
        super().load_state_dict(state_dict)
        params = [p for g in self.param_groups for p in g["params"]]
        for i, entry in state_dict["state"].items():
            p = params[i]
            self.state[p] = {k: v.to(device=p.device if k != "step" else v.device, copy=True)
                             for k, v in entry.items()}
            if self._rows(p):  # per-group tensors loaded whole (their shape is not the parameter's): this rank's rows
                self.state[p].update({k: distribute_tensor(v, p.device_mesh, p.placements, src_data_rank=None)
                                      for k, v in self.state[p].items() if k != "step" and not is_dtensor(v)})

