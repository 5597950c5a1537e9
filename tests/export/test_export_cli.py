"""``lowprec export RUN_DIR|CHECKPOINT``: the model rebuilt from a run's checkpoint is written exactly as the
model the trainer left in memory; bad input ends in one line and exit status 1."""
from __future__ import annotations

import json

import pytest
import torch
from click.testing import CliRunner
from safetensors import safe_open

from lowprec.cli import main
from lowprec.export import export
from lowprec.train.checkpoint import latest_checkpoint


def _invoke(*args):
    return CliRunner().invoke(main, [str(a) for a in args])


def _tensors(path) -> dict[str, torch.Tensor]:
    with safe_open(str(path / "model.safetensors"), "pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}


def _same_files(a, b) -> None:
    ta, tb = _tensors(a), _tensors(b)
    assert ta.keys() == tb.keys()
    for k in ta:
        assert ta[k].dtype == tb[k].dtype and torch.equal(ta[k].view(torch.uint8), tb[k].view(torch.uint8)), k
    assert json.loads((a / "config.json").read_text()) == json.loads((b / "config.json").read_text())


@pytest.mark.parametrize("fixture, fmt", [("tiny_fp8_current", "hf"), ("moe_fp8_blockwise", "fp8")])
def test_a_run_exports_as_the_model_it_trained(fixture, fmt, request, tmp_path):
    run = request.getfixturevalue(fixture)
    result = _invoke("export", run.run_dir, "--format", fmt, "--out", tmp_path / "cli")
    assert result.exit_code == 0, result.output
    assert f"step 2 of {run.preset}, trained in {run.recipe} on cpu" in result.output
    assert "written as" in result.output and "model.layers.0.self_attn.q_proj" in result.output
    export(run.model, tmp_path / "api", fmt)
    _same_files(tmp_path / "cli", tmp_path / "api")
    report = json.loads((tmp_path / "cli" / "export_report.json").read_text())
    assert report["format"] == fmt and report["recipe"] == run.recipe


def test_a_checkpoint_file_exports_too(moe_fp8_blockwise, tmp_path):
    ckpt = latest_checkpoint(moe_fp8_blockwise.run_dir / "checkpoints")
    result = _invoke("export", ckpt, "--format", "fp8", "--out", tmp_path / "out", "--json")
    assert result.exit_code == 0, result.output
    rows = json.loads(result.output)["layers"]
    assert {r["name"]: r["how"] for r in rows}["model.layers.1.mlp.experts.0.up_proj"] == "as trained"
    # its tensors file stands for it (it was refused as "a corrupt or truncated file", which it is not)
    tensors = _invoke("export", ckpt.with_suffix(".safetensors"), "--format", "fp8", "--out", tmp_path / "t", "--json")
    assert tensors.exit_code == 0, tensors.output
    assert json.loads(tensors.output)["layers"] == rows


def test_a_warning_is_one_line(tiny_fp8_current, tmp_path):
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("default")  # as a user's shell has it
        result = _invoke("export", tiny_fp8_current.run_dir, "--format", "compressed-tensors", "--scheme", "nvfp4",
                         "--out", tmp_path / "out")
    assert result.exit_code == 0, result.output
    # it was Python's "<path>:113: UserWarning: lowprec: ..." and the source line under it
    said = [line for line in result.stderr.splitlines() if "weight-only" in line]
    assert len(said) == 1 and said[0].startswith("warning: lowprec: compressed-tensors nvfp4 written weight-only")
    assert "UserWarning" not in result.stderr


@pytest.mark.parametrize("args, message", [
    (["--format", "gguf"], "Error: format: expected one of hf, fp8"),
    (["--format", "hf", "--scheme", "fp8-block"], "Error: scheme: expected no scheme for format 'hf'"),
    (["--format", "fp8", "--scheme", "nvfp4"], "Error: scheme: expected no scheme for format 'fp8'"),
])
def test_bad_format_or_scheme_is_one_line(tiny_fp8_current, tmp_path, args, message):
    result = _invoke("export", tiny_fp8_current.run_dir, *args, "--out", tmp_path / "out")
    assert result.exit_code == 1
    assert result.output.strip().splitlines() == [result.output.strip()] and result.output.startswith(message)
    assert not (tmp_path / "out").exists()


def test_unknown_scheme_is_one_line(tiny_fp8_current, tmp_path):
    from lowprec.export import formats

    schemes = formats().get("compressed-tensors")
    if not schemes:
        pytest.skip("the compressed-tensors format is not built here")
    result = _invoke("export", tiny_fp8_current.run_dir, "--format", "compressed-tensors", "--scheme", "int3",
                     "--out", tmp_path / "out")
    assert result.exit_code == 1 and result.output.startswith("Error: scheme: expected one of ")


def test_missing_or_corrupt_checkpoint_is_one_line(tiny_fp8_current, tmp_path):
    result = _invoke("export", tmp_path / "nowhere", "--format", "hf", "--out", tmp_path / "out")
    assert result.exit_code == 1 and result.output.startswith("Error: checkpoint: expected a run directory")
    empty = tmp_path / "empty"
    empty.mkdir()
    result = _invoke("export", empty, "--format", "hf", "--out", tmp_path / "out")
    assert result.exit_code == 1 and result.output.startswith("Error: checkpoint: expected a directory holding")
    ckpt = latest_checkpoint(tiny_fp8_current.run_dir / "checkpoints")
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / ckpt.name).write_bytes(ckpt.read_bytes())
    blob = bytearray(ckpt.with_suffix(".safetensors").read_bytes())
    blob[-10] ^= 0xFF
    (broken / ckpt.with_suffix(".safetensors").name).write_bytes(bytes(blob))
    result = _invoke("export", broken, "--format", "hf", "--out", tmp_path / "out")
    assert result.exit_code == 1 and result.output.startswith("Error: checkpoint: ")
    assert "corrupt" in result.output and len(result.output.strip().splitlines()) == 1
    assert not (tmp_path / "out").exists()
    alone = tmp_path / "alone"
    alone.mkdir()
    tensors = alone / ckpt.with_suffix(".safetensors").name
    tensors.write_bytes(ckpt.with_suffix(".safetensors").read_bytes())
    result = _invoke("export", tensors, "--format", "hf", "--out", tmp_path / "out")
    assert result.exit_code == 1 and result.output.startswith("Error: checkpoint: expected a checkpoint's step_*.json")


def test_existing_out_is_refused_unless_overwrite(tiny_fp8_current, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "x").write_text("x")
    result = _invoke("export", tiny_fp8_current.run_dir, "--format", "hf", "--out", out)
    assert result.exit_code == 1 and result.output.startswith("Error: --out: expected a new or empty directory")
    result = _invoke("export", tiny_fp8_current.run_dir, "--format", "hf", "--out", out, "--overwrite")
    assert result.exit_code == 0 and not (out / "x").exists()


def test_a_run_of_no_preset_needs_its_model_named(tmp_path):
    import warnings

    from lowprec.train.data import load_data
    from lowprec.train.loop import train
    from lowprec.train.model import build_model
    from tests.train.runs import CFG, MICRO

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        train(build_model(MICRO), load_data(), CFG, out_dir=tmp_path / "run")
    result = _invoke("export", tmp_path / "run", "--format", "hf", "--out", tmp_path / "out")
    assert result.exit_code == 1
    assert result.output.startswith("Error: model: expected the Hugging Face config the run trained (--model PATH)")
    result = _invoke("export", tmp_path / "run", "--format", "hf", "--out", tmp_path / "out", "--model", "tiny")
    assert result.exit_code == 1 and result.output.startswith("Error: model: expected the model the checkpoint "
                                                              "was trained on, a model of")


def test_fp8_weights_export_their_stored_codes_and_the_optimizers_masters(tmp_path):
    import warnings

    from lowprec.export import load_trained
    from lowprec.nn.fp8_weight import stored_codes
    from lowprec.train.config import TrainConfig
    from lowprec.train.data import load_data
    from lowprec.train.loop import train
    from lowprec.train.models import load_model

    model, _ = load_model("moe-tiny", vocab_size=256)
    cfg = TrainConfig(recipe="fp8-blockwise", steps=1, batch_size=2, seq_len=32, eval_every=1, val_batches=1,
                      warmup_steps=1, tensorboard=False, progress=False, telemetry_every=0, dtype="bfloat16",
                      fp8_weights=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        train(model, load_data(), cfg, out_dir=tmp_path / "run")
    result = _invoke("export", tmp_path / "run", "--format", "fp8", "--out", tmp_path / "fp8")
    assert result.exit_code == 0, result.output
    assert _invoke("export", tmp_path / "run", "--format", "hf", "--out", tmp_path / "hf").exit_code == 0
    trained = load_trained(tmp_path / "run")
    codes = stored_codes(trained.model.layers[0].attention.wq.weight)  # the FP8 parameter's own codes
    fp8, hf = _tensors(tmp_path / "fp8"), _tensors(tmp_path / "hf")
    assert torch.equal(fp8["model.layers.0.self_attn.q_proj.weight"].view(torch.uint8), codes.data.view(torch.uint8))
    assert torch.equal(fp8["model.layers.0.self_attn.q_proj.weight_scale_inv"], codes.scale)
    master = trained.masters["layers.0.attention.wq.weight"]  # FP32, in the optimizer's state alone
    assert master.dtype == torch.float32
    assert torch.equal(hf["model.layers.0.self_attn.q_proj.weight"], master.to(torch.bfloat16))
