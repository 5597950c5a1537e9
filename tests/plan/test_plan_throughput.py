"""FLOPs per token by GEMM format, native vs emulated peaks, and time, days and cost."""
from __future__ import annotations

import pytest

from lowprec.plan.gemm_paths import Path
from lowprec.plan.gpus import GPUS
from lowprec.plan.layers import count_params
from lowprec.plan.memory import Training
from lowprec.plan.models import PRESETS
from lowprec.plan.planner import PlanConfig, plan
from lowprec.plan.recipes import get_recipe
from lowprec.plan.throughput import flop_terms, throughput


def test_llama2_7b_flops_by_hand():
    s, d, layers, vocab = 4096, 4096, 32, 32000
    block = 4 * d * d + 3 * d * 11008
    expected = 6 * layers * block + 6 * vocab * d + 12 * layers * d * s  # 6N (no input table) + PaLM attention
    terms = flop_terms(PRESETS["llama-2-7b"], get_recipe("bf16"), GPUS["h100"], s, "none")
    assert sum(t.flops for t in terms) == expected
    # the same as 6 x (all parameters - input embedding - norms) + attention
    c = count_params(PRESETS["llama-2-7b"])
    assert expected == 6 * (c.total - c.embedding - c.norms) + 12 * layers * d * s


def test_bf16_tokens_per_second_is_gpus_mfu_peak_over_flops():
    p = plan(PlanConfig(model="llama-2-7b", recipe="bf16", gpu="h100", gpus=8, mfu=0.5, tokens=1e12,
                        price_per_gpu_hour=2.0, training=Training(seq=4096)))
    flops = p.throughput.model_flops_per_token
    tps = 8 * 0.5 * 989e12 / flops
    assert p.throughput.tokens_per_s == pytest.approx(tps)
    assert p.throughput.effective_peak_tflops == pytest.approx(989)
    assert p.throughput.days == pytest.approx(1e12 / tps / 86400)
    assert p.throughput.cost == pytest.approx(1e12 / tps / 3600 * 8 * 2.0)
    assert p.throughput.step_s == pytest.approx(4096 * 8 / tps)  # one micro-batch per rank


@pytest.mark.parametrize("gpus, pp, grad_accum, micro_batches", [
    (8, 1, 1, 1), (8, 1, 4, 4),
    (8, 4, 1, 4),  # a 1F1B pipeline runs at least pp micro-batches per step
    (8, 4, 2, 4), (8, 2, 6, 6),
])
def test_a_step_is_grad_accum_micro_batches_per_data_parallel_rank(gpus, pp, grad_accum, micro_batches):
    p = plan(PlanConfig(model="llama-2-7b", gpu="h100", gpus=gpus, pp=pp,
                        training=Training(seq=2048, micro_batch=2, grad_accum=grad_accum)))
    assert p.throughput.tokens_per_step == 2048 * 2 * (gpus // pp) * micro_batches


NATIVE, EMULATED, FOLDED = Path.NATIVE, Path.EMULATED, Path.FOLDED


# (format, peak, path, emulated in) of fprop, dgrad, wgrad, as the kernels decide on each row: FP8 on
# FP8 tensor cores (DeepSeek blocks on Hopper only; torch reports gfx942 as 9.4), MX and NVFP4 emulated
# everywhere, in BF16 on CUDA (exact there) and FP32 elsewhere or where FP32 block scales are not exact.
@pytest.mark.parametrize("recipe, gpu, expected", [
    ("nvfp4", "h100", [("nvfp4", 989, EMULATED, "bf16")] * 3),
    ("nvfp4", "b200", [("nvfp4", 9000, NATIVE, None)] * 3),  # block-scaled tensor cores, checked on first use
    ("mxfp4", "b200", [("mxfp4", 9000, NATIVE, None)] + [("mxfp8", 4500, NATIVE, None)] * 2),
    ("fp8-rowwise", "a100", [("fp8", 312, EMULATED, "bf16")] * 3),
    ("fp8-blockwise", "h100", [("fp8", 1979, NATIVE, None)] * 3),
    ("fp8-blockwise", "b200", [("fp8", 80, EMULATED, "fp32")] * 3),
    ("fp8-current", "b200", [("fp8", 4500, NATIVE, None)] * 3),
    ("fp8-current", "mi300x", [("fp8", 2614.9, NATIVE, None)] * 3),
    ("nvfp4", "mi355x", [("nvfp4", 2516.6, EMULATED, "bf16")] * 3),
    ("mxfp4", "mi355x", [("fp8", 5033.2, FOLDED, None)] * 3),  # MX folded to row scales: FP8 tensor cores
    ("mxfp8", "h100", [("fp8", 1979, FOLDED, None)] * 3),
    ("mxfp8", "gaudi3", [("mxfp8", 1835, EMULATED, "fp32")] * 3),  # no FP32 peak listed: the BF16 one
])
def test_each_gemm_runs_at_its_formats_peak_or_as_emulated(recipe, gpu, expected):
    terms = {t.name: t for t in flop_terms(PRESETS["llama-3-8b"], get_recipe(recipe), GPUS[gpu], 4096, "none")}
    linears = [terms[f"linears: {g}"] for g in ("fprop", "dgrad", "wgrad")]
    assert [(t.gemm, t.tflops, t.path, t.emulated_in) for t in linears] == expected
    assert all((t.cast_bytes > 0) == (t.path in (EMULATED, FOLDED)) for t in linears)
    assert terms["attention scores and values"].gemm == "bf16"


def test_blended_peak_between_bf16_and_fp8():
    terms = flop_terms(PRESETS["llama-3-8b"], get_recipe("fp8-current"), GPUS["h100"], 8192, "none")
    t = throughput(terms, gpus=1, mfu=1.0, tokens_per_step=8192)
    assert 989 < t.effective_peak_tflops < 1979
    by_hand = t.model_flops_per_token / sum(x.flops / (x.tflops * 1e12) for x in terms) / 1e12
    assert t.effective_peak_tflops == pytest.approx(by_hand)


def test_moe_flops_use_active_parameters():
    terms = flop_terms(PRESETS["deepseek-v3"], get_recipe("bf16"), GPUS["h100"], 4096, "none")
    linears = sum(t.flops for t in terms if t.name.startswith("linears"))
    c = count_params(PRESETS["deepseek-v3"])
    assert linears == 6 * c.quantized_active
    assert 6 * 35e9 < linears < 6 * 37e9  # 37B active minus embeddings, head and routers


def test_full_recompute_adds_a_forward_but_not_model_flops():
    m, r, g = PRESETS["llama-3-8b"], get_recipe("fp8-current"), GPUS["h100"]
    none = flop_terms(m, r, g, 4096, "none")
    full = flop_terms(m, r, g, 4096, "full")
    extra = sum(t.flops for t in full if t.recompute)
    attn_fwd = 2 * 4096 * 32 * (128 + 128) * 32
    assert extra == 2 * count_params(m).quantized_active + attn_fwd
    t_none = throughput(none, gpus=1, mfu=0.4, tokens_per_step=1)
    t_full = throughput(full, gpus=1, mfu=0.4, tokens_per_step=1)
    assert t_full.model_flops_per_token == t_none.model_flops_per_token
    assert t_full.tokens_per_s < t_none.tokens_per_s
    assert flop_terms(m, r, g, 4096, "selective") == none


@pytest.mark.parametrize("kwargs, match", [
    (dict(tokens=-1.0), "tokens: expected a positive finite number, got -1.0"),
    (dict(tokens=float("inf")), "tokens: expected a positive finite number"),
    (dict(mfu=1.5), "mfu: expected a fraction in"),
    (dict(mfu=0.0), "mfu: expected a positive finite number"),
    (dict(price_per_gpu_hour=-2.0), "price_per_gpu_hour: expected a non-negative finite number"),
    (dict(gpus=0), "gpus: expected a positive int, got 0"),
    (dict(gpu="h300"), "gpu: expected one of a100, h100, .*, got 'h300'"),
    (dict(recipe="fp3"), "recipe: expected one of bf16, .*mxfp4, nvfp4 .*, got 'fp3'"),
])
def test_bad_plan_settings_are_refused(kwargs, match):
    with pytest.raises(ValueError, match=match):
        plan(PlanConfig(model="llama-2-7b", **kwargs))


def test_nvfp4s_last_blocks_run_bf16_gemms():
    block = 4 * 4096 * 4096 + 3 * 4096 * 11008  # one Llama-2-7B block's linears
    terms = {t.name: t for t in flop_terms(PRESETS["llama-2-7b"], get_recipe("nvfp4"), GPUS["h100"], 4096, "none")}
    # the policy keeps the last ceil(0.15 x 32) = 5 blocks in BF16; the other 27 take NVFP4
    kept = terms["linears of the last 5 blocks (bf16 by policy)"]
    assert (kept.flops, kept.gemm, kept.tflops) == (6 * 5 * block, "bf16", 989)
    assert all(terms[f"linears: {g}"].flops == 2 * 27 * block for g in ("fprop", "dgrad", "wgrad"))
    assert not any(t.name.startswith("linears of the last") for t in flop_terms(
        PRESETS["llama-2-7b"], get_recipe("fp8-current"), GPUS["h100"], 4096, "none"))
