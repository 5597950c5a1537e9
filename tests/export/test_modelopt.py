"""The ModelOpt NVFP4 layout. ModelOpt's readers (TensorRT-LLM, vLLM) need a GPU, so the stored tensors are decoded
here by the documented layout (ml_dtypes for the codes, ``weight_scale * weight_scale_2`` for the scale) and by
compressed-tensors' converter from ModelOpt's NVFP4 to its own, then its decompression."""
from __future__ import annotations

import json

import pytest
import torch

from lowprec.export.compressed import CompressedTensorsLayout
from lowprec.export.layout import AS_TRAINED, FROM_MASTER, LayerWeight
from lowprec.export.modelopt import GRID, ModelOptNvfp4Layout
from lowprec.quant import quantize
from tests.export.layout_helpers import (  # noqa: F401 (trained_tiny: a fixture)
    fp4_values,
    layer,
    nvfp4_as_compressed_tensors_reads,
    quantized_logits,
    safetensors_of,
    tokens_of,
    trained_tiny,
)
from tests.helpers import SQNR_FLOORS, sqnr

OUT, IN = 48, 128
NAME = "model.layers.0.mlp.up_proj"


def _master(seed: int = 0, shape: tuple[int, int] = (OUT, IN)) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=g) * 0.05


def _as_modelopt_reads(t: dict[str, torch.Tensor]) -> torch.Tensor:
    """``decode(weight) * (fp32(weight_scale) * weight_scale_2)`` per 16-element group, low nibble first."""
    scale = (t["weight_scale"].float() * t["weight_scale_2"]).repeat_interleave(16, dim=1)  # (out, in)
    return fp4_values(t["weight"]) * scale


@pytest.mark.parametrize("recipe,how", [("nvfp4", AS_TRAINED), (None, FROM_MASTER), ("mxfp4", FROM_MASTER)])
def test_stored_weight_decodes_to_lowprec_values_bit_for_bit(recipe, how):
    master = _master(1)
    w = layer(master, recipe, NAME)
    t, written = ModelOptNvfp4Layout().write_layer(w)
    assert written == how
    assert {k: (v.dtype, tuple(v.shape)) for k, v in t.items()} == {
        "weight": (torch.uint8, (OUT, IN // 2)), "weight_scale": (torch.float8_e4m3fn, (OUT, IN // 16)),
        "weight_scale_2": (torch.float32, ())}
    q = w.trained if how == AS_TRAINED else quantize(master, GRID.fmt, GRID.granularity)
    assert t["weight_scale_2"].item() == q.global_scale.item()  # the multiplier itself, no reciprocal
    assert torch.equal(_as_modelopt_reads(t), q.dequantize(torch.float32))


def test_compressed_tensors_converts_it_to_what_the_compressed_tensors_layout_writes():
    """compressed-tensors' own converter from ModelOpt NVFP4 (``1 / weight_scale_2`` as its global scale) gives
    the tensors lowprec's compressed-tensors nvfp4 layout writes, and its decompression reads them."""
    pytest.importorskip("compressed_tensors", reason="compressed-tensors (the export extra) is not installed")
    from compressed_tensors.compressors import BaseCompressor
    from compressed_tensors.entrypoints.convert.converters.modelopt_nvfp4 import ModelOptNvfp4Converter
    from compressed_tensors.quantization import QuantizationConfig

    w = layer(_master(2), "nvfp4", NAME)
    amax = {NAME: 3.0}
    ours, _ = ModelOptNvfp4Layout(input_amax=amax).write_layer(w)
    converted = ModelOptNvfp4Converter(targets=["Linear"]).process({f"{NAME}.{k}": v for k, v in ours.items()})
    ct_layout = CompressedTensorsLayout("nvfp4", input_amax=amax)
    theirs, _ = ct_layout.write_layer(w)
    for k in ("weight_packed", "weight_scale", "weight_global_scale"):
        assert torch.equal(converted[f"{NAME}.{k}"].reshape(theirs[k].shape), theirs[k]), k
    assert torch.allclose(converted[f"{NAME}.input_global_scale"], theirs["input_global_scale"], rtol=2.0**-22)
    qc = QuantizationConfig.model_validate(ct_layout.quantization_config([]))
    state = {k: converted[f"{NAME}.{k}"].reshape(theirs[k].shape) for k in ("weight_packed", "weight_scale",
                                                                               "weight_global_scale")}
    got = BaseCompressor.get_value_from_registry(qc.format).decompress(state, qc.config_groups["group_0"])
    assert torch.equal(got["weight"], nvfp4_as_compressed_tensors_reads(state))
    # its global scale divides: within one FP32 rounding of ModelOpt's block scale, so within bfloat16's
    # rounding of ModelOpt's values (see lowprec.export.compressed)
    assert torch.allclose(got["weight"].float(), _as_modelopt_reads(ours), rtol=2.0**-8, atol=0)


def test_hf_quant_config_names_the_algorithm_group_and_kept_layers():
    kept = ["lm_head", "model.layers.3.mlp.down_proj"]
    with pytest.warns(UserWarning, match="weight-only"):
        files = ModelOptNvfp4Layout().extra_files(kept)
    cfg = json.loads(files["hf_quant_config.json"])
    assert cfg["producer"]["name"] == "lowprec"
    assert cfg["quantization"] == {"quant_algo": "W4A16_NVFP4", "kv_cache_quant_algo": None, "group_size": 16,
                                   "exclude_modules": kept}
    calibrated = ModelOptNvfp4Layout(input_amax={NAME: 2.0})
    assert json.loads(calibrated.extra_files(kept)["hf_quant_config.json"])["quantization"]["quant_algo"] == "NVFP4"
    assert calibrated.config(kept) == {}  # config.json carries no quantization_config


def test_calibrated_input_scale_is_amax_over_2688():
    t, _ = ModelOptNvfp4Layout(input_amax={NAME: 5.5}).write_layer(layer(_master(), name=NAME))
    assert t["input_scale"].dtype == torch.float32 and t["input_scale"].shape == ()
    assert t["input_scale"].item() == torch.tensor(5.5 / 2688.0, dtype=torch.float32).item()
    with pytest.raises(ValueError, match="input_amax"):
        ModelOptNvfp4Layout(input_amax={}).write_layer(layer(_master(), name=NAME))


def test_shapes_it_cannot_hold_are_kept_and_refused():
    layout = ModelOptNvfp4Layout()
    odd = LayerWeight("odd", _master(shape=(16, 40)))
    assert "multiple of 16" in layout.keeps(odd)
    assert "one (out, in) weight" in layout.keeps(LayerWeight("e", torch.zeros(2, 16, 32)))
    with pytest.raises(ValueError, match="w: expected a weight ModelOpt NVFP4 can hold"):
        layout.write_layer(odd)


# --- end to end: a model trained by lowprec in NVFP4, exported, read back by the documented layout -----------------

def test_nvfp4_trained_model_reads_back_with_lowprecs_logits(trained_tiny, tmp_path):  # noqa: F811
    """ModelOpt's readers need a GPU: the export is decoded here by its documented layout into the Llama its
    config.json describes, and computes logits within NVFP4's floor of lowprec's own quantized forward (measured:
    26 dB, the activations being quantized by lowprec only)."""
    transformers = pytest.importorskip("transformers", reason="transformers (the export extra) is not installed")
    from lowprec.export import KEPT, export
    from lowprec.export.trained import linear_weight

    model = trained_tiny("nvfp4")
    with pytest.warns(UserWarning, match="weight-only"):
        report = export(model, tmp_path / "mo", "modelopt-nvfp4")
    how = {r.name: r.how for r in report.layers}
    assert how["model.layers.0.mlp.down_proj"] == AS_TRAINED and how["model.layers.1.mlp.down_proj"] == KEPT
    quant = json.loads((tmp_path / "mo" / "hf_quant_config.json").read_text())["quantization"]
    assert quant["exclude_modules"] == report.kept and quant["group_size"] == 16
    config = json.loads((tmp_path / "mo" / "config.json").read_text())
    assert "quantization_config" not in config
    tensors = safetensors_of(tmp_path / "mo")
    quantized = {k.removesuffix(".weight_scale_2") for k in tensors if k.endswith(".weight_scale_2")}
    assert quantized == {n for n, h in how.items() if h != KEPT}
    state = {}
    for k, v in tensors.items():
        module, _, suffix = k.rpartition(".")
        if module in quantized and suffix == "weight":
            state[k] = _as_modelopt_reads({s: tensors[f"{module}.{s}"] for s in ("weight", "weight_scale",
                                                                                     "weight_scale_2")})
        elif module not in quantized or suffix not in ("weight_scale", "weight_scale_2"):
            state[k] = v.float()
    wo = model.layers[0].attention.wo  # as trained: the codes the forward GEMM multiplied
    assert torch.equal(state["model.layers.0.self_attn.o_proj.weight"],
                       linear_weight(wo, wo.plan(nearest=True)).dequantize(torch.float32))
    hf = transformers.LlamaForCausalLM(transformers.LlamaConfig(**config)).float().eval()
    hf.load_state_dict(state)
    with torch.no_grad():
        theirs = hf(input_ids=tokens_of()).logits
    assert sqnr(quantized_logits(model, tokens_of()), theirs) >= SQNR_FLOORS["nvfp4"]
