"""Benchmark 3: Llama-3-8B SwiGLU FFN and two decoder layers, forward + backward, time and peak memory.

    python benchmarks/bench_layers.py --out results/ [--stages ffn-eager,ffn-compile,layers-compile]

Variants, all in one process: BF16 (plain ``nn.Linear``); every lowprec recipe through
``lowprec.convert`` (``lowprec.nn.Linear``); torchao float8 tensorwise and rowwise, when torchao is
importable. Each stage writes its JSON as soon as it ends, so a run cut short keeps what it
measured. Weights are cast at every step, as in a training step without gradient accumulation.
"""
from __future__ import annotations

import argparse
import copy
import time

import torch
import torch.nn as nn
from _common import DEVICE, bench_ms, environment, print_table, write_json

import lowprec
from lowprec import Policy
from lowprec.train.model import Block, FeedForward, ModelConfig, rope_tables

LLAMA3_8B = ModelConfig(dim=4096, n_layers=2, n_heads=32, n_kv_heads=8, ffn_dim=14336, max_seq_len=8192,
                        rope_theta=500000.0)
ALL_LINEARS = Policy(keep_head=False, keep_last_blocks=0)


class TwoLayers(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.layers = nn.ModuleList(Block(cfg) for _ in range(2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        cos, sin = rope_tables(x.shape[1], self.cfg.head_dim, self.cfg.rope_theta, x.device)
        for layer in self.layers:
            x = layer(x, cos, sin)  # (B, T, dim)
        return x


def variant(base: nn.Module, name: str) -> nn.Module:
    """A copy of ``base`` set up as ``name`` says: bf16, lowprec:<recipe>, torchao:<recipe>."""
    m = copy.deepcopy(base)
    kind, _, recipe = name.partition(":")
    if kind == "lowprec":
        lowprec.convert(m, recipe, ALL_LINEARS)
    elif kind == "torchao":
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training

        convert_to_float8_training(m, config=Float8LinearConfig.from_recipe_name(recipe))
    return m


def measure(model: nn.Module, x: torch.Tensor, dy: torch.Tensor, compiled: bool, rep: int) -> dict:
    fwd = torch.compile(model) if compiled else model
    params = [p for p in model.parameters()]

    def step():
        fwd(x).backward(dy)

    breaks = torch._dynamo.utils.counters["graph_break"]
    breaks.clear()
    t0 = time.perf_counter()
    step()
    step()  # compile, autotune, warm the delayed-scaling histories
    first_s = time.perf_counter() - t0
    n_breaks = sum(breaks.values())
    if DEVICE == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        step()
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() / 2**30  # parameters, input and gradients included
    else:
        peak = float("nan")
    # do_bench's warmup and rep are milliseconds: a median of about rep / step-time steps
    ms = bench_ms(step, warmup=rep // 6, rep=rep) if DEVICE == "cuda" else bench_ms(step)
    for p in params + [x]:
        p.grad = None
    return {"ms": ms, "peak_gib": peak, "first_two_steps_s": first_s, "graph_breaks": n_breaks}


def run_stage(stage: str, names: list[str], args, env: dict, results: dict) -> None:
    kind, mode = stage.split("-")
    dt = torch.bfloat16
    if kind == "ffn":
        cfg = ModelConfig(dim=args.dim, n_layers=1, n_heads=32, n_kv_heads=8, ffn_dim=args.ffn)
        base = FeedForward(args.dim, args.ffn).to(DEVICE, dt)
        x = torch.randn(args.tokens, args.dim, device=DEVICE, dtype=dt, requires_grad=True)
    else:
        cfg = LLAMA3_8B if args.dim == 4096 else ModelConfig(dim=args.dim, n_layers=2, n_heads=32, n_kv_heads=8,
                                                             ffn_dim=args.ffn, max_seq_len=args.seq)
        base = TwoLayers(cfg).to(DEVICE, dt)
        x = torch.randn(args.batch, args.seq, args.dim, device=DEVICE, dtype=dt, requires_grad=True)
    with torch.no_grad():
        for p in base.parameters():
            p.normal_(0, 0.02)
    dy = torch.randn_like(x) * 1e-2
    rows = results.setdefault(stage, {})
    for name in names:
        try:
            m = variant(base, name)
            rows[name] = measure(m, x, dy, compiled=(mode == "compile"), rep=300 if kind == "ffn" else 1000)
            del m
        except Exception as e:  # a variant that fails is recorded and the stage goes on
            rows[name] = {"error": f"{type(e).__name__}: {str(e)[:400]}"}
        if DEVICE == "cuda":
            torch.cuda.empty_cache()
        print(stage, name, rows[name], flush=True)
        torch._dynamo.reset()
        write_json(args.out, f"bench_layers_{args.stages.replace(',', '_')}.json",
                   {"env": env, "args": vars(args), "results": results})


def table(results: dict) -> None:
    for stage, rows in results.items():
        bf = rows.get("bf16", {})
        out = []
        for name, r in rows.items():
            if "ms" not in r:
                out.append([name, r.get("error", "")[:60], "", "", "", ""])
                continue
            ratio = bf.get("ms", float("nan")) / r["ms"]
            mem = r["peak_gib"] / bf["peak_gib"] if bf.get("peak_gib") else float("nan")
            out.append([name, f"{r['ms']:.2f}", f"{ratio:.2f}x", f"{r['peak_gib']:.2f}", f"{mem:.2f}x",
                        r.get("graph_breaks", "")])
        print_table(stage, ["variant", "ms", "speed vs bf16", "peak GiB", "mem vs bf16", "graph breaks"], out)


LOWPREC = [f"lowprec:{r}" for r in ("fp8-current", "fp8-delayed", "fp8-rowwise", "fp8-blockwise", "mxfp8", "mxfp4",
                                     "nvfp4")]
ALL = ["bf16", *LOWPREC, "torchao:tensorwise", "torchao:rowwise"]
STAGES = {"ffn-eager": ALL, "ffn-compile": ALL, "layers-eager": ALL, "layers-compile": ALL}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=".")
    ap.add_argument("--stages", default="ffn-eager,ffn-compile,layers-compile,layers-eager")
    ap.add_argument("--only", default="", help="comma-separated variant names to keep (default: all)")
    ap.add_argument("--tokens", type=int, default=16384)
    ap.add_argument("--dim", type=int, default=4096)
    ap.add_argument("--ffn", type=int, default=14336)
    ap.add_argument("--seq", type=int, default=8192)
    ap.add_argument("--batch", type=int, default=2)
    args = ap.parse_args()
    torch.manual_seed(0)
    env = environment()
    results: dict = {}
    keep = set(filter(None, args.only.split(",")))
    for stage in args.stages.split(","):
        names = [n for n in STAGES[stage] if not keep or n in keep]
        run_stage(stage, names, args, env, results)
    print(env)
    table(results)


if __name__ == "__main__":
    main()
