"""The routed experts of one ``moe-1b`` block, forward and backward: BF16 against lowprec's batched recipes,
each way lowprec can run them, in one process.

```
cd benchmarks
python3 bench_moe.py --out results                         # one GPU: moe-1b's experts, 16k tokens, top 4
python3 bench_moe.py --tokens 256 --experts 4 --dim 128 --width 128 --out results   # dry run, any machine
python3 bench_moe.py --variants "bf16 grouped_mm,bf16 cudagraphs,fp8-current loop,fp8-current cudagraphs"
python3 bench_moe.py --recipes mxfp8,mxfp4 --variants "bf16 compiled,bf16 cudagraphs,mxfp8 grouped,mxfp8 cudagraphs"
python3 bench_moe.py --recipes fp8-blockwise --variants "bf16 compiled,fp8-blockwise grouped,fp8-blockwise cudagraphs"
```

Variants (all on the same routed rows, grouped by expert, with random unbalanced counts; ``<recipe>`` each of
``--recipes``, fp8-current and fp8-rowwise by default; fp8-blockwise, whose three GEMMs run on lowprec's
grouped Triton GEMMs with block scales; mxfp8 and mxfp4, whose three GEMMs run folded to row scales where the
device runs them so):
- ``bf16 loop``: one BF16 ``linear`` per expert (what ``GroupedLinear`` without a recipe did before);
- ``bf16 grouped_mm``: ``torch._grouped_mm`` (what it does now on a GPU; the baseline of the ratios);
- ``<recipe> loop``: every expert's casts and GEMMs one by one (``lowprec.nn.grouped.GroupedFunction``);
- ``<recipe> batched``: the casts of all experts batched, GEMMs per expert;
- ``<recipe> grouped``: batched casts, the GEMMs in ``torch._scaled_grouped_mm`` where it runs them best
  (E4M3 pairs with fast accumulation: the forward), the gradients' (E5M2 pairs, E4M3 pairs without fast
  accumulation) in lowprec's grouped Triton GEMMs (``kernels.triton_grouped_gemm``), NVFP4's emulated GEMMs
  as one grouped BF16 GEMM each (``kernels.grouped_emulated``): what ``GroupedLinear`` runs;
- ``<recipe> triton``: as ``grouped``, every grouped GEMM on the Triton kernels (E4M3 pairs too);
- ``<recipe> on device``: as ``grouped``, the counts left on the device (what a compiled graph runs, here
  eager: no host read, the padding sized for any routing);
- ``bf16 compiled``, ``<recipe> compiled``: the experts under ``torch.compile`` (in the graph: BF16's
  grouped GEMM, and the FP8 recipes' path on the device);
- ``bf16 cudagraphs``, ``<recipe> cudagraphs``: the same under ``torch.compile(mode="reduce-overhead")``,
  each call replayed as CUDA graphs (the host's launches recorded once).

Checks first: each variant's output, input gradient and ``w2`` weight gradient against its recipe's loop
(relative error), and the loops' against BF16's (SQNR). Then the milliseconds of forward + backward of the
SwiGLU experts (w1, w3, w2), and each variant's speed relative to ``bf16 grouped_mm``.
"""
from __future__ import annotations

import argparse
import contextlib
from unittest import mock

import _common as C
import torch

from lowprec.kernels import grouped_emulated, grouped_gemm
from lowprec.nn import InputShare, grouped, grouped_casts
from lowprec.train.moe_model import RoutedExperts

RECIPES = ("fp8-current", "fp8-delayed", "fp8-rowwise", "fp8-blockwise", "mxfp8", "mxfp4", "nvfp4")
"""The recipes whose experts lowprec batches (per tensor, per row, FP32 blocks, MX): each runs every way of the
table."""


def _counts(tokens: int, experts: int, top_k: int, seed: int = 0) -> tuple[int, ...]:
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(tokens, experts, generator=g) + torch.randn(experts, generator=g)  # unbalanced
    chosen = logits.topk(top_k, dim=1).indices.flatten()
    return tuple(torch.bincount(chosen, minlength=experts).tolist())


def _on_device(self, x, offsets):
    """``RoutedExperts.forward`` with every projection on the counts as the device holds them, eagerly (where
    the device runs that path; elsewhere, as in a dry run on a CPU, the counts read)."""
    def run(lin, h):
        way = lin._on_device(h)
        return lin._on_offsets(h, offsets, way) if way is not None else lin(h, offsets)

    return run(self.w2, self.act(run(self.w1, x), run(self.w3, x)))


def _variant(name: str):
    """Patch lowprec for one way of running the experts (``grouped``, the default way, needs no patch)."""
    if name.endswith("on device"):
        return mock.patch.object(RoutedExperts, "forward", _on_device)
    mode = name.split()[-1]
    never = lambda *a, **k: False  # noqa: E731
    patches = {"loop": [(grouped_casts, "batches", never)],
               "batched": [(grouped_gemm, "runs_grouped", never), (grouped_emulated, "runs", never)],
               "triton": [(grouped_gemm, "_on_torch", lambda a, b, fast_accum: False)]}
    if name == "bf16 loop":
        return mock.patch.object(grouped, "_grouped_bf16", lambda *a, **k: None)
    stack = contextlib.ExitStack()
    for patch in patches.get(mode, ()):
        stack.enter_context(mock.patch.object(*patch))
    return stack


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", type=int, default=16384)
    ap.add_argument("--experts", type=int, default=32)
    ap.add_argument("--top-k", type=int, default=4)
    ap.add_argument("--dim", type=int, default=1024)
    ap.add_argument("--width", type=int, default=512)
    ap.add_argument("--recipes", default="fp8-current,fp8-rowwise",
                    help=f"comma-separated recipes among {', '.join(RECIPES)}")
    ap.add_argument("--out", default=None)
    ap.add_argument("--variants", default=None, help="comma-separated names of the table (default: all); "
                    "'bf16 grouped_mm' and each recipe's loop always run, as the references")
    args = ap.parse_args()
    dev = C.DEVICE
    counts = _counts(args.tokens, args.experts, args.top_k)
    rows = sum(counts)
    offsets = torch.tensor(counts, device=dev).cumsum(0)
    torch.manual_seed(0)
    base = RoutedExperts(args.experts, args.dim, args.width).to(dev, torch.bfloat16)
    base.w1.state.share = base.w3.state.share = InputShare(("w1", "w3"))  # as convert groups them
    x = torch.randn(rows, args.dim, device=dev, dtype=torch.bfloat16)
    dy = torch.randn(rows, args.dim, device=dev, dtype=torch.bfloat16) * 1e-2
    recipes = tuple(args.recipes.split(","))
    unknown = set(recipes) - set(RECIPES)
    if unknown:
        ap.error(f"--recipes: expected names among {', '.join(RECIPES)}, got {', '.join(sorted(unknown))}")
    modes = ("loop", "batched", "grouped", "triton", "on device", "compiled", "cudagraphs")
    variants = ["bf16 loop", "bf16 grouped_mm", "bf16 compiled", "bf16 cudagraphs",
                *(f"{r} {m}" for r in recipes for m in modes)]
    if args.variants:
        wanted = set(args.variants.split(",")) | {"bf16 grouped_mm", *(f"{r} loop" for r in recipes)}
        unknown = wanted - set(variants)
        if unknown:
            ap.error(f"--variants: expected names among {', '.join(variants)}, got {', '.join(sorted(unknown))}")
        variants = [v for v in variants if v in wanted]
    outs, times = {}, {}
    for name in variants:
        recipe = name.split()[0] if name.split()[0] in RECIPES else None
        for lin in (base.w1, base.w3, base.w2):
            lin.set_recipe(recipe)
        torch._dynamo.reset()
        graphs = name.endswith("cudagraphs")
        forward = (torch.compile(base, mode="reduce-overhead") if graphs
                   else torch.compile(base) if name.endswith("compiled") else base)
        with _variant(name):
            xg = x.clone().requires_grad_()

            def step(xg=xg, forward=forward, graphs=graphs):
                if graphs:  # the last call's outputs are dead: its graphs' memory may be written again
                    torch.compiler.cudagraph_mark_step_begin()
                xg.grad = None
                for p in base.parameters():
                    p.grad = None
                y = forward(xg, offsets)
                y.backward(dy)
                return y

            torch.manual_seed(1)  # stochastic rounding (nvfp4) draws alike for every variant's checked step
            y = step()
            outs[name] = (y.detach().float(), xg.grad.float(), base.w2.weight.grad.float())
            times[name] = C.bench_ms(step, warmup=5, rep=30)
    checks = []
    for r in recipes:
        ref = outs[f"{r} loop"]
        for mode in modes[1:]:
            if f"{r} {mode}" not in outs:
                continue
            checks.append([f"{r} {mode}", *(f"{((a - b).norm() / b.norm()).item():.2e}"
                                             for a, b in zip(outs[f"{r} {mode}"], ref))])
        checks.append([f"{r} loop vs bf16 (SQNR dB)", *(f"{C.sqnr(b, a):.1f}"
                                                         for a, b in zip(ref, outs["bf16 grouped_mm"]))])
    C.print_table("checks: relative error against the recipe's loop", ["variant", "output", "input grad", "w2 grad"],
                  checks)
    print("grouped GEMM self-check:", grouped_gemm.grouped_status())
    if "nvfp4" in recipes and torch.device(dev).type == "cuda":
        print("nvfp4: its gradients round stochastically, and on a GPU the loop's Linears draw their numbers in "
              "Triton (Philox) where the batched casts draw torch's: the gradients differ by two roundings' "
              "spread; on the CPU they equal the loop bit for bit")
    base_ms = times["bf16 grouped_mm"]
    table = [[n, f"{times[n]:.2f}", f"{base_ms / times[n]:.2f}x"] for n in variants]
    C.print_table(f"{args.experts} experts {args.dim}->{args.width}->{args.dim}, {rows} routed rows, fwd+bwd",
                  ["variant", "ms", "vs bf16 grouped_mm"], table)
    if args.out:
        C.write_json(args.out, C.result_name("moe", str(args.experts)),
                     {"env": C.environment(), "counts": counts, "ms": times,
                      "checks": checks, "grouped": grouped_gemm.grouped_status()})


if __name__ == "__main__":
    main()
