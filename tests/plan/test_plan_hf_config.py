"""Reading model shapes from Hugging Face config.json files (fields as the published configs write them)."""
from __future__ import annotations

import json

import pytest

from lowprec.plan.hf_config import _Config, from_hf_config, load_hf_config, missing_fields
from lowprec.plan.layers import count_params
from lowprec.plan.models import PRESETS, get_model

LLAMA_3_8B = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 4096,
    "intermediate_size": 14336, "num_attention_heads": 32, "num_hidden_layers": 32, "num_key_value_heads": 8,
    "vocab_size": 128256, "tie_word_embeddings": False, "rope_theta": 500000.0, "torch_dtype": "bfloat16",
}
DEEPSEEK_V3 = {
    "model_type": "deepseek_v3", "hidden_size": 7168, "intermediate_size": 18432, "moe_intermediate_size": 2048,
    "num_hidden_layers": 61, "num_attention_heads": 128, "num_key_value_heads": 128, "n_routed_experts": 256,
    "n_shared_experts": 1, "num_experts_per_tok": 8, "first_k_dense_replace": 3, "moe_layer_freq": 1,
    "q_lora_rank": 1536, "kv_lora_rank": 512, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64,
    "v_head_dim": 128, "vocab_size": 129280, "tie_word_embeddings": False, "num_nextn_predict_layers": 1,
}
MIXTRAL = {
    "model_type": "mixtral", "hidden_size": 4096, "intermediate_size": 14336, "num_attention_heads": 32,
    "num_hidden_layers": 32, "num_key_value_heads": 8, "num_local_experts": 8, "num_experts_per_tok": 2,
    "vocab_size": 32000, "tie_word_embeddings": False,
}
QWEN3_MOE = {
    "model_type": "qwen3_moe", "hidden_size": 2048, "intermediate_size": 6144, "moe_intermediate_size": 768,
    "num_attention_heads": 32, "num_hidden_layers": 48, "num_key_value_heads": 4, "head_dim": 128,
    "num_experts": 128, "num_experts_per_tok": 8, "decoder_sparse_step": 1, "mlp_only_layers": [],
    "vocab_size": 151936, "tie_word_embeddings": False,
}


@pytest.mark.parametrize("cfg, preset", [
    (LLAMA_3_8B, "llama-3-8b"), (DEEPSEEK_V3, "deepseek-v3"), (MIXTRAL, "mixtral-8x7b"), (QWEN3_MOE, "qwen3-30b-a3b"),
])
def test_configs_give_the_presets_counts(cfg, preset):
    assert count_params(from_hf_config(cfg)) == count_params(PRESETS[preset])


def test_qwen2_moe_shared_expert_and_sparse_step():
    cfg = {**QWEN3_MOE, "model_type": "qwen2_moe", "num_hidden_layers": 8, "decoder_sparse_step": 2,
           "mlp_only_layers": [1], "shared_expert_intermediate_size": 4096}
    m = from_hf_config(cfg)
    # MoE where (i + 1) % 2 == 0 and i not in [1]: layers 3, 5, 7
    assert (m.n_moe_layers, m.n_dense_layers) == (3, 5)
    assert (m.moe.n_shared, m.moe.shared_ffn) == (1, 4096)


def test_defaults_kv_heads_head_dim_and_text_config():
    cfg = {"text_config": {**LLAMA_3_8B, "num_key_value_heads": None}}
    m = from_hf_config(cfg)
    assert (m.n_kv_heads, m.head_dim, m.tied_embeddings) == (32, 128, False)


def test_load_from_file_or_folder(tmp_path):
    folder = tmp_path / "Meta-Llama-3-8B"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(LLAMA_3_8B))
    for path in (folder, folder / "config.json"):
        m = load_hf_config(path)
        assert m.name == "Meta-Llama-3-8B"
        assert count_params(m).total == 8_030_261_248
    assert get_model(str(folder)).d_model == 4096


def test_missing_key_names_file_and_key(tmp_path):
    cfg = dict(LLAMA_3_8B)
    del cfg["hidden_size"]
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="hidden_size: expected an int, got nothing"):
        _Config(cfg, tmp_path.name).get_int("hidden_size")


@pytest.mark.parametrize("cfg, missing", [
    ({"model_type": "llama", "vocab_size": 256}, "hidden_size, num_hidden_layers, num_attention_heads, "
                                                 "intermediate_size"),
    ({"model_type": "llama", "vocab_size": 256, "hidden_size": 64, "num_attention_heads": None},
     "num_hidden_layers, num_attention_heads, intermediate_size"),
    ({k: v for k, v in MIXTRAL.items() if k != "num_local_experts"}, "num_local_experts"),
    ({k: v for k, v in QWEN3_MOE.items() if k not in ("num_experts", "moe_intermediate_size")},
     "num_experts, moe_intermediate_size"),
    ({k: v for k, v in DEEPSEEK_V3.items() if k != "kv_lora_rank"}, "kv_lora_rank"),
    ({"text_config": {"model_type": "llama", "hidden_size": 64}}, "vocab_size, num_hidden_layers, "
                                                                  "num_attention_heads, intermediate_size"),
])
def test_missing_fields_are_all_named_in_one_line(tmp_path, cfg, missing):
    # a config of model_type and vocab_size alone was filled from Llama-7B's defaults when trained
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError) as e:
        load_hf_config(tmp_path)
    model_type = (cfg.get("text_config") or cfg)["model_type"]
    # the argument is --model (it was named after the config's folder)
    assert str(e.value) == (f"model: expected a config.json stating every field of a {model_type!r} "
                            f"model's shape (lowprec fills in no model's defaults), got "
                            f"'{tmp_path / 'config.json'}' without {missing}")
    with pytest.raises(ValueError, match=r"^cfg: expected a config.json stating every field of a .*, got one without"):
        from_hf_config(cfg)


def test_a_config_without_model_type_asks_for_it(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"hidden_size": 64}))
    with pytest.raises(ValueError) as e:  # it read "every field of a None model's shape"
        load_hf_config(tmp_path)
    assert str(e.value).startswith("model: expected a config.json stating every field of its model's shape and its "
                                   "model_type (lowprec fills in no model's defaults), got ")


def test_a_type_outside_the_table_states_width_depth_heads_and_vocabulary():
    gpt2 = {"model_type": "gpt2", "vocab_size": 256, "n_embd": 64, "n_layer": 2}
    assert missing_fields(gpt2) == ["hidden_size", "num_hidden_layers", "num_attention_heads"]
    aliases = {"hidden_size": "n_embd", "num_hidden_layers": "n_layer", "num_attention_heads": "n_head"}
    assert missing_fields(gpt2, aliases) == ["num_attention_heads"]
    assert missing_fields({**gpt2, "n_head": 2}, aliases) == []


def test_wrong_type_and_bad_json_and_missing_file(tmp_path):
    with pytest.raises(ValueError, match=r"^cfg.num_hidden_layers: expected a non-negative int, got '32' \(str\)"):
        from_hf_config({**LLAMA_3_8B, "num_hidden_layers": "32"})
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ValueError, match="valid JSON"):
        load_hf_config(tmp_path / "config.json")
    with pytest.raises(FileNotFoundError, match="config.json"):
        load_hf_config(tmp_path / "nowhere")
