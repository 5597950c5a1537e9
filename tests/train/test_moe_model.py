"""The ``moe-tiny`` preset: a DeepSeek-style mixture of experts whose routed experts are GroupedLinears,
routed top-k by softmax without dropping a token, and converted as the default policy says (routers kept)."""
from __future__ import annotations

import warnings

import pytest
import torch

import lowprec
from lowprec.nn import GroupedLinear
from lowprec.train.model import PRESETS, build_model
from lowprec.train.moe_model import MoEConfig

CFG = PRESETS["moe-tiny"]


def test_the_preset_counts_its_parameters_and_names_its_router_and_experts():
    model = build_model(CFG)
    assert sum(p.numel() for p in model.parameters()) == CFG.num_params()
    ff = model.layers[0].feed_forward
    assert type(ff.router) is torch.nn.Linear and ff.router.out_features == CFG.moe.n_experts
    assert all(isinstance(g, GroupedLinear) and g.num_experts == 8 for g in (ff.experts.w1, ff.experts.w3,
                                                                              ff.experts.w2))
    # 128 wide: every recipe's blocks, fp8-blockwise's 128x128 too, tile the experts
    assert all(CFG.dim % lowprec.recipes.get(r).required_multiple() == 0 for r in lowprec.recipes.names())


def _per_token(ff, x):
    """Each token through its top-k experts one at a time, weighted, plus the shared expert: what
    grouping, sorting and combining must equal."""
    weights, experts = ff.route(x)
    e = ff.experts
    out = []
    for t in range(x.shape[0]):
        acc = ff.shared(x[t:t + 1])[0]
        for w, k in zip(weights[t], experts[t].tolist()):
            h = torch.nn.functional.silu(x[t] @ e.w1.weight[k].T) * (x[t] @ e.w3.weight[k].T)
            acc = acc + w * (h @ e.w2.weight[k].T)
        out.append(acc)
    return torch.stack(out)


def test_every_token_reaches_its_top_k_experts_and_is_combined_by_their_weights():
    torch.manual_seed(0)
    ff = build_model(CFG).layers[0].feed_forward
    x = torch.randn(2, 24, CFG.dim)
    weights, _ = ff.route(x.flatten(0, 1))
    assert torch.allclose(weights.sum(-1), torch.ones(48))
    y = ff(x)
    # fp32, one summation order against another over 128-wide dot products: a few ulps of values ~0.1
    torch.testing.assert_close(y.flatten(0, 1), _per_token(ff, x.flatten(0, 1)), rtol=0, atol=1e-5)


def test_experts_without_tokens_get_zero_gradients_and_the_router_learns():
    model = build_model(CFG)
    ff = model.layers[0].feed_forward
    with torch.no_grad():  # every token prefers experts 0 and 1
        ff.router.weight.zero_()
        ff.router.weight[:2] = 0.01
    x = torch.randn(1, 16, CFG.dim).abs()
    ff(x).square().sum().backward()
    grads = ff.experts.w1.weight.grad
    assert grads[:2].abs().sum() > 0 and torch.equal(grads[2:], torch.zeros_like(grads[2:]))
    assert ff.router.weight.grad.abs().sum() > 0


def test_convert_keeps_the_routers_and_gives_the_experts_the_recipe():
    model = build_model(CFG)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # emulated GEMMs on the CPU
        report = lowprec.convert(model, "fp8-blockwise")
    rows = {lr.name: lr for lr in report.layers}
    assert rows["layers.0.feed_forward.router"].reason == "MoE router / gate (kept by policy)"
    experts = [lr for lr in report.layers if lr.experts is not None]
    assert len(experts) == 6 and all(lr.converted and lr.shape_text == "8 experts x 128 x 128" for lr in experts)
    assert report.unseen == [] and report.coverage().fraction > 0.9
    model(torch.randint(0, 256, (2, 16))).sum().backward()
    assert model.layers[1].feed_forward.experts.w2.weight.grad is not None


@pytest.mark.parametrize("args, message", [
    ({"n_experts": 0, "top_k": 1}, "moe.n_experts: expected a positive int, got 0"),
    ({"n_experts": 4, "top_k": 5}, "moe.top_k: expected at most n_experts=4, got 5"),
    ({"n_experts": 4, "top_k": 2, "n_shared": -1}, "moe.n_shared: expected a non-negative int, got -1"),
])
def test_a_bad_moe_config_is_refused_naming_the_field(args, message):
    with pytest.raises(ValueError, match=f"^{message}"):
        MoEConfig(**args)


def test_the_planner_knows_the_preset_with_its_experts():
    from lowprec.plan import count_params, get_model

    spec = get_model("ref-moe-tiny")
    assert (spec.moe.n_experts, spec.moe.top_k, spec.moe.expert_ffn, spec.moe.n_shared) == (8, 2, 128, 1)
    counts = count_params(spec)
    assert counts.total == CFG.num_params() and counts.active < counts.total


@pytest.mark.parametrize("parallel", ["ddp", "fsdp2"])
def test_expert_parallelism_refuses_delayed_experts_before_any_step(parallel):
    """Each expert keeps amax histories under fp8-delayed; split over ranks, the reduction of histories would
    mix experts: refused by the config, naming --ep and the recipe (fp8-current with --ep is accepted)."""
    from lowprec.train.config import TrainConfig

    with pytest.raises(ValueError, match=r"^ep: expected 1 with recipe fp8-delayed \(delayed scaling keeps an amax "
                                         r"history per expert.*got 2$"):
        TrainConfig(recipe="fp8-delayed", parallel=parallel, ep=2)
    TrainConfig(recipe="fp8-current", parallel=parallel, ep=2)
