"""The planner against the H200: its total for the 1B model's training step, with each memory option,
within 10% of the peak measured by benchmarks/bench_model.py (benchmarks/results/memory-1b.json)."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from lowprec.cli import main

RESULTS = Path(__file__).resolve().parents[2] / "benchmarks" / "results"
MEASURED = json.loads((RESULTS / "memory-1b.json").read_text())
OPTIONS = {"fp8w": ["--fp8-weights"], "fp8act": ["--fp8-activations", "1x128"],
           "fp8states": ["--optim-states", "fp8"], "int8states": ["--optim-states", "int8"]}


def _args(variant: str) -> list[str]:
    if variant == "bf16":
        return ["--recipe", "bf16"]
    recipe, *options = variant.removeprefix("lowprec:").split("+")
    return ["--recipe", recipe] + [a for o in options for a in OPTIONS[o]]


@pytest.mark.parametrize("variant", sorted(MEASURED["peak_gib"]))
def test_the_planned_step_is_within_ten_percent_of_the_measured_peak(variant):
    args = ["plan", "--model", str(RESULTS / MEASURED["model_config"]), "--gpu", "h200", "--gpus", "1",
            "--seq", str(MEASURED["seq"]), "--micro-batch", str(MEASURED["micro_batch"]), "--json", *_args(variant)]
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 0, result.output
    planned_gib = json.loads(result.stdout)["memory"]["total_gb"] * 1e9 / 2**30
    measured = MEASURED["peak_gib"][variant]
    assert abs(planned_gib - measured) <= 0.10 * measured, (planned_gib, measured)
