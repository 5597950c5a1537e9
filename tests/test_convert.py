"""``lowprec.convert``: which linears become low precision, the reason given for every other one,
the report, re-conversion, and parameters shared with an optimizer made before conversion."""
from __future__ import annotations

import json
import sys
import warnings

import pytest
import torch
import torch.nn as nn

import lowprec
from lowprec.convert import Kept
from lowprec.nn import Linear
from lowprec.policy import Policy
from lowprec.train.model import ModelConfig, build_model

HEAD = "LM head / final projection (kept by policy)"
ROUTER = "MoE router / gate (kept by policy)"
MHA = "inside nn.MultiheadAttention (reads the weight directly)"


class Block(nn.Module):
    """Every kind of linear a policy decides about, in one transformer block."""

    def __init__(self) -> None:
        super().__init__()
        self.attn = nn.MultiheadAttention(64, 4, batch_first=True)
        self.router = nn.Linear(64, 8, bias=False)  # MoE router
        self.gate = nn.Linear(64, 4, bias=False)  # MoE gate
        self.gate_proj, self.up_proj = nn.Linear(64, 128), nn.Linear(64, 128)  # SwiGLU (HF names)
        self.down_proj = nn.Linear(128, 64)
        self.w1 = nn.Linear(64, 128)  # SwiGLU (Llama names)


class Toy(nn.Module):
    def __init__(self, n_blocks: int = 4) -> None:
        super().__init__()
        self.emb = nn.Embedding(256, 64)
        self.layers = nn.ModuleList(Block() for _ in range(n_blocks))
        self.odd = nn.Linear(100, 64)  # no recipe's GEMM takes 100
        self.lm_head = nn.Linear(64, 256)
        self.tied = nn.Linear(64, 256, bias=False)  # a head tied to the embedding, under another name
        self.tied.weight = self.emb.weight


def linear_names(model: nn.Module) -> list[str]:
    return [n for n, m in model.named_modules() if isinstance(m, nn.Linear)]


def quiet_convert(model, recipe, policy=None):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return lowprec.convert(model, recipe, policy)


def reasons(report) -> dict[str, str]:
    return {lr.name: lr.reason for lr in report.layers}


def test_every_linear_is_reported_with_its_reason():
    model = Toy()
    names = linear_names(model)
    report = quiet_convert(model, "fp8-current")
    assert [lr.name for lr in report.layers] == names
    got = reasons(report)
    for i in range(4):
        p = f"layers.{i}."
        assert got[p + "attn.out_proj"] == MHA
        assert got[p + "router"] == ROUTER and got[p + "gate"] == ROUTER
        for leaf in ("gate_proj", "up_proj", "down_proj", "w1"):
            assert got[p + leaf] == "fp8-current"
    assert got["lm_head"] == HEAD and got["tied"] == HEAD
    assert got["odd"] == "high precision: in_features=100 not a multiple of 16 (fp8-current)"
    converted = {lr.name for lr in report.converted}
    assert converted == {f"layers.{i}.{leaf}" for i in range(4) for leaf in ("gate_proj", "up_proj", "down_proj", "w1")}
    for lr in report.layers:
        module = model.get_submodule(lr.name)
        assert (lr.in_features, lr.out_features) == (module.in_features, module.out_features)
        assert isinstance(module, Linear) == (lr.converted or lr.name == "odd")


def test_the_reference_model_keeps_only_its_output_head():
    cfg = ModelConfig(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=128)
    model = build_model(cfg)
    report = quiet_convert(model, "mxfp8")
    assert [lr.name for lr in report.kept] == ["output"] and reasons(report)["output"] == HEAD
    assert len(report.converted) == 2 * 7


def test_kept_layers_are_untouched_and_the_multihead_attention_still_works():
    model = Toy()
    before = {n: type(model.get_submodule(n)) for n in linear_names(model)}
    quiet_convert(model, "mxfp8")
    assert type(model.layers[0].attn.out_proj) is before["layers.0.attn.out_proj"]
    assert type(model.lm_head) is nn.Linear and model.tied.weight is model.emb.weight
    x = torch.randn(2, 5, 64)
    y, _ = model.layers[0].attn(x, x, x)
    assert y.shape == (2, 5, 64)


def test_first_and_last_blocks_are_kept_when_the_policy_says():
    report = quiet_convert(Toy(), "fp8-current", Policy(keep_first_blocks=1, keep_last_blocks=1))
    got = reasons(report)
    assert got["layers.0.w1"] == "block 0 of the first 1 (kept by policy)"
    assert got["layers.3.down_proj"] == "block 3 of the last 1 (kept by policy)"
    assert got["layers.1.w1"] == got["layers.2.w1"] == "fp8-current"
    assert got["layers.0.router"] == ROUTER  # the more specific reason first


@pytest.mark.parametrize(("n_blocks", "kept"), [(4, [3]), (8, [6, 7]), (20, [17, 18, 19])])
def test_nvfp4_keeps_its_last_15_percent_of_blocks_by_default(n_blocks, kept):
    got = reasons(quiet_convert(Toy(n_blocks), "nvfp4"))
    hp = sorted(i for i in range(n_blocks) if got[f"layers.{i}.w1"] != "nvfp4")
    assert hp == kept
    assert got[f"layers.{kept[0]}.w1"] == f"block {kept[0]} of the last {len(kept)} (kept by policy)"
    override = reasons(quiet_convert(Toy(n_blocks), "nvfp4", Policy(keep_last_blocks=0)))
    assert all(override[f"layers.{i}.w1"] == "nvfp4" for i in range(n_blocks))


def test_include_and_exclude_take_globs_or_predicates():
    got = reasons(quiet_convert(Toy(), "fp8-current", Policy(include=("layers.*.up_proj", "layers.*.w1"))))
    assert got["layers.2.up_proj"] == got["layers.2.w1"] == "fp8-current"
    assert got["layers.2.down_proj"] == "not matched by policy.include"
    got = reasons(quiet_convert(Toy(), "fp8-current", Policy(exclude=lambda name, m: m.in_features == 128)))
    assert got["layers.1.down_proj"] == "excluded by policy.exclude" and got["layers.1.w1"] == "fp8-current"


def test_skip_small_true_keeps_layers_with_a_dimension_under_min_features_everywhere():
    got = reasons(quiet_convert(Toy(), "fp8-current", Policy(skip_small=True, min_features=65)))
    assert got["layers.0.w1"] == "too small to gain (64x128: a dimension under policy.min_features)"
    assert reasons(quiet_convert(Toy(), "fp8-current", Policy(skip_small=True, min_features=64)))[
        "layers.0.w1"] == "fp8-current"
    assert reasons(quiet_convert(Toy(), "fp8-current", Policy(skip_small=True)))["layers.0.w1"].startswith("too small")


def test_by_default_small_layers_convert_where_the_recipe_is_emulated_and_the_report_says_so():
    report = quiet_convert(Toy(), "fp8-current")  # on the CPU every GEMM is emulated
    got = reasons(report)
    assert got["layers.0.w1"] == "fp8-current"
    assert "layers.0.w1" in report.small_elsewhere and "have a dimension under 1024" in str(report)
    assert not quiet_convert(Toy(), "fp8-current", Policy(skip_small=False)).small_elsewhere


def test_the_small_layer_rule_is_taken_per_device_where_the_recipe_runs_natively():
    from lowprec.kernels import capability
    from lowprec.nn.plan import layer_plan

    r = lowprec.recipes.get("fp8-current")
    cpu = layer_plan(r, torch.device("cpu"), 768, 2048, None, 1024)
    assert cpu.hp_reason is None and capability("cpu").fp8_gemm is False
    # a device with FP8 GEMMs: the same layer stays in high precision, and says why
    C = sys.modules["lowprec.kernels.capability"]  # the package exports a function of the same name

    hopper = C.Capability("cuda", "H", (9, 0), True, True, False, False)
    dev = torch.device("cuda", 7)
    C._KNOWN[dev] = hopper
    try:
        plan = layer_plan(r, dev, 768, 2048, None, 1024)
        assert plan.hp_reason.startswith("too small to gain on cuda (768x2048")
        assert layer_plan(r, dev, 2048, 1024, None, 1024).hp_reason is None
        assert layer_plan(r, dev, 768, 2048, None, None).hp_reason is None  # skip_small=False
        # MX runs folded on the FP8 tensor cores there: small layers gain nothing either; NVFP4 is emulated
        assert layer_plan(lowprec.recipes.get("mxfp8"), dev, 768, 2048, None, 1024).hp_reason.startswith("too small")
        assert layer_plan(lowprec.recipes.get("nvfp4"), dev, 768, 2048, None, 1024).hp_reason is None
    finally:
        del C._KNOWN[dev]
        layer_plan.cache_clear()


def test_heads_and_routers_convert_when_the_policy_allows():
    got = reasons(quiet_convert(Toy(), "fp8-current", Policy(keep_head=False, keep_routers=False)))
    assert got["lm_head"] == got["tied"] == "fp8-current"
    assert got["layers.0.router"] == "high precision: out_features=8 not a multiple of 16 (fp8-current)"
    assert got["layers.0.gate"] == "high precision: out_features=4 not a multiple of 16 (fp8-current)"


def test_a_layer_the_recipe_cannot_take_is_reported_warned_and_runs_plain():
    model = Toy()
    ref = nn.Linear(100, 64)
    ref.load_state_dict(model.odd.state_dict())
    with pytest.warns(UserWarning, match=r"1 linear\(s\) run in high precision because the mxfp8 GEMMs "
                                         r"cannot take their shape: odd"):
        report = lowprec.convert(model, "mxfp8")
    assert reasons(report)["odd"] == "high precision: in_features=100 not a multiple of 32 (mxfp8)"
    x = torch.randn(3, 100)
    assert torch.equal(model.odd(x), ref(x))


def test_fp8_blockwise_needs_multiples_of_128():
    got = reasons(quiet_convert(Toy(), "fp8-blockwise"))
    assert got["layers.0.w1"] == "high precision: in_features=64 not a multiple of 128 (fp8-blockwise)"
    assert got["layers.0.down_proj"] == "high precision: out_features=64 not a multiple of 128 (fp8-blockwise)"
    assert got["odd"] == "high precision: in_features=100 and out_features=64 not a multiple of 128 (fp8-blockwise)"


def test_emulated_gemms_are_reported_and_warned_on_cpu():
    with pytest.warns(UserWarning, match=r"nvfp4 fprop/dgrad/wgrad GEMMs are emulated on cpu"):
        report = lowprec.convert(Toy(), "nvfp4")
    assert report.gemm_paths == {"fprop": "emulated", "dgrad": "emulated", "wgrad": "emulated"}
    assert quiet_convert(Toy(), "bf16").gemm_paths == {"fprop": "hp", "dgrad": "hp", "wgrad": "hp"}


def test_the_report_as_text_markdown_and_json():
    report = quiet_convert(Toy(n_blocks=2), "mxfp8")
    assert report.summary() == ("recipe mxfp8: 8 of 17 linears converted (57% of linear parameters), 9 kept in "
                                "high precision; "
                                "GEMMs on cpu: fprop emulated, dgrad emulated, wgrad emulated")
    text = str(report)
    assert text.splitlines()[0] == report.summary() and "layers.1.up_proj" in text
    md = report.to_table(markdown=True).splitlines()
    assert [c.strip() for c in md[0].strip("|").split("|")] == ["layer", "shape", "low precision", "reason"]
    row = [c.strip() for c in md[2 + 6].strip("|").split("|")]
    assert len(md) == 2 + 17 and row == ["layers.0.w1", "64x128", "yes", "mxfp8"]
    data = json.loads(report.to_json())
    assert data["recipe"] == "mxfp8" and data["device"] == "cpu" and len(data["layers"]) == 17
    assert data["layers"][-2] == {"name": "lm_head", "in_features": 64, "out_features": 256, "converted": False,
                                  "reason": HEAD, "params": 64 * 256 + 256, "kept": "policy"}
    assert data["coverage"] == {"converted": 8, "linears": 17, "converted_params": report.coverage().converted_params,
                                "params": sum(lr.params for lr in report.layers), "kept": {"policy": 8, "shape": 1},
                                "fraction": report.coverage().fraction}


def test_the_coverage_counts_linears_and_their_parameters_with_why_the_rest_are_kept():
    model = Toy(n_blocks=2)
    report = quiet_convert(model, "fp8-blockwise")  # 64-wide layers: not multiples of 128
    linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
    every = sum(p.numel() for m in linears for p in m.parameters(recurse=False))
    c = report.coverage()
    assert (c.linears, c.params) == (len(linears), every)
    assert c.converted == sum(lr.converted for lr in report.layers)
    shapes = sum("not a multiple of 128" in lr.reason for lr in report.layers)
    assert shapes > 0 and dict(c.kept) == {Kept.SHAPE: shapes, Kept.POLICY: c.linears - c.converted - shapes}
    assert str(c) == f"{c.converted} of {c.linears} linears converted ({c.share} of linear parameters)"
    assert report.summary().startswith(f"recipe fp8-blockwise: {c}, ")


def test_reconverting_to_another_recipe_rebinds_the_same_modules():
    model = Toy()
    quiet_convert(model, "fp8-current")
    first = model.layers[1].w1
    report = quiet_convert(model, "mxfp8", Policy(exclude=("layers.1.up_proj",)))
    assert model.layers[1].w1 is first and first.recipe.name == "mxfp8"
    assert reasons(report)["layers.1.up_proj"] == "excluded by policy.exclude"
    assert model.layers[1].up_proj.recipe is None  # converted before, now back to high precision
    x = torch.randn(4, 64)
    up = model.layers[1].up_proj
    assert torch.equal(up(x), nn.functional.linear(x, up.weight, up.bias))
    assert reasons(quiet_convert(model, "bf16"))["layers.1.up_proj"] == "bf16"


def test_an_optimizer_made_before_conversion_still_trains_the_model():
    model = Toy(n_blocks=1)
    params = list(model.parameters())
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    quiet_convert(model, "fp8-current")
    assert list(model.parameters()) == params and all(a is b for a, b in zip(model.parameters(), params))
    w1 = model.layers[0].w1
    before = w1.weight.detach().clone()
    w1(torch.randn(8, 64)).square().sum().backward()
    opt.step()
    assert not torch.equal(w1.weight, before)


@pytest.mark.parametrize(("args", "exc", "message"), [
    (("model", "fp8-current"), TypeError, r"model: expected a torch.nn.Module, got 'model' \(str\)"),
    ((None, "fp9"), ValueError, r"recipe: expected one of bf16, .*got 'fp9'"),
    ((None, 8), TypeError, r"recipe: expected a recipe name or lowprec.recipes.Recipe, got 8"),
    ((None, "mxfp8", "keep the head"), TypeError, r"policy: expected a lowprec.Policy or None, got 'keep the head'"),
], ids=["model", "recipe-name", "recipe-type", "policy"])
def test_bad_arguments_are_refused_by_name(args, exc, message):
    args = tuple(Toy(1) if a is None else a for a in args)
    with pytest.raises(exc, match=message):
        lowprec.convert(*args)


@pytest.mark.parametrize(("kw", "message"), [
    ({"include": "layers.*"}, r"include: expected None, a tuple of glob patterns or a predicate .*got 'layers.\*'"),
    ({"exclude": ["w1"]}, r"exclude: expected None, a tuple of glob patterns"),
    ({"keep_first_blocks": -1}, r"keep_first_blocks: expected a non-negative int, got -1"),
    ({"keep_last_blocks": 1.5}, r"keep_last_blocks: expected a non-negative int, got 1.5"),
])
def test_a_bad_policy_is_refused_by_name(kw, message):
    with pytest.raises(ValueError, match=message):
        Policy(**kw)


def test_a_model_without_linears_gives_an_empty_report():
    report = quiet_convert(nn.Sequential(nn.Embedding(4, 4), nn.LayerNorm(4)), "fp8-current")
    assert report.layers == [] and report.summary().startswith("recipe fp8-current: 0 of 0 linears converted")


def test_recast_inputs_must_be_a_bool():
    with pytest.raises(TypeError, match=r"recast_inputs: expected a bool, got 'yes'"):
        Policy(recast_inputs="yes")


def test_the_policy_says_which_layers_recast_their_inputs_in_a_compiled_backward():
    saved = lowprec.nn.fp8_activations("1x128")
    cases = [(Policy(), False), (Policy(recast_inputs=True), True),
             (Policy(saved_activations=saved, recast_inputs=True), False)]
    for policy, want in cases:
        model = nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 64))
        quiet_convert(model, "fp8-current", policy)
        assert policy.recasts_inputs is want
        assert all(m.recast_input is want and m.plan().recast_input is want for m in model), policy


def test_blocks_kept_in_a_numbered_module_dict_as_in_a_module_list():
    """torchtitan keeps its blocks in a ModuleDict keyed "0", "1", ...: the last-blocks rule finds them there."""
    toy = Toy(4)
    toy.layers = nn.ModuleDict({str(i): block for i, block in enumerate(toy.layers)})
    got = reasons(quiet_convert(toy, "nvfp4"))
    assert got["layers.3.w1"] == "block 3 of the last 1 (kept by policy)"
    assert got["layers.2.w1"] == "nvfp4"
