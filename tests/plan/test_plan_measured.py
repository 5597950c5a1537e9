"""The planner against the H200: its total for the 1B model's training step, with each memory option, and
for the moe-1b mixture of experts (32 experts of 512, top 4, a shared expert; written as the Qwen2-MoE config
that describes its shapes), within 10% of the peak measured by benchmarks/bench_model.py
(benchmarks/results/memory-1b.json, memory-moe-1b.json)."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from lowprec.cli import main

RESULTS = Path(__file__).resolve().parents[2] / "benchmarks" / "results"
MEASURED = {name: json.loads((RESULTS / f"memory-{name}.json").read_text()) for name in ("1b", "moe-1b")}
OPTIONS = {"fp8w": ["--fp8-weights"], "fp8act": ["--fp8-activations", "1x128"],
           "fp8states": ["--optim-states", "fp8"], "int8states": ["--optim-states", "int8"]}


def _args(variant: str) -> list[str]:
    if variant == "bf16":
        return ["--recipe", "bf16"]
    recipe, *options = variant.removeprefix("lowprec:").split("+")
    return ["--recipe", recipe] + [a for o in options for a in OPTIONS[o]]


@pytest.mark.parametrize(("model", "variant"), [(m, v) for m in MEASURED for v in sorted(MEASURED[m]["peak_gib"])])
def test_the_planned_step_is_within_ten_percent_of_the_measured_peak(model, variant):
    run = MEASURED[model]
    args = ["plan", "--model", str(RESULTS / run["model_config"]), "--gpu", "h200", "--gpus", "1",
            "--seq", str(run["seq"]), "--micro-batch", str(run["micro_batch"]), "--json", *_args(variant)]
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 0, result.output
    planned_gib = json.loads(result.stdout)["memory"]["total_gb"] * 1e9 / 2**30
    measured = run["peak_gib"][variant]
    assert abs(planned_gib - measured) <= 0.10 * measured, (planned_gib, measured)


def test_the_moe_config_describes_the_moe_1b_preset():
    """The Qwen2-MoE config the planner reads for moe-1b has the preset's parameters (vocabulary 32000)."""
    import dataclasses

    from lowprec.train.model import PRESETS

    result = CliRunner().invoke(main, ["plan", "--model", str(RESULTS / MEASURED["moe-1b"]["model_config"]),
                                       "--gpu", "h200", "--gpus", "1", "--json"])
    assert result.exit_code == 0, result.output
    preset = dataclasses.replace(PRESETS["moe-1b"], vocab_size=32000)
    assert json.loads(result.stdout)["model"]["params"] == preset.num_params()
