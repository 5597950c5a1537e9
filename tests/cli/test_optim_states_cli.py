"""``--optim-states`` and ``--no-master-weights`` from the command line: train, compare and plan."""
from __future__ import annotations

import json

from click.testing import CliRunner

from lowprec.cli import main

SMALL = ["--steps", "2", "--batch-size", "2", "--seq-len", "16", "--val-batches", "1", "--no-tensorboard", "--quiet"]


def test_compare_shows_each_recipe_beside_its_fp32_moments_run(tmp_path):
    result = CliRunner().invoke(main, ["compare", "--recipes", "bf16", "--optim-states", "int8", "--seeds", "1",
                                       *SMALL, "--json", "--out", str(tmp_path)])
    assert result.exit_code == 0, result.output
    rows = {r["recipe"]: r for r in json.loads(result.stdout)["results"]}
    assert set(rows) == {"bf16", "bf16+int8-states"}
    base, lp = rows["bf16"]["final_val_loss"], rows["bf16+int8-states"]["final_val_loss"]
    assert rows["bf16+int8-states"]["gap_to_baseline"] == (lp - base) / base
    assert (tmp_path / "runs" / "bf16-int8-states" / "log.csv").exists()


def test_train_without_master_weights_needs_low_precision_parameters(tmp_path):
    args = ["train", "--optim-states", "fp8", "--no-master-weights", *SMALL, "--out", str(tmp_path)]
    result = CliRunner().invoke(main, [*args, "--dtype", "float32"])
    assert result.exit_code != 0
    assert "master_weights: expected True for float32 parameters" in result.output
    result = CliRunner().invoke(main, [*args, "--dtype", "bfloat16", "--json"])
    assert result.exit_code == 0, result.output


def test_plan_models_the_chosen_states():
    args = ["plan", "--model", "llama-3-8b", "--gpus", "1", "--json"]
    fp32 = json.loads(CliRunner().invoke(main, args).stdout)
    fp8 = json.loads(CliRunner().invoke(main, [*args, "--optim-states", "fp8", "--no-master-weights"]).stdout)
    parts = lambda p: {c["name"]: c["bytes"] for c in p["memory"]["components"]}  # noqa: E731
    moments_fp32, moments_fp8 = parts(fp32)["optimizer moments (adamw)"], parts(fp8)["optimizer moments (adamw, fp8)"]
    assert moments_fp8 == moments_fp32 / 8 * 2.125  # 8 bytes per parameter against 2 x (1 + 8/128)
    assert "master weights (fp32)" in parts(fp32) and "master weights (fp32)" not in parts(fp8)
    assert fp8["training"]["optim_states"] == "fp8" and fp8["training"]["master_weights"] is False
