"""Parameter counts of the model presets, against published figures and hand-written formulas."""
from __future__ import annotations

import pytest

from lowprec.plan.layers import count_params
from lowprec.plan.models import PRESETS, ModelSpec, MoESpec, all_presets, get_model


# Parameter counts as the model cards / safetensors indexes state them.
@pytest.mark.parametrize("name, published", [
    ("llama-2-7b", 6_738_415_616),
    ("llama-3-8b", 8_030_261_248),
    ("llama-3-70b", 70_553_706_496),
    ("llama-3-405b", 405_853_388_800),
    ("mixtral-8x7b", 46_702_792_704),
    # the published 30,532,122,624 includes Qwen3's per-head q/k norms (2 x 128 per layer), left out here
    ("qwen3-30b-a3b", 30_532_122_624 - 48 * 2 * 128),
])
def test_dense_and_moe_presets_match_published_counts(name, published):
    assert count_params(PRESETS[name]).total == published


def _deepseek_v3_by_hand() -> tuple[int, int]:
    d, layers, vocab = 7168, 61, 129280
    attention = (d * 1536 + 1536 * 128 * (128 + 64) + d * (512 + 64) + 512 * 128 * (128 + 128)
                 + 128 * 128 * d + 2 * d + 1536 + 512)
    expert = 3 * d * 2048
    moe_layer = 256 * expert + expert + d * 256  # routed + shared + router
    dense_layer = 3 * d * 18432
    total = layers * attention + 3 * dense_layer + 58 * moe_layer + 2 * vocab * d + d
    active = layers * attention + 3 * dense_layer + 58 * (9 * expert + d * 256) + 2 * vocab * d + d
    return total, active


def test_deepseek_v3_total_and_active_parameters():
    counts = count_params(PRESETS["deepseek-v3"])
    total, active = _deepseek_v3_by_hand()
    assert (counts.total, counts.active) == (total, active)
    assert counts.total == pytest.approx(671e9, rel=2e-3)  # "671B total, 37B activated" (arXiv 2412.19437)
    assert counts.active == pytest.approx(37e9, rel=0.02)


def test_moe_active_excludes_unused_experts_only():
    m = PRESETS["qwen3-30b-a3b"]
    c = count_params(m)
    unused = 48 * (128 - 8) * 3 * 2048 * 768
    assert c.total - c.active == unused


def test_reference_presets_agree_with_the_trainers_own_count():
    from lowprec.train.model import PRESETS as TRAIN

    presets = all_presets()
    for key, cfg in TRAIN.items():
        assert count_params(presets[f"ref-{key}"]).total == cfg.num_params(), key


def test_tied_embeddings_count_the_table_once():
    untied = ModelSpec(name="t", vocab=1000, d_model=64, n_layers=2, n_heads=4, n_kv_heads=4, head_dim=16, ffn=128)
    tied = ModelSpec(name="t", vocab=1000, d_model=64, n_layers=2, n_heads=4, n_kv_heads=4, head_dim=16, ffn=128,
                     tied_embeddings=True)
    assert count_params(untied).total - count_params(tied).total == 1000 * 64


def test_get_model_is_case_insensitive_and_names_the_choices():
    assert get_model("Llama-3-70B") is PRESETS["llama-3-70b"]
    with pytest.raises(ValueError, match=r"model: expected one of .*llama-3-8b.*got 'llama-9'"):
        get_model("llama-9")


@pytest.mark.parametrize("kwargs, match", [
    (dict(n_kv_heads=3), "n_kv_heads: expected a divisor of n_heads=4"),
    (dict(d_model=0), r"d_model: expected a positive int, got 0"),
])
def test_bad_shapes_are_refused(kwargs, match):
    base = dict(name="bad", vocab=10, d_model=64, n_layers=2, n_heads=4, n_kv_heads=4, head_dim=16, ffn=128)
    with pytest.raises(ValueError, match=match):
        ModelSpec(**{**base, **kwargs})


def test_moe_top_k_cannot_exceed_experts():
    with pytest.raises(ValueError, match="moe.top_k: expected at most n_experts=4, got 5"):
        MoESpec(n_experts=4, top_k=5, expert_ffn=8)
