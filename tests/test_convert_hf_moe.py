"""``convert`` runs the experts of Hugging Face MoE models (transformers 5's fused 3-D experts) through
``GroupedLinear``: the same parameters under the same names, the same function (the eager loop's, bit for
bit, without a recipe), the recipe's casts per expert as a loop of ``lowprec.nn.Linear`` makes them, and
a report that lists the experts and keeps the routers in high precision. Tiny models built by
transformers itself: hidden 64, 4 experts of width 128, top-2, 2 layers."""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn

from lowprec.convert_hf_moe import ROUTER_KEPT, ROUTER_NOT_CONVERTED, HFGroupedExperts, swap_hf_experts
from lowprec.nn import Linear
from lowprec.nn.plan import Kept
from lowprec.policy import Policy
from tests.test_convert_grouped import convert, rows

transformers = pytest.importorskip("transformers")

E, H, D, V = 4, 64, 128, 128  # experts, hidden, expert width, vocabulary
SMALL = dict(vocab_size=V, hidden_size=H, num_hidden_layers=2, num_attention_heads=4, num_experts_per_tok=2)
CONFIGS = {
    "mixtral": lambda: transformers.MixtralConfig(**SMALL, intermediate_size=D, num_key_value_heads=2,
                                                  num_local_experts=E),
    "qwen3_moe": lambda: transformers.Qwen3MoeConfig(**SMALL, intermediate_size=D, moe_intermediate_size=D,
                                                     num_key_value_heads=2, num_experts=E, head_dim=16),
    "qwen2_moe": lambda: transformers.Qwen2MoeConfig(**SMALL, intermediate_size=D, moe_intermediate_size=D,
                                                     shared_expert_intermediate_size=D, num_key_value_heads=2,
                                                     num_experts=E),
    "deepseek_v3": lambda: transformers.DeepseekV3Config(
        **SMALL, intermediate_size=D, moe_intermediate_size=D, num_key_value_heads=4, n_routed_experts=E,
        n_group=1, topk_group=1, first_k_dense_replace=0, kv_lora_rank=32, q_lora_rank=None, qk_rope_head_dim=16,
        qk_nope_head_dim=16, v_head_dim=16, n_shared_experts=1),
    "gpt_oss": lambda: transformers.GptOssConfig(**SMALL, intermediate_size=D, num_key_value_heads=2,
                                                 num_local_experts=E, head_dim=16),
}
ROUTER = {"gpt_oss": "router"}  # the others call it gate


def build(kind: str, seed: int = 0, experts: str = "eager") -> nn.Module:
    """A tiny model of ``kind`` as transformers builds it, its experts' implementation ``experts``."""
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(CONFIGS[kind](), experts_implementation=experts)
    if kind == "gpt_oss":  # transformers leaves its experts' biases at zero: make them count
        for layer in model.model.layers:
            for b in (layer.mlp.experts.gate_up_proj_bias, layer.mlp.experts.down_proj_bias):
                nn.init.normal_(b, std=0.1)
    return model.eval()


def tokens(seed: int = 1) -> torch.Tensor:
    return torch.randint(0, V, (2, 12), generator=torch.Generator().manual_seed(seed))


def experts_of(model: nn.Module, layer: int = 0) -> nn.Module:
    return model.model.layers[layer].mlp.experts


@pytest.mark.parametrize("kind", list(CONFIGS))
def test_without_a_recipe_the_model_gives_the_eager_loops_logits_bit_for_bit(kind):
    # the same rows for each expert's GEMMs, the same products, each token's two outputs added in the
    # same order (see [Note: Hugging Face experts]): equal, not close
    model = build(kind)
    converted = copy.deepcopy(model)
    swapped = swap_hf_experts(converted)
    assert [m.name for m in swapped] == [f"model.layers.{i}.mlp.experts" for i in range(2)]
    assert all(isinstance(experts_of(converted, i), HFGroupedExperts) for i in range(2))
    with torch.no_grad():
        got, want = converted(tokens()).logits, model(tokens()).logits
    if kind == "gpt_oss":  # its eager loop adds the biases after the product; linear fuses them (addmm)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    else:
        assert torch.equal(got, want)


@pytest.mark.parametrize("kind", ["mixtral", "gpt_oss"])
def test_bf16_on_a_bf16_model_gives_its_logits(kind):
    model = build(kind).to(torch.bfloat16)
    converted = copy.deepcopy(model)
    report, _ = convert(converted, "bf16")
    assert rows(report)["model.layers.0.mlp.experts.gate_up_proj"].converted and report.unseen == []
    with torch.no_grad():
        got, want = converted(tokens()).logits, model(tokens()).logits
    if kind == "gpt_oss":  # the biases: one BF16 rounding (addmm) where the eager loop makes two
        torch.testing.assert_close(got, want, rtol=1.6e-2, atol=8e-3)
    else:
        assert torch.equal(got, want)


def test_against_transformers_default_grouped_mm_the_logits_differ_by_summation_order_alone():
    # grouped_mm sums each token's k outputs in FP32 and runs its GEMMs as one grouped call: float32
    # rounding apart (a few ulps of the logits), the same function
    model = build("mixtral", experts="grouped_mm")
    converted = copy.deepcopy(model)
    swap_hf_experts(converted)
    with torch.no_grad():
        torch.testing.assert_close(converted(tokens()).logits, model(tokens()).logits, rtol=1e-5, atol=1e-5)


def test_the_state_dict_keeps_transformers_names_shapes_and_parameter_objects():
    model = build("gpt_oss")
    before = {k: (tuple(v.shape), v.data_ptr()) for k, v in model.state_dict().items()}
    param = experts_of(model).gate_up_proj
    convert(model)
    assert {k: (tuple(v.shape), v.data_ptr()) for k, v in model.state_dict().items()} == before  # nothing copied
    assert experts_of(model).gate_up_proj is param and tuple(param.shape) == (E, H, 2 * D)  # GPT-OSS: [E, in, out]
    assert not any("_grouped" in n for n, _ in model.named_parameters())


@pytest.mark.parametrize("kind", ["mixtral", "gpt_oss"])
def test_a_transformers_checkpoint_loads_into_the_converted_model_and_back(kind):
    other = build(kind, seed=7)
    converted = build(kind)
    swap_hf_experts(converted)
    converted.load_state_dict(other.state_dict())  # strict: the same names and shapes
    with torch.no_grad():
        assert torch.equal(converted(tokens()).logits, other(tokens()).logits)
    fresh = build(kind, seed=3)
    fresh.load_state_dict(converted.state_dict())
    with torch.no_grad():
        assert torch.equal(fresh(tokens()).logits, other(tokens()).logits)


def _eager_with_linears(hf_experts: nn.Module, recipe: str, x, top_k_index, top_k_weights):
    """transformers' eager loop with each expert's projections as ``lowprec.nn.Linear`` bound to
    ``recipe``: the reference the routing glue must meet; returns the output and the Linears."""
    out = torch.zeros_like(x)
    mask = nn.functional.one_hot(top_k_index, E).permute(2, 1, 0)  # (E, k, T)
    linears = []
    for e in range(E):
        pair = []
        for name in ("gate_up_proj", "down_proj"):
            w = getattr(hf_experts, name)[e].detach()
            w = w.t() if hf_experts.is_transposed else w  # (out, in)
            bias = getattr(hf_experts, f"{name}_bias", None)
            lin = Linear(w.shape[1], w.shape[0], bias=bias is not None, recipe=recipe)
            lin.weight.data.copy_(w)
            if bias is not None:
                lin.bias.data.copy_(bias[e].detach())
            pair.append(lin)
        linears.append(pair)
        slot, token = torch.where(mask[e])
        if token.numel():
            y = pair[1](hf_experts._apply_gate(pair[0](x[token])))
            out.index_add_(0, token, (y * top_k_weights[token, slot, None]).to(out.dtype))
    return out, linears


@pytest.mark.parametrize("recipe", ["fp8-current", "mxfp8"])
@pytest.mark.parametrize("kind", ["mixtral", "gpt_oss"])
def test_the_converted_experts_equal_a_loop_of_lowprec_linears_forward_and_backward(kind, recipe):
    model = build(kind).train()
    hf_experts = copy.deepcopy(experts_of(model))
    convert(model, recipe)
    experts = experts_of(model)
    torch.manual_seed(2)
    x = torch.randn(24, H)
    top_k_index = torch.stack([torch.randperm(E)[:2] for _ in range(24)])  # (T, 2), every expert some tokens
    weights = torch.rand(24, 2)
    x1, w1 = x.clone().requires_grad_(), weights.clone().requires_grad_()
    x2, w2 = x.clone().requires_grad_(), weights.clone().requires_grad_()
    got = experts(x1, top_k_index, w1)
    want, linears = _eager_with_linears(hf_experts, recipe, x2, top_k_index, w2)
    assert torch.equal(got, want)
    dy = torch.randn_like(got)
    got.backward(dy)
    want.backward(dy)
    assert torch.equal(x1.grad, x2.grad) and torch.equal(w1.grad, w2.grad)
    for i, name in enumerate(("gate_up_proj", "down_proj")):
        grad = getattr(experts, name).grad
        grad = grad.transpose(1, 2) if kind == "gpt_oss" else grad  # (E, out, in)
        assert torch.equal(grad, torch.stack([linears[e][i].weight.grad for e in range(E)]))
        if kind == "gpt_oss":
            assert torch.equal(getattr(experts, f"{name}_bias").grad,
                               torch.stack([linears[e][i].bias.grad for e in range(E)]))


def test_gradients_reach_every_expert_with_tokens_and_no_other():
    model = build("qwen3_moe").train()
    convert(model)
    experts = experts_of(model)
    torch.manual_seed(3)
    top_k_index = torch.stack([torch.randperm(3)[:2] for _ in range(16)])  # experts 0-2 only
    experts(torch.randn(16, H), top_k_index, torch.rand(16, 2)).square().sum().backward()
    for p in (experts.gate_up_proj, experts.down_proj):
        assert torch.count_nonzero(p.grad[3]) == 0
        # every element but where E5M2 gradients cancel or underflow (one in 16,384 here)
        assert all(torch.count_nonzero(p.grad[e]) > 0.99 * p.grad[e].numel() for e in range(3))


def test_through_the_whole_model_the_gradients_are_the_eager_loops():
    model = build("mixtral").train()
    converted = copy.deepcopy(model)
    swap_hf_experts(converted)
    for m in (model, converted):
        m(tokens(), labels=tokens()).loss.backward()
    grads = dict(model.named_parameters())
    for name, p in converted.named_parameters():
        # the hidden states' gradient sums its uses in autograd's order: float32 rounding apart
        torch.testing.assert_close(p.grad, grads[name].grad, rtol=1e-5, atol=1e-6, msg=name)
    router = converted.model.layers[0].mlp.gate.weight.grad
    assert torch.count_nonzero(router) > 0  # the routing weights' gradient reaches the router


@pytest.mark.parametrize("kind", ["mixtral", "qwen3_moe"])
def test_a_converted_model_trains_with_adamw(kind):
    model = build(kind).train()
    report, _ = convert(model, "fp8-current")
    assert rows(report)["model.layers.1.mlp.experts.down_proj"].converted
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    batch = tokens()
    losses = []
    for _ in range(6):
        loss = model(batch, labels=batch).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    assert all(torch.isfinite(torch.tensor(losses))) and losses[-1] < losses[0] - 0.1, losses


def test_the_report_lists_the_experts_and_keeps_the_routers():
    model = build("mixtral")
    report, said = convert(model)
    r = rows(report)
    for i in range(2):
        prefix = f"model.layers.{i}.mlp"
        gate_up, down = r[f"{prefix}.experts.gate_up_proj"], r[f"{prefix}.experts.down_proj"]
        router = r[f"{prefix}.gate"]
        assert (gate_up.converted, gate_up.reason, gate_up.experts, gate_up.params) == (True, "fp8-current", E,
                                                                                       E * 2 * D * H)
        assert gate_up.shape_text == f"4 experts x {2 * D} x {H}" and down.shape_text == f"4 experts x {H} x {D}"
        assert (router.converted, router.reason, router.kept, router.params) == (False, ROUTER_KEPT, Kept.POLICY, E * H)
    assert report.unseen == [] and not any("cannot see into" in s for s in said)
    c = report.coverage()
    assert (c.converted, c.linears) == (12, 15)  # 8 attention linears, 4 expert projections; 2 routers, the head
    assert c.converted_params == 2 * (2 * H * H + 2 * H * 32 + 3 * E * D * H)
    assert [lr.name for lr in report.layers[-3:]] == [
        "model.layers.1.mlp.experts.gate_up_proj", "model.layers.1.mlp.experts.down_proj", "model.layers.1.mlp.gate"]
    assert "recipe=fp8-current" in repr(experts_of(model))


@pytest.mark.parametrize("kind, shared", [("qwen2_moe", "shared_expert"), ("deepseek_v3", "shared_experts")])
def test_a_shared_expert_converts_as_linears_beside_the_routed_experts(kind, shared):
    report, _ = convert(build(kind))
    r = rows(report)
    assert all(r[f"model.layers.0.mlp.{shared}.{p}"].converted for p in ("gate_proj", "up_proj", "down_proj"))
    assert r["model.layers.0.mlp.experts.down_proj"].converted and r["model.layers.0.mlp.gate"].reason == ROUTER_KEPT
    assert report.unseen == []
    if kind == "qwen2_moe":  # its shared expert's sigmoid gate: a gate, kept as routers are
        assert r["model.layers.0.mlp.shared_expert_gate"].reason == ROUTER_KEPT


def test_gpt_oss_experts_are_reported_as_out_x_in_with_their_biases():
    report, _ = convert(build("gpt_oss"))
    r = rows(report)
    row = r["model.layers.0.mlp.experts.gate_up_proj"]
    assert row.shape_text == f"4 experts x {2 * D} x {H}" and row.params == E * (H * 2 * D + 2 * D)
    assert r["model.layers.0.mlp.router"].params == E * H + E and report.unseen == []


def test_fp8_delayed_converts_the_experts_each_with_its_history():
    """The experts of a Mixtral run fp8-delayed as its attention does, each expert with an amax history of its
    own in the model's banks; a training step records the experts that were routed tokens."""
    model = build("mixtral")
    report, said = convert(model, "fp8-delayed", Policy(keep_last_blocks=0))
    row = rows(report)["model.layers.0.mlp.experts.down_proj"]
    assert row.converted and row.reason == "fp8-delayed" and report.unseen == []
    assert not any("refuse" in s for s in said)
    model.train()
    model(tokens()).logits.float().square().mean().backward()
    experts = experts_of(model)
    named = dict(experts.named_delayed_states())
    assert len(named) == 2 * E and [1, 1, 1] in [s.recorded for s in named.values()]
    down = experts.projections[1].weight
    assert named[f".{down}#expert0"] is experts.grouped()[1].delayed_states()[0][1]
    # the histories travel in the experts module's state_dict, and load into a model converted alike
    sd = model.state_dict()
    key = "model.layers.0.mlp.experts._extra_state"
    assert sd[key].shape[:2] == (2, E)
    twin = build("mixtral")
    convert(twin, "fp8-delayed", Policy(keep_last_blocks=0))
    twin.load_state_dict(sd)
    for (n, a), (_, b) in zip(experts.named_delayed_states(), experts_of(twin).named_delayed_states(), strict=True):
        assert torch.equal(a.history, b.history) and a.recorded == b.recorded, n


def test_the_policy_applies_to_the_experts_by_their_weights_names_and_routers_stay_kept():
    model = build("mixtral")
    report, said = convert(model, policy=Policy(exclude=("*.experts.down_proj",), keep_routers=False))
    r = rows(report)
    assert r["model.layers.0.mlp.experts.gate_up_proj"].converted
    assert r["model.layers.0.mlp.experts.down_proj"].reason == "excluded by policy.exclude"
    gate = r["model.layers.0.mlp.gate"]
    assert (gate.reason, gate.converted, gate.kept) == (ROUTER_NOT_CONVERTED, False, Kept.UNSUPPORTED)
    assert not any("matching none" in s for s in said)
    convert(model)  # converting again binds the recipe again, to the same modules
    assert experts_of(model).grouped()[1].recipe is not None and isinstance(experts_of(model), HFGroupedExperts)


def test_experts_lowprec_cannot_express_stay_named_as_unseen():
    model = build("mixtral")
    experts_of(model, 1).has_post_expert_norm = True  # a norm after each expert: not expressed
    report, said = convert(model)
    assert [u.name for u in report.unseen] == ["model.layers.1.mlp.gate.weight",  # its router with it
                                               "model.layers.1.mlp.experts.gate_up_proj",
                                               "model.layers.1.mlp.experts.down_proj"]
    assert not isinstance(experts_of(model, 1), HFGroupedExperts) and isinstance(experts_of(model, 0), HFGroupedExperts)
    assert sum("cannot see into" in s for s in said) == 1


def test_modulelist_experts_convert_as_plain_linears():
    class MLP(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.gate_proj, self.up_proj, self.down_proj = nn.Linear(H, D), nn.Linear(H, D), nn.Linear(D, H)

    model = nn.ModuleDict({"gate": nn.Linear(H, E), "experts": nn.ModuleList(MLP() for _ in range(E))})
    report, _ = convert(model)
    assert [lr.name for lr in report.converted] == [f"experts.{e}.{p}" for e in range(E)
                                                    for p in ("gate_proj", "up_proj", "down_proj")]
    assert report.unseen == [] and isinstance(model["experts"][0].gate_proj, Linear)


def test_an_expert_index_out_of_range_is_refused_in_one_line():
    model = build("mixtral")
    swap_hf_experts(model)
    with pytest.raises(ValueError, match=r"^top_k_index: expected expert indices in \[0, 4\), got 4$"):
        experts_of(model)(torch.randn(3, H), torch.tensor([[0, 1], [2, 4], [1, 3]]), torch.rand(3, 2))
    with pytest.raises(ValueError, match=r"^top_k_weights: expected a tensor of shape \(3, 2\)"):
        experts_of(model)(torch.randn(3, H), torch.tensor([[0, 1], [2, 3], [1, 3]]), torch.rand(3))


@pytest.mark.slow
def test_a_converted_model_compiles_once_whatever_the_routing():
    """Under ``torch.compile`` the converted experts run outside the graph ([Note: experts under torch.compile]
    in ``lowprec.nn.routing``): new routings compile nothing again, and the losses are the eager model's."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    model = build("mixtral").train()
    convert(model, "fp8-current")
    twin = copy.deepcopy(model)
    compiled = torch.compile(model, backend="aot_eager")
    for seed in range(3):
        batch = tokens(seed)
        loss = compiled(batch, labels=batch).loss
        loss.backward()
        eager = twin(batch, labels=batch).loss
        eager.backward()
        torch.testing.assert_close(loss, eager, rtol=1e-4, atol=0)
        if seed == 0:
            graphs = counters["stats"]["unique_graphs"]
    assert counters["stats"]["unique_graphs"] == graphs
    assert [r for r in counters["graph_break"] if "lowprec.nn.routing" not in r] == []
    g, g_eager = experts_of(model).down_proj.grad, experts_of(twin).down_proj.grad
    torch.testing.assert_close(g, g_eager, rtol=1e-3, atol=1e-6)
