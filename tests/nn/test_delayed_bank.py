"""The delayed-scaling bank: one set of tensors per device for every layer of a converted model, folded
once per forward (see [Note: the delayed-scaling bank] in ``lowprec.nn.delayed_bank``)."""
from __future__ import annotations

import warnings

import pytest
import torch
from torch._dynamo.backends.common import aot_autograd

import lowprec
from tests.nn.common import randn
from tests.nn.test_delayed import with_amax

POLICY = lowprec.Policy(keep_head=False, keep_last_blocks=0, skip_small=False)


def _model(n_layers: int, recipe: str = "fp8-delayed") -> torch.nn.Sequential:
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(64, 64) for _ in range(n_layers)])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "GEMMs are emulated on cpu"
        lowprec.convert(model, recipe, POLICY)
    return model


def test_a_converted_model_keeps_every_layers_state_in_one_bank_per_device():
    model = _model(4)
    states = [m.delayed_state for m in model]
    bank = states[0].bank
    assert all(s.bank is bank for s in states) and sorted(s.row for s in states) == [0, 1, 2, 3]
    x = randn(8, 64, seed=0).requires_grad_()
    model(x).sum().backward()
    model(randn(8, 64, seed=1).requires_grad_()).sum().backward()
    # each layer's history is its row of the bank's one tensor
    for s in states:
        assert s.recorded == [2, 2, 2]
        assert torch.equal(s.history, bank.history[s.row].t())
    assert states[0].history[0, 0].item() == x.abs().amax().item()


def _forward_nodes(n_layers: int, recipe: str) -> int:
    """Operations in the forward graph AOTAutograd hands the compiler for a converted model of
    ``n_layers`` linears, compiled whole."""
    torch._dynamo.reset()
    model = _model(n_layers, recipe)
    counted = []

    def count(gm, _):
        counted.append(sum(n.op == "call_function" for n in gm.graph.nodes))
        return gm

    compiled = torch.compile(model, fullgraph=True, backend=aot_autograd(fw_compiler=count, bw_compiler=count))
    compiled(randn(8, 64, seed=0).requires_grad_()).sum().backward()
    return counted[0]


@pytest.mark.slow
def test_a_compiled_delayed_layer_adds_few_operations_to_a_current_one():
    # Per layer, what delayed scaling adds to the forward graph over fp8-current's: reading two scales and
    # leaving two amaxes pending, 34 operations on the CPU path (68 when each cast updated its history).
    # The fold is once per forward, whatever the number of layers.
    per_layer = [(_forward_nodes(n, "fp8-delayed") - _forward_nodes(n, "fp8-current")) for n in (2, 6)]
    added = (per_layer[1] - per_layer[0]) / 4
    assert added <= 40, added
    fold = per_layer[0] - 2 * added
    assert 0 < fold <= 60, fold


class _Twice(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(64, 64)

    def forward(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return self.lin(a) + self.lin(b)


def test_a_layer_called_twice_in_one_forward_records_the_larger_amax_once():
    torch.manual_seed(0)
    model = _Twice()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        lowprec.convert(model, "fp8-delayed", POLICY)
    a = with_amax(randn(8, 64, seed=1), 2.0).requires_grad_()
    b = with_amax(randn(8, 64, seed=2), 8.0).requires_grad_()
    model(a, b).sum().backward()
    state = model.lin.delayed_state
    assert state.recorded == [1, 1, 1]  # one amax per role for the forward, whatever the calls
    assert state.history[0, 0].item() == 8.0  # the larger of the two inputs'
    model(b, a).sum().backward()
    assert state.recorded == [2, 2, 2] and state.history[1, 0].item() == 8.0


def test_a_layer_outside_a_converted_model_folds_its_own_bank():
    lin = lowprec.nn.Linear(64, 64, recipe="fp8-delayed")
    assert not lin.delayed_state.banks.by_hook
    for seed, amax in enumerate([4.0, 0.5]):
        lin(with_amax(randn(8, 64, seed=seed), amax).requires_grad_()).sum().backward()
    assert lin.delayed_state.history[:2, 0].tolist() == [4.0, 0.5]
    # a model converted around it takes the row into its bank, history and all
    model = torch.nn.Sequential(lin)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        lowprec.convert(model, "fp8-delayed", POLICY)
    assert lin.delayed_state.banks.by_hook and lin.delayed_state.history[:2, 0].tolist() == [4.0, 0.5]


def test_several_rows_record_at_once_as_one_record_per_live_row():
    """``BankRows`` (a mixture-of-experts layer's experts, cast in one batch): ``record_rows`` leaves the bank
    as a ``record`` per live row does, the larger of two pending amaxes kept and NaN kept for the fold (which
    records it as 0), rows not live untouched; after a fold every row reads the history's amax, and a row
    before its first record reads the amax it is given (current scaling)."""
    from lowprec.nn.delayed_bank import BankRows, DelayedBank
    from lowprec.recipes import DelayedScaling, Role

    def bank():
        b = DelayedBank(DelayedScaling(history_len=4), torch.device("cpu"))
        for _ in range(5):
            b.take_row()
        return b

    batched, single = bank(), bank()
    rows = torch.tensor([3, 0, 4, 1])
    live = torch.tensor([True, True, False, True])
    steps = [torch.tensor([1.0, 2.0, 3.0, 4.0]), torch.tensor([0.5, float("nan"), 9.0, 8.0])]
    for role in Role:
        for amax in steps:  # two records before a fold: the larger is pending
            BankRows(batched, rows, live).record(role, amax)
            for r, a, on in zip(rows.tolist(), amax, live.tolist(), strict=True):
                if on:
                    single.record(r, role, a)
    for name in ("pending", "dy_pending", "dy_records"):
        torch.testing.assert_close(getattr(batched, name), getattr(single, name), rtol=0, atol=0, equal_nan=True,
                                   msg=name)
    current = torch.tensor([7.0, 7.0, 7.0, 7.0])
    assert torch.equal(BankRows(batched, rows, live).amax(Role.INPUT, current), current)  # none folded yet
    batched.fold()
    single.fold()
    for name in ("history", "count", "amax", "ready"):
        assert torch.equal(getattr(batched, name), getattr(single, name)), name
    for role in Role:
        got = BankRows(batched, rows, live).amax(role, current)
        # row 3: the larger of its two; row 0: its NaN recorded as 0; row 4: never recorded
        assert got.tolist() == [1.0, 0.0, 7.0, 8.0], role
