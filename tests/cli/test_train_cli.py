import json
import os
import shutil
import subprocess
import sys

import pytest
import torch
from click.testing import CliRunner

from lowprec.cli import main, train_cmd
from lowprec.cli.train_cmd import FAILED_RUN_STATUS
from lowprec.kernels import GemmPath
from lowprec.policy_file import CONVERT_SMALL
from lowprec.train.lock import run_directory_lock
from lowprec.train.logs import read_log
from lowprec.train.models import load_model
from tests.train.runs import resave

SMALL = ["--batch-size", "2", "--seq-len", "32", "--val-batches", "1", "--quiet", "--no-tensorboard"]


def _invoke(*args):
    return CliRunner().invoke(main, list(args))


@pytest.mark.parametrize("args, message", [
    (["train", "--recipe", "fp3"], "Error: recipe: expected one of bf16, fp16"),
    (["train", "--model", "huge"], "Error: model: expected one of 'tiny', 'small', '125m', '350m', '1b', "
                                    "'moe-tiny', 'moe-1b' or a path"),
    (["train", "--data", "no/such/file.txt"], "Error: data: expected an existing file or directory, got "
                                              "'no/such/file.txt'"),
    (["train", "--steps", "0"], "Error: steps: expected a positive int, got 0"),
    (["train", "--steps", "-3"], "Error: steps: expected a positive int, got -3"),
    (["compare", "--recipes", "bf16,fp9"], "Error: recipe: expected one of bf16"),
    (["compare", "--model", "huge", "--steps", "2"], "Error: model: expected one of 'tiny'"),
    (["compare", "--steps", "0"], "Error: steps: expected a positive int, got 0"),
    (["compare", "--data", "missing-dir/"], "Error: data: expected an existing file or directory"),
    (["train", "--auto-precision", "--telemetry-every", "0"],
     "Error: --auto-precision: expected --telemetry-every N > 0"),
    (["train", "--hp-final-fraction", "1.5"], "Error: --hp-final-fraction: expected a fraction in [0, 1)"),
    (["train", "--policy", "no/such/policy.json"], "Error: policy: expected a policy JSON file, got "
                                                   "'no/such/policy.json', which is not a file"),
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
        assert r["verdict"] in ("PASS", "WARN", "FAIL") and len(r["runs"][0]["curve"]) == 3 and r["steps"] == 3
        assert r["final_val_loss"] is not None and r["tokens_per_s"] > 0
    assert rows["bf16"]["gap_to_baseline"] == 0.0
    # the first step's loss, before any update, differs from BF16's by quantization noise alone
    first = {name: r["runs"][0]["curve"][0]["loss"] for name, r in rows.items()}
    assert all(abs(v - first["bf16"]) < 0.01 * first["bf16"] for v in first.values())
    assert report["data"]["fingerprint"] and report["model"]["params"] == 1_672_896
    for name in ("report.md", "report.html", "report.json", "loss_curves.png"):
        assert (out / name).stat().st_size > 0
    assert (out / "runs" / "nvfp4" / "seed-0" / "log.csv").is_file()  # the default: bf16 over 3 seeds
    assert rows["bf16"]["seeds"] == [0, 1, 2] and rows["nvfp4"]["seeds"] == [0]


def test_python_dash_m_lowprec_gives_a_one_line_error_not_a_traceback(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "lowprec", "train", "--recipe", "nope", "--out", str(tmp_path)],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1
    assert proc.stderr.strip().splitlines() == [proc.stderr.strip()] and "Traceback" not in proc.stderr
    assert proc.stderr.startswith("Error: recipe: expected one of")


def test_the_same_command_twice_gives_the_same_curve(tmp_path):
    curves = []  # nvfp4 draws random bits (its gradients' stochastic rounding): train() must seed them
    for name in ("a", "b"):
        result = _invoke("train", "--recipe", "nvfp4", "--steps", "3", "--eval-every", "3", "--out",
                         str(tmp_path / name), *SMALL)
        assert result.exit_code == 0, result.output
        rows = read_log(tmp_path / name / "log.csv")
        curves.append([(r["step"], r["loss"], r["grad_norm"], r["val_loss"]) for r in rows])
    assert curves[0] == curves[1] and len(curves[0]) == 3


def test_a_run_grows_with_the_defaults_its_checkpoint_was_trained_with(tmp_path):
    # --warmup-steps and --eval-every default to a tenth and a sixth of --steps: on --resume, to the checkpoint's
    out = str(tmp_path / "run")
    assert _invoke("train", "--steps", "10", "--out", out, *SMALL).exit_code == 0
    grown = _invoke("train", "--steps", "20", "--out", out, "--resume", *SMALL)
    assert grown.exit_code == 0, grown.output
    rows = read_log(tmp_path / "run" / "log.csv")
    assert [int(r["step"]) for r in rows] == list(range(1, 21))
    rates = [float(r["lr"]) for r in rows]
    assert rates[9] == pytest.approx(2e-4, rel=1e-12)  # the first run ended at the floor of its cosine ...
    assert set(rates[10:]) == {rates[9]}  # ... and the grown run goes on from there, with no jump
    assert [r["step"] for r in rows if r["val_loss"]] == [str(s) for s in range(1, 21)]  # every step, as before
    elapsed = [float(r["elapsed_s"]) for r in rows]
    assert all(a < b for a, b in zip(elapsed, elapsed[1:]))  # the clock goes on across the resume


@pytest.fixture(scope="module")
def cli_run(tmp_path_factory):
    """A 2-step run of the tiny model through the command line, with its checkpoint."""
    out = tmp_path_factory.mktemp("cli") / "run"
    result = _invoke("train", "--steps", "2", "--out", str(out), *SMALL)
    assert result.exit_code == 0, result.output
    return out


def _one_line_error(result, start):
    assert result.exit_code == 1, result.output
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(start), result.output
    assert "Traceback" not in result.output


def _flip_a_loss_digit(out):
    path = out / "checkpoints" / "step_00000002.json"
    text = path.read_bytes()
    at = text.index(b'"loss": ') + len(b'"loss": ') + 3
    path.write_bytes(text[:at] + (b"1" if text[at:at + 1] != b"1" else b"2") + text[at + 1:])


def _nan_weight(state):
    state["model"]["layers.0.attention.wq.weight"][0, 0] = float("nan")


def _garbage_rng(state):
    state["rng"]["cpu"] = torch.full_like(state["rng"]["cpu"], 3)


@pytest.mark.parametrize("damage, error", [
    (_flip_a_loss_digit, "Error: checkpoint: expected sha256"),
    (lambda out: resave(out / "checkpoints", lambda s: s["model"].pop("norm.weight")),
     "Error: checkpoint: expected the state of this model in"),
    (lambda out: resave(out / "checkpoints", lambda s: s["model"].update({"extra.weight": torch.zeros(2)})),
     "Error: checkpoint: expected the state of this model in"),
    (lambda out: resave(out / "checkpoints", lambda s: s["model"].update({"norm.weight": torch.zeros(3)})),
     "Error: checkpoint: expected 'norm.weight' of shape (192,)"),
    (lambda out: resave(out / "checkpoints",
                        lambda s: s["optimizer"]["optimizer"]["state"][1].update({"exp_avg": torch.zeros(3)})),
     "Error: checkpoint: expected optimizer state 'exp_avg' of"),
    (lambda out: resave(out / "checkpoints", _garbage_rng), "Error: checkpoint: expected a valid CPU generator state"),
    (lambda out: resave(out / "checkpoints", _nan_weight),
     "Error: checkpoint: expected finite weights and optimizer state in"),
], ids=["flipped-loss-digit", "missing-key", "extra-key", "wrong-shape", "optimizer-shape", "garbage-rng", "nan"])
def test_a_damaged_or_unfitting_checkpoint_is_one_line(cli_run, tmp_path, damage, error):
    out = tmp_path / "run"
    shutil.copytree(cli_run, out)
    damage(out)
    _one_line_error(_invoke("train", "--steps", "3", "--out", str(out), "--resume", *SMALL), error)


def test_a_run_that_ends_with_a_non_finite_validation_loss_fails(tmp_path):
    # an lr of 1e20: the first step is taken and its weights leave finite values, the later ones are skipped;
    # the run ended "val loss nan, 3 skipped steps" with exit status 0
    result = _invoke("train", "--steps", "4", "--lr", "1e20", "--out", str(tmp_path), *SMALL)
    assert result.exit_code == FAILED_RUN_STATUS, result.output
    assert result.stderr.strip().splitlines()[-1].startswith("Error: the final validation loss is nan (the model's "
                                                              "weights or outputs are no longer finite: lower --lr")


def test_an_lr_whose_first_adam_step_overflows_float32_is_refused(tmp_path):
    # it was a traceback from torch's Adam: "value cannot be converted to type float without overflow"
    _one_line_error(_invoke("train", "--steps", "2", "--lr", "1e38", "--out", str(tmp_path), *SMALL),
                    "Error: lr: expected a positive number under 3.4e+37 (Adam's first step, lr / (1 - beta1), must "
                    "fit float32), got 1e+38 (float)")


def test_a_run_whose_steps_are_all_skipped_fails(tmp_path, monkeypatch):
    def nan_model(*args, **kwargs):
        model, spec = load_model(*args, **kwargs)
        with torch.no_grad():
            model.layers[0].attention.wq.weight[0, 0] = float("nan")
        return model, spec

    monkeypatch.setattr(train_cmd, "load_model", nan_model)
    result = _invoke("train", "--steps", "3", "--out", str(tmp_path), *SMALL)
    assert result.exit_code == FAILED_RUN_STATUS != 0, result.output
    assert result.stderr.strip().splitlines()[-1] == ("Error: every step of this run was skipped (3 of 3: non-finite "
                                                      "loss or gradients), so the weights did not change")
    monkeypatch.undo()
    # its checkpoint holds the NaN (with valid checksums): refused, not resumed into more skipped steps
    _one_line_error(_invoke("train", "--steps", "4", "--out", str(tmp_path), "--resume", *SMALL),
                    "Error: checkpoint: expected finite weights and optimizer state in")


def test_a_directory_another_run_writes_is_refused(tmp_path):
    out = tmp_path / "run"
    # this process holds the lock; the command's run opens the lock file anew and is another writer
    with run_directory_lock(out):
        for args in (["train", "--steps", "2", "--resume"], ["compare", "--steps", "2"], ["train", "--steps", "2"]):
            _one_line_error(_invoke(*args, "--out", str(out), *SMALL),
                            f"Error: out_dir: expected a directory no other run is writing, got '{out}', locked by "
                            f"process {os.getpid()} ")
    assert _invoke("train", "--steps", "2", "--out", str(out), *SMALL).exit_code == 0  # free again


def test_train_takes_a_policy_file_and_keeps_it_in_the_run(tmp_path):
    from lowprec.policy import Policy
    from lowprec.policy_file import save_policy
    from lowprec.train.run_state import saved_train_config
    path = save_policy(Policy(exclude=("layers.0.*",), skip_small=False), tmp_path / "policy.json")
    out = tmp_path / "run"
    result = _invoke("train", "--recipe", "fp8-current", "--steps", "1", "--policy", str(path), "--out", str(out),
                     *SMALL)
    assert result.exit_code == 0, result.output
    saved = saved_train_config(out / "checkpoints")
    assert saved["policy"] == {"exclude": ["layers.0.*"], "skip_small": False}, saved
    bad = tmp_path / "bad.json"
    bad.write_text('{"format": "lowprec-policy", "version": 1, "policy": {"exlcude": []}}')
    result = _invoke("train", "--policy", str(bad), "--out", str(tmp_path / "r2"), *SMALL)
    assert result.exit_code == 1 and "unknown field(s) 'exlcude'" in result.output, result.output


def _native_here(monkeypatch, request):
    """The GPU's decision on this CPU: every GEMM path native (cuBLAS), so the small-layer rule applies; the
    tiny model's linears are all small, so none reaches a native GEMM. Layer plans are cached by shape: those
    an earlier test made on this CPU are dropped first, and those made here after."""
    import importlib

    from lowprec.nn import plan

    # the layer plans decide every path, the conversion report's too
    monkeypatch.setattr(importlib.import_module("lowprec.nn.plan"), "gemm_path", lambda *args, **kw: GemmPath.CUBLAS)
    plan.layer_plan.cache_clear()
    request.addfinalizer(plan.layer_plan.cache_clear)


@pytest.mark.parametrize("how", ["policy", "native"])
def test_layers_too_small_to_gain_are_one_line_at_the_start_and_in_the_summary(how, tmp_path, monkeypatch,
                                                                              request):
    """The speed rule keeps the tiny model's 28 block linears in high precision: forced by a policy file
    (skip_small: true), or by the rule a GPU applies where the recipe runs natively. train says so in one
    line naming the option that converts them (not once per layer shape), then in its summary; telemetry
    says at the start that it has nothing to sample, and inspect explains the missing telemetry.csv."""
    args = ["train", "--model", "tiny", "--recipe", "fp8-current", "--steps", "1", "--telemetry-every", "1",
            "--out", str(tmp_path / "run"), *SMALL]
    if how == "policy":
        (tmp_path / "p.json").write_text(json.dumps({"format": "lowprec-policy", "version": 1,
                                                     "policy": {"skip_small": True}}))
        args += ["--policy", str(tmp_path / "p.json")]
    else:
        _native_here(monkeypatch, request)
    result = _invoke(*args)
    assert result.exit_code == 0, result.output
    lines = result.output.splitlines()
    small = [line for line in lines if "too small to gain" in line]
    said = ('28 of 29 linears stay in float32 on cpu, too small to gain from fp8-current (a dimension under '
            '{}: their GEMMs would save less time than their casts cost); a --policy file holding '
            + CONVERT_SMALL.replace("{", "{{").replace("}", "}}") + ' converts them')
    under = "1024" if how == "native" else "policy.min_features"
    assert small[0] == "warning: " + said.format(under)
    assert small[-1] == "note: " + said.format(under) and lines.index(small[-1]) > lines.index(
        next(line for line in lines if line.startswith("step 1:")))
    assert len([line for line in lines if line.startswith("warning:")]) == 2, result.output
    assert any(line.startswith("warning: lowprec: telemetry has nothing to sample") for line in lines)
    assert not (tmp_path / "run" / "telemetry.csv").exists()
    inspected = _invoke("inspect", str(tmp_path / "run"))
    assert inspected.exit_code == 0 and inspected.output.startswith(
        f"{tmp_path / 'run'}: no telemetry.csv, nothing to inspect: no layer of the run was converted to "
        "fp8-current"), inspected.output


def test_a_policy_pattern_that_names_no_layer_is_refused_before_training(tmp_path):
    from lowprec.policy import Policy
    from lowprec.policy_file import save_policy
    # a typo in "attention": the run trained with the policy doing nothing, without a word
    path = save_policy(Policy(exclude=("layers.*.atention.*", "layers.0.*")), tmp_path / "policy.json")
    out = tmp_path / "run"
    result = _invoke("train", "--recipe", "fp8-current", "--steps", "1", "--policy", str(path), "--out", str(out),
                     *SMALL)
    _one_line_error(result, "Error: --policy: expected include/exclude patterns that each match a linear layer's "
                            "name such as 'layers.0.attention.wq', got exclude 'layers.*.atention.*' matching none "
                            "of the model's ")
    assert not (out / "log.csv").exists()
