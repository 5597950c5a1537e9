"""The experts' weight-gradient grouped GEMM at several tile settings, and the experts' transposed weight codes,
at the expert shapes of ``moe-1b``, Mixtral-8x7B and Qwen3-30B-A3B (16k tokens): what chose
``triton_grouped_gemm.FEATURE_TILES`` and the Triton transposed copy.

```
cd benchmarks
python3 bench_grouped_tiles.py --out results          # one GPU
```

For each shape: the features kind (E5M2 x E4M3, the weight gradient of ``fp8-current``) in milliseconds and
TFLOP/s at each setting (tiles, pipeline stages, programs per multiprocessor), with its largest difference from
the first setting (the same bits expected: only the tiling changes); then the transposed copy of every expert's
FP8 weight codes, torch's against lowprec's, checked equal bit for bit. Needs a GPU.
"""
from __future__ import annotations

import argparse

import _common as C
import torch
from bench_moe import _counts

from lowprec.kernels import triton_grouped
from lowprec.kernels import triton_grouped_gemm as TG

SHAPES = {"moe-1b": (32, 1024, 512, 4), "mixtral-8x7b": (8, 4096, 14336, 2), "qwen3-30b-a3b": (128, 2048, 768, 8)}
"""Experts, model width, expert width, experts per token."""
SETTINGS = (((128, 128, 128), 4, 3), ((256, 128, 128), 4, 1), ((256, 128, 128), 3, 1), ((256, 128, 128), 4, 2))
"""(tiles, stages, programs per multiprocessor): the kernel's setting before run 84, then three of 256 rows."""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", type=int, default=16384)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        ap.error("a CUDA device is needed (the kernels' tiles matter on a GPU only)")
    dev = "cuda"
    kept = (TG.FEATURE_TILES, TG.FEATURE_STAGES, TG.FEATURES_PER_SM)
    rows, result = [], {}
    try:
        for name, (e, dim, width, top_k) in SHAPES.items():
            counts = _counts(args.tokens, e, top_k)
            padded = [-(-c // 16) * 16 for c in counts]
            ends = torch.tensor(padded, device=dev).cumsum(0).to(torch.int32)
            for m, n in ((width, dim), (dim, width)):
                a_t = torch.randn(m, sum(padded), device=dev).to(torch.float8_e5m2)
                b_t = torch.randn(n, sum(padded), device=dev).to(torch.float8_e4m3fn)
                sa, sb = torch.ones(e * m, device=dev), torch.ones(e * n, device=dev)
                flops, first = 2 * m * n * sum(counts), None
                for tiles, stages, per_sm in SETTINGS:
                    TG.FEATURE_TILES, TG.FEATURE_STAGES, TG.FEATURES_PER_SM = tiles, stages, per_sm
                    def run(a_t=a_t, sa=sa, b_t=b_t, sb=sb, ends=ends):
                        return TG._grouped_features(a_t, sa, b_t, sb, ends, torch.bfloat16)

                    out = run().float()
                    first = out if first is None else first
                    ms = C.bench_ms(run)
                    diff = (out - first).abs().max().item()
                    rows.append([f"{name} wgrad {m}x{n}", f"{tiles} s{stages} p{per_sm}", f"{ms:.3f}",
                                 f"{flops / ms / 1e9:.0f}", f"{diff:.2g}"])
                    result[f"{name} {m}x{n} {tiles} s{stages} p{per_sm}"] = ms
            for r, k in ((width, dim), (dim, width)):
                w = torch.randn(e, r, k, device=dev).to(torch.float8_e4m3fn)
                same = torch.equal(triton_grouped.transposed(w).view(torch.uint8),
                                   w.transpose(1, 2).contiguous().view(torch.uint8))
                ms_torch = C.bench_ms(lambda w=w: w.transpose(1, 2).contiguous())
                ms_triton = C.bench_ms(lambda w=w: triton_grouped.transposed(w))
                rows.append([f"{name} transposed ({e}, {r}, {k})", "torch / triton",
                             f"{ms_torch:.3f} / {ms_triton:.3f}", "-", "0" if same else "DIFFERS"])
                result[f"{name} transposed {r}x{k}"] = (ms_torch, ms_triton, same)
    finally:
        TG.FEATURE_TILES, TG.FEATURE_STAGES, TG.FEATURES_PER_SM = kept
    C.print_table(f"grouped weight-gradient tiles and transposed codes, {args.tokens} tokens",
                  ["what", "setting", "ms", "TFLOP/s", "max diff vs first"], rows)
    if args.out:
        C.write_json(args.out, C.result_name("grouped_tiles"), {"env": C.environment(), "ms": result})


if __name__ == "__main__":
    main()
