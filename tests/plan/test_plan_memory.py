"""Memory per GPU: the textbook figures, hand-computed activations, ZeRO and TP/PP/EP splits, errors."""
from __future__ import annotations

import pytest

from lowprec.plan.layers import count_params
from lowprec.plan.memory import Parallel, Training, fewest_gpus, memory_per_gpu, stage_memory
from lowprec.plan.models import PRESETS, ModelSpec, MoESpec
from lowprec.plan.recipes import get_recipe

NO_OVERHEAD = dict(overhead_gb=0.0, fragmentation=0.0)
TINY = ModelSpec(name="tiny", vocab=100, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=16, ffn=128)


def _parts(model, recipe="bf16", *, gpus=1, tp=1, pp=1, ep=1, zero=0, stage=None, **train) -> dict[str, float]:
    m = PRESETS[model] if isinstance(model, str) else model
    par = Parallel(gpus=gpus, tp=tp, pp=pp, ep=ep, zero=zero)
    t = Training(**{**NO_OVERHEAD, **train})
    mem = memory_per_gpu(m, get_recipe(recipe), par, t) if stage is None else \
        stage_memory(m, get_recipe(recipe), par, t, stage)
    return {c.name: c.bytes for c in mem.components}


def test_textbook_70b_bf16_fp8_and_optimizer_bytes():
    p = count_params(PRESETS["llama-3-70b"]).total
    bf16 = _parts("llama-3-70b", "bf16")
    assert bf16["weights (bf16)"] == 2 * p  # 141 GB: "70B parameters take 140 GB in BF16"
    assert bf16["master weights (fp32)"] + bf16["optimizer moments (adamw)"] == 12 * p
    assert bf16["gradients (bf16)"] == 2 * p
    fp8 = _parts("llama-3-70b", "fp8-current", grad_accum=2)["low-precision weight copy (fp8-current)"]
    assert 68e9 < fp8 < 71e9  # "70 GB in FP8": the block linears, the BF16 embeddings and head excluded
    assert _parts("llama-3-70b", grad_dtype="fp32")["gradients (fp32)"] == 4 * p
    int8 = _parts("llama-3-70b", optim_states="int8")["optimizer moments (adamw, int8)"]
    assert 2 * p < int8 < 2.01 * p  # two 8-bit moments and one FP32 absmax per 2048 values


def test_deepseek_v3_fp8_weights_about_671_gb():
    fp8 = _parts("deepseek-v3", "fp8-blockwise", grad_accum=2)["low-precision weight copy (fp8-blockwise)"]
    assert fp8 == pytest.approx(671e9, rel=0.005)


def _block_linears_by_hand_llama2() -> list[tuple[int, int]]:
    """(d_in, d_out) of one Llama-2-7B block."""
    d, f = 4096, 11008
    return [(d, d)] * 4 + [(d, f)] * 2 + [(f, d)]


# Bytes per element of a d_out x d_in weight's forward cast (reduced over k = d_in) and of its transposed
# cast (reduced over n = d_out), by hand from each preset's fprop.rhs and dgrad.rhs; ``numel`` = k * n.
WEIGHT_CASTS = {
    "mxfp8": (lambda k, n: 1 + 1 / 32, lambda k, n: 1 + 1 / 32),
    # FP4 forward weights; the data-gradient GEMM takes the weight as MXFP8
    "mxfp4": (lambda k, n: 0.5 + 1 / 32, lambda k, n: 1 + 1 / 32),
    # NVFP4 weights are quantized in 16x16 tiles (nvfp4(16, two_d=True)): one E4M3 scale per 256, both ways
    "nvfp4": (lambda k, n: 0.5 + 1 / 256, lambda k, n: 0.5 + 1 / 256),
    "fp8-rowwise": (lambda k, n: 1 + 4 / k, lambda k, n: 1 + 4 / n),
    "fp8-current": (lambda k, n: 1 + 4 / (k * n), lambda k, n: 1 + 4 / (k * n)),
    "fp8-blockwise": (lambda k, n: 1 + 4 / (128 * 128), lambda k, n: 1 + 4 / (128 * 128)),
}


# Llama-2-7B's 32 blocks that take the recipe: NVFP4's policy keeps the last ceil(0.15 x 32) = 5 in BF16
QUANTIZED_BLOCKS = {"nvfp4": 27}


@pytest.mark.parametrize("recipe", WEIGHT_CASTS)
def test_under_grad_accumulation_both_casts_of_every_layer_are_held(recipe):
    fwd, t = WEIGHT_CASTS[recipe]
    parts = _parts("llama-2-7b", recipe, grad_accum=4)
    layers, blocks = _block_linears_by_hand_llama2(), QUANTIZED_BLOCKS.get(recipe, 32)
    assert parts[f"low-precision weight copy ({recipe})"] == pytest.approx(
        blocks * sum(k * n * fwd(k, n) for k, n in layers), rel=1e-12)
    assert parts[f"transposed weight copy ({recipe})"] == pytest.approx(
        blocks * sum(k * n * t(k, n) for k, n in layers), rel=1e-12)
    assert not any(name.startswith("weight casts") for name in parts)


@pytest.mark.parametrize("recipe", WEIGHT_CASTS)
def test_without_grad_accumulation_one_layers_casts_are_alive_at_a_time(recipe):
    # the largest Llama-2-7B linears (gate, up, down) are 4096 x 11008; down has k = 11008
    fwd, t = WEIGHT_CASTS[recipe]
    shapes = [(4096, 11008), (11008, 4096)]
    expected = max(k * n * fwd(k, n) for k, n in shapes) + max(k * n * t(k, n) for k, n in shapes)
    parts = _parts("llama-2-7b", recipe)
    assert parts[f"weight casts ({recipe}), one layer at a time"] == pytest.approx(expected, rel=1e-12)
    assert parts[f"weight casts ({recipe}), one layer at a time"] < 0.1e9  # not 32 layers' worth (GBs)
    assert f"low-precision weight copy ({recipe})" not in parts and f"transposed weight copy ({recipe})" not in parts


def test_the_transient_casts_are_one_tensor_parallel_shard_and_one_expert():
    name = "weight casts (fp8-current), one layer at a time"
    tp = _parts("llama-2-7b", "fp8-current", gpus=8, tp=8)[name]
    assert tp == pytest.approx(2 * (4096 * 11008 / 8 + 4), rel=1e-12)
    # Mixtral: an expert's 4096 x 14336 weight is the largest, whichever rank holds it and however many
    moe = _parts("mixtral-8x7b", "fp8-current", gpus=8, ep=8)[name]
    assert moe == pytest.approx(2 * (4096 * 14336 + 4), rel=1e-12)


def test_bf16_keeps_no_weight_cast():
    for grad_accum in (1, 4):
        parts = _parts("llama-2-7b", "bf16", grad_accum=grad_accum)
        assert parts["low-precision weight copy"] == 0
        assert not any("cast" in name or "transposed" in name for name in parts)


def test_zero_stages_shard_what_they_promise():
    p = count_params(PRESETS["llama-2-7b"]).total
    names = ["weights (bf16)", "gradients (bf16)", "master weights (fp32)", "optimizer moments (adamw)"]
    full = _parts("llama-2-7b", "mxfp8", gpus=8, grad_accum=2)
    for zero, sharded in [(0, set()), (1, set(names[2:])), (2, set(names[1:])), (3, set(names))]:
        parts = _parts("llama-2-7b", "mxfp8", gpus=8, zero=zero, grad_accum=2)
        for name in names:
            assert parts[name] == pytest.approx(full[name] / (8 if name in sharded else 1)), (zero, name)
        # a layer casts the weight it computes with, the gathered one under ZeRO-3: never sharded
        for name in ("low-precision weight copy (mxfp8)", "transposed weight copy (mxfp8)"):
            assert parts[name] == full[name] > 0, (zero, name)
    assert full["master weights (fp32)"] == 4 * p


def test_tensor_parallel_splits_block_linears_and_vocabulary_not_norms():
    m = PRESETS["llama-3-70b"]
    c = count_params(m)
    local = _parts("llama-3-70b", gpus=8, tp=8)["weights (bf16)"] / 2
    assert local == (c.quantized + 2 * m.vocab * m.d_model) / 8 + c.norms


def test_key_value_heads_replicate_when_tp_exceeds_them():
    m = PRESETS["llama-3-70b"]  # 64 query heads, 8 key/value heads
    c = count_params(m)
    kv = 80 * 2 * 8192 * 1024
    local = _parts("llama-3-70b", gpus=16, tp=16)["weights (bf16)"] / 2
    assert local == (c.quantized - kv + 2 * m.vocab * m.d_model) / 16 + kv / 8 + c.norms


def test_pipeline_stages_split_layers_with_embedding_first_and_head_last():
    m = PRESETS["llama-2-7b"]
    layer = sum(k * n for k, n in _block_linears_by_hand_llama2()) + 2 * 4096
    table = 32000 * 4096
    first = _parts("llama-2-7b", gpus=2, pp=2, stage=0)["weights (bf16)"] / 2
    last = _parts("llama-2-7b", gpus=2, pp=2, stage=1)["weights (bf16)"] / 2
    assert (first, last) == (16 * layer + table, 16 * layer + table + 4096)
    assert first + last == count_params(m).total


def test_expert_parallel_splits_routed_experts_only():
    m = PRESETS["mixtral-8x7b"]
    c = count_params(m)
    experts = 32 * 8 * 3 * 4096 * 14336
    local = _parts("mixtral-8x7b", gpus=8, ep=8)["weights (bf16)"] / 2
    assert local == c.total - experts + experts / 8
    # ZeRO-1 then shards the experts' optimizer states over dp / ep = 2, the rest over dp = 16
    moments = _parts("mixtral-8x7b", gpus=16, ep=8, zero=1)["optimizer moments (adamw)"]
    assert moments == pytest.approx(8 * ((c.total - experts) / 16 + experts / 8 / 2))


# Bytes per token of one TINY block (d 64, 4 heads of 16, 2 kv heads, ffn 128), written out by hand:
# attention: residual 64, q 64, k 32, v 32, out 64 (bf16) + log-sum-exp 4 (fp32), then the q/k/v input 64
#            in the recipe's format, and, for a quantizing recipe, a quantized copy of out (64)
# mlp:       residual 64, gate and up outputs 2 x 128 (bf16), then the gate/up input 64 and down input 128
ATTN_CORE = (64 + 64 + 32 + 32 + 64) * 2 + 4 * 4
MLP_CORE = (64 + 2 * 128) * 2


@pytest.mark.parametrize("recipe, lp", [
    ("bf16", 2), ("fp8-current", 1), ("mxfp8", 1 + 1 / 32), ("nvfp4", 0.5 + 1 / 16),
    # mxfp4 saves its input as the wgrad GEMM's MXFP8 cast (E4M3 + one E8M0 per 32), not as FP4
    ("mxfp4", 1 + 1 / 32),
])
def test_activations_by_hand(recipe, lp):
    tokens = 8 * 2
    parts = _parts(TINY, recipe, seq=8, micro_batch=2)
    extra_out = 0 if recipe == "bf16" else 64 * lp
    # NVFP4 keeps the last ceil(0.15 x 2) = 1 of TINY's 2 blocks in BF16: its linears save BF16 inputs
    q, hp = (1, 1) if recipe == "nvfp4" else (2, 0)
    assert parts["activations: attention"] == pytest.approx(
        q * tokens * (ATTN_CORE + 64 * lp + extra_out) + hp * tokens * (ATTN_CORE + 64 * 2))
    assert parts["activations: mlp"] == pytest.approx(
        q * tokens * (MLP_CORE + (64 + 128) * lp) + hp * tokens * (MLP_CORE + (64 + 128) * 2))
    assert parts["activations: output"] == tokens * ((64 + 64) * 2 + 100 * 4)


def test_selective_and_full_recompute_by_hand():
    tokens = 16
    sel = _parts(TINY, "fp8-current", seq=16, recompute="selective")
    # selective keeps the GEMMs' outputs, the two projections' that a residual addition reads included
    # (BF16, 64 each), and recomputes the residual sum the second norm reads (64, BF16)
    attn, mlp = ATTN_CORE + 64 * 2, MLP_CORE - 64 * 2 + 64 * 2
    assert (sel["activations: attention"], sel["activations: mlp"]) == (2 * tokens * attn, 2 * tokens * mlp)
    full = _parts(TINY, "fp8-current", seq=16, recompute="full")
    assert full["activations: layer inputs"] == 2 * tokens * 64 * 2
    one_block = ATTN_CORE + 64 + 64 + MLP_CORE + 64 + 128
    assert full["activations: recomputed block"] == tokens * one_block


def test_pipeline_in_flight_micro_batches_and_sequence_parallel_split():
    base = _parts(TINY, seq=16)["activations: mlp"]
    assert _parts(TINY, gpus=2, pp=2, seq=16, stage=0)["activations: mlp"] == base  # 2 in flight x 1 layer
    assert _parts(TINY, gpus=2, pp=2, seq=16, stage=1)["activations: mlp"] == base / 2
    assert _parts(TINY, gpus=2, tp=2, seq=16)["activations: mlp"] == base / 2


def test_lower_precision_and_recompute_never_grow_activations():
    def acts(recipe, recompute):
        return sum(v for k, v in _parts("llama-3-8b", recipe, recompute=recompute).items() if "activ" in k)
    for recompute in ("none", "selective", "full"):
        assert acts("fp8-current", recompute) <= acts("bf16", recompute)
        assert acts("nvfp4", recompute) <= acts("bf16", recompute)
    # NVFP4 rebuilds one of its BF16 blocks at a time under full recomputation, so only without it is it
    # below FP8 (its 15% BF16 blocks save more than the FP4 ones save)
    assert acts("nvfp4", "none") <= acts("fp8-current", "none")
    assert acts("bf16", "full") < acts("bf16", "selective") < acts("bf16", "none")


def test_moe_activations_count_top_k_copies():
    moe = ModelSpec(name="m", vocab=100, d_model=64, n_layers=1, n_heads=4, n_kv_heads=4, head_dim=16, ffn=128,
                    moe=MoESpec(n_experts=4, top_k=2, expert_ffn=32))
    parts = _parts(moe, "fp8-current", seq=1)
    # residual 64 + router input 64 (bf16: the router stays high precision) + probs 4 (fp32)
    # + top-2 x (gate, up 2 x 32 + expert output 64) (bf16) + top-2 x (input 64 + hidden 32) (fp8)
    assert parts["activations: moe"] == (64 + 64) * 2 + 4 * 4 + 2 * (64 + 64) * 2 + 2 * (64 + 32)


def test_fewest_gpus_is_the_smallest_count_that_fits():
    m, r, t = PRESETS["llama-3-70b"], get_recipe("fp8-current"), Training()
    n = fewest_gpus(m, r, 80, t, tp=8, zero=3)
    total = lambda g: memory_per_gpu(m, r, Parallel(gpus=g, tp=8, zero=3), t).total  # noqa: E731
    assert total(n) <= 80e9 < total(n - 8)
    assert fewest_gpus(m, r, 80, t, zero=0) is None  # without sharding nothing changes with more GPUs


@pytest.mark.parametrize("kwargs, match", [
    (dict(tp=3), "tp: expected a divisor of the 64 attention heads of llama-3-70b, got 3"),
    (dict(gpus=8, ep=2), "ep: expected 1 for a dense model of llama-3-70b, got 2"),
    (dict(gpus=6, tp=4), "gpus: expected a multiple of tp x pp = 4, got 6"),
    (dict(zero=4), "zero: expected one of 0, 1, 2, 3, got 4"),
    (dict(gpus=81, pp=81), "pp: expected at most the 80 layers of llama-3-70b, got 81"),
])
def test_bad_layouts_are_refused(kwargs, match):
    with pytest.raises(ValueError, match=match):
        _parts("llama-3-70b", **{"gpus": kwargs.get("tp", 1), **kwargs})


@pytest.mark.parametrize("kwargs, match", [
    (dict(recompute="some"), "recompute: expected one of 'none', 'selective', 'full', got 'some'"),
    (dict(seq=0), "seq: expected a positive int, got 0"),
    (dict(optimizer="sgd"), "optimizer: expected one of 'adamw', got 'sgd'"),
    (dict(grad_accum=0), "grad_accum: expected a positive int, got 0"),
])
def test_bad_training_settings_are_refused(kwargs, match):
    with pytest.raises(ValueError, match=match):
        Training(**kwargs)
