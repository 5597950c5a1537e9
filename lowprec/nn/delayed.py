"""Delayed scaling state of one layer: amax histories of its input, weight and grad_output.

[Note: delayed scaling]
A delayed scale is computed from amaxes seen before (``max`` of the history, or the most recent),
times ``2^margin``, then the tensor is cast with it and its own amax is recorded. Until a role has a
recorded amax it uses current scaling. Non-finite amaxes are recorded as 0, so one bad step cannot
poison the scales of the following ``history_len`` steps (the step itself is caught by the guard).

The state travels in the module's ``state_dict`` as one float32 tensor (so that any checkpoint
format holds it): row 0 is a header ``[version, history_len, 0]``, row 1 the number of amaxes
recorded per role, and rows ``2..`` the history, one column per role. It is never required: a missing or mismatched entry starts again
from current scaling.
"""
from __future__ import annotations

import warnings

import torch

from lowprec import formats as F
from lowprec.quant.scales import amax_scale
from lowprec.recipes import DelayedScaling

ROLES = ("input", "weight", "grad_output")
_VERSION = 1


class DelayedState:
    def __init__(self, config: DelayedScaling, device: torch.device) -> None:
        self.config = config
        self.history = torch.zeros(config.history_len, len(ROLES), device=device)  # (L, roles)
        self.recorded = [0] * len(ROLES)

    def scale(self, role: str, fmt: F.Format) -> torch.Tensor | None:
        """The dequantizing scale for ``role`` from its history, or None before its first amax."""
        i = ROLES.index(role)
        n = self.recorded[i]
        if n == 0:
            return None
        col = self.history[:, i]
        if self.config.algo == "max":
            amax = col.amax()
        else:
            amax = col[(n - 1) % self.config.history_len]
        return amax_scale(amax * 2.0**self.config.margin, fmt).reshape(1, 1)

    def record(self, role: str, amax: torch.Tensor) -> None:
        i = ROLES.index(role)
        amax = torch.where(torch.isfinite(amax), amax, 0.0).float().to(self.history.device)
        self.history[self.recorded[i] % self.config.history_len, i] = amax
        self.recorded[i] += 1

    def to_tensor(self) -> torch.Tensor:
        header = torch.zeros(2, len(ROLES))
        header[0, 0], header[0, 1] = _VERSION, self.config.history_len
        header[1] = torch.tensor(self.recorded, dtype=torch.float32)
        return torch.cat([header.to(self.history.device), self.history]).cpu()

    def load_tensor(self, t: torch.Tensor, where: str) -> None:
        """Restore from :meth:`to_tensor`; a malformed or mismatched entry is ignored with a warning."""
        ok = (isinstance(t, torch.Tensor) and t.dim() == 2 and t.shape[1] == len(ROLES)
              and t.shape[0] == self.config.history_len + 2
              and int(t[0, 0]) == _VERSION and int(t[0, 1]) == self.config.history_len)
        if not ok:
            warnings.warn(f"lowprec: {where}: delayed-scaling state does not match this recipe "
                          f"(history_len {self.config.history_len}); starting from current scaling", stacklevel=3)
            return
        self.history.copy_(t[2:].to(self.history.device))
        self.recorded = [int(v) for v in t[1].tolist()]
