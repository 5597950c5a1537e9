"""The issue's end to end: ``lowprec train`` runs a recipe of each family two steps, ``lowprec export`` writes the
run in every format, and transformers (and compressed-tensors' own reader) load it, with logits within an SQNR
floor of lowprec's own forward of the run."""
from __future__ import annotations

import json
import warnings

import pytest
import torch
from click.testing import CliRunner

from lowprec.cli import main
from lowprec.export.source import load_trained
from tests.export.hf_load import load_causal_lm
from tests.export.layout_helpers import safetensors_of, tokens_of

transformers = pytest.importorskip("transformers", reason="transformers (the export extra) is not installed")

TRAIN = ["--model", "tiny", "--steps", "2", "--batch-size", "2", "--seq-len", "32", "--val-batches", "1",
         "--quiet", "--no-tensorboard", "--telemetry-every", "0"]
FAMILIES = {"fp8": "fp8-current", "mx": "mxfp8", "nvfp4": "nvfp4"}
"""One trained run per recipe family: each exports to every format, as trained where its weights fit."""
EXPORTS = [  # (family, format, scheme, SQNR floor in dB of transformers' logits against lowprec's forward)
    ("fp8", "hf", None, 25),
    pytest.param("fp8", "fp8", None, 25, marks=pytest.mark.skip(
        reason="transformers (5.24) dequantizing FP8 on a CPU derives the block from the scale grid (192 rows over 2 "
               "scale rows: 96), so the tiny preset's partial 128-blocks load wrong there (test_fp8 loads a "
               "128-wide model)")),
    ("fp8", "compressed-tensors", "fp8-dynamic", 25), ("fp8", "compressed-tensors", "fp8-block", 25),
    ("mx", "compressed-tensors", "mxfp8", 20), ("mx", "compressed-tensors", "mxfp4", 10),
    ("mx", "mxfp4", None, 20),
    ("nvfp4", "compressed-tensors", "nvfp4", 10), ("nvfp4", "modelopt-nvfp4", None, None),
]


def _invoke(*args):
    return CliRunner().invoke(main, [str(a) for a in args])


@pytest.fixture(scope="session")
def runs(tmp_path_factory):
    """``runs(family)``: the run directory of ``lowprec train`` in that family's recipe, trained once."""
    done: dict[str, object] = {}

    def get(family: str):
        if family not in done:
            out = tmp_path_factory.mktemp(f"cli-{family}") / "run"
            result = _invoke("train", "--recipe", FAMILIES[family], "--out", out, *TRAIN)
            assert result.exit_code == 0, result.output
            done[family] = out
        return done[family]

    return get


def _sqnr(x: torch.Tensor, ref: torch.Tensor) -> float:
    return float(10 * torch.log10(ref.pow(2).mean() / (x - ref).pow(2).mean()))


@torch.no_grad()
def _lowprec_logits(run) -> torch.Tensor:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return load_trained(run).model.eval()(tokens_of()).float()


@pytest.mark.parametrize("family, fmt, scheme, floor", EXPORTS)
def test_a_trained_run_exports_and_loads(runs, family, fmt, scheme, floor, tmp_path):
    run = runs(family)
    out = tmp_path / "export"
    result = _invoke("export", run, "--format", fmt, *(["--scheme", scheme] if scheme else []), "--out", out,
                     "--json")
    assert result.exit_code == 0, result.output
    report = json.loads(result.output[result.output.index("{"):])
    assert report["format"] == fmt and report["recipe"] in (FAMILIES[family], None)  # None: hf, or all kept
    if floor is None:  # modelopt: transformers has no reader of hf_quant_config.json; its tensors are checked
        assert (out / "hf_quant_config.json").is_file()
        return
    dtype = torch.float32 if scheme in (None, "fp8-dynamic", "fp8-block") else torch.bfloat16  # FP4/MX unpack in BF16
    hf = load_causal_lm(out, dtype)
    with torch.no_grad():
        theirs = hf(input_ids=tokens_of()).logits.float()
    assert _sqnr(theirs, _lowprec_logits(run)) >= floor


@pytest.mark.parametrize("scheme", ["fp8-dynamic", "fp8-block", "mxfp8", "mxfp4", "nvfp4"])
def test_compressed_tensors_reads_back_every_tensor(runs, scheme, tmp_path):
    """compressed-tensors' own reader (its ModelCompressor over the directory) gives back each tensor as written."""
    ct = pytest.importorskip("compressed_tensors", reason="compressed-tensors (the export extra) is not installed")
    family = {"fp8-dynamic": "fp8", "fp8-block": "fp8", "mxfp8": "mx", "mxfp4": "mx", "nvfp4": "nvfp4"}[scheme]
    out = tmp_path / "export"
    assert _invoke("export", runs(family), "--format", "compressed-tensors", "--scheme", scheme,
                   "--out", out).exit_code == 0
    written = safetensors_of(out)
    config = json.loads((out / "config.json").read_text())["quantization_config"]
    parsed = ct.quantization.QuantizationConfig.model_validate(config)
    assert parsed.format == config["format"]
    from compressed_tensors.utils.safetensors_load import get_weight_mappings

    for name, path in get_weight_mappings(str(out)).items():
        from safetensors import safe_open

        with safe_open(path, "pt") as f:
            t = f.get_tensor(name)
        assert t.dtype == written[name].dtype and torch.equal(t.view(torch.uint8), written[name].view(torch.uint8))
