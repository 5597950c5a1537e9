"""The planner's saved activations follow what the code saves: for the feed-forward half of a block of the
reference model in BF16 (its norm, the SwiGLU and the three linears), the bytes ``block_bytes`` gives for the
``mlp`` group equal the bytes ``saved_tensors_hooks`` counts, with and without FP8 saved activations, for a
BF16 and an FP8 recipe; and the attention norm's input equals ``attn.residual``. The planner leaves out
per-tensor scales (4 bytes a tensor, not per token): they are added here, counted from what was saved."""
from __future__ import annotations

import pytest
import torch

import lowprec
from lowprec.nn import fp8_activations
from lowprec.plan import ModelSpec, Training, get_recipe
from lowprec.plan.activations import block_bytes, block_saved
from lowprec.train.model import ModelConfig, build_model

pytestmark = pytest.mark.filterwarnings("ignore:lowprec.*emulated:UserWarning")
# widths multiples of 128, so that 1 x 128 blocks need no padding
CFG = ModelConfig(vocab_size=64, dim=128, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=256, max_seq_len=16)
SPEC = ModelSpec(name="ref", vocab=64, d_model=128, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=32, ffn=256)
B, T = 2, 8


def _counted(fn, params) -> tuple[int, int]:
    """(bytes of the distinct storages saved for backward, parameters aside; how many are single FP32 scales)."""
    kept: list[torch.Tensor] = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: kept.append(t) or t, lambda t: t):
        fn()
    storages = {t.untyped_storage().data_ptr(): t for t in kept if t.untyped_storage().data_ptr() not in params}
    nbytes = sum(t.untyped_storage().nbytes() for t in storages.values())
    return nbytes, sum(1 for t in storages.values() if t.numel() == 1 and t.dtype == torch.float32)


@pytest.mark.parametrize("recipe", ["bf16", "fp8-current"])
@pytest.mark.parametrize("act", [None, "1x128", "tensor"])
def test_planned_feed_forward_bytes_equal_the_counted(recipe, act):
    saved = fp8_activations(act) if act else None
    model = build_model(CFG, seed=0).to(torch.bfloat16)
    lowprec.convert(model, recipe, lowprec.Policy(saved_activations=saved))
    block = model.layers[0]
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    h = torch.randn(B, T, CFG.dim, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16).requires_grad_()
    counted, scales = _counted(lambda: block.feed_forward(block.ffn_norm(h)), params)
    train = Training(saved_activations=saved)
    planned = block_bytes(SPEC, False, get_recipe(recipe), "none", train.act)["mlp"] * B * T
    assert counted == planned + 4 * scales
    if recipe == "fp8-current" or act == "tensor":
        assert scales > 0
    norm_in, norm_scales = _counted(lambda: block.attention_norm(h), params)
    residual = next(s for s in block_saved(SPEC, False) if s.name == "attn.residual")
    assert norm_in == residual.bytes(get_recipe(recipe), train.act) * B * T + 4 * norm_scales


def test_fp8_activations_shrink_the_planned_activations_as_the_code_saves():
    """Llama-3-8B on the H200 with fp8-current: the norms' inputs and gate/up go from 2 B to 1 + 4/128."""
    bf16 = lowprec.plan.plan(lowprec.plan.PlanConfig(model="llama-3-8b", recipe="fp8-current", gpu="h200"))
    fp8 = lowprec.plan.plan(lowprec.plan.PlanConfig(model="llama-3-8b", recipe="fp8-current", gpu="h200",
                                                    training=Training(saved_activations=fp8_activations())))
    act = {c.name: c.bytes for c in bf16.memory.components if c.name.startswith("activations")}
    act8 = {c.name: c.bytes for c in fp8.memory.components if c.name.startswith("activations")}
    m, tokens = bf16.model, 4096
    spared = (2 - (1 + 4 / 128)) * tokens
    assert act["activations: mlp"] - act8["activations: mlp"] == pytest.approx(
        spared * m.n_layers * (m.d_model + 2 * m.ffn))
    assert act["activations: attention"] - act8["activations: attention"] == pytest.approx(
        spared * m.n_layers * m.d_model)
    assert act["activations: output"] - act8["activations: output"] == pytest.approx(spared * m.d_model)


def test_bad_training_saved_activations_is_refused():
    with pytest.raises(TypeError, match="saved_activations: expected None or a lowprec.nn.SavedActivations"):
        Training(saved_activations="1x128")
