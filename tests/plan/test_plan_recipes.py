"""The planner's recipe costs, derived from ``lowprec.recipes``: presets by hand, against the bytes a
real ``QuantizedTensor`` reports, GEMM formats of mixed operands, and a user-defined recipe planned."""
from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from lowprec import recipes as R
from lowprec.plan.memory import Parallel, Training, memory_per_gpu, stage_memory
from lowprec.plan.models import ModelSpec
from lowprec.plan.planner import PlanConfig, plan
from lowprec.plan.recipes import RECIPES, ROW, TENSOR, cost_of, gemm_format, get_recipe, storage_of
from lowprec.policy import Policy
from lowprec.quant import blockwise, columnwise, mx, nvfp4, quantize, rowwise, tensorwise

K, N = 4096, 1024  # a weight (N, K) reduced over K
INF = float("inf")  # activations are counted per token, so a per-tensor scale costs nothing

# (weight bytes/element, saved-input bytes/element, gemms) written out from each preset's casts
BY_HAND = {
    "bf16": (None, 2, ("bf16",) * 3),
    "fp16": (None, 2, ("fp16",) * 3),
    "fp8-delayed": (1 + 4 / (K * N), 1, ("fp8",) * 3),
    "fp8-current": (1 + 4 / (K * N), 1, ("fp8",) * 3),
    "fp8-rowwise": (1 + 4 / K, 1 + 4 / K, ("fp8",) * 3),
    "fp8-blockwise": (1 + 4 / (128 * 128), 1 + 4 / 128, ("fp8",) * 3),
    "mxfp8": (1 + 1 / 32, 1 + 1 / 32, ("mxfp8",) * 3),
    # FP4 forward, but the wgrad input cast is MXFP8 E4M3 in blocks of 32: 1 + 1/32 saved, not 0.5 + 1/32
    "mxfp4": (0.5 + 1 / 32, 1 + 1 / 32, ("mxfp4", "mxfp8", "mxfp8")),
    # weights in 16x16 tiles (one E4M3 per 256), activations in 1x16 blocks
    "nvfp4": (0.5 + 1 / 256, 0.5 + 1 / 16, ("nvfp4",) * 3),
}


@pytest.mark.parametrize("name", R.names())
def test_every_preset_costs_what_its_casts_say(name):
    weight, saved, gemms = BY_HAND[name]
    cost = get_recipe(name)
    assert cost == RECIPES[name] and cost.name == name and cost.gemms == gemms
    assert (cost.weight is None) == (weight is None) == (not cost.quantizes)
    if weight is not None:
        assert cost.weight.bytes_per_element(K, K * N) == pytest.approx(weight, rel=1e-12)
    assert cost.saved_input.bytes_per_element(K, INF) == pytest.approx(saved, rel=1e-12)
    # no preset rounds weight.T stochastically: backward casts it again rather than keep forward's
    assert cost.weight_t_saved is False
    assert cost.note == " ".join(R.get(name).doc.split("\n\n")[0].split())


@pytest.mark.parametrize("name", [n for n in R.names() if R.get(n).low_precision])
@pytest.mark.parametrize("role", ["fprop.weight", "wgrad.input", "wgrad.grad_output"])
def test_storage_equals_the_bytes_a_quantized_tensor_reports(name, role):
    cast = R.get(name).casts()[role]
    x = torch.randn(256, 512)  # (rows, K): a whole number of every preset's blocks
    q = quantize(x, cast.format, cast.granularity)
    global_scale = 4 if q.global_scale is not None else 0  # NVFP4's one FP32 per tensor: not planned
    assert storage_of(cast).bytes_per_element(512, x.numel()) * x.numel() == q.nbytes - global_scale


@pytest.mark.parametrize("lhs, rhs, expected", [
    (R.Cast(format="e2m1", granularity=mx(32)), R.Cast(format="e4m3", granularity=mx(32)), "mxfp8"),
    (R.Cast(format="e3m2", granularity=mx(32)), R.Cast(format="e2m1", granularity=mx(32)), "mxfp6"),
    (R.Cast(format="e2m3", granularity=mx(32)), R.Cast(format="e2m3", granularity=mx(32)), "mxfp6"),
    (R.Cast(format="e2m1", granularity=nvfp4(16)), R.Cast(format="e5m2", granularity=tensorwise()), "fp8"),
    (R.Cast(format="e4m3", granularity=blockwise(1, 128)), R.Cast(format="e5m2", granularity=columnwise()), "fp8"),
    (R.Cast(format="e4m3", granularity=rowwise()), R.Cast(format=None), "bf16"),  # one side high precision
    (R.Cast(format="fp16"), R.Cast(format="e4m3", granularity=tensorwise()), "fp16"),
    (R.Cast(format="fp16"), R.Cast(format=None), "bf16"),
])
def test_a_gemm_of_mixed_operands_runs_at_the_wider_format(lhs, rhs, expected):
    assert gemm_format(R.Gemm(lhs=lhs, rhs=rhs)) == expected


def test_whole_dimension_granularities_map_to_tensor_row_and_column():
    assert storage_of(R.Cast(format="e4m3", granularity=tensorwise())).scale_every == TENSOR
    assert storage_of(R.Cast(format="e4m3", granularity=rowwise())).scale_every == ROW
    col = storage_of(R.Cast(format="e5m2", granularity=columnwise()))
    assert col.bytes_per_element(K, K * N) == 1 + 4 / N  # one FP32 per column of N rows
    assert storage_of(R.Cast(format=None)).bytes_per_element(K, K * N) == 2


TINY = ModelSpec(name="tiny", vocab=100, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=16, ffn=128)


def _user_recipe() -> R.Recipe:
    fwd = R.Cast(format="e4m3", granularity=rowwise())
    bwd = R.Cast(format="e5m2", granularity=tensorwise())
    return R.Recipe(name="rowwise-fwd-e5m2-bwd", fprop=R.Gemm(lhs=fwd, rhs=fwd), dgrad=R.Gemm(lhs=bwd, rhs=bwd),
                    wgrad=R.Gemm(lhs=bwd, rhs=bwd))


def _tiny_parts(cost, **train) -> dict[str, float]:
    mem = memory_per_gpu(TINY, cost, Parallel(gpus=1), Training(seq=8, overhead_gb=0.0, fragmentation=0.0, **train))
    return {c.name: c.bytes for c in mem.components}


# TINY's linears, d_out x d_in: q 64x64, k 32x64, v 32x64, o 64x64, gate 128x64, up 128x64, down 64x128
TINY_NUMEL = 64 * 64 * 2 + 32 * 64 * 2 + 128 * 64 * 3
TINY_ROWS = 64 + 32 + 32 + 64 + 128 + 128 + 64  # their d_out: one row-wise scale per output row


def test_a_user_recipe_plans_with_hand_computed_bytes():
    cost = cost_of(_user_recipe())
    assert cost.gemms == ("fp8",) * 3 and cost.note == _user_recipe().summary()
    parts = _tiny_parts(cost)
    # Without accumulation one layer's casts at a time, the largest: gate (or up) forward, rowwise
    # E4M3, 8192 bytes + 128 FP32 row scales; down's transposed E5M2 per tensor, 8192 + one FP32 scale.
    assert parts["weight casts (rowwise-fwd-e5m2-bwd), one layer at a time"] == (8192 + 4 * 128) + (8192 + 4)
    # Under accumulation every layer's (2 layers): forward 1 byte per element + a scale per output
    # row; transposed 1 byte per element + one scale per weight (7 per layer).
    held = _tiny_parts(cost, grad_accum=3)
    assert held["low-precision weight copy (rowwise-fwd-e5m2-bwd)"] == 2 * (TINY_NUMEL + 4 * TINY_ROWS)
    assert held["transposed weight copy (rowwise-fwd-e5m2-bwd)"] == 2 * (TINY_NUMEL + 4 * 7)
    # Saved inputs, E5M2 per tensor: 1 byte per element per token (one scale per tensor is nothing per
    # token): q/k/v input 64 + a copy of the attention output 64; gate/up input 64 + down input 128.
    tokens = 8
    attn_core = (64 + 64 + 32 + 32 + 64) * 2 + 4 * 4
    mlp_core = (64 + 2 * 128) * 2
    assert parts["activations: attention"] == 2 * tokens * (attn_core + 64 + 64)
    assert parts["activations: mlp"] == 2 * tokens * (mlp_core + 64 + 128)


def test_a_stochastically_rounded_weight_transpose_is_saved_per_micro_batch_in_flight():
    c = R.Cast(format="e4m3", granularity=tensorwise())
    sr = replace(c, rounding="stochastic")
    recipe = R.Recipe(name="sr-dgrad", fprop=R.Gemm(lhs=c, rhs=c), dgrad=R.Gemm(lhs=c, rhs=sr),
                      wgrad=R.Gemm(lhs=c, rhs=c))
    cost = cost_of(recipe)
    assert cost.weight_t_saved
    one_layer = TINY_NUMEL + 4 * 7  # 1 byte per element + one FP32 scale per weight
    for stage, in_flight in ((0, 2), (1, 1)):  # a 1F1B pipeline of 2 stages, one layer each
        mem = stage_memory(TINY, cost, Parallel(gpus=2, pp=2), Training(seq=8, overhead_gb=0.0), stage)
        parts = {x.name: x.bytes for x in mem.components}
        assert parts["transposed weight copy (sr-dgrad)"] == in_flight * one_layer
        # only the forward cast is transient: the largest, gate's 8192 bytes + one scale
        assert parts["weight casts (sr-dgrad), one layer at a time"] == 8192 + 4
    held = _tiny_parts(cost, grad_accum=2)  # the cached cast is saved once, whatever is in flight
    assert held["transposed weight copy (sr-dgrad)"] == 2 * one_layer


def test_plan_accepts_a_user_recipe_object():
    # on an A100 the FP8 GEMMs are emulated, so the small-layer rule does not apply: the tiny linears take it
    p = plan(PlanConfig(model=TINY, recipe=_user_recipe(), gpu="a100", gpus=1))
    assert p.recipe == cost_of(_user_recipe())
    assert {t.gemm for t in p.flops if t.name.startswith("linears")} == {"fp8"}


def test_the_plan_keeps_small_linears_in_bf16_where_the_gemms_run_on_tensor_cores():
    """The default policy's small-layer rule, as convert applies it on the device: on an H100 (FP8 tensor
    cores) every linear of the tiny model has a dimension under 1024 and stays in BF16, in the FLOPs and in
    memory; on an A100 (emulated) they all take the recipe."""
    h100 = plan(PlanConfig(model=TINY, recipe=_user_recipe(), gpu="h100", gpus=1))
    assert h100.recipe == replace(cost_of(_user_recipe()), min_features=Policy().min_features)
    assert not any(t.name.startswith("linears:") for t in h100.flops)
    a100 = plan(PlanConfig(model=TINY, recipe=_user_recipe(), gpu="a100", gpus=1))
    assert a100.params.quantized > 0 and a100.recipe.min_features is None and h100.params.quantized == 0
    small = [t for t in h100.flops if t.name.startswith("linears with a dimension under 1024")]
    assert len(small) == 1 and small[0].gemm == "bf16" and small[0].flops == 6 * a100.params.quantized_active
    bf16 = plan(PlanConfig(model=TINY, recipe="bf16", gpu="h100", gpus=1)).memory.components
    assert {x.name: x.bytes for x in h100.memory.components if x.bytes} == {x.name: x.bytes for x in bf16 if x.bytes}
    bf16 = plan(PlanConfig(model=TINY, recipe="bf16", gpu="h100", gpus=1))
    assert bf16.recipe.min_features is None


def test_unknown_and_wrong_type_recipes_are_refused():
    with pytest.raises(ValueError, match=r"recipe: expected one of bf16, .*nvfp4 .*, got 'nosuch'"):
        get_recipe("nosuch")
    with pytest.raises(TypeError, match="recipe: expected a recipe name or lowprec.recipes.Recipe, got 3 "):
        get_recipe(3)
    with pytest.raises(TypeError, match="recipe: expected a lowprec.recipes.Recipe, got 'bf16'"):
        cost_of("bf16")
