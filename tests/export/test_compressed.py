"""The compressed-tensors layout against compressed-tensors itself: the tensors its compressors make, its config
classes and presets, and its own decompression, which must give lowprec's dequantized weight."""
from __future__ import annotations

import json
import warnings

import pytest
import torch

from lowprec.export.compressed import SCHEMES, CompressedTensorsLayout
from lowprec.export.layout import AS_TRAINED, FROM_MASTER, LayerWeight
from lowprec.quant import quantize
from tests.export.layout_helpers import (  # noqa: F401 (trained_tiny: a fixture)
    e8m0_values,
    fp4_values,
    layer,
    nvfp4_as_compressed_tensors_reads,
    quantized_logits,
    safetensors_of,
    tokens_of,
    trained_tiny,
    trained_weight,
)
from tests.helpers import SQNR_FLOORS, sqnr

ct = pytest.importorskip("compressed_tensors", reason="compressed-tensors (the export extra) is not installed")
from compressed_tensors.compressors import BaseCompressor  # noqa: E402
from compressed_tensors.quantization import QuantizationConfig, preset_name_to_scheme  # noqa: E402
from compressed_tensors.quantization.lifecycle.forward import dequantize as ct_dequantize  # noqa: E402
from compressed_tensors.quantization.lifecycle.initialize import initialize_module_for_quantization  # noqa: E402
from compressed_tensors.quantization.utils import generate_gparam  # noqa: E402

OUT, IN = 72, 256  # out not a multiple of 128: fp8-block's last row of blocks is partial
AMAX = {"model.layers.0.mlp.up_proj": 5.5}
PRESETS = {"fp8-dynamic": "FP8_DYNAMIC", "fp8-block": "FP8_BLOCK", "mxfp8": "MXFP8", "mxfp4": "MXFP4",
           "nvfp4": "NVFP4A16"}
"""The library's preset each scheme is; nvfp4 with calibrated activations is its NVFP4."""


def _master(seed: int = 0, shape: tuple[int, int] = (OUT, IN)) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=g) * 0.05


def _layout(scheme: str, calibrated: bool = False) -> CompressedTensorsLayout:
    return CompressedTensorsLayout(scheme, input_amax=AMAX if calibrated else None)


def _scheme(layout: CompressedTensorsLayout):
    with pytest.warns(UserWarning, match="weight-only") if layout.scheme.name == "nvfp4" and \
            layout.input_amax is None else _no_warning():
        qc = QuantizationConfig.model_validate(layout.quantization_config(["lm_head"]))
    return qc, qc.config_groups["group_0"]


class _no_warning:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def _decompressed(layout: CompressedTensorsLayout, tensors: dict) -> torch.Tensor:
    """compressed-tensors' own decompression of one linear, as transformers' loader calls it."""
    qc, scheme = _scheme(layout)
    compressor = BaseCompressor.get_value_from_registry(qc.format)
    return compressor.decompress(dict(tensors), scheme)["weight"]


CASES = [(s, False) for s in SCHEMES] + [("nvfp4", True)]


@pytest.mark.parametrize("scheme,calibrated", CASES)
def test_tensors_are_the_ones_its_compressor_makes(scheme, calibrated):
    """Every name, dtype and shape of a linear compressed by compressed-tensors itself (FP32 model)."""
    layout = _layout(scheme, calibrated)
    tensors, _ = layout.write_layer(layer(_master()))
    _, group = _scheme(layout)
    lin = torch.nn.Linear(IN, OUT, bias=False)
    initialize_module_for_quantization(lin, group, force_zero_point=False)
    with torch.no_grad():  # any scale will do: only the compressed names, dtypes and shapes are compared
        for name, p in lin.named_parameters():
            if name != "weight":
                p.fill_(1.0)
    compressor = BaseCompressor.get_value_from_registry(layout.scheme.format)
    assert compressor.can_compress(torch.nn.Linear, group)
    compressor.compress_module(lin)
    expected = {n: (t.dtype, tuple(t.shape)) for n, t in lin.state_dict().items()}
    assert {n: (t.dtype, tuple(t.shape)) for n, t in tensors.items()} == expected


@pytest.mark.parametrize("scheme,calibrated", CASES)
def test_config_is_the_library_preset(scheme, calibrated):
    layout = _layout(scheme, calibrated)
    qc, group = _scheme(layout)
    preset = preset_name_to_scheme("NVFP4" if calibrated else PRESETS[scheme], ["Linear"])
    dump = lambda args: None if args is None else args.model_dump(exclude={"observer"})  # noqa: E731
    assert dump(group.weights) == dump(preset.weights)
    assert dump(group.input_activations) == dump(preset.input_activations)
    assert group.targets == ["Linear"] and qc.ignore == ["lm_head"]
    assert qc.quant_method == "compressed-tensors" and qc.format == layout.scheme.format
    assert qc.quantization_status == "compressed"


@pytest.mark.parametrize("scheme", ["fp8-dynamic", "fp8-block", "mxfp8", "mxfp4"])
def test_decompression_is_lowprec_dequantization_from_master(scheme):
    """No trained weight: the master quantized by lowprec, and compressed-tensors reads back lowprec's values
    bit for bit (FP8 in the FP32 of its scales, MX in bfloat16, where a power-of-two scale is exact)."""
    layout = _layout(scheme)
    master = _master(1)
    tensors, how = layout.write_layer(layer(master))
    assert how == FROM_MASTER
    got = _decompressed(layout, tensors)
    grid = SCHEMES[scheme].grid
    assert torch.equal(got, quantize(master, grid.fmt, grid.granularity).dequantize(got.dtype))


TRAINED = [  # scheme, recipe the weight trained under, how it is written
    ("fp8-dynamic", "fp8-rowwise", AS_TRAINED),
    ("fp8-dynamic", "fp8-current", AS_TRAINED),  # one scale per tensor repeats onto every channel
    ("fp8-dynamic", "fp8-blockwise", FROM_MASTER),  # a 128x128 block spans 128 channels
    ("fp8-block", "fp8-blockwise", AS_TRAINED),
    ("fp8-block", "fp8-current", AS_TRAINED),
    ("fp8-block", "fp8-rowwise", FROM_MASTER),
    ("mxfp8", "mxfp8", AS_TRAINED),
    ("mxfp8", "mxfp4", FROM_MASTER),  # E2M1 codes are not E4M3's
    ("mxfp4", "mxfp4", AS_TRAINED),
    ("nvfp4", "nvfp4", AS_TRAINED),  # 16x16 tiles as sixteen 1x16 blocks
    ("nvfp4", "mxfp4", FROM_MASTER),  # E8M0 scales are not E4M3's
]


@pytest.mark.parametrize("scheme,recipe,how", TRAINED)
def test_trained_weight_is_written_as_trained_where_it_fits(scheme, recipe, how):
    layout = _layout(scheme)
    master = _master(2)
    w = layer(master, recipe)
    tensors, written = layout.write_layer(w)
    assert written == how
    grid = SCHEMES[scheme].grid
    expected = w.trained if how == AS_TRAINED else quantize(master, grid.fmt, grid.granularity)
    got = _decompressed(layout, tensors)
    if scheme == "nvfp4":  # the reader's global scale divides: see test_nvfp4_global_scale_is_one_rounding
        assert torch.equal(got, nvfp4_as_compressed_tensors_reads(tensors))
    else:
        assert torch.equal(got, expected.dequantize(got.dtype))
    if how == AS_TRAINED and scheme == "nvfp4":  # the 16x16 codes, not a fresh 1x16 quantization
        fresh = quantize(master, grid.fmt, grid.granularity)
        assert not torch.equal(expected.dequantize(), fresh.dequantize())


def test_nvfp4_global_scale_is_one_rounding():
    """compressed-tensors divides by ``G = fp32(1 / g)``; lowprec multiplies by ``g``. The codes and block
    scales are lowprec's; each block's effective scale ``fp32(s / G)`` is lowprec's ``fp32(s * g)`` or one FP32
    unit in the last place from it, and the same exactly when ``g`` is a power of two."""
    layout = _layout("nvfp4")
    master = _master(3)
    w = layer(master, "nvfp4")
    q = w.trained
    tensors, _ = layout.write_layer(w)
    assert tensors["weight_global_scale"].dtype == torch.float32
    assert torch.equal(tensors["weight_global_scale"], torch.ones(1) / q.global_scale.reshape(1))
    s = tensors["weight_scale"].float()
    theirs = s / tensors["weight_global_scale"]  # (out, in/16), as compressed-tensors' _dequantize forms it
    ours = (q.scale * q.global_scale).repeat_interleave(16, dim=0)[:OUT]  # 16x16 tiles as 1x16 rows
    ulp = torch.abs(torch.nextafter(ours, torch.full_like(ours, float("inf"))) - ours)
    assert torch.all(torch.abs(theirs - ours) <= ulp)
    # the reader in FP32 (its dequantize with the unpacked codes in FP32): codes times its effective scale
    from compressed_tensors.compressors.nvfp4.helpers import unpack_fp4_from_uint8
    _, group = _scheme(layout)
    x_q = unpack_fp4_from_uint8(tensors["weight_packed"], OUT, IN, dtype=torch.float32)
    got = ct_dequantize(x_q, s, args=group.weights, dtype=torch.float32,
                        global_scale=tensors["weight_global_scale"])
    assert torch.equal(got, fp4_values(tensors["weight_packed"]) * theirs.repeat_interleave(16, dim=1))
    # a tensor amax of 2688 / 2^10 makes g = 2^-10: then the reader's FP32 weight is lowprec's, bit for bit
    exact = master.clone()
    exact[0, 0] = 2688.0 / 1024
    w = layer(exact, "nvfp4")
    assert w.trained.global_scale.item() == 2.0**-10
    tensors, _ = layout.write_layer(w)
    got = ct_dequantize(unpack_fp4_from_uint8(tensors["weight_packed"], OUT, IN, dtype=torch.float32),
                        tensors["weight_scale"].float(), args=group.weights, dtype=torch.float32,
                        global_scale=tensors["weight_global_scale"])
    assert torch.equal(got, w.trained.dequantize(torch.float32))


@pytest.mark.parametrize("scheme", ["mxfp4", "nvfp4"])
def test_fp4_bytes_hold_the_even_element_in_the_low_nibble(scheme):
    """The packed bytes against an independent decode (ml_dtypes, low nibble first) and against
    compressed-tensors' own unpacking."""
    from compressed_tensors.compressors.nvfp4.helpers import unpack_fp4_from_uint8
    w = layer(_master(4), scheme)
    tensors, how = _layout(scheme).write_layer(w)
    assert how == AS_TRAINED
    packed = tensors["weight_packed"]
    assert torch.equal(fp4_values(packed), w.trained.values()[:OUT, :IN])
    assert torch.equal(unpack_fp4_from_uint8(packed, OUT, IN, dtype=torch.float32), fp4_values(packed))
    if scheme == "mxfp4":  # E8M0 codes 2^(code - 127), the trained scales
        assert torch.equal(e8m0_values(tensors["weight_scale"]), w.trained.scale)


def test_nvfp4_activation_global_scale_is_the_library_one():
    """``fp32(448 * 6 / amax)``, one rounding; compressed-tensors' own ``generate_gparam`` multiplies 2688 by
    ``fp32(1 / amax)`` (torch's scalar-over-tensor), so the two may be one unit in the last place apart."""
    layout = _layout("nvfp4", calibrated=True)
    tensors, _ = layout.write_layer(layer(_master()))
    amax = AMAX["model.layers.0.mlp.up_proj"]
    assert tensors["input_global_scale"].dtype == torch.float32
    assert tensors["input_global_scale"].item() == torch.tensor(2688.0 / amax, dtype=torch.float32).item()
    theirs = generate_gparam(-torch.tensor([amax]), torch.tensor([amax]))
    assert torch.allclose(tensors["input_global_scale"], theirs, rtol=2.0**-23, atol=0)


def test_nvfp4_calibration_must_name_every_layer():
    with pytest.raises(ValueError, match="input_amax"):
        _layout("nvfp4", calibrated=True).write_layer(layer(_master(), name="model.layers.1.mlp.up_proj"))
    with pytest.raises(ValueError, match="input_amax"):
        CompressedTensorsLayout("nvfp4", input_amax={"x": -1.0}).write_layer(LayerWeight("x", _master()))


def test_shapes_the_scheme_cannot_hold_are_kept_and_refused():
    odd = LayerWeight("odd", _master(shape=(32, 48)))
    assert "multiple of 32" in _layout("mxfp4").keeps(odd)
    assert "multiple of 128" in _layout("fp8-block").keeps(odd)
    assert _layout("fp8-dynamic").keeps(odd) is None
    with pytest.raises(ValueError, match="w: expected a weight the mxfp4 scheme can hold"):
        _layout("mxfp4").write_layer(odd)
    experts = LayerWeight("experts", torch.zeros(2, 32, 64))
    assert "one (out, in) weight" in _layout("nvfp4").keeps(experts)
    with pytest.raises(ValueError, match="scheme: expected one of"):
        CompressedTensorsLayout("int4")


def test_trained_weight_of_another_shape_is_refused():
    w = LayerWeight("l", _master(), trained_weight(_master(shape=(16, IN)), "mxfp8"), "mxfp8")
    with pytest.raises(ValueError, match="w.trained: expected a quantized weight of the master's shape"):
        _layout("mxfp8").write_layer(w)


# --- end to end: a model trained by lowprec, exported, loaded by transformers -------------------------------------

E2E = [  # scheme, the recipe whose weights it takes as trained, the SQNR floor of its logits (tests.helpers)
    ("fp8-dynamic", "fp8-rowwise", "fp8_e4m3_cast"),
    ("fp8-block", "fp8-blockwise", "fp8_e4m3_cast"),
    ("mxfp8", "mxfp8", "mxfp8"),
    ("mxfp4", "mxfp4", "mxfp4"),
    ("nvfp4", "nvfp4", "nvfp4"),
]
"""Logits of the model transformers loads (weights dequantized by compressed-tensors, activations in FP32) against
lowprec's own quantized forward (the same weights, activations quantized too); measured 34-36 dB for the FP8
schemes, 34 for mxfp8, 21 for mxfp4 and 26 for nvfp4 (its last block kept in BF16 by the recipe). The floors are
the tests' ones for one rounding onto each format."""


def _load_dequantized(path):
    transformers = pytest.importorskip("transformers", reason="transformers (the export extra) is not installed")
    from transformers.utils import logging

    logging.set_verbosity_error()
    config = transformers.CompressedTensorsConfig(dequantize=True)  # compressed-tensors decompresses at load
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "the quantization_config from the model will be used": as it should
        return transformers.AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32,
                                                                 quantization_config=config).eval()


@pytest.mark.parametrize("scheme,recipe,floor", E2E)
def test_trained_model_loads_in_transformers_with_lowprecs_logits(scheme, recipe, floor, trained_tiny,  # noqa: F811
                                                                 tmp_path):
    from lowprec.export import export
    from lowprec.export.trained import linear_weight

    model = trained_tiny(recipe)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # nvfp4: written weight-only, said once
        report = export(model, tmp_path / "ct", "compressed-tensors", scheme)
    how = {r.name: r.how for r in report.layers}
    assert how["model.layers.0.self_attn.o_proj"] == how["model.layers.0.mlp.down_proj"] == AS_TRAINED
    assert report.kept[-1] == "lm_head"
    written = json.loads((tmp_path / "ct" / "config.json").read_text())["quantization_config"]
    assert written["ignore"] == report.kept
    hf = _load_dequantized(tmp_path / "ct")
    # a layer as trained: transformers holds the codes the forward GEMM multiplied, dequantized
    wo = model.layers[0].attention.wo
    trained = linear_weight(wo, wo.plan(nearest=True))
    got = hf.model.layers[0].self_attn.o_proj.weight
    if scheme == "nvfp4":
        tensors = safetensors_of(tmp_path / "ct")
        o_proj = {k.rsplit(".", 1)[1]: v for k, v in tensors.items() if ".0.self_attn.o_proj." in k}
        assert torch.equal(got, nvfp4_as_compressed_tensors_reads(o_proj).float())
    else:  # FP8 in FP32, MX in bfloat16: both exact
        assert torch.equal(got, trained.dequantize(torch.float32))
    with torch.no_grad():
        theirs = hf(input_ids=tokens_of()).logits
    assert sqnr(quantized_logits(model, tokens_of()), theirs) >= SQNR_FLOORS[floor]


def test_moe_experts_load_in_transformers(moe_fp8_blockwise, tmp_path):
    """moe-tiny (written as ERNIE 4.5, one module per expert): fp8-blockwise's 128x128 expert weights as trained,
    which transformers folds into its fused experts."""
    from lowprec.export import export

    model = moe_fp8_blockwise.model
    report = export(model, tmp_path / "ct", "compressed-tensors", "fp8-block")
    assert {r.how for r in report.layers if ".experts." in r.name} == {AS_TRAINED}
    hf = _load_dequantized(tmp_path / "ct")
    w1 = model.layers[1].feed_forward.experts.w1.weight[3]  # expert 3's gate: the first rows of gate_up
    ours = quantize(w1, "e4m3", SCHEMES["fp8-block"].grid.granularity).dequantize(torch.float32)
    assert torch.equal(hf.model.layers[1].mlp.experts.gate_up_proj[3][:w1.shape[0]], ours)
    with torch.no_grad():
        theirs = hf(input_ids=tokens_of()).logits
    assert sqnr(quantized_logits(model, tokens_of()), theirs) >= SQNR_FLOORS["fp8_e4m3_cast"]
