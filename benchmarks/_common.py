"""Shared by the benchmark scripts: environment, timing, bit comparison, tables and JSON output."""
from __future__ import annotations

import datetime
import json
import os
import platform
import sys
import time
from collections.abc import Callable
from typing import TypeVar

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))  # run from a checkout without install

from lowprec._table import format_table

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
"""Where the benchmarks run; on a machine without CUDA only a dry run at tiny sizes makes sense."""

T = TypeVar("T")


def environment() -> dict:
    import triton

    dev = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    return {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"), "device": dev,
            "torch": torch.__version__, "triton": triton.__version__, "cuda": torch.version.cuda,
            "python": platform.python_version()}


def bench_ms(fn, warmup: int = 25, rep: int = 100) -> float:
    """Median milliseconds of ``fn`` by ``triton.testing.do_bench`` (CUDA events, L2 flushed); on a
    machine without CUDA (a dry run of the script) one wall-clock call."""
    if not torch.cuda.is_available():
        t = time.perf_counter()
        fn()
        return (time.perf_counter() - t) * 1e3
    import triton.testing

    return float(triton.testing.do_bench(fn, warmup=warmup, rep=rep, return_mode="median"))


def sync(device: torch.device | str) -> None:
    """Wait for the work queued on ``device`` (a CUDA one; nothing to wait for on a CPU)."""
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def timed(step: Callable[[], T], n: int, device: torch.device | str) -> tuple[list[float], T]:
    """Seconds of each of ``n`` calls of ``step`` on ``device`` (CUDA events, one sync at the end; wall clock
    on a CPU), and what the last call returned (a training step's loss)."""
    if torch.device(device).type != "cuda":
        seconds = []
        for _ in range(n):
            t0 = time.perf_counter()
            out = step()
            seconds.append(time.perf_counter() - t0)
        return seconds, out
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(n)]
    for start, end in events:
        start.record()
        out = step()
        end.record()
    torch.cuda.synchronize(device)
    return [start.elapsed_time(end) / 1e3 for start, end in events], out


def copy_bandwidth(nbytes: int = 1 << 31) -> float:
    """Device-to-device copy, bytes read plus written per second: the ceiling for memory-bound casts."""
    src = torch.randn(nbytes // 4, device=DEVICE)
    dst = torch.empty_like(src)
    ms = bench_ms(lambda: dst.copy_(src))
    return 2 * nbytes / (ms * 1e-3)


def canonical_codes(data: torch.Tensor, fmt_name: str) -> torch.Tensor:
    """uint8 codes with every NaN code made one (a NaN's sign and payload follow the device's
    division, not the format)."""
    c = data.view(torch.uint8) if data.dtype != torch.uint8 else data
    if fmt_name == "e4m3":
        return torch.where((c & 0x7F) == 0x7F, 0x7F, c)
    if fmt_name == "e5m2":
        return torch.where((c & 0x7F) > 0x7C, 0x7F, c)
    return c


def same_bits(a: torch.Tensor | None, b: torch.Tensor | None) -> bool:
    """Bitwise equality of float32 tensors (NaN == NaN when their bits agree)."""
    if a is None or b is None:
        return a is None and b is None
    a, b = a.contiguous(), b.contiguous()
    return a.shape == b.shape and torch.equal(a.view(torch.int32), b.view(torch.int32))


def same_quantized(q, r) -> bool:
    """``q`` and the reference ``r`` (QuantizedTensors) hold the same codes, scales and metadata."""
    return (q.data.shape == r.data.shape and q.shape == r.shape and q.fmt == r.fmt
            and torch.equal(canonical_codes(q.data, q.fmt.name), canonical_codes(r.data, r.fmt.name))
            and same_bits(q.scale.float(), r.scale.float()) and same_bits(q.global_scale, r.global_scale))


def sqnr(ref: torch.Tensor, test: torch.Tensor) -> float:
    ref, test = ref.double(), test.double()
    noise = torch.linalg.vector_norm(ref - test).item()
    return float("inf") if noise == 0 else 20 * torch.log10(torch.linalg.vector_norm(ref) / noise).item()


def result_name(*parts: str) -> str:
    """A result file's name from what was asked (so that runs split over several calls do not overwrite
    one another), without the characters some file transfers drop: ``,`` ``:`` ``+``."""
    return ("_".join(parts) + ".json").replace(",", "-").replace(":", ".").replace("+", "_")


def write_json(out_dir: str, name: str, payload: dict) -> None:
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, name), "w") as fh:
        json.dump(payload, fh, indent=1, default=str)


def print_table(title: str, headers: list[str], rows: list[list]) -> None:
    print(f"\n## {title}")
    print(format_table(headers, rows, markdown=True))
