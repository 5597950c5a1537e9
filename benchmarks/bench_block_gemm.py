"""The Triton block-scaled GEMM (``kernels.triton_block_gemm.block_scaled_mm``) on the GPU: checked against the
emulated ``scaled_mm`` and timed beside it and a BF16 ``torch.mm``.

    python benchmarks/bench_block_gemm.py [--variants] [--out results/]

For each shape ``(M, N, K)`` and each of mxfp8, mxfp4 and nvfp4, quantizes random operands as the recipe's
fprop casts them (outside the timing), then:

* checks: the largest error relative to the output's largest magnitude, SQNR against the emulation, and the
  largest error per unit of ``|A| |B|^T`` in units of ``2^-8``, the bound [Note: block-scaled GEMMs on tensor
  cores] states for the FP8 MMA's accumulation inside a 32-wide chunk (``bound`` <= 1 holds it);
* bit-exactness on operands whose partial sums are all representable (small integers, E2M1 values, NVFP4
  codes with small E4M3 scales), where the GEMM must equal the emulation bit for bit;
* times (CUDA events, median of 20 after 5 warm-up calls) ``block_scaled_mm``, the emulated ``scaled_mm``
  and ``torch.mm`` in BF16, all with BF16 output.

With ``--variants``: every kernel variant (``BlockGemmVariant``) of mxfp8 and mxfp4 (nvfp4: ``dequant``, its
only one) at the first two shapes, each checked as above (the bit-exactness on operands of the timed shape)
and timed, with the tile the autotuner chose; one progress line each.

Under 3 minutes on an H200, autotuning included (``--variants``: under 4).
"""
from __future__ import annotations

import argparse
import statistics

import torch
from _common import environment, print_table, sqnr, write_json

from lowprec import formats as F
from lowprec import recipes as R
from lowprec.kernels.gemm import scaled_mm
from lowprec.kernels.triton_block_gemm import BlockGemmVariant, _chunk_tuned, _dequant_tuned, block_scaled_mm
from lowprec.quant import QuantizedTensor, nvfp4, quantize

SHAPES = [(8192, 4096, 4096), (8192, 14336, 4096), (8192, 4096, 14336)]
RECIPES = ["mxfp8", "mxfp4", "nvfp4"]
MMA_BOUND = 2.0**-8  # the FP8 MMA's error inside a chunk, per unit of sum |a_k b_k|, under the 14-bit model


def median_ms(fn, warmup: int = 5, rep: int = 20) -> float:
    for _ in range(warmup):
        fn()
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(rep)]
    for start, end in events:
        start.record()
        fn()
        end.record()
    torch.cuda.synchronize()
    return statistics.median(s.elapsed_time(e) for s, e in events)


def operands(recipe: str, m: int, n: int, k: int, gen: torch.Generator) -> tuple[QuantizedTensor, QuantizedTensor]:
    """Random ``x (M, K)`` and ``w (N, K)`` (BF16, magnitudes varying along K) cast as ``recipe``'s fprop."""
    spec = R.get(recipe).fprop
    x = (torch.randn(m, k, device="cuda", generator=gen) * torch.logspace(-2, 2, k, device="cuda")).bfloat16()
    w = (torch.randn(n, k, device="cuda", generator=gen) / k**0.5).bfloat16()
    return (quantize(x, spec.lhs.format, spec.lhs.granularity, rounding=spec.lhs.rounding),
            quantize(w, spec.rhs.format, spec.rhs.granularity, rounding=spec.rhs.rounding))


def check(a: QuantizedTensor, b: QuantizedTensor, variant: BlockGemmVariant | None = None) -> dict:
    ref = scaled_mm(a, b, torch.float32, backend="emulated")
    got = block_scaled_mm(a, b, torch.float32, variant=variant)
    err = (got - ref).abs()
    mag = a.dequantize(torch.float32).abs() @ b.dequantize(torch.float32).abs().t()  # (M, N): sum |a_k b_k|
    per_unit = (err / mag.clamp_min(torch.finfo(torch.float32).tiny)).max().item()
    return {"max_rel": (err.max() / ref.abs().max()).item(), "sqnr_db": sqnr(ref, got), "bound": per_unit / MMA_BOUND,
            "nan_same": torch.equal(torch.isnan(got), torch.isnan(ref))}


def exact_operands(recipe: str, m: int, n: int, k: int, gen: torch.Generator) -> tuple[QuantizedTensor, ...]:
    """Operands whose products' partial sums, in any order and in a 14-bit MMA accumulation, are exact."""
    if recipe == "nvfp4":
        return tuple(_nvfp4_exact(rows, k, two_d, g, gen) for rows, two_d, g in ((m, False, 2.0**-3), (n, True, 4.0)))
    spec = R.get(recipe).fprop
    if spec.lhs.format == "e2m1":  # E2M1 values: products are multiples of 1/4 up to 36
        grid = torch.tensor([-6.0, -4, -3, -2, -1.5, -1, -0.5, 0, 0.5, 1, 1.5, 2, 3, 4, 6], device="cuda")
        x, w = (grid[torch.randint(0, 15, (r, k), device="cuda", generator=gen)] for r in (m, n))
    else:  # integers of at most 4 significant bits
        x, w = (torch.randint(-15, 16, (r, k), device="cuda", generator=gen).float() for r in (m, n))
    return quantize(x, spec.lhs.format, spec.lhs.granularity), quantize(w, spec.rhs.format, spec.rhs.granularity)


def _nvfp4_exact(rows: int, k: int, two_d: bool, g: float, gen: torch.Generator) -> QuantizedTensor:
    br = 16 if two_d else 1
    codes = torch.randint(0, 16, (rows, k), device="cuda", generator=gen, dtype=torch.uint8)
    choices = torch.tensor([0.5, 0.75, 1.0, 1.5, 2.0, 3.0], device="cuda")
    scale = choices[torch.randint(0, 6, (rows // br, k // 16), device="cuda", generator=gen)]
    return QuantizedTensor(codes, scale, F.get("e2m1"), nvfp4(16, two_d=two_d), torch.Size((rows, k)),
                           torch.float32, torch.tensor(g, device="cuda"))


def run(m: int, n: int, k: int, recipe: str, bf16_ms: float, gen: torch.Generator) -> dict:
    a, b = operands(recipe, m, n, k, gen)
    row = {"shape": f"{m}x{n}x{k}", "recipe": recipe, **check(a, b)}
    ea, eb = exact_operands(recipe, 1024, 1024, 4096, gen)
    row["bit_exact"] = torch.equal(block_scaled_mm(ea, eb), scaled_mm(ea, eb, torch.float32, backend="emulated"))
    row["kernel_ms"] = median_ms(lambda: block_scaled_mm(a, b, torch.bfloat16))
    row["emulated_ms"] = median_ms(lambda: scaled_mm(a, b, torch.bfloat16, backend="emulated"))
    flops = 2 * m * n * k
    row.update(kernel_tflops=flops / row["kernel_ms"] / 1e9, kernel_vs_bf16=bf16_ms / row["kernel_ms"],
               emulated_vs_bf16=bf16_ms / row["emulated_ms"], bf16_ms=bf16_ms)
    print(row, flush=True)
    return row


def run_variant(m: int, n: int, k: int, recipe: str, variant: BlockGemmVariant, ops: tuple, exact: tuple,
                base: dict) -> dict:
    """One variant on prepared operands: timed first (the autotuning happens there), then checked."""
    a, b = ops
    ms = median_ms(lambda: block_scaled_mm(a, b, torch.bfloat16, variant=variant))
    tuner = _dequant_tuned if variant is BlockGemmVariant.DEQUANT else _chunk_tuned
    row = {**base, "variant": variant.value, "kernel_ms": ms, "kernel_tflops": 2 * m * n * k / ms / 1e9,
           "kernel_vs_bf16": base["bf16_ms"] / ms, "tile": str(tuner.best_config).split(", num_ctas")[0]}
    row.update(check(a, b, variant))
    row["bit_exact"] = torch.equal(block_scaled_mm(*exact, variant=variant),
                                   scaled_mm(*exact, torch.float32, backend="emulated"))
    print({c: (f"{v:.4g}" if isinstance(v, float) else v) for c, v in row.items()}, flush=True)
    return row


def variants_main(gen: torch.Generator) -> list[dict]:
    rows = []
    for m, n, k in SHAPES[:2]:
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
        bf16_ms = median_ms(lambda x=x, w=w: torch.mm(x, w.t()))
        del x, w
        for recipe in RECIPES:
            ops, exact = operands(recipe, m, n, k, gen), exact_operands(recipe, m, n, k, gen)
            emulated_ms = median_ms(lambda ops=ops: scaled_mm(*ops, torch.bfloat16, backend="emulated"))
            base = {"shape": f"{m}x{n}x{k}", "recipe": recipe, "bf16_ms": bf16_ms,
                    "emulated_vs_bf16": bf16_ms / emulated_ms}
            print(f"{base['shape']} {recipe}: BF16 {bf16_ms:.3f} ms, emulated {emulated_ms:.3f} ms", flush=True)
            for v in [BlockGemmVariant.DEQUANT] if recipe == "nvfp4" else list(BlockGemmVariant):
                if v is BlockGemmVariant.CHUNK_INLINE and recipe == "mxfp8":
                    continue  # FP8 codes: the same kernel as chunk
                rows.append(run_variant(m, n, k, recipe, v, ops, exact, base))
            del ops, exact
            torch.cuda.empty_cache()
    headers = ["shape", "recipe", "variant", "tile", "err / bound", "SQNR dB", "bit-exact", "ms", "TFLOP/s",
               "/ BF16", "emul / BF16"]
    keys = ["shape", "recipe", "variant", "tile", "bound", "sqnr_db", "bit_exact", "kernel_ms", "kernel_tflops",
            "kernel_vs_bf16", "emulated_vs_bf16"]
    print_table("block_scaled_mm variants (speed ratios: BF16 time / time)", headers,
                [[f"{r[c]:.3g}" if isinstance(r[c], float) else str(r[c]) for c in keys] for r in rows])
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default=None, help="a folder for the JSON result (none: print only)")
    p.add_argument("--variants", action="store_true", help="every kernel variant at the first two shapes")
    args = p.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench_block_gemm: expected a CUDA device, got none")
    gen = torch.Generator(device="cuda").manual_seed(0)
    if args.variants:
        rows = variants_main(gen)
        if args.out:
            write_json(args.out, "bench_block_gemm_variants.json", {"environment": environment(), "rows": rows})
        return
    rows = []
    for m, n, k in SHAPES:
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
        bf16_ms = median_ms(lambda x=x, w=w: torch.mm(x, w.t()))
        rows += [run(m, n, k, r, bf16_ms, gen) for r in RECIPES]
    headers = ["shape", "recipe", "max rel err", "SQNR dB", "err / bound", "NaN same", "bit-exact", "kernel ms",
               "TFLOP/s", "kernel / BF16", "emulated / BF16", "BF16 ms"]
    keys = ["shape", "recipe", "max_rel", "sqnr_db", "bound", "nan_same", "bit_exact", "kernel_ms", "kernel_tflops",
            "kernel_vs_bf16", "emulated_vs_bf16", "bf16_ms"]
    fmt = {float: lambda v: f"{v:.3g}"}
    print_table("block_scaled_mm against the emulation and BF16 (speed ratios: BF16 time / time)", headers,
                [[fmt.get(type(r[c]), str)(r[c]) for c in keys] for r in rows])
    if args.out:
        write_json(args.out, "bench_block_gemm.json", {"environment": environment(), "rows": rows})


if __name__ == "__main__":
    main()
