"""GPT-OSS's mxfp4 layout: decoded by the documented layout (ml_dtypes, low nibble first, ``2^(code - 127)``), by
transformers' own unpacking, and loaded by transformers on the CPU (which dequantizes) as a tiny GPT-OSS."""
from __future__ import annotations

import json

import pytest
import torch

from lowprec.export.gptoss import GRID, GptOssMxfp4Layout, checkpoint_key
from lowprec.export.layout import AS_TRAINED, FROM_MASTER, LayerWeight
from lowprec.quant import quantize
from tests.export.hf_load import load_causal_lm
from tests.export.layout_helpers import (  # noqa: F401 (trained_tiny: a fixture)
    e8m0_values,
    fp4_values,
    layer,
    tokens_of,
    trained_tiny,
)

E, OUT, IN = 4, 48, 64
NAME = "model.layers.0.mlp.experts.gate_up_proj"


def _master(seed: int = 0, shape: tuple[int, ...] = (E, OUT, IN)) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=g) * 0.05


def _as_documented(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """(E, out, in) from ``blocks`` (E, out, in/32, 16) and ``scales`` (E, out, in/32)."""
    values = fp4_values(blocks)  # (E, out, in/32, 32)
    return (values * e8m0_values(scales)[..., None]).flatten(-2)


@pytest.mark.parametrize("recipe,how", [("mxfp4", AS_TRAINED), (None, FROM_MASTER), ("nvfp4", FROM_MASTER)])
def test_blocks_and_scales_decode_to_lowprec_values(recipe, how):
    master = _master(1)
    w = layer(master, recipe, NAME)
    t, written = GptOssMxfp4Layout().write_layer(w)
    assert written == how
    assert {k: (v.dtype, tuple(v.shape)) for k, v in t.items()} == {
        "blocks": (torch.uint8, (E, OUT, IN // 32, 16)), "scales": (torch.uint8, (E, OUT, IN // 32))}
    q = w.trained if how == AS_TRAINED else quantize(master, GRID.fmt, GRID.granularity)
    assert torch.equal(_as_documented(t["blocks"], t["scales"]), q.dequantize(torch.float32))


def test_transformers_unpacks_them_to_lowprec_values():
    """transformers' own GPT-OSS unpacking, into its (E, in, out) parameter, in FP32 and in bfloat16."""
    pytest.importorskip("transformers", reason="transformers (the export extra) is not installed")
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    w = layer(_master(2), "mxfp4", NAME)
    t, _ = GptOssMxfp4Layout().write_layer(w)
    for dtype in (torch.float32, torch.bfloat16):
        got = convert_moe_packed_tensors(t["blocks"], t["scales"], dtype=dtype)
        assert torch.equal(got, w.trained.dequantize(dtype).transpose(1, 2))


def test_transformers_loads_a_tiny_gpt_oss_on_the_cpu(tmp_path):
    """A GPT-OSS checkpoint whose experts this layout wrote: transformers loads it on the CPU (dequantizing, as
    it does without its GPU kernels) with lowprec's expert values, and computes the logits of a model holding
    them."""
    pytest.importorskip("transformers", reason="transformers (the export extra) is not installed")
    import safetensors.torch
    from transformers import GptOssConfig, GptOssForCausalLM

    cfg = GptOssConfig(vocab_size=64, hidden_size=64, intermediate_size=32, num_hidden_layers=1,
                       num_attention_heads=2, num_key_value_heads=1, head_dim=32, num_local_experts=E,
                       num_experts_per_tok=2, max_position_embeddings=64, layer_types=["full_attention"],
                       rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    torch.manual_seed(0)
    ref = GptOssForCausalLM(cfg).eval()
    with torch.no_grad():
        for p in ref.parameters():
            p.normal_(0, 0.05)
    state = {k: v.detach().clone() for k, v in ref.state_dict().items()}
    layout = GptOssMxfp4Layout()
    experts = ref.model.layers[0].mlp.experts
    for proj in ("gate_up_proj", "down_proj"):
        name = f"model.layers.0.mlp.experts.{proj}"
        w = layer(state.pop(name).transpose(1, 2).contiguous(), "mxfp4", name)  # lowprec's (E, out, in)
        tensors, how = layout.write_layer(w)
        assert how == AS_TRAINED
        state.update({checkpoint_key(name, k): v for k, v in tensors.items()})
        with torch.no_grad():  # the reference holds lowprec's dequantized experts
            getattr(experts, proj).copy_(w.trained.dequantize(torch.float32).transpose(1, 2))
    kept = ["model.layers.0.self_attn.q_proj", "lm_head"]
    config = {**cfg.to_dict(), "quantization_config": layout.quantization_config(kept)}
    (tmp_path / "config.json").write_text(json.dumps(config))
    safetensors.torch.save_file(state, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    loaded = load_causal_lm(tmp_path, torch.float32)
    for proj in ("gate_up_proj", "down_proj"):
        assert torch.equal(getattr(loaded.model.layers[0].mlp.experts, proj), getattr(experts, proj))
    tokens = torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert torch.equal(loaded(tokens).logits, ref(tokens).logits)


def test_config_names_the_method_and_the_modules_kept():
    kept = ["model.layers.0.self_attn.q_proj", "model.layers.1.mlp.experts.down_proj", "lm_head"]
    assert GptOssMxfp4Layout().config(kept) == {"quantization_config": {
        "quant_method": "mxfp4",
        "modules_to_not_convert": ["model.layers.0.self_attn.q_proj", "model.layers.1.mlp.experts", "lm_head"]}}
    assert GptOssMxfp4Layout().extra_files(kept) == {}


def test_dense_linears_are_kept_and_experts_need_whole_blocks():
    layout = GptOssMxfp4Layout()
    assert "MoE experts only" in layout.keeps(LayerWeight("model.layers.0.self_attn.q_proj", torch.zeros(64, 64)))
    odd = LayerWeight(NAME, torch.zeros(2, 16, 48))
    assert "multiple of 32" in layout.keeps(odd)
    assert layout.keeps(LayerWeight(NAME, _master())) is None
    with pytest.raises(ValueError, match="w: expected fused experts"):
        layout.write_layer(odd)


# --- end to end: through lowprec.export ----------------------------------------------------------------------------

def test_a_model_without_fused_experts_is_written_whole_in_high_precision(trained_tiny, tmp_path):  # noqa: F811
    """lowprec's exports hold no fused GPT-OSS experts (its decoders are written as Llama and ERNIE 4.5, one module
    per expert): every linear is kept, each with the layout's reason, and transformers loads the result with the
    BF16 model's logits."""
    pytest.importorskip("transformers", reason="transformers (the export extra) is not installed")

    from lowprec.export import KEPT, export
    from tests.export.conftest import bf16_weights_fp32_logits

    model = trained_tiny("mxfp4")
    report = export(model, tmp_path / "oss", "mxfp4")
    assert {r.how for r in report.layers} == {KEPT}
    assert all("MoE experts only" in r.reason for r in report.layers if r.name != "lm_head")
    written = json.loads((tmp_path / "oss" / "config.json").read_text())["quantization_config"]
    assert written == {"quant_method": "mxfp4", "modules_to_not_convert": report.kept}
    hf = load_causal_lm(tmp_path / "oss", torch.float32)
    with torch.no_grad():
        theirs = hf(input_ids=tokens_of()).logits
    ours = bf16_weights_fp32_logits(model, tokens_of())
    assert (theirs - ours).abs().max() <= 1e-5 * ours.abs().max()
