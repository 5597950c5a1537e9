"""Benchmark 2: scaled GEMM TFLOP/s per recipe against BF16, at Llama-3-8B shapes.

    python benchmarks/bench_gemm.py --out results/

For each shape ``(M tokens) x (K in) -> (N out)`` of a Llama-3-8B layer, and 8192^3, and each recipe's
forward operands (MX: folded to row scales on FP8 tensor cores, the folding timed with the GEMM; and
emulated), quantizes both operands (outside the timing), checks ``scaled_mm`` against the FP32 GEMM
of the dequantized operands (SQNR), and times it beside ``torch.mm`` in BF16, in one process.
"""
from __future__ import annotations

import argparse
import dataclasses

import torch
from _common import DEVICE, bench_ms, environment, print_table, sqnr, write_json

from lowprec.kernels import capability, gemm_backend, quantize, scaled_mm
from lowprec.quant import blockwise, mx, nvfp4, rowwise, tensorwise

SHAPES = {"qo_proj": (4096, 4096), "gate_up": (4096, 14336), "down": (14336, 4096)}
# name: (lhs fmt, lhs granularity, rhs fmt, rhs granularity, fast_accum, backend or None for the default)
RECIPES = {
    "fp8 tensor fast-accum": ("e4m3", tensorwise(), "e4m3", tensorwise(), True, None),
    "fp8 tensor": ("e4m3", tensorwise(), "e4m3", tensorwise(), False, None),
    "fp8 row": ("e4m3", rowwise(), "e4m3", rowwise(), False, None),
    "fp8 1x128 x 128x128": ("e4m3", blockwise(1, 128), "e4m3", blockwise(128, 128), False, None),
    "fp8 1x128 x 128x128 emulated": ("e4m3", blockwise(1, 128), "e4m3", blockwise(128, 128), False, "emulated"),
    "fp8 1x128 x 1x128 (wgrad)": ("e4m3", blockwise(1, 128), "e4m3", blockwise(1, 128), False, None),
    "fp8 1x128 x 1x128 emulated": ("e4m3", blockwise(1, 128), "e4m3", blockwise(1, 128), False, "emulated"),
    "mxfp8": ("e4m3", mx(32, "ceil"), "e4m3", mx(32, "ceil"), False, None),
    "mxfp8 emulated": ("e4m3", mx(32, "ceil"), "e4m3", mx(32, "ceil"), False, "emulated"),
    "mxfp4": ("e2m1", mx(32, "ceil"), "e2m1", mx(32, "ceil"), False, None),
    "mxfp4 emulated": ("e2m1", mx(32, "ceil"), "e2m1", mx(32, "ceil"), False, "emulated"),
    "nvfp4 (emulated)": ("e2m1", nvfp4(16), "e2m1", nvfp4(16, True), False, None),
}
SQUARE = 8192
"""The MX issue's GEMM target: 8192^3."""


def check_fold() -> dict:
    """The Triton fold against the reference, bit for bit, for every MX element format (a NaN's sign aside),
    and the folded GEMM's first-use check on this device (its error per unit of |A||B|^T)."""
    from lowprec.kernels import fold as FD
    from lowprec.kernels.first_use import relative_error
    from lowprec.kernels.gemm import _emulated, _folded

    out = {}
    for fmt in ("e4m3", "e5m2", "e3m2", "e2m3", "e2m1"):
        x = torch.randn(1000, 4096, device=DEVICE) * torch.logspace(-12, 12, 4096, base=2, device=DEVICE)
        q = quantize(x, fmt, mx(32, "ceil"))
        a, b = FD.fold(q, backend="triton"), FD.fold_reference(q)
        nan = a.values().isnan()
        same = torch.equal(nan, b.values().isnan()) and torch.equal(a.scale, b.scale) and torch.equal(
            a.data.view(torch.uint8)[~nan], b.data.view(torch.uint8)[~nan])
        out[f"triton fold == reference ({fmt})"] = same

        def folded(data, scale, q=q):  # the reference's ops as a compiled graph runs them
            r = FD.fold_reference(dataclasses.replace(q, data=data, scale=scale))
            return r.data.view(torch.uint8), r.scale

        c_data, c_scale = torch.compile(folded, dynamic=False)(q.data, q.scale)  # one graph per format
        out[f"compiled fold == reference ({fmt})"] = torch.equal(c_scale, b.scale) and torch.equal(
            c_data[~nan], b.data.view(torch.uint8)[~nan])
    for name, a, b in FD.CHECK.problems(torch.device(DEVICE)):
        out[f"first-use check error ({name})"] = relative_error(a, b, _folded, _emulated)
    return out


def run_shape(m: int, k: int, n: int) -> list[dict]:
    x = torch.randn(m, k, device=DEVICE, dtype=torch.bfloat16)
    w = (torch.randn(n, k, device=DEVICE) / k**0.5).bfloat16()
    flops = 2 * m * n * k
    bf16_ms = bench_ms(lambda: x @ w.t())
    out = [{"recipe": "bf16", "ms": bf16_ms, "tflops": flops / bf16_ms / 1e9, "vs_bf16": 1.0, "sqnr_db": None}]
    cap = capability()
    for name, (fa, ga, fb, gb, fast, backend) in RECIPES.items():
        qa, qb = quantize(x, fa, ga), quantize(w, fb, gb)
        be = backend or gemm_backend(qa, qb, cap)
        row = {"recipe": name, "backend": be}
        try:
            y = scaled_mm(qa, qb, torch.bfloat16, fast_accum=fast, backend=be)
            ref = qa.dequantize(torch.float32) @ qb.dequantize(torch.float32).t()
            row["sqnr_db"] = sqnr(ref, y.float())
            ms = bench_ms(lambda qa=qa, qb=qb, fast=fast, be=be:
                          scaled_mm(qa, qb, torch.bfloat16, fast_accum=fast, backend=be))
            row.update(ms=ms, tflops=flops / ms / 1e9, vs_bf16=bf16_ms / ms)
        except Exception as e:  # a path the device refuses: recorded, not fatal
            row["error"] = f"{type(e).__name__}: {str(e)[:300]}"
        out.append(row)
        print(m, k, n, row, flush=True)
    return out


def probe_blockwise(m: int = 2048, k: int = 1024, n: int = 1536) -> list[dict]:
    """Which scale layouts ``torch._scaled_mm`` takes for 1x128 x 128x128 blocks, and whether the
    result matches the dequantized FP32 GEMM (cuBLAS refuses some layouts, and may misread others)."""
    x = torch.randn(m, k, device=DEVICE).bfloat16()
    w = torch.randn(n, k, device=DEVICE).bfloat16()
    qa, qb = quantize(x, "e4m3", blockwise(1, 128)), quantize(w, "e4m3", blockwise(128, 128))
    ref = qa.dequantize(torch.float32) @ qb.dequantize(torch.float32).t()
    sa_col = qa.scale.t().contiguous().t()  # (M, K/128), outer-dim-major
    variants = {"a col-major, b = scale.T view": (sa_col, qb.scale.t()),
                "a col-major, b = scale.T contiguous": (sa_col, qb.scale.t().contiguous()),
                "a row-major, b = scale.T view": (qa.scale, qb.scale.t()),
                "a row-major, b = scale.T contiguous": (qa.scale, qb.scale.t().contiguous())}
    out = []
    for name, (sa, sb) in variants.items():
        row = {"layout": name}
        try:
            y = torch._scaled_mm(qa.data, qb.data.t(), scale_a=sa, scale_b=sb, out_dtype=torch.bfloat16)
            row["sqnr_db"] = sqnr(ref, y.float())
        except Exception as e:
            row["error"] = f"{type(e).__name__}: {str(e)[:200]}"
        out.append(row)
        print("blockwise probe", row, flush=True)
    return out


RAGGED = [(2048, 768, 768), (2048, 768, 256), (2048, 2048, 768), (1000, 640, 384), (4096, 1024, 1536),
          (1001, 768, 130), (1002, 1024, 130)]
"""Block counts along K that are not multiples of 4 (768 = 6 x 128, 640 = 5 x 128), and row counts (M,
and N of a 1x128 right operand) that are not multiples of 4."""


def probe_blockwise_shapes() -> list[dict]:
    """lowprec's cuBLAS block-scaled GEMMs against the dequantized FP32 GEMM at ragged shapes (see
    [Note: block scales for cuBLAS] in ``lowprec.kernels.gemm``): a wrong scale layout shows as a low SQNR."""
    out = []
    for m, k, n in RAGGED:
        x = torch.randn(m, k, device=DEVICE) * torch.logspace(-2, 2, k, device=DEVICE)  # scales differ per block
        for rhs in (blockwise(128, 128), blockwise(1, 128)):
            w = torch.randn(n, k, device=DEVICE) * torch.logspace(2, -2, k, device=DEVICE)
            qa, qb = quantize(x, "e4m3", blockwise(1, 128)), quantize(w, "e4m3", rhs)
            ref = qa.dequantize(torch.float32) @ qb.dequantize(torch.float32).t()
            row = {"shape": f"{m}x{k}x{n}", "rhs": f"{rhs.block_rows}x{rhs.block_cols}"}
            try:
                row["sqnr_db"] = sqnr(ref, scaled_mm(qa, qb, torch.float32, backend="cublas"))
            except Exception as e:
                row["error"] = f"{type(e).__name__}: {str(e)[:200]}"
            out.append(row)
            print("blockwise shape", row, flush=True)
    return out


def probe_mm_out_dtype() -> str:
    a = torch.randn(256, 256, device=DEVICE).bfloat16()
    try:
        return str(torch.mm(a, a, out_dtype=torch.float32).dtype)
    except Exception as e:
        return f"{type(e).__name__}: {str(e)[:200]}"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=".")
    ap.add_argument("--tokens", type=int, default=16384)
    ap.add_argument("--probes-only", action="store_true", help="only the layout and ragged-shape checks")
    args = ap.parse_args()
    torch.manual_seed(0)
    env = environment()
    probes = {"blockwise_layouts": probe_blockwise(), "blockwise_ragged": probe_blockwise_shapes(),
              "mm_out_dtype_fp32": probe_mm_out_dtype()}
    print(probes, flush=True)
    if args.probes_only:
        write_json(args.out, "bench_gemm_probes.json", {"env": env, "probes": probes})
        return
    fold = check_fold()
    print(fold, flush=True)
    results, rows = {}, []
    shapes = {name: (args.tokens, k, n) for name, (k, n) in SHAPES.items()} | {"8192^3": (SQUARE,) * 3}
    for shape, (m, k, n) in shapes.items():
        res = run_shape(m, k, n)
        results[shape] = res
        for r in res:
            rows.append([shape, f"{m}x{k}x{n}", r["recipe"], r.get("backend", "torch.mm"),
                         f"{r['tflops']:.0f}" if "tflops" in r else r.get("error", "")[:40],
                         f"{r['vs_bf16']:.2f}x" if "vs_bf16" in r else "-",
                         f"{r['sqnr_db']:.1f}" if r.get("sqnr_db") is not None else "-"])
    write_json(args.out, "bench_gemm.json", {"env": env, "tokens": args.tokens, "probes": probes, "fold": fold,
                                             "results": results})
    print(f"\n{env}\n{fold}")
    print_table("scaled GEMMs (out BF16)", ["layer", "MxKxN", "recipe", "backend", "TFLOP/s", "vs BF16", "SQNR dB"],
                rows)


if __name__ == "__main__":
    main()
