"""Benchmark 8: the optimizer step alone, torch's fused AdamW against AdamWLP's moments, fused and not.

    python benchmarks/bench_optim.py --out results/ [--size 1b] [--steps 5]
    python benchmarks/bench_optim.py --size tiny --steps 1      # dry run, any machine

The parameters of the reference model at ``--size`` (float32, as the masters ``lowprec.optim`` keeps),
each with a fixed random float32 gradient. First a check: on CUDA, AdamWLP's fused step
(``lowprec.optim.fused``) against its torch step over three steps, parameters and every state tensor
bit for bit, for each moment format the kernel covers. Then the median time of one ``step()`` of:
torch's AdamW (``fused=True``, FP32 moments), and AdamWLP with FP32, BF16, 8-bit and FP8 moments, fused
where covered and batched torch ops otherwise; with the moments' bytes and the ratios to torch's.
Last, the FP8 weights' requantization after a step (``--fp8-weights``): the model's linear weights as
per-tensor FP8 weights with float32 masters, cast weight by weight (``requantize_``) against all at once
(``requantize_all``, one launch on CUDA): the same bits, and the time of each.
"""
from __future__ import annotations

import argparse
import statistics

import torch
from _common import DEVICE, environment, print_table, sync, timed, write_json
from _models import ADAMW, SIZES
from torch import nn

from lowprec.nn.fp8_requantize import requantize_all
from lowprec.nn.fp8_weight import FP8Weight
from lowprec.optim import AdamWLP
from lowprec.quant import tensorwise
from lowprec.train.model import Transformer

CHECKED = ("fp32", "bf16", "int8")


def parameters(size_name: str, seed: int = 0, count: int | None = None) -> list[torch.Tensor]:
    """Float32 tensors shaped like the model's parameters (its first ``count``), each with a gradient, on ``DEVICE``."""
    with torch.device("meta"):
        shapes = [p.shape for p in Transformer(SIZES[size_name].config).parameters()][:count]
    gen = torch.Generator(device=DEVICE).manual_seed(seed)
    out = []
    for shape in shapes:
        p = nn.Parameter(torch.randn(shape, device=DEVICE, generator=gen) * 0.02)
        p.grad = torch.randn(shape, device=DEVICE, generator=gen) * 1e-3
        out.append(p)
    return out


def check(size_name: str) -> dict[str, bool]:
    """Whether the fused step equals the torch step bit for bit (CUDA only), per moment format."""
    if DEVICE != "cuda":
        return {}
    out = {}
    for states in CHECKED:
        a = parameters(size_name, seed=1, count=12)  # the embedding, the first blocks' weights and norms
        b = [nn.Parameter(p.detach().clone()) for p in a]
        for p, q in zip(a, b):
            q.grad = p.grad.clone()
        opt_a, opt_b = AdamWLP(a, states=states, fused=False, **ADAMW), AdamWLP(b, states=states, fused=True, **ADAMW)
        for _ in range(3):
            opt_a.step()
            opt_b.step()
        same = all(torch.equal(p.view(torch.int32), q.view(torch.int32)) for p, q in zip(a, b))
        same &= all(torch.equal(opt_a.state[p][k], opt_b.state[q][k]) for p, q in zip(a, b) for k in opt_a.state[p])
        out[states] = same
    return out


def variants() -> list[tuple[str, callable]]:
    out = [("torch AdamW fused (fp32 moments)", lambda ps: torch.optim.AdamW(ps, fused=True, **ADAMW))]
    for states in ("fp32", "bf16", "int8", "fp8"):
        for use in ((True, False) if states in CHECKED and DEVICE == "cuda" else (False,)):
            label = f"AdamWLP {states} ({'fused' if use else 'torch ops'})"
            out.append((label, lambda ps, s=states, u=use: AdamWLP(ps, states=s, fused=u, **ADAMW)))
    return out


def measure(size_name: str, make, steps: int) -> dict:
    params = parameters(size_name)
    opt = make(params)
    opt.step()  # creates the state
    opt.step()
    sync(DEVICE)
    seconds, _ = timed(opt.step, steps, DEVICE)
    moments = sum(v.numel() * v.element_size() for s in opt.state.values() for k, v in s.items() if k != "step")
    return {"step_ms": statistics.median(seconds) * 1e3, "moments_gib": moments / 2**30,
            "params": sum(p.numel() for p in params)}


def requantization(size_name: str, steps: int) -> dict:
    """The model's 2-D weights but the embedding's (the LM head's too), as per-tensor FP8 weights: each
    requantized from its own float32 master weight by weight and all at once; same bits, median ms."""
    masters = [p.detach() for p in parameters(size_name)[1:] if p.dim() == 2]
    made = {way: [FP8Weight.of(m.bfloat16(), tensorwise()) for m in masters] for way in ("alone", "together")}

    def alone() -> None:
        for w, m in zip(made["alone"], masters):
            w.requantize_(m)

    def together() -> None:
        requantize_all(made["together"], masters)

    out = {"weights": len(masters)}
    for way, fn in (("alone", alone), ("together", together)):
        fn()
        sync(DEVICE)
        seconds, _ = timed(fn, steps, DEVICE)
        out[f"{way}_ms"] = statistics.median(seconds) * 1e3
    out["bit_exact"] = all(torch.equal(a._data.view(torch.uint8), b._data.view(torch.uint8))
                           and torch.equal(a._scale, b._scale) for a, b in zip(made["alone"], made["together"]))
    return out


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=".")
    ap.add_argument("--size", default="1b", choices=sorted(SIZES))
    ap.add_argument("--steps", type=int, default=5)
    args = ap.parse_args(argv)
    exact = check(args.size)
    for states, same in exact.items():
        print(f"fused AdamWLP step, {states} moments: {'bit-exact' if same else 'DIFFERS from'} the torch step")
    results = {}
    for label, make in variants():
        results[label] = measure(args.size, make, args.steps)
        print(label, results[label], flush=True)
        if DEVICE == "cuda":
            torch.cuda.empty_cache()
    base = next(iter(results.values()))
    print_table(f"{args.size}: one optimizer step", ["optimizer", "ms", "vs torch AdamW", "moments GiB"],
                [[k, f"{r['step_ms']:.2f}", f"{base['step_ms'] / r['step_ms']:.2f}x", f"{r['moments_gib']:.2f}"]
                 for k, r in results.items()])
    requant = requantization(args.size, args.steps)
    print(f"FP8 weights requantized after a step ({requant['weights']} per-tensor weights): "
          f"{'bit-exact' if requant['bit_exact'] else 'DIFFERENT'} together; weight by weight "
          f"{requant['alone_ms']:.2f} ms, together {requant['together_ms']:.2f} ms "
          f"({requant['alone_ms'] / requant['together_ms']:.2f}x)")
    write_json(args.out, f"bench_optim_{args.size}.json", {"env": environment(), "args": vars(args),
                                                          "bit_exact": exact, "results": results,
                                                          "requantization": requant})
    return {"bit_exact": exact, "results": results, "requantization": requant}


if __name__ == "__main__":
    main()
