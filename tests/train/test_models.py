import json
import sys
import warnings

import pytest
import torch

from lowprec.train.config import TrainConfig
from lowprec.train.data import load_data
from lowprec.train.loop import train
from lowprec.train.model import PRESETS
from lowprec.train.models import load_model


def test_a_preset_takes_the_data_vocabulary():
    model, spec = load_model("tiny", vocab_size=320, seed=1)
    assert model.output.out_features == 320 and spec.config["vocab_size"] == 320
    assert spec.n_params == sum(p.numel() for p in model.parameters()) and spec.name == "tiny"
    assert spec.config["dim"] == PRESETS["tiny"].dim


def test_an_unknown_model_is_named():
    with pytest.raises(ValueError,
                       match="model: expected one of 'tiny', 'small', '125m', '350m', '1b', 'moe-tiny', 'moe-1b' "
                             "or a path"):
        load_model("gpt-5")


def _llama_config(directory):
    directory.mkdir()
    (directory / "config.json").write_text(json.dumps({
        "model_type": "llama", "architectures": ["LlamaForCausalLM"], "vocab_size": 256, "hidden_size": 64,
        "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 2, "num_key_value_heads": 1,
        "max_position_embeddings": 128}))
    return directory


def test_without_transformers_a_config_path_is_refused_clearly(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "transformers", None)  # what an environment without it sees
    with pytest.raises(ValueError, match="model: expected .* 'hf' extra.*transformers is not installed"):
        load_model(str(_llama_config(tmp_path / "hf")))


def test_a_hugging_face_config_trains_with_its_lm_head_kept(tmp_path):
    pytest.importorskip("transformers")
    model, spec = load_model(str(_llama_config(tmp_path / "hf")), seed=0)
    assert spec.config["model_type"] == "llama" and spec.n_params > 0
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        result = train(model, load_data(), TrainConfig(recipe="mxfp8", steps=3, batch_size=2, seq_len=32,
                                                       val_batches=1, eval_every=3, tensorboard=False,
                                                       progress=False))
    assert "model.lm_head" in result.conversion and result.steps == 3 and result.final_val_loss < 6.0
    line = next(line for line in result.conversion.splitlines() if line.startswith("model.lm_head"))
    assert " no " in line  # kept in high precision by the default policy
    assert torch.isfinite(torch.tensor(result.final_train_loss))


@pytest.mark.parametrize("fields, missing", [
    ({}, "hidden_size, num_hidden_layers, num_attention_heads, intermediate_size"),
    # it trained a 32-layer, 11008-wide model, Llama-7B's defaults, without a word
    ({"hidden_size": 64}, "num_hidden_layers, num_attention_heads, intermediate_size"),
])
def test_a_config_that_leaves_out_its_shape_is_refused_naming_every_field(tmp_path, fields, missing):
    pytest.importorskip("transformers")
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama", "vocab_size": 256, **fields}))
    with pytest.raises(ValueError) as e:
        load_model(str(tmp_path))
    assert str(e.value) == ("model: expected a config.json stating every field of a 'llama' model's shape (lowprec "
                            f"fills in no model's defaults), got '{tmp_path / 'config.json'}' without {missing}")


def test_a_type_outside_the_table_may_state_its_shape_under_its_own_names(tmp_path):
    pytest.importorskip("transformers")
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2", "vocab_size": 256, "n_embd": 32,
                                                      "n_layer": 1, "n_head": 2}))
    model, _ = load_model(str(tmp_path))
    assert model.model.config.n_layer == 1 and model.model.config.n_embd == 32
