"""benchmarks/bench_distributed.py, run as its dry run (torchrun, two gloo ranks, the tiny model, one timed
step): what it measures, and the bytes it counts against the model's own shapes."""
from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
from torch import nn

from lowprec.train.model import build_model, preset
from tests.helpers import BENCHMARKS, load_benchmark

ROOT = Path(__file__).resolve().parents[1]
WORLD = 2
VARIANTS = ["ddp:bf16", "ddp:fp8-current+fp8comm", "fsdp2:bf16", "fsdp2:fp8-current+fp8ag+fp8rs"]
ROW_FIELDS = {"tokens_per_s_per_gpu", "tokens_per_s", "step_ms", "peak_gib", "first_step_s", "bytes_per_step",
              "sent_bytes_per_step", "sent_bytes_per_step_total", "loss_first", "loss_last", "skipped_steps",
              "conversion", "speed_vs_bf16", "memory_vs_bf16", "sent_bytes_vs_bf16", "all_gather_vs_bf16"}
KINDS = {"all_gather", "reduce_scatter", "all_reduce", "all_to_all", "broadcast"}
AGREE_BYTES = 16
"""The optimizer's one agreement all-reduce per step: four float32 numbers."""


@pytest.fixture(name="bench", scope="module")
def bench_fixture():
    """The script as a module."""
    with pytest.MonkeyPatch.context() as mp:
        yield load_benchmark("bench_distributed", mp)


@pytest.fixture(name="rows", scope="module")
def rows_fixture(tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("bench_distributed")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={WORLD}",
           str(BENCHMARKS / "bench_distributed.py"), "--sizes", "tiny", "--steps", "1", "--warmup", "0",
           "--variants", ",".join(VARIANTS), "--out", str(out), "--timeout-s", "60"]
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=150)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "## tiny / eager / 2 ranks" in done.stdout  # rank 0's table, printed once
    assert done.stdout.count("## tiny") == 1
    files = list(out.glob("*.json"))
    assert len(files) == 1
    payload = json.loads(files[0].read_text())
    assert payload["args"]["variants"] == VARIANTS and payload["env"]["world_size"] == WORLD
    return payload["results"]["tiny / eager / 2 ranks"]


def _shapes() -> dict[str, int]:
    """Parameter counts of the tiny model: all, in the blocks, and in the blocks' linear weights."""
    model = build_model(preset("tiny"))
    blocks = sum(p.numel() for p in model.layers.parameters())
    linears = sum(m.weight.numel() for m in model.layers.modules() if isinstance(m, nn.Linear))
    return {"all": sum(p.numel() for p in model.parameters()), "blocks": blocks, "block_linears": linears,
            "block": blocks // len(model.layers), "layers": len(model.layers)}


def test_every_variant_measures_a_whole_step(bench, rows):
    size = bench.SIZES["tiny"]
    assert list(rows) == VARIANTS
    for name, r in rows.items():
        extra = ({"grad_comm_hook_bytes_per_step"} if "fp8comm" in name or "fp8rs" in name else set()) | \
            ({"fp8_all_gather_layers"} if "fp8ag" in name else set())
        assert set(r) == ROW_FIELDS | extra, name
        assert set(r["bytes_per_step"]) == KINDS
        assert r["tokens_per_s_per_gpu"] == pytest.approx(size.tokens / r["step_ms"] * 1e3, rel=1e-12)
        assert r["tokens_per_s"] == pytest.approx(WORLD * r["tokens_per_s_per_gpu"], rel=1e-12)
        assert r["first_step_s"] > 0 and r["skipped_steps"] == 0
        assert r["peak_gib"] is None and r["memory_vs_bf16"] is None  # no CUDA allocator on a CPU
        # weights of std 0.02 give nearly uniform logits; the step after the first has learned something
        assert abs(r["loss_first"] - math.log(size.config.vocab_size)) < 0.2
        assert r["loss_last"] < r["loss_first"]
    assert rows["ddp:bf16"]["speed_vs_bf16"] == 1.0 and rows["fsdp2:bf16"]["sent_bytes_vs_bf16"] == 1.0


def test_ddp_all_reduces_the_bf16_gradient_once_per_step(rows):
    n = _shapes()["all"]
    bf16 = rows["ddp:bf16"]["bytes_per_step"]
    assert bf16 == {"all_gather": 0, "reduce_scatter": 0, "all_reduce": 2 * n + AGREE_BYTES, "all_to_all": 0,
                    "broadcast": 0}
    fp8 = rows["ddp:fp8-current+fp8comm"]["bytes_per_step"]
    assert fp8["all_reduce"] == AGREE_BYTES and fp8["reduce_scatter"] == 0
    # 128 codes and a float32 scale per 128 values, each of DDP's few buckets padded to whole blocks per rank
    assert n * 132 / 128 <= fp8["all_to_all"] < (n + 4 * WORLD * 128) * 132 / 128


def test_ddp_fp8_counted_bytes_equal_the_hooks_own_count(rows):
    r = rows["ddp:fp8-current+fp8comm"]
    sent = r["sent_bytes_per_step"]
    assert sent["all_to_all"] + sent["all_gather"] == r["grad_comm_hook_bytes_per_step"]


def test_fsdp2_bytes_follow_the_shapes(rows):
    s = _shapes()
    root = s["all"] - s["blocks"]
    bf16, fp8 = rows["fsdp2:bf16"], rows["fsdp2:fp8-current+fp8ag+fp8rs"]
    # each rank hands its half of every weight: blocks for the forward and again for the backward, but the
    # last block and the root (embedding, final norm, LM head) once: they stay gathered into the backward
    assert bf16["bytes_per_step"]["all_gather"] == 2 * (2 * s["blocks"] - s["block"] + root) // WORLD
    block_bytes = s["block_linears"] + 2 * (s["blocks"] - s["block_linears"])  # E4M3 linear weights, BF16 norms
    assert fp8["bytes_per_step"]["all_gather"] == (2 * block_bytes - block_bytes // s["layers"] + 2 * root) // WORLD
    assert fp8["bytes_per_step"]["all_gather"] < bf16["bytes_per_step"]["all_gather"]
    assert fp8["all_gather_vs_bf16"] == fp8["bytes_per_step"]["all_gather"] / bf16["bytes_per_step"]["all_gather"]
    # the reduce-scatter takes the whole BF16 gradient; in FP8 each unit's goes as 132 bytes per 128 values
    assert bf16["bytes_per_step"]["reduce_scatter"] == 2 * s["all"]
    units = [s["block"]] * s["layers"] + [root]
    assert fp8["bytes_per_step"]["reduce_scatter"] == 0
    assert fp8["bytes_per_step"]["all_to_all"] == sum(WORLD * math.ceil(n / WORLD / 128) * 132 for n in units)
    assert fp8["sent_bytes_per_step"]["all_to_all"] == fp8["grad_comm_hook_bytes_per_step"]
    # one all-reduce of every FP8-gathered weight's amax after the step, beside the optimizer's agreement
    assert fp8["bytes_per_step"]["all_reduce"] == AGREE_BYTES + 4 * 7 * s["layers"]
    assert fp8["fp8_all_gather_layers"] == 7 * s["layers"]


def test_sent_bytes_follow_each_collectives_schedule(bench):
    sent = bench.sent_bytes
    assert [sent(k, 1200, 4) for k in ("all_gather", "reduce_scatter", "all_reduce", "all_to_all")] == \
        [3600, 900, 1800, 900]
    assert sent("all_reduce", 1200, 1) == 0


def test_variant_names(bench):
    v = bench.Variant.parse("fsdp2:fp8-delayed+fp8rs+fp8ag")
    assert (v.parallel, v.recipe, v.options, v.baseline) == ("fsdp2", "fp8-delayed", ("fp8rs", "fp8ag"), "fsdp2:bf16")
    assert v.name == "fsdp2:fp8-delayed+fp8rs+fp8ag"


@pytest.mark.parametrize("argv", [["--variants", "ddp:fp8-current+fp8ag"], ["--variants", "fsdp2:fp8-current+fp8comm"],
                                  ["--variants", "fsdp2:fp9"], ["--variants", "tp:bf16"],
                                  ["--variants", "fsdp2:bf16+fp8rs+fp8rs"], ["--sizes", "7b"], ["--steps", "0"],
                                  ["--rounds", "0"]])
def test_bad_flags_are_refused(bench, argv, capsys, monkeypatch):
    monkeypatch.setenv("LOCAL_RANK", "0")
    with pytest.raises(SystemExit) as e:
        bench.parse_args(argv)
    assert e.value.code == 2
    assert "expected" in capsys.readouterr().err


def test_a_launch_without_torchrun_says_how(bench, capsys, monkeypatch):
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    with pytest.raises(SystemExit):
        bench.parse_args(["--sizes", "tiny"])
    assert "torchrun --nproc-per-node N" in capsys.readouterr().err


def test_rounds_time_every_variant_in_turn(rows, tmp_path):
    """``--rounds 3``: the variants set up together, then three rounds of a step of each: a median per round
    and over all, no peak (every variant resident), and per step the bytes of the variants measured alone."""
    variants = ["ddp:bf16", "fsdp2:bf16"]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={WORLD}",
           str(BENCHMARKS / "bench_distributed.py"), "--sizes", "tiny", "--steps", "1", "--warmup", "0",
           "--rounds", "3", "--variants", ",".join(variants), "--out", str(tmp_path), "--timeout-s", "60"]
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=150)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    (path,) = tmp_path.glob("*.json")
    assert path.name.endswith("_rounds3.json")
    got = json.loads(path.read_text())["results"]["tiny / eager / 2 ranks"]
    for name in variants:
        r = got[name]
        assert r["rounds"] == 3 and len(r["round_median_ms"]) == 3 and all(ms > 0 for ms in r["round_median_ms"])
        assert r["peak_gib"] is None and r["memory_vs_bf16"] is None
        assert r["bytes_per_step"] == rows[name]["bytes_per_step"]  # the same step as alone
    assert got["fsdp2:bf16"]["speed_vs_bf16"] == 1.0
