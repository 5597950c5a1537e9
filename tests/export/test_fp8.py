"""The ``fp8`` format (DeepSeek-V3 / Qwen-FP8 blocks): the codes lowprec's quantizer makes, read back bit for
bit; transformers' CPU load (which dequantizes to BF16) and an independent dequantization compute logits close
to lowprec's own quantized forward."""
from __future__ import annotations

import json
import math

import pytest
import torch
from safetensors import safe_open

from lowprec.export import AS_TRAINED, FROM_MASTER, KEPT, export
from lowprec.export.rope import rope_permutation
from lowprec.export.trained import linear_weight
from lowprec.quant import blockwise, quantize
from tests.export.conftest import copy_of
from tests.helpers import sqnr

transformers = pytest.importorskip("transformers", reason="the export extra (transformers) is not installed")

LOGITS_SQNR_FLOOR = 25.0
"""Logits of the exported FP8 weights (dequantized; BF16 or FP32 activations) against lowprec's own quantized
forward (the recipe's FP8 weights and FP8 activations). As trained (moe-tiny, fp8-blockwise) the weights are the
same and only the activations' quantization, left to the reader (dynamic), differs: measured 34-35 dB. From the
master (tiny, fp8-current) the weights are 128x128 blocks where training cast them per tensor: 28-29 dB. The
floor is the tests' ``fp8_e4m3_cast`` one (25 dB): one E4M3 rounding of each operand."""
CONFIG = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}


def _tensors(path) -> dict[str, torch.Tensor]:
    with safe_open(str(path / "model.safetensors"), "pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8)


def dequantize_blocks(codes: torch.Tensor, scale_inv: torch.Tensor) -> torch.Tensor:
    """The fp8 layout read independently: each 128x128 block's codes times its scale, edges cropped."""
    full = scale_inv.repeat_interleave(128, 0).repeat_interleave(128, 1)[:codes.shape[0], :codes.shape[1]]
    return codes.float() * full


@torch.no_grad()
def _lowprec_logits(model, tokens) -> torch.Tensor:
    return copy_of(model).eval()(tokens).float()  # the recipe's quantized forward, rounding to nearest


def test_fp8_blockwise_codes_are_written_as_trained(moe_fp8_blockwise, tmp_path):
    model = moe_fp8_blockwise.model
    report = export(model, tmp_path / "fp8", "fp8")
    tensors = _tensors(tmp_path / "fp8")
    how = {r.name: r.how for r in report.layers}
    assert how["model.layers.0.self_attn.q_proj"] == AS_TRAINED
    assert how["model.layers.1.mlp.experts.7.down_proj"] == AS_TRAINED
    assert how["model.layers.0.self_attn.k_proj"] == KEPT  # 64 rows: fp8-blockwise ran it in high precision
    for name, layer in [("model.layers.0.self_attn.q_proj", model.layers[0].attention.wq),
                        ("model.layers.1.mlp.shared_experts.down_proj", model.layers[1].feed_forward.shared.w2)]:
        ours = quantize(layer.weight, "e4m3", blockwise(128, 128))  # lowprec's quantizer, FP32 master
        assert tensors[f"{name}.weight"].dtype == torch.float8_e4m3fn
        assert torch.equal(_bits(tensors[f"{name}.weight"]), _bits(ours.data))
        assert torch.equal(tensors[f"{name}.weight_scale_inv"], ours.scale)
        trained = linear_weight(layer, layer.plan(nearest=True))  # what the forward GEMM multiplied
        assert torch.equal(_bits(trained.data), _bits(ours.data)) and torch.equal(trained.scale, ours.scale)
    w1 = model.layers[1].feed_forward.experts.w1.weight[5]
    ours = quantize(w1, "e4m3", blockwise(128, 128))
    assert torch.equal(_bits(tensors["model.layers.1.mlp.experts.5.gate_proj.weight"]), _bits(ours.data))
    assert torch.equal(tensors["model.layers.1.mlp.experts.5.gate_proj.weight_scale_inv"], ours.scale)
    kept = tensors["model.layers.0.self_attn.k_proj.weight"]
    assert kept.dtype == torch.bfloat16 and "model.layers.0.self_attn.k_proj.weight_scale_inv" not in tensors


def test_config_lists_the_kept_layers_for_both_readers(moe_fp8_blockwise, tmp_path):
    report = export(moe_fp8_blockwise.model, tmp_path / "fp8", "fp8")
    q = json.loads((tmp_path / "fp8" / "config.json").read_text())["quantization_config"]
    assert {k: q[k] for k in CONFIG} == CONFIG
    assert q["modules_to_not_convert"] == q["ignored_layers"] == report.kept
    assert {"lm_head", "model.layers.0.mlp.gate", "model.layers.1.self_attn.v_proj"} <= set(report.kept)


def test_transformers_loads_it_on_cpu_dequantized(moe_fp8_blockwise, tokens, tmp_path):
    pytest.importorskip("accelerate", reason="transformers loads FP8 checkpoints only with accelerate installed")
    export(moe_fp8_blockwise.model, tmp_path / "fp8", "fp8")
    tensors = _tensors(tmp_path / "fp8")
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "fp8"))
    # on a CPU transformers dequantizes a pre-quantized FP8 checkpoint into BF16 weights
    q_proj = hf.model.layers[0].self_attn.q_proj.weight
    want = dequantize_blocks(tensors["model.layers.0.self_attn.q_proj.weight"],
                             tensors["model.layers.0.self_attn.q_proj.weight_scale_inv"])
    assert q_proj.dtype == torch.bfloat16 and torch.equal(q_proj, want.to(torch.bfloat16))
    gate_up = hf.model.layers[1].mlp.experts.gate_up_proj[3]  # (2I, H): expert 3's gate over its up
    want = dequantize_blocks(tensors["model.layers.1.mlp.experts.3.gate_proj.weight"],
                             tensors["model.layers.1.mlp.experts.3.gate_proj.weight_scale_inv"])
    assert torch.equal(gate_up[:128], want.to(torch.bfloat16))
    with torch.no_grad():
        theirs = hf(input_ids=tokens).logits.float()
    assert sqnr(_lowprec_logits(moe_fp8_blockwise.model, tokens), theirs) >= LOGITS_SQNR_FLOOR


def test_other_recipes_are_quantized_from_the_master(tiny_fp8_current, tokens, tmp_path):
    model = tiny_fp8_current.model
    report = export(model, tmp_path / "fp8", "fp8")
    tensors = _tensors(tmp_path / "fp8")
    assert {r.how for r in report.layers} == {FROM_MASTER, KEPT} and report.kept == ["lm_head"]
    c = model.config
    perm = rope_permutation(c.n_kv_heads, c.head_dim)
    for name, w in [("model.layers.2.self_attn.k_proj", model.layers[2].attention.wk.weight[perm]),
                    ("model.layers.3.mlp.down_proj", model.layers[3].feed_forward.w2.weight)]:
        ours = quantize(w, "e4m3", blockwise(128, 128))
        out, inner = w.shape
        assert tensors[f"{name}.weight_scale_inv"].shape == (math.ceil(out / 128), math.ceil(inner / 128))
        assert torch.equal(_bits(tensors[f"{name}.weight"]), _bits(ours.data[:out, :inner]))
        assert torch.equal(tensors[f"{name}.weight_scale_inv"], ours.scale)
    # 192 wide: partial blocks, which transformers' CPU dequantization does not take (docs/export.md);
    # read independently instead, into the Llama the config describes
    config = json.loads((tmp_path / "fp8" / "config.json").read_text())
    config.pop("quantization_config")
    hf = transformers.LlamaForCausalLM(transformers.LlamaConfig(**config)).float()
    state = {k: (dequantize_blocks(v, tensors[f"{k}_scale_inv"]) if v.dtype == torch.float8_e4m3fn else v.float())
             for k, v in tensors.items() if not k.endswith("_scale_inv")}
    hf.load_state_dict(state)
    with torch.no_grad():
        theirs = hf(input_ids=tokens).logits
    assert sqnr(_lowprec_logits(model, tokens), theirs) >= LOGITS_SQNR_FLOOR
