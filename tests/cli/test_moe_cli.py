"""``lowprec train`` and ``lowprec compare`` take the ``moe-tiny`` preset, its experts running the recipe."""
from __future__ import annotations

import json
import math

import pytest
from click.testing import CliRunner

from lowprec.cli import main
from lowprec.train.logs import read_log

SMALL = ["--batch-size", "2", "--seq-len", "32", "--val-batches", "1", "--quiet", "--no-tensorboard"]


def test_train_moe_tiny_in_fp8_current(tmp_path):
    result = CliRunner().invoke(main, ["train", "--model", "moe-tiny", "--recipe", "fp8-current", "--steps", "3",
                                       "--out", str(tmp_path / "run"), "--json", *SMALL])
    assert result.exit_code == 0, result.output
    summary = json.loads(result.stdout)
    assert summary["steps"] == 3 and summary["recipe"] == "fp8-current" and summary["skipped_steps"] == 0
    assert math.isfinite(summary["final_val_loss"]) and summary["final_val_loss"] < 5.6  # ln 256 = 5.55
    assert len(read_log(tmp_path / "run" / "log.csv")) == 3


@pytest.mark.slow
def test_compare_on_moe_tiny_earns_a_verdict_with_the_experts_converted(tmp_path):
    result = CliRunner().invoke(main, ["compare", "--model", "moe-tiny", "--recipes", "fp8-current", "--seeds", "1",
                                       "--steps", "2", "--out", str(tmp_path / "cmp"), "--json", *SMALL])
    assert result.exit_code == 0, result.output
    rows = {r["recipe"]: r for r in json.loads(result.stdout)["results"]}
    assert rows["fp8-current"]["verdict"] in ("PASS", "WARN", "FAIL")
    coverage = rows["fp8-current"]["coverage"]
    # 2 blocks of 4 attention linears, 3 shared-expert linears and 3 groups of experts; 2 routers and the head kept
    assert (coverage["converted"], coverage["linears"], coverage["kept"]) == (20, 23, {"policy": 3})
    assert coverage["fraction"] > 0.9
