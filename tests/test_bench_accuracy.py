"""benchmarks/bench_accuracy.py --report: merging result directories with an earlier merged table."""
from __future__ import annotations

import json
import math

import pytest

from tests.helpers import load_benchmark


def _run(recipe: str, seed: int, val: float) -> dict:
    return {"recipe": recipe, "seed": seed, "model": "125m", "final_val_loss": val, "tokens_per_s": 100.0 * (seed + 1),
            "peak_memory_gib": 10.0, "tokens": 5e7, "skipped": 0, "val_curve": [[10, val + 1.0], [20, val]]}


def test_report_merges_directories_and_tables(tmp_path):
    old = tmp_path / "old.json"
    old.write_text(json.dumps({"rows": [_run("bf16", 0, 0.60), _run("bf16", 1, 0.62), _run("mxfp8", 0, 0.615)]}))
    new = tmp_path / "new"
    new.mkdir()
    (new / "fp8-rowwise-seed0.json").write_text(json.dumps(_run("fp8-rowwise", 0, 0.63)))
    with pytest.MonkeyPatch.context() as mp:
        bench = load_benchmark("bench_accuracy", mp)
        result = bench.main(["--report", str(old), str(new), "--out", str(tmp_path / "all")])
    assert sorted(r["recipe"] for r in result["rows"]) == ["bf16", "bf16", "fp8-rowwise", "mxfp8"]
    assert result["bf16_mean"] == pytest.approx(0.61)
    spread = math.sqrt(((0.60 - 0.61) ** 2 + (0.62 - 0.61) ** 2) / 1)  # sample standard deviation of two seeds
    assert result["noise_rel"] == pytest.approx(2 * spread * math.sqrt(1 + 1 / 2) / 0.61)
    saved = json.loads((tmp_path / "all" / "accuracy.json").read_text())
    assert len(saved["rows"]) == 4


def test_a_run_found_twice_counts_once(tmp_path):
    table = tmp_path / "table.json"
    table.write_text(json.dumps({"rows": [_run("bf16", 0, 0.60), _run("bf16", 1, 0.62)]}))
    with pytest.MonkeyPatch.context() as mp:
        bench = load_benchmark("bench_accuracy", mp)
        once = bench.main(["--report", str(table), "--out", str(tmp_path / "a")])
        twice = bench.main(["--report", str(table), str(table), "--out", str(tmp_path / "b")])
    assert len(twice["rows"]) == 2 and twice["noise_rel"] == once["noise_rel"]
