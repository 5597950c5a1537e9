"""benchmarks/bench_optim.py's dry run: every optimizer steps, the moments take the bytes their formats say, and the
FP8 weights requantized together equal those requantized one by one."""
from __future__ import annotations

import pytest
import torch

from tests.helpers import load_benchmark


def test_dry_run_times_every_optimizer(tmp_path):
    with pytest.MonkeyPatch.context() as mp:
        bench = load_benchmark("bench_optim", mp)
        with torch.random.fork_rng():
            out = bench.main(["--size", "tiny", "--steps", "1", "--out", str(tmp_path)])
    r = out["results"]
    n = r["torch AdamW fused (fp32 moments)"]["params"]
    assert all(v["step_ms"] > 0 and v["params"] == n for v in r.values())
    gib = {k.split()[1]: v["moments_gib"] * 2**30 / n for k, v in r.items() if k.startswith("AdamWLP")}
    assert gib["fp32"] == pytest.approx(8.0) and gib["bf16"] == pytest.approx(4.0)
    assert 2.0 < gib["int8"] < 2.01 and 2.0 < gib["fp8"] < 2.2  # codes plus per-block float32 scales
    assert (tmp_path / "bench_optim_tiny.json").exists()
    requant = out["requantization"]
    # on the CPU both ways take the reference: this checks the amaxes taken together, not the kernel
    assert requant["bit_exact"] and requant["weights"] == 29 and requant["together_ms"] > 0  # 4 x 7 + the LM head
