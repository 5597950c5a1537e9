import json
import subprocess
import sys

import pytest
from click.testing import CliRunner

from lowprec.cli import main
from lowprec.train.logs import read_log

SMALL = ["--batch-size", "2", "--seq-len", "32", "--val-batches", "1", "--quiet", "--no-tensorboard"]


def _invoke(*args):
    return CliRunner().invoke(main, list(args))


@pytest.mark.parametrize("args, message", [
    (["train", "--recipe", "fp3"], "Error: recipe: expected one of bf16, fp16"),
    (["train", "--model", "huge"], "Error: model: expected one of 'tiny', 'small', '125m', '350m', '1b' or a path"),
    (["train", "--data", "no/such/file.txt"], "Error: data: expected an existing file or directory, got "
                                              "'no/such/file.txt'"),
    (["train", "--steps", "0"], "Error: steps: expected a positive int, got 0"),
    (["train", "--steps", "-3"], "Error: steps: expected a positive int, got -3"),
    (["compare", "--recipes", "bf16,fp9"], "Error: recipe: expected one of bf16"),
    (["compare", "--model", "huge", "--steps", "2"], "Error: model: expected one of 'tiny'"),
    (["compare", "--steps", "0"], "Error: steps: expected a positive int, got 0"),
    (["compare", "--data", "missing-dir/"], "Error: data: expected an existing file or directory"),
])
def test_bad_input_is_one_line_and_exit_1(args, message, tmp_path):
    result = _invoke(*args, "--out", str(tmp_path / "out"))
    assert result.exit_code == 1, result.output
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(message), result.output
    assert "Traceback" not in result.output


def test_resume_without_a_checkpoint_is_an_error(tmp_path):
    result = _invoke("train", "--steps", "2", "--resume", "--out", str(tmp_path), *SMALL)
    assert result.exit_code == 1 and "Error: resume: expected a checkpoint in" in result.output


def test_train_then_resume_longer(tmp_path):
    out = str(tmp_path / "run")
    first = _invoke("train", "--steps", "3", "--out", out, "--json", *SMALL)
    assert first.exit_code == 0, first.output
    summary = json.loads(first.stdout)
    assert summary["steps"] == 3 and summary["recipe"] == "bf16" and summary["final_val_loss"] < 5.6
    assert len(read_log(tmp_path / "run" / "log.csv")) == 3
    assert (tmp_path / "run" / "checkpoints" / "step_00000003.json").is_file()
    again = _invoke("train", "--steps", "3", "--out", out, *SMALL)  # would mix two runs' checkpoints
    assert again.exit_code == 1 and "out_dir: expected a directory without checkpoints" in again.output
    more = _invoke("train", "--steps", "5", "--out", out, "--resume", "--json", *SMALL)
    assert more.exit_code == 0, more.output
    rows = read_log(tmp_path / "run" / "log.csv")
    assert [r["step"] for r in rows] == ["1", "2", "3", "4", "5"]


@pytest.mark.slow
def test_compare_end_to_end_on_the_tiny_model(tmp_path):
    out = tmp_path / "cmp"
    result = _invoke("compare", "--model", "tiny", "--recipes", "fp8-current,mxfp8,mxfp4,nvfp4", "--steps", "3",
                     "--out", str(out), "--json", *SMALL)
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    rows = {r["recipe"]: r for r in report["results"]}
    assert list(rows) == ["bf16", "fp8-current", "mxfp8", "mxfp4", "nvfp4"]  # the baseline added, first
    for r in rows.values():
        assert r["verdict"] in ("PASS", "WARN", "FAIL") and len(r["curve"]) == 3 and r["steps"] == 3
        assert r["final_val_loss"] is not None and r["tokens_per_s"] > 0
    assert rows["bf16"]["gap_to_baseline"] == 0.0
    # the first step's loss, before any update, differs from BF16's by quantization noise alone
    first = {name: r["curve"][0]["loss"] for name, r in rows.items()}
    assert all(abs(v - first["bf16"]) < 0.01 * first["bf16"] for v in first.values())
    assert report["data"]["fingerprint"] and report["model"]["params"] == 1_672_896
    for name in ("report.md", "report.html", "report.json", "loss_curves.png"):
        assert (out / name).stat().st_size > 0
    assert (out / "runs" / "nvfp4" / "log.csv").is_file()


def test_python_dash_m_lowprec_gives_a_one_line_error_not_a_traceback(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "lowprec", "train", "--recipe", "nope", "--out", str(tmp_path)],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1
    assert proc.stderr.strip().splitlines() == [proc.stderr.strip()] and "Traceback" not in proc.stderr
    assert proc.stderr.startswith("Error: recipe: expected one of")


def test_the_same_command_twice_gives_the_same_curve(tmp_path):
    curves = []
    for name in ("a", "b"):
        result = _invoke("train", "--recipe", "mxfp4", "--steps", "3", "--eval-every", "3", "--out",
                         str(tmp_path / name), *SMALL)
        assert result.exit_code == 0, result.output
        rows = read_log(tmp_path / name / "log.csv")
        curves.append([(r["step"], r["loss"], r["grad_norm"], r["val_loss"]) for r in rows])
    assert curves[0] == curves[1] and len(curves[0]) == 3
