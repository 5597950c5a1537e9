"""Delayed scaling state of one layer: amax histories of its input, weight and grad_output.

[Note: delayed scaling]
A delayed scale is computed from amaxes seen before (``max`` of the history, or the most recent),
times ``2^margin``, then the tensor is cast with it and its own amax is recorded. Until a role has a
recorded amax it uses current scaling. A layer's state is its row of its model's bank on its device
(``lowprec.nn.delayed_bank``): a cast reads the scale the last fold computed and leaves its amax
pending; the fold, once per forward of the model, updates every layer's histories and scales in one
batch (see [Note: the delayed-scaling bank]). The state is tensors only, written by tensor operations,
so a compiled graph (forward and backward) holds it without a break or a recompilation per step.
Non-finite amaxes are recorded as 0, so one bad step cannot poison the scales of the following
``history_len`` steps (the step itself is caught by the guard).

[Note: delayed scaling under torch.compile]
Dynamo lifts the bank's tensors into the graph as inputs that the graph writes. Forward records the
input's and the weight's amaxes, backward the output gradient's; a graph input written in both halves
cannot be split between them by the partitioner inductor uses ("was invalid, but is output"), while one
written in backward alone is written by the backward graph. So grad_output's pending amax and its
record count are written in backward only, everything else (the fold's histories, counts and scales,
forward's pending amaxes) in forward only; forward reads what backward wrote, at its fold.

A second hazard: the partitioner may recompute in backward, from a history, a scale forward computed,
after forward has written the history: a version-counter error (met with weight.T's scale when only
backward read it, at ``history_len=4``) or a stale scale. So backward reads only the scales of
forward's own casts (a delayed weight.T is cast again in backward only in forward's format:
``lowprec.nn.plan.layer_plan``), and compiled code takes the input's and the weight's delayed scales
through ``lowprec::keep``, an opaque copy: the partitioner never recomputes an opaque operator that
forward needs. The copy is a guard: with forward's scales alone, no case tried here failed without it.

[Note: the EMA of a history]
``algo="ema"`` averages the amaxes the history holds, oldest first: ``e = a_1``, then
``e = (1 - c) * e + c * a_k`` for each newer ``a_k`` (``c`` = ``ema_coeff``). It is computed from the
history at each fold (one weighted sum per role, in float64), so it needs no state beside the history and a
checkpoint of any version restores it; amaxes older than ``history_len`` have left the average, which
with the default 1024 changes it by less than ``(1 - c)^1023`` of its value.

[Note: amax outliers]
A finite outlier poisons a history too: one input element of 1e30 makes ``max`` of the history
1e30 for ``history_len`` steps, and every clean tensor of those steps is scaled by it and quantizes
to zero -- the loss keeps falling, as the layer's output is then only its bias. So an amax more than
``2^outlier_bits`` times the largest in the history (:class:`lowprec.recipes.DelayedScaling`) is
recorded as that bound and counted in ``outliers``: a lone outlier costs at most ``outlier_bits``
bits of headroom, and a real jump of the range is followed by ``outlier_bits`` per step. The batch
holding it is cast with the scale from before it, so the outlier itself saturates. The check is made
by the fold, for all layers at once, in tensor operations (no host sync, no graph break); the host
reads the counts when it logs, through :func:`amax_outliers`, which warns once per layer. Under data
parallelism each rank counts its own outliers (the capped histories are then reduced as any others).
The first amax of a role has no history to be judged against.

The state travels in the module's ``state_dict`` as one float32 tensor (so that any checkpoint
format holds it): row 0 is a header ``[version, history_len, 0]``, row 1 the number of amaxes
recorded per role, row 2 the outliers capped per role, and rows ``3..`` the history, one column per
role. Version 1 had no outlier row (it loads with no outliers counted). It is never required: a
missing or mismatched entry starts again from current scaling.
"""
from __future__ import annotations

import warnings

import torch
from torch import nn

from lowprec import formats as F
from lowprec.kernels.ops import keep
from lowprec.nn.delayed_bank import DelayedBank, DelayedBanks, release_on_collect
from lowprec.quant.scales import amax_scale
from lowprec.recipes import DelayedScaling, Role

ROLES = tuple(r.name.lower() for r in Role)
"""The history's columns, in :class:`lowprec.recipes.Role` order."""
_VERSION = 2
_HEADER_ROWS = {1: 2, 2: 3}
"""Rows before the history, per version of the saved tensor."""


class DelayedState:
    """The amax histories of one layer: its row of a :class:`~lowprec.nn.delayed_bank.DelayedBank`,
    shared with the other layers of its model on its device (see [Note: the delayed-scaling bank]).
    ``banks``: the model's banks; None gives the layer banks of its own, which its forward folds."""

    def __init__(self, config: DelayedScaling, device: torch.device, banks: DelayedBanks | None = None) -> None:
        self.config = config
        self.banks = banks if banks is not None else DelayedBanks()
        self._take(torch.device(device))
        self._warned = [0] * len(ROLES)
        """Outliers per role that :func:`amax_outliers` has already warned about."""
        self._seen = [False] * len(ROLES)
        """Host mirror of ``ready`` for eager code, which decides without reading the device."""

    def _take(self, device: torch.device) -> None:
        self.bank = self.banks.bank(self.config, device)
        self.row = self.bank.take_row()
        release_on_collect(self, self.bank, self.row)

    @property
    def device(self) -> torch.device:
        return self.bank.device

    def _settled(self) -> DelayedBank:
        """The bank with every pending amax folded in, for a reader on the host (eager code only)."""
        self.bank.fold()
        return self.bank

    @property
    def history(self) -> torch.Tensor:
        """The histories as one (L, roles) tensor, a copy: write through :meth:`record` or :meth:`load_history`."""
        return self._settled().history[self.row].t().clone()

    @property
    def count(self) -> torch.Tensor:
        """Amaxes recorded per role, (roles,), a copy."""
        return self._settled().count[self.row].clone()

    @property
    def outliers(self) -> torch.Tensor:
        """Amaxes recorded capped per role, (roles,), a copy."""
        return self._settled().outliers[self.row].clone()

    def load_history(self, history: torch.Tensor) -> None:
        """Overwrite the histories with an (L, roles) tensor (a checkpoint's, or one reduced over ranks)."""
        bank = self._settled()
        bank.history[self.row].copy_(history.t())
        bank.fold()  # the scales follow the new history

    def to(self, device: torch.device) -> None:
        """Move the row to the bank of ``device`` (a meta state, made on a meta model, starts afresh)."""
        old, row = self.bank, self.row
        self._take(torch.device(device))
        if old.device.type != "meta":
            old.fold()
            for name in ("history", "count", "outliers"):
                getattr(self.bank, name)[self.row].copy_(getattr(old, name)[row])
            self.bank.fold()  # the row's scales, from what it brought
        self.banks.drop_empty()

    def rebank(self, banks: DelayedBanks) -> None:
        """Move the row into ``banks`` (a model's, from ``lowprec.convert``), keeping what it holds."""
        if banks is not self.banks:
            old = self.banks
            self.banks = banks
            self.to(self.device)
            old.drop_empty()

    @property
    def recorded(self) -> list[int]:
        """Amaxes recorded per role (reads the device)."""
        return [int(v) for v in self.count.tolist()]

    def scale(self, role: Role, fmt: F.Format, current: torch.Tensor | None = None) -> torch.Tensor | None:
        """The dequantizing scale for ``role`` from its history, as the last fold left it; before its
        first amax, None (the cast then scales by its own amax). Compiled code cannot branch on the
        device's count: it gets the history's scale, or before the first amax the scale of ``current``
        (the operand's amax, which the compiler reduces inside the kernel that produced the operand)."""
        i, bank = int(role), self.bank
        if torch.compiler.is_compiling() and current is not None:
            # the amax chosen, then one scale: amax_scale is elementwise, so this is the scale of either
            # case, in half the graph's operations
            ready, history_amax = bank.read(self.row, role)
            amax = torch.where(ready, history_amax, current)
            scale = amax_scale(amax, fmt).reshape(1, 1)
            # see [Note: delayed scaling under torch.compile]: forward's scales reach backward as saved
            return scale if role is Role.GRAD_OUTPUT else keep(scale)
        if not self._seen[i]:
            # the host cannot tell when a fold made the role ready: ask the device, until it says yes
            self._seen[i] = bool(bank.read(self.row, role)[0])
            if not self._seen[i]:
                return None
        return amax_scale(bank.read(self.row, role)[1], fmt).reshape(1, 1)

    def last(self, role: Role) -> torch.Tensor:
        """The amax ``role`` recorded last (0 before any): pending or folded, read without folding (see
        ``DelayedBank.last``); no host sync."""
        return self.bank.last(self.row, role)

    def record(self, role: Role, amax: torch.Tensor) -> None:
        """``amax`` pending for ``role``: the next fold adds it to the history (non-finite: 0; an outlier:
        capped, see [Note: amax outliers]); tensor operations only."""
        self.bank.record(self.row, role, amax)

    def to_tensor(self) -> torch.Tensor:
        header = torch.zeros(_HEADER_ROWS[_VERSION], len(ROLES))
        header[0, 0], header[0, 1] = _VERSION, self.config.history_len
        header[1], header[2] = self.count.float().cpu(), self.outliers.float().cpu()
        return torch.cat([header, self.history.cpu()])

    def load_tensor(self, t: torch.Tensor, where: str) -> None:
        """Restore from :meth:`to_tensor` (this version or version 1); a malformed or mismatched entry
        is ignored with a warning."""
        version = int(t[0, 0]) if isinstance(t, torch.Tensor) and t.dim() == 2 and t.numel() else None
        rows = _HEADER_ROWS.get(version)
        ok = (rows is not None and t.shape[1] == len(ROLES) and t.shape[0] == self.config.history_len + rows
              and int(t[0, 1]) == self.config.history_len)
        if not ok:
            warnings.warn(f"lowprec: {where}: delayed-scaling state does not match this recipe "
                          f"(history_len {self.config.history_len}); starting from current scaling", stacklevel=3)
            return
        counts = [int(v) for v in t[1].tolist()]
        outliers = [int(v) for v in t[2].tolist()] if rows > 2 else [0] * len(ROLES)
        bank = self._settled()
        bank.count[self.row].copy_(torch.tensor(counts))
        bank.outliers[self.row].copy_(torch.tensor(outliers))
        self.load_history(t[rows:].to(self.device))
        self._seen = [n > 0 for n in counts]
        self._warned = outliers  # warned about in the run that saved them


def delayed_states_of(model: nn.Module) -> list[tuple[str, DelayedState]]:
    """``(name, state)`` of every delayed-scaling state in ``model``, in module order: each module that holds
    some says which (``named_delayed_states``: a Linear its own, a GroupedLinear one per expert named
    ``<layer>#expert<e>``, Hugging Face experts run by lowprec their projections')."""
    return [(name + suffix, state) for name, m in model.named_modules()
            for suffix, state in (m.named_delayed_states() if hasattr(m, "named_delayed_states") else ())]


def amax_outliers(model: nn.Module) -> int:
    """The amax outliers capped so far in every delayed-scaling layer of ``model`` (see [Note: amax
    outliers]), for a training loop to log; warns once for each layer and role that has new ones, naming
    the layer. Reads the device once (call it when logging, not inside a compiled region)."""
    named = delayed_states_of(model)
    if not named:
        return 0
    counts = torch.stack([s.outliers.to(named[0][1].device) for _, s in named]).tolist()  # one sync
    for (name, state), per_role in zip(named, counts):
        for i, n in enumerate(per_role):
            if n > state._warned[i]:
                if state._warned[i] == 0:
                    warnings.warn(
                        f"lowprec: {name or 'model'}: an {ROLES[i]} amax over 2^{state.config.outlier_bits} "
                        f"times its delayed-scaling history's largest was capped ({n} so far): an outlier in "
                        "the data or activations (see DelayedState.outliers)", stacklevel=2)
                state._warned[i] = n
    return sum(sum(c) for c in counts)
