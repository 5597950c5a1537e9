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


def test_each_recipe_is_summarised_over_its_seeds(tmp_path):
    """A recipe run with two seeds: the gap of its mean to BF16's mean, the noise of a two-seed mean, and
    its mean gap to BF16's run of the same seed; a recipe whose seed BF16 lacks has no paired gap."""
    table = tmp_path / "table.json"
    rows = [_run("bf16", 0, 0.60), _run("bf16", 1, 0.62), _run("bf16", 2, 0.61),
            _run("mxfp4", 0, 0.612), _run("mxfp4", 1, 0.6324), _run("nvfp4", 5, 0.63),
            _run("mxfp8", 0, 0.61), _run("mxfp8", 1, float("nan"))]
    table.write_text(json.dumps({"rows": rows}))
    with pytest.MonkeyPatch.context() as mp:
        bench = load_benchmark("bench_accuracy", mp)
        result = bench.main(["--report", str(table), "--out", str(tmp_path / "all")])
    mx = result["recipes"]["mxfp4"]
    assert mx["seeds"] == 2
    assert mx["gap"] == pytest.approx((0.6222 - 0.61) / 0.61)
    assert mx["noise"] == pytest.approx(2 * 0.01 * math.sqrt(1 / 2 + 1 / 3) / 0.61)  # BF16's spread: 0.01
    assert mx["paired_gap"] == pytest.approx((0.012 / 0.60 + 0.0124 / 0.62) / 2)  # +2% against each own seed
    assert result["recipes"]["nvfp4"]["paired_gap"] is None and "bf16" not in result["recipes"]
    # a recipe that diverged at one seed has no gap, rather than the gap of its finished seed
    assert result["recipes"]["mxfp8"] == {"seeds": 2, "diverged": 1, "gap": None,
                                          "noise": pytest.approx(2 * 0.01 * math.sqrt(1 / 2 + 1 / 3) / 0.61),
                                          "paired_gap": None}


def test_jobs_pair_recipe_seeds_with_bf16_seeds():
    with pytest.MonkeyPatch.context() as mp:
        bench = load_benchmark("bench_accuracy", mp)
        default = bench.jobs(bench.parse_args(["--recipes", "mxfp4,nvfp4"]))
        more = bench.jobs(bench.parse_args(["--recipes", "bf16,mxfp4", "--bf16-seeds", "1", "--recipe-seeds", "2",
                                            "--seed-start", "3"]))
    assert default == [("bf16", 0), ("bf16", 1), ("mxfp4", 0), ("nvfp4", 0)]
    assert more == [("bf16", 3), ("mxfp4", 3), ("mxfp4", 4)]


def test_eager_trains_without_the_compiler(tmp_path, capsys):
    text = tmp_path / "corpus.txt"
    text.write_text("lowprec trains in low precision. " * 400)
    seen = []

    def train(model, data, cfg, **kw):
        seen.append(cfg)
        raise KeyboardInterrupt  # the configuration is all this test needs

    with pytest.MonkeyPatch.context() as mp:
        bench = load_benchmark("bench_accuracy", mp)
        mp.setattr(bench, "train", train)
        common = ["--model", "tiny", "--tokens", "512", "--batch-size", "2", "--seq-len", "16", "--data", str(text),
                  "--out", str(tmp_path / "out")]
        for flags in (["--eager"], []):
            with pytest.raises(KeyboardInterrupt):
                bench.run_one(bench.parse_args(common + flags), "fp8-current", 0)
        with pytest.raises(SystemExit):
            bench.parse_args(common + ["--eager", "--cuda-graphs"])
    eager, compiled = seen
    assert eager.compile is None and not eager.cuda_graphs
    assert compiled.compile == "inductor"
    assert "--cuda-graphs: replays compiled steps; expected it without --eager, got both" in capsys.readouterr().err


def test_runs_of_one_seed_in_two_modes_are_both_kept_and_pair_by_mode(tmp_path, capsys):
    """BF16's compiled seeds in a table, then a directory with an eager BF16 run of seed 0 and an eager recipe
    run: the eager BF16 run does not replace the compiled one (it did, silently, before runs had a mode); the
    band is the compiled seeds', and the eager recipe pairs with the eager BF16 run of its seed."""
    table = tmp_path / "table.json"
    table.write_text(json.dumps({"rows": [_run("bf16", 0, 0.60), _run("bf16", 1, 0.62), _run("bf16", 2, 0.61)]}))
    new = tmp_path / "eager"
    new.mkdir()
    (new / "bf16-seed0.json").write_text(json.dumps({**_run("bf16", 0, 0.64), "compiled": False}))
    (new / "mxfp4-seed0.json").write_text(json.dumps({**_run("mxfp4", 0, 0.672), "compiled": False}))
    (new / "nvfp4-seed1.json").write_text(json.dumps({**_run("nvfp4", 1, 0.651), "compiled": False}))
    with pytest.MonkeyPatch.context() as mp:
        bench = load_benchmark("bench_accuracy", mp)
        result = bench.main(["--report", str(table), str(new), "--out", str(tmp_path / "all")])
    assert sorted((r["recipe"], r["seed"], bench.mode(r)) for r in result["rows"]) == [
        ("bf16", 0, "compiled"), ("bf16", 0, "eager"), ("bf16", 1, "compiled"), ("bf16", 2, "compiled"),
        ("mxfp4", 0, "eager"), ("nvfp4", 1, "eager")]
    assert result["bf16_band_mode"] == "compiled" and result["bf16_mean"] == pytest.approx(0.61)
    assert result["recipes"]["mxfp4"]["paired_gap"] == pytest.approx(0.672 / 0.64 - 1)  # the eager seed 0
    assert result["recipes"]["nvfp4"]["paired_gap"] == pytest.approx(0.651 / 0.62 - 1)  # no eager seed 1: the band's
    # speed against BF16's eager run (100 tokens/s), not the compiled band's mean (200)
    row = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("| mxfp4"))
    assert [c.strip() for c in row.split("|")][8:10] == ["100", "1.00x"], row
