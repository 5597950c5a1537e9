"""The ``hf`` format: transformers loads it and computes lowprec's logits."""
from __future__ import annotations

import json

import pytest
import torch

import lowprec
from lowprec.export import KEPT, export
from lowprec.export.report import REPORT_FILE
from lowprec.export.rope import permute_rows, rope_permutation
from lowprec.quant import blockwise, mx, quantize, rowwise, tensorwise
from tests.export.conftest import bf16_weights_fp32_logits, copy_of, hp_logits

transformers = pytest.importorskip("transformers", reason="the export extra (transformers) is not installed")

BF16_ULPS = 4
"""The BF16 logits of transformers and of lowprec may differ by this many BF16 units in the last place of the
largest logit. Both hold the same BF16 weights and run every GEMM in BF16, but round differently on the way:
lowprec rotates queries and keys in FP32 and rounds once, transformers' Llama rotates in BF16; the attention
and SwiGLU kernels sum in different orders. Each such difference is a rounding of a BF16 activation (half a
unit) that the following layers carry on; measured: 1 unit over 4 layers."""
FP32_RTOL = 1e-5
"""With the same BF16-rounded weights computed in FP32, only the order of FP32 sums differs: a relative error
near FP32's 6e-8 per operation, summed over a few hundred terms (measured: 8e-7 of the largest logit)."""


def _load(path, dtype=None):
    return transformers.AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype)


def test_tiny_loads_as_llama_with_lowprecs_logits(tiny_fp8_current, tokens, tmp_path):
    model = tiny_fp8_current.model
    report = lowprec.export(model, tmp_path / "hf", format="hf")
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    c = model.config
    assert config["architectures"] == ["LlamaForCausalLM"] and config["model_type"] == "llama"
    assert (config["hidden_size"], config["intermediate_size"], config["num_hidden_layers"],
            config["num_attention_heads"], config["num_key_value_heads"], config["vocab_size"]) == (
        c.dim, c.ffn_dim, c.n_layers, c.n_heads, c.n_kv_heads, c.vocab_size)
    assert config["rope_theta"] == c.rope_theta and config["rms_norm_eps"] == c.norm_eps
    assert config["tie_word_embeddings"] is False and config["torch_dtype"] == "bfloat16"
    hf = _load(tmp_path / "hf")
    assert type(hf).__name__ == "LlamaForCausalLM" and hf.dtype == torch.bfloat16
    with torch.no_grad():
        theirs = hf(input_ids=tokens).logits.float()
    ours = hp_logits(model, tokens, torch.bfloat16)
    top = ours.abs().max()
    ulp = 2.0 ** (torch.floor(torch.log2(top)) - 7)  # BF16 keeps 8 significant bits
    assert (theirs - ours).abs().max() <= BF16_ULPS * ulp
    # the same weights in FP32 agree to FP32's rounding: every name, shape and the RoPE permutation are right
    hf32 = _load(tmp_path / "hf", torch.float32)
    with torch.no_grad():
        theirs32 = hf32(input_ids=tokens).logits
    ours32 = bf16_weights_fp32_logits(model, tokens)
    assert (theirs32 - ours32).abs().max() <= FP32_RTOL * ours32.abs().max()
    assert report.architecture == "LlamaForCausalLM" and report.kept == ["lm_head"]
    assert all(r.how == "from the FP32 master" for r in report.layers if r.name != "lm_head")


def test_moe_tiny_loads_as_ernie_with_lowprecs_logits(moe_fp8_blockwise, tokens, tmp_path):
    model = moe_fp8_blockwise.model
    report = export(model, tmp_path / "hf", "hf")
    assert report.architecture == "Ernie4_5_MoeForCausalLM"
    hf32 = _load(tmp_path / "hf", torch.float32)
    layer = hf32.model.layers[0].mlp
    assert layer.shared_experts is not None and layer.experts.gate_up_proj.shape == (8, 256, 128)
    with torch.no_grad():
        theirs = hf32(input_ids=tokens).logits
    ours = bf16_weights_fp32_logits(model, tokens)
    assert (theirs - ours).abs().max() <= FP32_RTOL * ours.abs().max()


def test_the_routing_bias_of_loss_free_balancing_is_exported_and_routes_alike(moe_fp8_blockwise, tokens, tmp_path):
    """A model balanced without a loss (``MoEConfig.balance_rate``) routes by its experts' biases: written
    as ERNIE 4.5's ``e_score_correction_bias``, they choose the same experts there (biases large enough to
    change the choice: zero ones would give other logits)."""
    model = copy_of(moe_fp8_blockwise.model)
    g = torch.Generator().manual_seed(5)
    for block in model.layers:
        ff = block.feed_forward
        ff.balance_rate = 0.01
        ff.register_buffer("expert_bias", torch.rand(8, generator=g) * 0.2)
        ff.register_buffer("expert_load", torch.zeros(8), persistent=False)
    export(model, tmp_path / "hf", "hf")
    hf32 = _load(tmp_path / "hf", torch.float32)
    torch.testing.assert_close(hf32.model.layers[1].mlp.gate.moe_statics.e_score_correction_bias[0],
                               model.layers[1].feed_forward.expert_bias, rtol=0, atol=0)
    with torch.no_grad():
        theirs = hf32(input_ids=tokens).logits
    ours = bf16_weights_fp32_logits(model, tokens)
    assert (theirs - ours).abs().max() <= FP32_RTOL * ours.abs().max()
    unbiased = bf16_weights_fp32_logits(moe_fp8_blockwise.model, tokens)
    assert (unbiased - ours).abs().max() > 10 * FP32_RTOL * ours.abs().max()


def test_report_is_saved_and_kept_layers_are_named(moe_fp8_blockwise, tmp_path):
    report = export(moe_fp8_blockwise.model, tmp_path / "out", "hf")
    saved = json.loads((tmp_path / "out" / REPORT_FILE).read_text())
    assert saved == json.loads(report.to_json())
    kept = {r["name"]: r["reason"] for r in saved["layers"] if r["how"] == KEPT}
    assert "not a multiple of 128" in kept["model.layers.0.self_attn.k_proj"]
    assert "model.layers.1.mlp.gate" in kept and "lm_head" in kept
    assert sorted(saved["files"]) == ["config.json", "export_report.json", "model.safetensors"]


@pytest.mark.parametrize("granularity, kept", [
    (blockwise(128, 128), True), (rowwise(), True), (tensorwise(), True), (mx(32), True),
    (blockwise(16, 16), False),
])
def test_rope_permutation_keeps_the_codes_where_the_scales_allow(granularity, kept):
    w = torch.randn(192, 96, generator=torch.Generator().manual_seed(1))  # 6 heads of 32 rows
    perm = rope_permutation(6, 32)
    q = quantize(w, "e4m3", granularity)
    moved = permute_rows(q, perm)
    if not kept:
        assert moved is None
        return
    again = quantize(w[perm], "e4m3", granularity)
    assert torch.equal(moved.data.view(torch.uint8), again.data.view(torch.uint8))
    assert torch.equal(moved.scale, again.scale)


def test_a_model_that_is_no_module_is_named(tmp_path):
    # it was "AttributeError: 'str' object has no attribute 'named_parameters'"
    with pytest.raises(TypeError, match=r"^model: expected a torch.nn.Module .*, got 'runs/x' \(str\)$"):
        export("runs/x", tmp_path / "out", "hf")
    assert list(tmp_path.iterdir()) == []


def test_out_dir_with_files_is_refused_unless_overwrite(tiny_fp8_current, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    with pytest.raises(ValueError, match=r"^out_dir: expected a new or empty directory"):
        export(tiny_fp8_current.model, out, "hf")
    assert (out / "notes.txt").read_text() == "mine"
    export(tiny_fp8_current.model, out, "hf", overwrite=True)
    assert not (out / "notes.txt").exists() and (out / "model.safetensors").is_file()
    assert [p.name for p in tmp_path.iterdir()] == ["out"]  # nothing left beside it


def test_a_failed_export_leaves_nothing(tiny_fp8_current, tmp_path):
    model = copy_of(tiny_fp8_current.model)
    with torch.no_grad():
        model.layers[1].feed_forward.w2.weight[0, 0] = float("nan")
    with pytest.raises(ValueError, match=r"^weight 'model.layers.1.mlp.down_proj': expected finite values"):
        export(model, tmp_path / "out", "hf")
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("kw, message", [
    ({"format": "gguf"}, r"^format: expected one of hf, fp8"),
    ({"format": "hf", "scheme": "nvfp4"}, r"^scheme: expected no scheme for format 'hf'"),
])
def test_bad_format_or_scheme_is_one_line(tiny_fp8_current, tmp_path, kw, message):
    with pytest.raises(ValueError, match=message):
        export(tiny_fp8_current.model, tmp_path / "out", **kw)
    assert list(tmp_path.iterdir()) == []


def test_a_model_it_cannot_write_is_refused(tmp_path):
    with pytest.raises(TypeError, match=r"^model: expected lowprec's reference Transformer"):
        export(torch.nn.Linear(4, 4), tmp_path / "out", "hf")


LLAMA = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "vocab_size": 256, "hidden_size": 128,
         "intermediate_size": 256, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
         "max_position_embeddings": 64, "tie_word_embeddings": True}


@pytest.mark.filterwarnings("ignore:lowprec.*emulated")
def test_a_hugging_face_model_keeps_its_own_names_and_config(tokens, tmp_path):
    from lowprec.train.models import load_model

    (tmp_path / "cfg").mkdir()
    (tmp_path / "cfg" / "config.json").write_text(json.dumps(LLAMA))
    model, _ = load_model(str(tmp_path / "cfg"), vocab_size=256, seed=3)
    lowprec.convert(model, "fp8-current")
    report = export(model, tmp_path / "hf", "hf")
    names = [r.name for r in report.layers]
    assert names[0] == "model.layers.0.self_attn.q_proj" and names[-1] == "lm_head"
    assert report.architecture == "LlamaForCausalLM"
    hf = _load(tmp_path / "hf", torch.float32)
    assert hf.config.tie_word_embeddings and hf.config.hidden_size == 128
    with torch.no_grad():
        theirs = hf(input_ids=tokens).logits
    ours = bf16_weights_fp32_logits(model, tokens)
    assert (theirs - ours).abs().max() <= FP32_RTOL * ours.abs().max()


def test_a_layer_a_gpu_may_have_kept_is_kept(tiny_fp8_current):
    from lowprec.export.trained import trained

    layer = tiny_fp8_current.model.layers[0].attention.wq  # 192 x 192: under the small-layer rule's 1024
    if torch.cuda.is_available():
        pytest.skip("a CUDA device is here: its rule is evaluated, not guessed")
    assert trained(layer).kept is None and trained(layer).weights[0] is not None
    assert trained(layer, torch.device("cuda")).kept.startswith("possibly kept on cuda by the small-layer rule")
