"""``lowprec compare`` tells how far it is while it runs: which run of how many, the share of the
whole comparison done, and tokens/s, before a run ends; with seeds, the baseline's band and a
noise-aware verdict per recipe, which ``--fail-on`` gates on."""
from __future__ import annotations

import importlib
import json

import pytest
from click.testing import CliRunner

from lowprec.cli import main
from lowprec.cli.compare_cmd import ProgressLines
from lowprec.convert import Coverage, Kept
from lowprec.train.compare import Progress
from lowprec.train.result import RunResult

MICRO = ["--steps", "2", "--batch-size", "2", "--seq-len", "16", "--val-batches", "1", "--no-tensorboard"]


def test_a_line_every_tenth_of_a_recipe_with_the_overall_share_and_median_tokens_per_s(capsys):
    lines = ProgressLines(n_runs=2, steps=20)
    for index, recipe in enumerate(["bf16", "mxfp8"]):
        for step in range(1, 21):
            lines.step(Progress(recipe, index, 2, 20, {"step": step, "loss": 1.0 / step,
                                                       "tokens_per_s": 100.0 * (index + 1) * step}))
    out = capsys.readouterr().err.splitlines()
    assert len(out) == 20  # every second step of 20, per recipe
    assert out[0] == "[1/2] bf16 step 2/20 (5% of the comparison): loss 0.5000, 150 tokens/s"
    assert out[9] == "[1/2] bf16 step 20/20 (50% of the comparison): loss 0.0500, 1,050 tokens/s"
    # a new recipe: its own rates, from its first step
    assert out[10] == "[2/2] mxfp8 step 2/20 (55% of the comparison): loss 0.5000, 300 tokens/s"
    assert out[-1] == "[2/2] mxfp8 step 20/20 (100% of the comparison): loss 0.0500, 2,100 tokens/s"


def test_compare_prints_progress_before_each_recipe_ends(tmp_path):
    result = CliRunner().invoke(main, ["compare", "--recipes", "bf16,fp8-current", "--seeds", "1", *MICRO, "--out",
                                       str(tmp_path)])
    assert result.exit_code == 0, result.output
    lines = [line for line in result.stderr.splitlines() if line.startswith("[")]
    assert [line.split(":")[0] for line in lines] == [
        "[1/2] bf16 step 1/2 (25% of the comparison)", "[1/2] bf16 step 2/2 (50% of the comparison)", "[1/2] bf16",
        "[2/2] fp8-current step 1/2 (75% of the comparison)", "[2/2] fp8-current step 2/2 (100% of the comparison)",
        "[2/2] fp8-current"]
    assert all(line.endswith(" tokens/s") for line in lines)


def test_with_seeds_the_baseline_trains_k_times_and_the_report_shows_its_band(tmp_path):
    result = CliRunner().invoke(main, ["compare", "--recipes", "fp8-current", "--seeds", "2", *MICRO, "--out",
                                       str(tmp_path)])
    assert result.exit_code == 0, result.output
    lines = [line.split(":")[0] for line in result.stderr.splitlines() if line.startswith("[")]
    assert lines[2::3] == ["[1/3] bf16 seed 0", "[2/3] fp8-current seed 0", "[3/3] bf16 seed 1"]
    assert "(2 seeds of bf16, 1 of each other recipe: 3 runs)" in result.stderr
    assert sorted(str(p.relative_to(tmp_path / "runs")) for p in (tmp_path / "runs").glob("*/seed-*")) == [
        "bf16/seed-0", "bf16/seed-1", "fp8-current/seed-0"]
    report = json.loads((tmp_path / "report.json").read_text())
    band = report["baseline_band"]
    assert band["seeds"] == [0, 1] and band["mean"] == pytest.approx(sum(band["val_losses"]) / 2)
    fp8 = report["results"][1]
    assert fp8["seeds"] == [0] and fp8["noise"] > 0 and fp8["reason"] in result.stdout
    assert f"bf16 band over 2 seeds: {band['mean']:.4f}" in result.stdout


def _fixed_losses(monkeypatch, losses, coverage=None):
    def fake_train(model, data, cfg, **kw):
        val = losses[(cfg.recipe, cfg.seed)]
        return RunResult(recipe=cfg.recipe, history=({"step": 1, "loss": val, "val_loss": val, "lr": 1e-3,
                                                      "skipped": False, "tokens_per_s": 1.0},),
                         tokens_per_s=1.0, peak_memory_bytes=None, diverged=False, conversion="",
                         coverage=(coverage or {}).get(cfg.recipe))

    monkeypatch.setattr(importlib.import_module("lowprec.train.compare"), "train", fake_train)


@pytest.mark.parametrize("mxfp8, fail_on, status, label", [
    (2.02, "warn", 0, "PASS (within noise)"),   # +1%: inside 2% and inside the noise (±11.5%)
    (2.20, "warn", 2, "WARN (within noise)"),   # +10%: beyond 2%, by less than the noise (2% + 11.5%)
    (2.20, "fail", 0, "WARN (within noise)"),
    (2.30, "fail", 2, "FAIL"),                  # +15%: beyond 2% + the noise
    (2.30, "never", 0, "FAIL"),
])
def test_fail_on_gates_on_the_noise_aware_levels(monkeypatch, tmp_path, mxfp8, fail_on, status, label):
    # bf16 over 3 seeds: mean 2.0, std 0.1; one mxfp8 seed: noise 2 * 0.1 * sqrt(1 + 1/3) / 2 = 11.5%
    _fixed_losses(monkeypatch, {("bf16", 0): 1.9, ("bf16", 1): 2.0, ("bf16", 2): 2.1, ("mxfp8", 0): mxfp8})
    result = CliRunner().invoke(main, ["compare", "--recipes", "mxfp8", "--seeds", "3", "--fail-on", fail_on,
                                       "--json", "--quiet", "--out", str(tmp_path), *MICRO])
    assert result.exit_code == status, result.output
    row = json.loads(result.stdout)["results"][1]
    assert row["label"] == label and row["noise"] == pytest.approx(0.2 * (4 / 3) ** 0.5 / 2)


@pytest.mark.parametrize("args, line", [
    (["--seeds", "0"], "Error: seeds: expected a whole number of seeds >= 1, got 0 (int)"),
    (["--seeds", "2", "--recipe-seeds", "3"],
     "Error: recipe_seeds: expected a whole number from 1 to seeds (2), got 3 (int)"),
    (["--recipe-seeds", "0"], "Error: recipe_seeds: expected a whole number from 1 to seeds (3), got 0 (int)"),
])
def test_bad_seed_counts_are_one_line_errors_before_anything_runs(tmp_path, args, line):
    result = CliRunner().invoke(main, ["compare", *args, "--out", str(tmp_path / "out"), *MICRO])
    assert (result.exit_code, result.output) == (1, line + "\n")
    assert not (tmp_path / "out").exists()


_NOTHING = Coverage(0, 29, 0, 1_622_016, ((Kept.SMALL, 28), (Kept.POLICY, 1)))
"""What the GPU's small-layer rule left of the tiny model: every linear in BF16."""


@pytest.mark.parametrize("fail_on, status", [("never", 0), ("warn", 2), ("fail", 0)])
def test_a_recipe_that_converted_nothing_is_not_tested_and_warn_gates_on_it(monkeypatch, tmp_path, fail_on, status):
    # its loss is BF16's own (the same seed, nothing converted): it said PASS (within noise)
    _fixed_losses(monkeypatch, {("bf16", 0): 1.9, ("bf16", 1): 2.0, ("bf16", 2): 2.1, ("mxfp8", 0): 1.9},
                  {"mxfp8": _NOTHING})
    result = CliRunner().invoke(main, ["compare", "--recipes", "mxfp8", "--seeds", "3", "--fail-on", fail_on,
                                       "--quiet", "--out", str(tmp_path), *MICRO])
    assert result.exit_code == status, result.output
    assert "| NOT TESTED" in result.stdout or " NOT TESTED\n" in result.stdout
    assert "mxfp8: NOT TESTED: 0 of 29 linears converted (0% of linear parameters): no linear ran it" in result.stdout
    assert "PASS" not in json.loads((tmp_path / "report.json").read_text())["results"][1]["verdict"]


def test_the_console_says_what_the_verdicts_mean_and_how_much_each_recipe_converted(monkeypatch, tmp_path):
    all_of_it = Coverage(28, 29, 1_589_248, 1_622_016, ((Kept.POLICY, 1),))
    _fixed_losses(monkeypatch, {("bf16", 0): 1.9, ("bf16", 1): 2.0, ("bf16", 2): 2.1, ("mxfp8", 0): 2.02},
                  {"mxfp8": all_of_it, "bf16": all_of_it})
    result = CliRunner().invoke(main, ["compare", "--recipes", "mxfp8", "--seeds", "3", "--quiet", "--out",
                                       str(tmp_path), *MICRO])
    assert result.exit_code == 0, result.output
    out = result.stdout
    assert "28/29 (97%)" in out and "; 28 of 29 linears converted (97% of linear parameters);" in out
    for start in ("PASS: ", "WARN: ", "FAIL: ", "NOT TESTED: ", "Why similar gaps can get different verdicts: "):
        assert "\n" + start in out
    assert "`" not in out and "*" not in out


def test_compare_warns_in_one_line_when_a_run_reads_its_data_more_than_once(monkeypatch, tmp_path):
    _fixed_losses(monkeypatch, {("bf16", 0): 2.0, ("mxfp8", 0): 2.0})
    text = tmp_path / "small.txt"
    text.write_text("lowprec " * 100)  # 800 bytes: 760 to train on

    def warned(steps):
        result = CliRunner().invoke(main, [
            "compare", "--recipes", "mxfp8", "--seeds", "1", "--data", str(text), "--steps", str(steps),
            "--batch-size", "2", "--seq-len", "16", "--val-batches", "1", "--no-tensorboard",
            "--out", str(tmp_path / f"out-{steps}")])
        assert result.exit_code == 0, result.output
        return [line for line in result.stderr.splitlines() if "memorization" in line]

    # 10 steps x 2 x 16 tokens = 320 of 760: less than once over; 30 steps read them 1.3 times
    assert warned(10) == []
    line = ("warning: 30 steps of 32 tokens read the 760 training tokens 1.3 times over: validation then measures "
            "memorization; pass --data with more text, or fewer --steps")
    assert warned(30) == [line]
    # train reads the same count
    result = CliRunner().invoke(main, ["train", "--data", str(text), "--steps", "30", "--batch-size", "2",
                                       "--seq-len", "16", "--val-batches", "1", "--no-tensorboard", "--quiet",
                                       "--out", str(tmp_path / "train")])
    assert result.exit_code == 0, result.output
    assert [x for x in result.stderr.splitlines() if "memorization" in x] == [line]
