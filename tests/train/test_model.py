import math

import pytest
import torch
import torch.nn.functional as F

from lowprec.nn import GroupedLinear
from lowprec.train.model import (
    PRESETS,
    Attention,
    ModelConfig,
    RMSNorm,
    Transformer,
    apply_rope,
    build_model,
    preset,
    rope_tables,
)

TINY = PRESETS["tiny"]


def test_tiny_is_one_to_five_million_parameters_and_count_matches_model():
    model = build_model(TINY)
    n = sum(p.numel() for p in model.parameters())
    assert n == TINY.num_params()
    assert 1_000_000 <= n <= 5_000_000


@pytest.mark.parametrize("name", list(PRESETS))
def test_every_linear_of_every_preset_tiles_into_32_blocks(name):
    with torch.device("meta"):
        model = Transformer(PRESETS[name])
    assert sum(p.numel() for p in model.parameters()) == PRESETS[name].num_params()
    names = dict(model.named_modules())
    # a MoE block's router (one output per expert) stays in high precision by policy: it need not tile
    linears = [m for n, m in names.items() if isinstance(m, (torch.nn.Linear, GroupedLinear))
               and not n.endswith(".router")]
    moe = PRESETS[name].moe
    per_block = 7 + (3 if moe is not None and moe.n_shared else 0)  # attention, feed-forward or experts, shared
    assert len(linears) == per_block * PRESETS[name].n_layers + 1
    for m in linears:
        assert m.in_features % 32 == 0 and m.out_features % 32 == 0


def test_preset_counts_grow_in_order():
    sizes = [PRESETS[n].num_params() for n in ("tiny", "small", "125m", "350m", "1b")]
    assert sizes == sorted(sizes)


def test_lm_head_and_embeddings_have_the_policy_names():
    names = dict(build_model(TINY).named_modules())
    assert isinstance(names["output"], torch.nn.Linear)
    assert isinstance(names["tok_embeddings"], torch.nn.Embedding)
    assert isinstance(names["layers.0.attention.wq"], torch.nn.Linear)
    assert isinstance(names["layers.3.feed_forward.w2"], torch.nn.Linear)


def test_rope_matches_complex_rotation():
    torch.manual_seed(0)
    x = torch.randn(2, 3, 7, 8)
    cos, sin = rope_tables(7, 8, 10000.0, torch.device("cpu"))
    # independent reference: pairs as complex numbers times e^{i m theta_j}
    theta = 1.0 / 10000.0 ** (torch.arange(0, 8, 2, dtype=torch.float64) / 8)
    rot = torch.polar(torch.ones(7, 4, dtype=torch.float64), torch.outer(torch.arange(7.0, dtype=torch.float64), theta))
    ref = torch.view_as_real(torch.view_as_complex(x.double().unflatten(-1, (-1, 2)).contiguous()) * rot).flatten(-2)
    torch.testing.assert_close(apply_rope(x, cos, sin).double(), ref, rtol=1e-5, atol=1e-5)
    # position 0 is not rotated; norms of pairs are preserved
    torch.testing.assert_close(apply_rope(x, cos, sin)[:, :, 0], x[:, :, 0], rtol=0, atol=0)


def test_rmsnorm_matches_torch_rmsnorm():
    torch.manual_seed(0)
    x = torch.randn(4, 5, 32)
    ours = RMSNorm(32, 1e-5)
    ref = torch.nn.RMSNorm(32, eps=1e-5)
    with torch.no_grad():
        ours.weight.copy_(torch.linspace(0.5, 2, 32))
        ref.weight.copy_(torch.linspace(0.5, 2, 32))
    torch.testing.assert_close(ours(x), ref(x), rtol=1e-6, atol=1e-6)


def test_grouped_query_attention_matches_explicit_softmax():
    torch.manual_seed(0)
    cfg = ModelConfig(dim=64, n_layers=1, n_heads=4, n_kv_heads=2, ffn_dim=64)
    attn = Attention(cfg)
    x = torch.randn(2, 5, 64)
    cos, sin = rope_tables(5, 16, cfg.rope_theta, x.device)
    q = apply_rope(attn.wq(x).view(2, 5, 4, 16).transpose(1, 2), cos, sin)
    k = apply_rope(attn.wk(x).view(2, 5, 2, 16).transpose(1, 2), cos, sin).repeat_interleave(2, dim=1)
    v = attn.wv(x).view(2, 5, 2, 16).transpose(1, 2).repeat_interleave(2, dim=1)
    scores = q @ k.transpose(-1, -2) / math.sqrt(16)
    scores = scores.masked_fill(torch.ones(5, 5).triu(1).bool(), float("-inf"))
    ref = attn.wo((scores.softmax(-1) @ v).transpose(1, 2).reshape(2, 5, 64))
    torch.testing.assert_close(attn(x, cos, sin), ref, rtol=1e-5, atol=1e-5)


def test_model_is_causal_and_shapes_are_right():
    model = build_model(TINY)
    tokens = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(1))
    logits = model(tokens)
    assert logits.shape == (2, 16, 256)
    changed = tokens.clone()
    changed[:, 10] = (changed[:, 10] + 1) % 256
    other = model(changed)
    torch.testing.assert_close(other[:, :10], logits[:, :10], rtol=0, atol=0)
    assert not torch.equal(other[:, 10:], logits[:, 10:])


def test_init_depends_on_seed_only_and_leaves_global_rng_alone():
    state = torch.get_rng_state()
    a, b, c = build_model(TINY, seed=3), build_model(TINY, seed=3), build_model(TINY, seed=4)
    assert torch.equal(torch.get_rng_state(), state)
    for (n, pa), pb, pc in zip(a.named_parameters(), b.parameters(), c.parameters()):
        assert torch.equal(pa, pb)
        if not n.endswith("norm.weight"):
            assert not torch.equal(pa, pc)
    # residual projections start smaller (GPT-2 scaling); std within 10% of the target
    std = a.layers[0].attention.wo.weight.std().item()
    assert abs(std - 0.02 / math.sqrt(8)) < 0.1 * 0.02 / math.sqrt(8)
    assert abs(a.layers[0].attention.wq.weight.std().item() - 0.02) < 0.002


def test_initial_loss_is_near_uniform():
    model = build_model(TINY)
    tokens = torch.randint(0, 256, (4, 64), generator=torch.Generator().manual_seed(0))
    loss = F.cross_entropy(model(tokens).flatten(0, 1), tokens.flatten())
    assert abs(loss.item() - math.log(256)) < 0.05


@pytest.mark.parametrize("kwargs, match", [
    (dict(dim=100), "dim: expected a multiple of 32"),
    (dict(ffn_dim=500), "ffn_dim: expected a multiple of 32"),
    (dict(n_heads=5), "n_heads: expected a divisor of dim=192"),
    (dict(n_kv_heads=4), "n_kv_heads: expected a divisor of n_heads=6"),
    (dict(n_layers=0), "n_layers: expected a positive int"),
])
def test_bad_config_names_the_field(kwargs, match):
    base = dict(dim=192, n_layers=4, n_heads=6, n_kv_heads=2, ffn_dim=512)
    with pytest.raises(ValueError, match=match):
        ModelConfig(**{**base, **kwargs})


def test_unknown_preset_and_too_long_input_are_refused():
    with pytest.raises(ValueError, match="model: expected one of 'tiny'.*got 'huge'"):
        preset("huge")
    model = build_model(ModelConfig(dim=32, n_layers=1, n_heads=2, n_kv_heads=1, ffn_dim=32, max_seq_len=8))
    with pytest.raises(ValueError, match="tokens: expected at most max_seq_len=8"):
        model(torch.zeros(1, 9, dtype=torch.long))
