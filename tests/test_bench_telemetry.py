"""benchmarks/bench_telemetry.py, run as its dry run (the tiny model, eager, on the CPU)."""
from __future__ import annotations

import json
import math

import pytest
import torch

from tests.helpers import load_benchmark


def test_the_dry_run_measures_both_steps_and_writes_them(tmp_path):
    with pytest.MonkeyPatch.context() as mp, torch.random.fork_rng():
        bench = load_benchmark("bench_telemetry", mp)
        result = bench.main(["--dry-run", "--every", "5", "--recipe", "fp8-current", "--out", str(tmp_path)])
    assert result["size"] == "tiny" and not result["compiled"]
    assert result["records_per_sample"] > 0 and result["records_per_sample"] % 6 == 0  # six sides per layer
    assert result["plain_step_ms"] > 0 and result["sampled_step_ms"] > 0 and math.isfinite(result["cost_pct"])
    saved = json.loads((tmp_path / "telemetry.json").read_text())
    assert saved["cost_pct"] == result["cost_pct"] and saved["every"] == 5
