"""Delayed scaling state of one layer: amax histories of its input, weight and grad_output.

[Note: delayed scaling]
A delayed scale is computed from amaxes seen before (``max`` of the history, or the most recent),
times ``2^margin``, then the tensor is cast with it and its own amax is recorded. Until a role has a
recorded amax it uses current scaling. The state is tensors only, recorded by tensor operations, so
a compiled graph (forward and backward) holds it without a break or a recompilation per step.
Non-finite amaxes are recorded as 0, so one bad step cannot poison the scales of the following
``history_len`` steps (the step itself is caught by the guard).

The state travels in the module's ``state_dict`` as one float32 tensor (so that any checkpoint
format holds it): row 0 is a header ``[version, history_len, 0]``, row 1 the number of amaxes
recorded per role, and rows ``2..`` the history, one column per role. It is never required: a missing
or mismatched entry starts again from current scaling.
"""
from __future__ import annotations

import warnings

import torch

from lowprec import formats as F
from lowprec.quant.scales import amax_scale
from lowprec.recipes import DelayedScaling, Role

ROLES = tuple(r.name.lower() for r in Role)
"""The history's columns, in :class:`lowprec.recipes.Role` order."""
_VERSION = 1


class DelayedState:
    """The amax histories of one layer, as tensors only (``history`` and the per-role ``count``), so
    that compiled code records into them without leaving its graph; see [Note: delayed scaling]."""

    def __init__(self, config: DelayedScaling, device: torch.device) -> None:
        self.config = config
        self.history = torch.zeros(config.history_len, len(ROLES), device=device)  # (L, roles)
        self.count = torch.zeros(len(ROLES), dtype=torch.int64, device=device)
        """Amaxes recorded per role; role ``i``'s next one goes to row ``count[i] % L``."""
        self._seen = [False] * len(ROLES)
        """Host mirror of ``count > 0`` for eager code, which decides without reading the device."""

    def to(self, device: torch.device) -> None:
        if self.history.is_meta:  # made on a meta model: nothing to copy, start afresh
            self.__init__(self.config, device)
        else:
            self.history, self.count = self.history.to(device), self.count.to(device)

    @property
    def recorded(self) -> list[int]:
        """Amaxes recorded per role (reads the device)."""
        return [int(v) for v in self.count.tolist()]

    def _history_scale(self, i: int, fmt: F.Format) -> torch.Tensor:
        amax = self.history[:, i].amax() if self.config.algo == "max" else self._last(i)
        return amax_scale(amax * 2.0**self.config.margin, fmt).reshape(1, 1)

    def _last(self, i: int) -> torch.Tensor:
        row = ((self.count[i] - 1) % self.config.history_len).reshape(1)
        return self.history[:, i].index_select(0, row).reshape(())  # a tensor index: no host sync

    def scale(self, role: Role, fmt: F.Format, x: torch.Tensor | None = None) -> torch.Tensor | None:
        """The dequantizing scale for ``role`` from its history; before its first amax, None (the
        cast then scales by its own amax). Compiled code cannot branch on the device's count: it
        gets the history's scale, or before the first amax the current scale of ``x``, which the
        compiler reduces inside the kernel that produced x."""
        i = int(role)
        if torch.compiler.is_compiling() and x is not None:
            current = amax_scale(x.detach().abs().amax().float(), fmt).reshape(1, 1)
            return torch.where(self.count[i] > 0, self._history_scale(i, fmt), current)
        if not self._seen[i]:
            # compiled code records without updating this mirror: ask the device, until it says yes
            self._seen[i] = bool(self.count[i] > 0)
            if not self._seen[i]:
                return None
        return self._history_scale(i, fmt)

    def last(self, role: Role) -> torch.Tensor:
        """The amax ``role`` recorded last (0 before any)."""
        return self._last(int(role))

    def record(self, role: Role, amax: torch.Tensor) -> None:
        """Add ``amax`` (non-finite: 0) to ``role``'s history, with tensor operations only."""
        i = int(role)
        amax = torch.where(torch.isfinite(amax), amax, 0.0).float().to(self.history.device)
        row = (self.count[i] % self.config.history_len).reshape(1)
        self.history[row, i] = amax.reshape(1)
        self.count[i:i + 1].add_(1)
        if not torch.compiler.is_compiling():
            self._seen[i] = True

    def to_tensor(self) -> torch.Tensor:
        header = torch.zeros(2, len(ROLES))
        header[0, 0], header[0, 1] = _VERSION, self.config.history_len
        header[1] = self.count.float().cpu()
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
        counts = [int(v) for v in t[1].tolist()]
        self.count.copy_(torch.tensor(counts, dtype=torch.int64))
        self._seen = [n > 0 for n in counts]
