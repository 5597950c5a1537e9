"""benchmarks/bench_moe.py, run as its dry run (four small experts, on the CPU): every variant asked for is
checked against its recipe's loop, and the MX recipes run each way the FP8 ones do."""
from __future__ import annotations

import json

import pytest
import torch

from tests.helpers import load_benchmark

SMALL = ["--tokens", "64", "--experts", "4", "--dim", "32", "--width", "32"]


@pytest.fixture(name="bench", scope="module")
def bench_fixture():
    with pytest.MonkeyPatch.context() as mp:
        yield load_benchmark("bench_moe", mp)


def test_the_mx_recipes_run_batched_and_equal_their_loops(bench, tmp_path, monkeypatch):
    monkeypatch.setattr("sys.argv", ["bench_moe.py", *SMALL, "--recipes", "mxfp8,mxfp4", "--out", str(tmp_path),
                                     "--variants", "mxfp8 batched,mxfp4 grouped"])
    with torch.random.fork_rng():
        bench.main()
    result = json.loads((tmp_path / "moe_4.json").read_text())
    assert set(result["ms"]) == {"bf16 grouped_mm", "mxfp8 loop", "mxfp8 batched", "mxfp4 loop", "mxfp4 grouped"}
    checks = {row[0]: row[1:] for row in result["checks"]}
    # on the CPU the batched casts and per-expert GEMMs are the loop's, bit for bit
    assert checks["mxfp8 batched"] == checks["mxfp4 grouped"] == ["0.00e+00"] * 3
    assert all(float(v) > 10 for v in checks["mxfp8 loop vs bf16 (SQNR dB)"])  # MX against BF16: real error


@pytest.mark.parametrize("argv", [["--recipes", "bf16"], ["--recipes", "fp9"], ["--variants", "mxfp8 grouped"]])
def test_unknown_recipes_and_variants_are_refused(bench, argv, monkeypatch, capsys):
    """A recipe it does not take (BF16 is the baseline every run measures; an unknown name), and a variant of a
    recipe not asked for, each named."""
    monkeypatch.setattr("sys.argv", ["bench_moe.py", *SMALL, *argv])
    with pytest.raises(SystemExit) as e:
        bench.main()
    assert e.value.code == 2 and "expected" in capsys.readouterr().err
