"""The delayed-scaling state of many layers in one set of tensors per device, updated in one batch.

[Note: the delayed-scaling bank]
Every layer of a converted model that scales by delay keeps its amax histories as one row of a
:class:`DelayedBank` (one per device and :class:`~lowprec.recipes.DelayedScaling` setting, in practice
one per device): ``history`` (layers, roles, L), the ``count`` and ``outliers`` per layer and role, and
what a cast reads, the ``amax`` behind each role's delayed scale (the algorithm's reduction of its
history, times ``2^margin``) with ``ready`` (a role with an amax recorded). A cast does not write the
history: it writes its amax into a PENDING slot of its row, and the fold (:meth:`DelayedBank.fold`)
moves every pending amax into its history (non-finite as 0, an outlier capped and counted: [Note: amax
outliers] in ``lowprec.nn.delayed``), advances the counts, and computes every layer's ``amax`` again:
one batch of tensor operations for all layers, where each cast used to update its own history with
some hundred scalar operations traced into every layer's forward and backward.

The fold runs once per forward of the model, before any layer reads a scale: a forward pre-hook on the
module ``lowprec.convert`` was given (:func:`bank_layers`), or, for a layer not in a converted model, its
own forward (its bank then holds it alone). So a forward's delayed scale sees every amax recorded by the
forwards and backwards before it (micro-batches of gradient accumulation included), as when each cast
wrote its history at once; a role that did not record since the last fold (a frozen layer, evaluation)
is left as it was. Readers on the host (``DelayedState.history``, ``state_dict``, the reduction across
ranks) fold first, so they see every amax recorded; folding earlier than the next forward changes nothing.

Forward writes the input's and the weight's pending amaxes, backward the output gradient's, into
separate tensors: a compiled graph must not write one tensor in both halves ([Note: delayed scaling
under torch.compile]). The fold, in forward, cannot clear what backward wrote, so backward also counts
its records (``dy_records``) and the fold notes how many it took (``dy_folded``): the difference says
a grad_output amax is pending.

A layer that records twice between folds (called twice in one forward, or its backward run twice)
records one amax: the largest of the calls' (non-finite as 0), and its count advances by one; both
calls read the same scale. No model in this package does that. A forward run again by activation
checkpointing records and folds nothing (see [Note: recomputed forwards] in ``lowprec.nn.recomputation``).
A layer of a converted model called on its own, outside the model's forward, reads the scales of the
model's last fold. Several forwards before their backwards (a pipeline's schedule) fold at each
forward: a backward's scale is the one folded at the forward before it.
"""
from __future__ import annotations

import weakref
from dataclasses import dataclass

import torch
from torch import nn

from lowprec.kernels.ops import keep
from lowprec.nn.recomputation import recomputing
from lowprec.recipes import DelayedAlgo, DelayedScaling, Role

N_ROLES = len(Role)
_NONE = -1.0
"""A forward role's pending slot with no amax (an amax is never negative; a non-finite one is NaN or inf)."""
_FORWARD_ROLES = (int(Role.INPUT), int(Role.WEIGHT))
"""The roles forward records, in the order of the ``pending`` columns."""


class DelayedBank:
    """The delayed-scaling state of layers on one device under one setting: one row per layer (see
    [Note: the delayed-scaling bank]). Tensors only, so compiled code reads and writes it in its graph."""

    def __init__(self, config: DelayedScaling, device: torch.device) -> None:
        self.config, self.device = config, torch.device(device)
        self._free: list[int] = []
        """Rows no layer holds (their layer's state was dropped); zeroed when taken again."""
        self._live = 0
        self._alloc(0)

    def _alloc(self, n: int, old: DelayedBank | None = None) -> None:
        L, dev = self.config.history_len, self.device
        # What a cast reads or writes is flat, one element per (layer, role), so that it is one index
        # into one tensor (a compiled graph writes a slice of a slice as several operations); the fold
        # views it (layers, roles).
        tensors = {
            "history": torch.zeros(n, N_ROLES, L, device=dev),  # (layers, roles, L): row count % L is next
            "count": torch.zeros(n, N_ROLES, dtype=torch.int64, device=dev),  # amaxes recorded
            "outliers": torch.zeros(n, N_ROLES, dtype=torch.int64, device=dev),  # of them, capped
            "amax": torch.zeros(n * N_ROLES, device=dev),  # (layers * roles,) the algorithm's, times 2^margin
            "ready": torch.zeros(n * N_ROLES, dtype=torch.bool, device=dev),  # (layers * roles,) count > 0
            # (layers * 2,) forward's amaxes (input, weight) not yet folded; -1: none
            "pending": torch.full((n * len(_FORWARD_ROLES),), _NONE, device=dev),
            "dy_pending": torch.zeros(n, device=dev),  # backward's (grad_output) amax, not yet folded
            "dy_records": torch.zeros(n, dtype=torch.int64, device=dev),  # written by backward only
            "dy_folded": torch.zeros(n, dtype=torch.int64, device=dev),  # dy_records at the last fold
        }
        for name, t in tensors.items():
            if old is not None:
                kept = getattr(old, name)
                t[: kept.shape[0]].copy_(kept)
            setattr(self, name, t)

    @property
    def rows(self) -> int:
        return self.history.shape[0]

    @property
    def live(self) -> int:
        """Rows held by a layer's state."""
        return self._live

    def take_row(self) -> int:
        """A zeroed row for a new layer state (outside any compiled graph: the tensors may be reallocated)."""
        self._live += 1
        if self._free:
            row = self._free.pop()
            for name in ("history", "count", "outliers", "dy_pending"):
                getattr(self, name)[row].zero_()
            self.amax[row * N_ROLES:(row + 1) * N_ROLES].zero_()
            self.ready[row * N_ROLES:(row + 1) * N_ROLES].zero_()
            n_fwd = len(_FORWARD_ROLES)
            self.pending[row * n_fwd:(row + 1) * n_fwd].fill_(_NONE)
            self.dy_folded[row] = self.dy_records[row]
            return row
        row = self.rows
        grown = DelayedBank.__new__(DelayedBank)
        grown.config, grown.device = self.config, self.device
        grown._alloc(max(2 * row, 1), old=self)  # doubling: adding n layers copies O(n) rows
        for name in vars(grown):
            if isinstance(getattr(grown, name), torch.Tensor):
                setattr(self, name, getattr(grown, name))
        self._free = list(range(self.rows - 1, row, -1))  # the new rows beyond this one, lowest first out
        return row

    def give_row(self, row: int) -> None:
        """A layer's state was dropped: its row is left as it is (inert: nothing pending) until taken again."""
        self._live -= 1
        self._free.append(row)

    # ---- record, fold, read ----------------------------------------------------------------------

    def record(self, row: int, role: Role, amax: torch.Tensor) -> None:
        """``amax`` pending for ``role`` of layer ``row`` (the largest, where the row has one pending;
        a non-finite one stays so, for the fold to record as 0). Nothing in a recomputed forward (see
        [Note: recomputed forwards] in ``lowprec.nn.recomputation``)."""
        if recomputing():
            return
        amax = amax.detach().float().reshape(()).to(self.device)
        if role is Role.GRAD_OUTPUT:
            pending = self.dy_records[row] != self.dy_folded[row]
            self.dy_pending[row] = torch.where(pending, torch.maximum(self.dy_pending[row], amax), amax)
            self.dy_records[row] += 1
        else:
            k = row * len(_FORWARD_ROLES) + _FORWARD_ROLES.index(int(role))
            self.pending[k] = torch.maximum(self.pending[k], amax)  # NaN stays NaN

    def last(self, row: int, role: Role) -> torch.Tensor:
        """The amax ``role`` of layer ``row`` recorded last (0 before any): its pending one where it has one
        (the fold judges it: non-finite, outlier), else its history's newest. A read that folds nothing, so
        a forward that asks (a cached weight cast recording its amax again) leaves every scale as the
        forward's layers read it, for a recomputation of that forward to read too."""
        i = int(role)
        newest = self.history[row, i].index_select(0, ((self.count[row, i] - 1) % self.config.history_len).reshape(1))
        if role is Role.GRAD_OUTPUT:
            pending, value = self.dy_records[row] != self.dy_folded[row], self.dy_pending[row]
        else:
            value = self.pending[row * len(_FORWARD_ROLES) + _FORWARD_ROLES.index(i)]
            pending = ~(value < 0)  # NaN is an amax
        return torch.where(pending, value, newest.reshape(()))

    def read(self, row: int, role: Role) -> tuple[torch.Tensor, torch.Tensor]:
        """(ready, amax times 2^margin) of ``role`` of layer ``row``, as the last fold left them, () each."""
        k = row * N_ROLES + int(role)
        return self.ready[k], self.amax[k]

    def read_rows(self, rows: torch.Tensor, role: Role) -> tuple[torch.Tensor, torch.Tensor]:
        """:meth:`read` of the layers ``rows`` ((n,) int64 on the bank's device), (n,) each."""
        k = rows * N_ROLES + int(role)
        return self.ready[k], self.amax[k]

    def record_rows(self, rows: torch.Tensor, role: Role, amax: torch.Tensor, live: torch.Tensor) -> None:
        """:meth:`record` of ``amax[i]`` for layer ``rows[i]`` where ``live[i]`` (the others record nothing),
        all at once: the same values as one record per live row, in a few tensor operations (``rows``
        distinct, (n,) int64 on the bank's device)."""
        if recomputing():
            return
        amax = amax.detach().float().reshape(-1).to(self.device)
        if role is Role.GRAD_OUTPUT:
            old = self.dy_pending[rows]
            pending = self.dy_records[rows] != self.dy_folded[rows]
            new = torch.where(pending, torch.maximum(old, amax), amax)
            self.dy_pending.index_copy_(0, rows, torch.where(live, new, old))
            self.dy_records.index_add_(0, rows, live.long())
        else:
            k = rows * len(_FORWARD_ROLES) + _FORWARD_ROLES.index(int(role))
            old = self.pending[k]
            self.pending.index_copy_(0, k, torch.where(live, torch.maximum(old, amax), old))  # NaN stays NaN

    @torch.no_grad()
    def fold(self) -> None:
        """Every pending amax into its history, then every role's amax again; see [Note: the
        delayed-scaling bank]. Tensor operations only: no host sync, no graph break. Nothing in a
        recomputed forward, whose casts read the scales the first forward read."""
        if recomputing():
            return
        cfg, history, count = self.config, self.history, self.count
        n = history.shape[0]
        pending = self.pending.view(n, len(_FORWARD_ROLES))
        dy_new = self.dy_records != self.dy_folded  # (layers,)
        new = torch.cat([pending, self.dy_pending.unsqueeze(1)], dim=1)  # (layers, roles)
        flag = torch.cat([~(pending < 0), dy_new.unsqueeze(1)], dim=1)  # (layers, roles); NaN is an amax
        new = torch.where(torch.isfinite(new), new, 0.0)  # one bad step must not poison the next scales
        if cfg.outlier_bits is not None:
            # an empty history has max 0 and no bound: the first amax is taken as it is
            bound = history.amax(dim=2) * 2.0**cfg.outlier_bits  # (layers, roles)
            outlier = flag & (bound > 0) & (new > bound)
            new = torch.where(outlier, bound, new)
            self.outliers.add_(outlier.long())
        slot = (count % cfg.history_len).unsqueeze(2)  # (layers, roles, 1)
        history.scatter_(2, slot, torch.where(flag.unsqueeze(2), new.unsqueeze(2), history.gather(2, slot)))
        count.add_(flag.long())
        self.ready.copy_((count > 0).view(-1))
        self.amax.copy_((self._reduce() * 2.0**cfg.margin).view(-1))
        self.pending.fill_(_NONE)
        self.dy_folded.copy_(self.dy_records)

    def _reduce(self) -> torch.Tensor:
        """Each role's history reduced by the recipe's algorithm, (layers, roles)."""
        algo, history = self.config.algo, self.history
        if algo is DelayedAlgo.MAX:
            return history.amax(dim=2)
        if algo is DelayedAlgo.MOST_RECENT:
            return history.gather(2, ((self.count - 1) % self.config.history_len).unsqueeze(2)).squeeze(2)
        return self._ema()

    def _ema(self) -> torch.Tensor:
        """The exponential moving average of each history, oldest to newest (see [Note: the EMA of a
        history] in ``lowprec.nn.delayed``), (layers, roles)."""
        c, n_rows = self.config.ema_coeff, self.config.history_len
        rows = torch.arange(n_rows, device=self.device)  # (L,)
        count = self.count.unsqueeze(2)  # (layers, roles, 1)
        age = (count - 1 - rows) % n_rows  # (layers, roles, L): 0 for the newest
        held = torch.clamp(count, max=n_rows)  # amaxes in the window
        weight = c * (1.0 - c) ** age.double()
        weight = torch.where(age == held - 1, (1.0 - c) ** age.double(), weight)  # the oldest starts the average
        weight = torch.where(age < held, weight, 0.0)
        return (self.history.double() * weight).sum(dim=2).float()


@dataclass(frozen=True, eq=False)
class BankRows:
    """Several layers' rows of one bank, read and recorded together (a mixture-of-experts layer's experts,
    each with a history of its own, cast in one batch: ``lowprec.nn.grouped_casts``). ``live``: which of them
    record (an expert without tokens records nothing, as a layer not called)."""

    bank: DelayedBank
    rows: torch.Tensor
    """(n,) int64 on the bank's device: each layer's row, distinct."""
    live: torch.Tensor
    """(n,) bool on the bank's device."""

    def amax(self, role: Role, current: torch.Tensor) -> torch.Tensor:
        """(n,): the amax each layer's delayed scale for ``role`` is taken from, as the last fold left it
        (times 2^margin), or before the role's first record ``current`` (the operand's own amax: current
        scaling), as ``DelayedState.scale`` takes it; a scale is the same function of either."""
        ready, history = self.bank.read_rows(self.rows, role)
        amax = torch.where(ready, history, current.to(history.dtype))
        # see [Note: delayed scaling under torch.compile] in lowprec.nn.delayed: forward's scales reach backward
        # as saved, never recomputed there from a history forward has written since
        return keep(amax) if torch.compiler.is_compiling() and role is not Role.GRAD_OUTPUT else amax

    def record(self, role: Role, amax: torch.Tensor) -> None:
        """``amax`` ((n,)) pending for ``role`` of each live layer."""
        self.bank.record_rows(self.rows, role, amax, self.live)


class DelayedBanks:
    """The banks of the layers of one model (or of one layer alone): one per device and setting.
    ``by_hook``: a forward pre-hook on the model folds them (:func:`bank_layers`); else each layer's
    forward folds its own."""

    def __init__(self, by_hook: bool = False) -> None:
        self.by_hook = by_hook
        self.banks: list[DelayedBank] = []

    def bank(self, config: DelayedScaling, device: torch.device) -> DelayedBank:
        """The bank for ``config`` on ``device``, made at the first layer to need it."""
        device = torch.device(device)
        for b in self.banks:
            if b.config == config and b.device == device:
                return b
        self.banks.append(DelayedBank(config, device))
        return self.banks[-1]

    def drop_empty(self) -> None:
        self.banks = [b for b in self.banks if b.live > 0]

    def fold(self) -> None:
        for b in self.banks:
            b.fold()


class _Fold:
    """The forward pre-hook that folds a model's banks (an object rather than a closure, so that a deep
    copy of the model takes a copy of the banks its layers hold, through the same memo)."""

    def __init__(self, banks: DelayedBanks) -> None:
        self.banks = banks

    def __call__(self, module: nn.Module, args) -> None:
        self.banks.fold()


def bank_layers(model: nn.Module, layers: list[nn.Module]) -> DelayedBanks:
    """Put the delayed-scaling state of ``layers`` (``lowprec.nn.Linear``s of ``model``) into the
    model's banks, folded once per forward of ``model`` by a pre-hook (see [Note: the delayed-scaling
    bank]); the hook and the banks are made at the first call for ``model`` and kept by later ones."""
    hook = next((h for h in model._forward_pre_hooks.values() if isinstance(h, _Fold)), None)
    if hook is None:
        hook = _Fold(DelayedBanks(by_hook=True))
        model.register_forward_pre_hook(hook)
    for lin in layers:
        lin.use_banks(hook.banks)
    return hook.banks


def release_on_collect(state: object, bank: DelayedBank, row: int) -> None:
    """Give ``row`` back to ``bank`` when ``state`` is collected (a layer's state replaced or dropped)."""
    weakref.finalize(state, bank.give_row, row)
