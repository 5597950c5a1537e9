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


def _graph_nodes(n_layers: int, recipe: str) -> tuple[int, int]:
    """Operations in the forward and the backward graph AOTAutograd hands the compiler for a converted
    model of ``n_layers`` linears, compiled whole."""
    torch._dynamo.reset()
    model = _model(n_layers, recipe)
    counted = []

    def count(gm, _):
        counted.append(sum(n.op == "call_function" for n in gm.graph.nodes))
        return gm

    compiled = torch.compile(model, fullgraph=True, backend=aot_autograd(fw_compiler=count, bw_compiler=count))
    compiled(randn(8, 64, seed=0).requires_grad_()).sum().backward()
    return counted[0], counted[1]


@pytest.mark.slow
def test_a_compiled_delayed_layer_has_fewer_operations_than_a_current_one():
    # Per layer, delayed scaling's forward graph against fp8-current's: each delayed cast takes its scale
    # in one operator (lowprec::delayed_scale) where current scaling reduces the operand and computes the
    # scale, and leaves its amax pending in one more (two nodes once functionalized), so the forward has
    # 14 fewer operations and the backward 19 fewer on the CPU path (34 and 14 more when the scale and the
    # record were tensor operations, 68 more when each cast updated its history). The fold is once per
    # forward, whatever the number of layers: 68 operations with the scales in E4M3 and E5M2.
    graphs = {n: [d - c for d, c in zip(_graph_nodes(n, "fp8-delayed"), _graph_nodes(n, "fp8-current"))]
              for n in (2, 6)}
    forward, backward = ((graphs[6][i] - graphs[2][i]) / 4 for i in (0, 1))
    assert forward <= -10 and backward <= -10, (forward, backward)
    fold = graphs[2][0] - 2 * forward
    assert 0 < fold <= 80, fold


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


def test_the_fold_computes_every_scale_in_each_format_the_layers_cast_in():
    from lowprec import formats as F
    from lowprec.quant.scales import amax_scale
    from lowprec.recipes import Role

    model = _model(2)
    for seed in range(2):
        model(randn(8, 64, seed=seed).requires_grad_()).sum().backward()
    bank = model[0].delayed_state.bank
    assert [f.name for f in bank.formats] == ["e4m3", "e5m2"]  # fp8-delayed's, learned at conversion
    for lin in model:
        row = lin.delayed_state.row
        for role in Role:
            for fmt in bank.formats:
                scales, k = bank.scale_at(row, role, fmt)
                want = amax_scale(bank.amax[row * len(Role) + int(role)], fmt)
                assert torch.equal(scales[k].view(torch.int32), want.view(torch.int32))
    # a format no plan named: compiled code computes its scales in its graph, eager code learns it
    e3m2 = F.get("e3m2")
    compiled = torch.compile(lambda: bank.scale_at(1, Role.WEIGHT, e3m2)[0], backend="eager", fullgraph=True)
    in_graph = compiled()
    assert len(bank.formats) == 2
    scales, k = bank.scale_at(1, Role.WEIGHT, e3m2)
    assert len(bank.formats) == 3 and scales[k].item() == in_graph[len(Role) + int(Role.WEIGHT)].item()
    assert scales[k].item() == amax_scale(bank.amax[len(Role) + int(Role.WEIGHT)], e3m2).item() != 1.0
