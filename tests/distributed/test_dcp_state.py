"""The optimizer's state keyed by parameter name, and an FSDP2 checkpoint loaded on 2 ranks and on 1."""
from __future__ import annotations

import json
import warnings

import pytest
import torch

import lowprec
from lowprec.distributed import checkpoint as dist_checkpoint
from lowprec.distributed import named_state
from lowprec.distributed.launch import Ranks
from lowprec.optim import Optimizer
from lowprec.train.model import build_model
from tests.distributed import dcp_scenarios
from tests.distributed.launch_helpers import MICRO, forked


@pytest.fixture(autouse=True)
def _quiet():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "emulated on cpu" is expected here
        yield


def _model(dtype=torch.bfloat16):
    model = build_model(MICRO, seed=0).to(dtype)
    lowprec.convert(model, lowprec.recipes.get("fp8-delayed"))
    return model


def _optimizer(params):
    return Optimizer(params, torch.optim.AdamW, lr=1e-2, master_weights=True)


def _position(opt, p):
    return [id(q) for q in opt.params].index(id(p))


def _one_step(model, opt):
    x = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(0))
    opt.backward(model(x).float().logsumexp(-1).mean())
    assert not opt.step().skipped


def test_optimizer_state_is_keyed_by_parameter_name_whatever_the_order():
    model = _model()
    params = dict(model.named_parameters())
    opt = _optimizer([{"params": [p for p in params.values() if p.ndim >= 2]},
                      {"params": [p for p in params.values() if p.ndim < 2], "weight_decay": 0.0}])
    _one_step(model, opt)
    by_name = named_state.optimizer_state_by_name(model, opt)
    assert set(by_name["optimizer"]["state"]) == set(by_name["master_weights"]) == set(params)
    for name, p in params.items():
        i = _position(opt, p)
        assert torch.equal(by_name["master_weights"][name], opt.master_weights[i])
        assert by_name["optimizer"]["state"][name] is opt.state_dict()["optimizer"]["state"][i]
    assert by_name["optimizer"]["param_groups"][1]["params"] == [n for n, p in params.items() if p.ndim < 2]
    # another optimizer over the same model, its groups in the other order, takes it by name
    other = _optimizer([{"params": [p for p in params.values() if p.ndim < 2], "weight_decay": 0.0},
                        {"params": [p for p in params.values() if p.ndim >= 2]}])
    positional = named_state.optimizer_state_by_position(model, other, by_name)
    other.load_state_dict(positional)
    for p_mine, p_other in ((_position(opt, p), _position(other, p)) for p in params.values()):
        assert torch.equal(opt.master_weights[p_mine], other.master_weights[p_other])
        for k in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(opt.state[opt.master_weights[p_mine]][k], other.state[other.master_weights[p_other]][k])


def test_an_optimizer_over_other_parameters_is_refused():
    model = _model()
    opt = _optimizer(list(model.parameters()) + [torch.nn.Parameter(torch.zeros(4, dtype=torch.bfloat16))])
    with pytest.raises(ValueError, match="opt: expected an optimizer over the model's own parameters"):
        named_state.optimizer_state_by_name(model, opt)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_an_fsdp2_checkpoint_loads_on_the_same_ranks_and_on_one_process(tmp_path, dtype):
    forked(dcp_scenarios.fsdp2_state, tmp_path, dtype, store=tmp_path / "store")
    for rank in (0, 1):  # 2 -> 2: every local shard back bit for bit, still sharded
        assert json.loads((tmp_path / f"reload_{rank}.json").read_text()) == \
            {"targets": True, "params": True, "moments": True, "sharded": True}
    # 2 -> 1: whole tensors in one process without a process group, equal to the shards gathered
    ref = torch.load(tmp_path / "reference.pt")
    model = _model(dtype)
    opt = _optimizer(model.parameters())
    json_path = tmp_path / "checkpoints" / "step_00000001.json"
    dist_checkpoint.load(json_path, dist_checkpoint.read(json_path, Ranks()), model, opt, Ranks())
    names = [n for n, _ in model.named_parameters()]
    for name, p, t in zip(names, model.parameters(), dcp_scenarios.targets(opt)):
        assert torch.equal(t, ref["targets"][name])
        assert torch.equal(p, ref["targets"][name].to(dtype))  # a bf16 model is set from its masters
        assert torch.equal(opt.state[t]["exp_avg_sq"], ref["exp_avg_sq"][name])
    extra = {k: v for k, v in model.state_dict().items() if k.endswith("_extra_state")}
    assert extra.keys() == ref["extra"].keys() and len(extra) == 2 * 7
    assert all(torch.equal(extra[k], ref["extra"][k]) for k in extra)
