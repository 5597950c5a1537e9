"""NVFP4 activation scales by calibration: the input scales an export writes are, in each reader's convention,
the input amax an independent loop records over the same batches (plain forward hooks of the test's own, on the
lowprec model's modules); compressed-tensors parses the config with its own ``QuantizationConfig``; the CLI's
``--calibrate N`` takes the run's own validation data."""
from __future__ import annotations

import json
import warnings

import pytest
import torch
from click.testing import CliRunner

from lowprec.cli import main
from lowprec.export import KEPT, export
from lowprec.nn.grouped_casts import Groups
from lowprec.train.data import load_data
from tests.export.conftest import copy_of
from tests.export.layout_helpers import safetensors_of

NVFP4_MAX = 448.0 * 6.0
ATTENTION = {"q_proj": "wq", "k_proj": "wk", "v_proj": "wv", "o_proj": "wo"}
MLP = {"gate_proj": "w1", "up_proj": "w3", "down_proj": "w2"}


def _module_of(name: str) -> str:
    """The lowprec module a Llama linear of the ``tiny`` export comes from (the names the export documents)."""
    _, _, i, block, proj = name.split(".")
    return f"layers.{i}.attention.{ATTENTION[proj]}" if block == "self_attn" else f"layers.{i}.feed_forward.{MLP[proj]}"


def _batches(n: int = 2) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return [torch.randint(0, 256, (2, 32), generator=g) for _ in range(n)]


@torch.no_grad()
def _reference_amax(model: torch.nn.Module, batches: list[torch.Tensor], names: list[str]) -> dict[str, float]:
    """Each named linear's input max |x| over ``batches``: a forward hook per module, the model in eval mode."""
    seen: dict[str, float] = {}

    def hook(name):
        def record(module, inputs, output):
            seen[name] = max(seen.get(name, 0.0), inputs[0].abs().max().item())
        return record

    handles = [model.get_submodule(_module_of(n)).register_forward_hook(hook(n)) for n in names]
    model.eval()
    for b in batches:
        model(b)
    for h in handles:
        h.remove()
    return seen


def _quantized(report) -> list[str]:
    return [r.name for r in report.layers if r.how != KEPT]


def _export(model, out, fmt, scheme=None, **kw):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        report = export(model, out, fmt, scheme, **kw)
    return report, [str(w.message) for w in caught]


def test_compressed_tensors_nvfp4_input_global_scale_is_the_recorded_amax(tiny_fp8_current, tmp_path):
    from compressed_tensors.quantization import QuantizationConfig, preset_name_to_scheme

    model, batches = copy_of(tiny_fp8_current.model), _batches()
    report, warned = _export(model, tmp_path / "ct", "compressed-tensors", "nvfp4", calibrate=batches)
    assert not [w for w in warned if "weight-only" in w]
    assert any("calibrated on 2 batches (128 tokens)" in n for n in report.notes)
    names = _quantized(report)
    assert names  # the tiny model's attention and MLP linears
    amax = _reference_amax(copy_of(tiny_fp8_current.model), batches, names)
    t = safetensors_of(tmp_path / "ct")
    for n in names:  # compressed-tensors divides by it: fp32(448 * 6 / amax)
        want = torch.tensor([NVFP4_MAX]) / torch.tensor([amax[n]], dtype=torch.float32)
        assert torch.equal(t[f"{n}.input_global_scale"], want), n
    assert not [k for k in t if k.endswith("input_global_scale") and k.rsplit(".", 1)[0] not in names]
    qc = QuantizationConfig.model_validate(json.loads((tmp_path / "ct" / "config.json").read_text())
                                           ["quantization_config"])
    inputs, preset = qc.config_groups["group_0"].input_activations, preset_name_to_scheme("NVFP4", ["Linear"])
    assert inputs is not None
    for field in ("num_bits", "type", "strategy", "group_size", "dynamic", "scale_dtype"):
        assert getattr(inputs, field) == getattr(preset.input_activations, field), field


def test_modelopt_input_scale_is_the_recorded_amax_and_the_algo_is_nvfp4(tiny_fp8_current, tmp_path):
    model, batches = copy_of(tiny_fp8_current.model), _batches(3)
    report, warned = _export(model, tmp_path / "mo", "modelopt-nvfp4", calibrate=iter(batches))
    assert not [w for w in warned if "weight-only" in w]
    names = _quantized(report)
    amax = _reference_amax(copy_of(tiny_fp8_current.model), batches, names)
    t = safetensors_of(tmp_path / "mo")
    for n in names:  # ModelOpt's multiplies: fp32(amax / (6 * 448)), 0-d
        want = torch.tensor(amax[n], dtype=torch.float32) / torch.tensor(NVFP4_MAX)
        assert t[f"{n}.input_scale"].shape == () and torch.equal(t[f"{n}.input_scale"], want), n
    cfg = json.loads((tmp_path / "mo" / "hf_quant_config.json").read_text())
    assert cfg["quantization"]["quant_algo"] == "NVFP4"


def test_routed_experts_get_the_amax_of_their_own_tokens(moe_fp8_blockwise, tmp_path):
    model, batches = copy_of(moe_fp8_blockwise.model), _batches(1)
    report, _ = _export(model, tmp_path / "moe", "modelopt-nvfp4", calibrate=batches)
    ref = copy_of(moe_fp8_blockwise.model).eval()
    seen: dict[tuple[str, int], float] = {}

    def record(name):
        def hook(module, inputs, output):
            x, offsets = inputs
            offsets = offsets.offsets if isinstance(offsets, Groups) else offsets  # the reference MoE routes once
            for e, (lo, hi) in enumerate(zip([0, *offsets.tolist()[:-1]], offsets.tolist())):
                if hi > lo:
                    seen[(name, e)] = max(seen.get((name, e), 0.0), x[lo:hi].abs().max().item())
        return hook

    w1 = "layers.0.feed_forward.experts.w1"
    handle = ref.get_submodule(w1).register_forward_hook(record(w1))
    with torch.no_grad():
        ref(batches[0])
    handle.remove()
    t = safetensors_of(tmp_path / "moe")
    rows = {r.name: r for r in report.layers}
    for e in range(ref.get_submodule(w1).num_experts):
        name = f"model.layers.0.mlp.experts.{e}.gate_proj"
        assert rows[name].how != KEPT
        want = torch.tensor(seen[(w1, e)], dtype=torch.float32) / torch.tensor(NVFP4_MAX)
        assert torch.equal(t[f"{name}.input_scale"], want), name


class _Untouched:
    """Batches that must not be read."""

    def __iter__(self):
        raise AssertionError("a format with dynamic activations ran a calibration")


def test_a_format_with_dynamic_activations_notes_calibration_unused(tiny_fp8_current, tmp_path):
    report, _ = _export(copy_of(tiny_fp8_current.model), tmp_path / "fp8", "fp8", calibrate=_Untouched())
    assert any("calibrate= given, not used" in n for n in report.notes)


def test_without_calibration_nvfp4_stays_weight_only_with_a_warning(tiny_fp8_current, tmp_path):
    _, warned = _export(copy_of(tiny_fp8_current.model), tmp_path / "w", "compressed-tensors", "nvfp4")
    assert [w for w in warned if "weight-only" in w]
    assert not [k for k in safetensors_of(tmp_path / "w") if k.endswith("input_global_scale")]


@pytest.mark.parametrize("batches, exc, message", [
    ([], ValueError, "calibrate: expected at least one batch"),
    ([torch.zeros(2, 32)], TypeError, r"calibrate\[0\]: expected a non-empty int64 tensor"),
    (torch.zeros(2, 32, dtype=torch.long), TypeError, "calibrate: expected an iterable of token batches"),
])
def test_bad_calibration_batches_are_refused(tiny_fp8_current, tmp_path, batches, exc, message):
    with pytest.raises(exc, match=message):
        export(copy_of(tiny_fp8_current.model), tmp_path / "x", "modelopt-nvfp4", calibrate=batches)
    assert not (tmp_path / "x").exists()


def _invoke(*args):
    return CliRunner().invoke(main, [str(a) for a in args])


def test_cli_calibrates_on_the_runs_validation_data(tiny_fp8_current, tmp_path):
    result = _invoke("export", tiny_fp8_current.run_dir, "--format", "compressed-tensors", "--scheme", "nvfp4",
                     "--calibrate", 2, "--out", tmp_path / "cli")
    assert result.exit_code == 0, result.output
    assert "calibration: 2 batches of 2x32 tokens from the run's validation data" in result.output
    assert "activation scales calibrated on 2 batches" in result.output
    report = json.loads((tmp_path / "cli" / "export_report.json").read_text())
    names = [r["name"] for r in report["layers"] if r["how"] != KEPT]
    batches = [x for x, _ in load_data().val_batches(2, 2, 32)]  # the run's batch size and sequence length
    amax = _reference_amax(copy_of(tiny_fp8_current.model), batches, names)
    t = safetensors_of(tmp_path / "cli")
    for n in names:
        assert torch.equal(t[f"{n}.input_global_scale"],
                           torch.tensor([NVFP4_MAX]) / torch.tensor([amax[n]], dtype=torch.float32)), n


@pytest.mark.parametrize("args, message", [
    (["--format", "modelopt-nvfp4", "--calibrate", "0"], "Error: --calibrate: expected a positive number"),
    (["--format", "modelopt-nvfp4", "--data", "x.txt"], "Error: --data: expected --calibrate N with it"),
])
def test_cli_bad_calibration_is_one_line(tiny_fp8_current, tmp_path, args, message):
    result = _invoke("export", tiny_fp8_current.run_dir, *args, "--out", tmp_path / "o")
    assert result.exit_code == 1 and len(result.output.strip().splitlines()) == 1, result.output
    assert result.output.startswith(message)


def test_cli_calibration_for_a_dynamic_format_is_noted(tiny_fp8_current, tmp_path):
    result = _invoke("export", tiny_fp8_current.run_dir, "--format", "fp8", "--calibrate", 1, "--out", tmp_path / "o")
    assert result.exit_code == 0, result.output
    assert "calibrate= given, not used" in result.output and "calibration:" not in result.output
