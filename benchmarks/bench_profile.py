"""Benchmark 7: where a whole training step's time and memory go, BF16 against lowprec and torchao.

    python benchmarks/bench_profile.py --out results/ [--size 1b] [--mode compiled|eager|cudagraphs]
        [--params fp32-autocast] [--variants bf16,lowprec:fp8-current,torchao:tensorwise] [--steps 3]
        [--recompute none|selective|full] [--gpu h200]
    python benchmarks/bench_profile.py --size moe-1b --mode cudagraphs --params bf16-master \
        --variants bf16,lowprec:fp8-current           # where the mixture of experts' step goes
    python benchmarks/bench_profile.py --size tiny --mode eager --steps 1     # dry run, any machine

The step is ``bench_model.py``'s, on the same model and batch. Per variant, after the first step and two
warmup steps: the wall time of ``--steps`` profiled steps, the GPU's kernel time by kind (GEMM,
attention, lowprec's cast kernels, inductor's fused kernels, the optimizer, other torch kernels, copies),
the time the GPU sat idle between kernels (launch-bound code shows here), the bytes the forward keeps
for the backward (allocated after the loss less allocated before the forward: saved activations and
the logits), the peak of the step, and the twenty longest kernels.

From BF16's profile it prints the ceiling of an FP8 recipe on this model: the step time if every
converted linear's GEMM ran ``--fp8-gemm-speedup`` times faster (1.9x: the H200's FP8 against BF16
GEMM throughput, ANCHORS.md) and nothing else changed. The converted linears' share of the GEMM time
is their share of the GEMM FLOPs (the LM head stays BF16). A recipe's figure against that ceiling
says how much of the gap is casts and how much is arithmetic the recipe does not touch. Beside it, the
least memory traffic of per-tensor FP8 casts made as separate kernels (an amax pass, then one pass
writing every copy), and its time at ``--hbm-tb-s``: what such casts cost at best.

Last, ``lowprec plan``'s step for each variant on ``--gpu`` (``lowprec.plan.step_time``: GEMMs, casts,
attention, other kernels, recomputation, optimizer), each part beside the profiled kinds it stands for: where
the planner's time model misses a step, this says which part. Under ``--mode cudagraphs`` the step replays
CUDA graphs, which allocate nothing: no saved bytes or peak are read there.
"""
from __future__ import annotations

import argparse
import gc
import re
import time
from collections import defaultdict

import torch
import torch.nn.functional as F
from _common import DEVICE, environment, print_table, sync, write_json
from _models import SIZES
from bench_model import TORCHAO_MISSING, check_variant, lowprec_options, make_step, place, planned, torchao_float8

from lowprec.plan.gpus import GPUS, get_gpu
from lowprec.train.model import build_model
from lowprec.train.recompute import Recompute

# lowprec's own Triton kernels, by the name the profiler gives them (the function's): its GEMMs (the
# experts' grouped GEMMs, the block-scaled ones) and its casts (amaxes, scales, codes, padded and
# transposed copies, folds); the optimizer's are "optimizer"
LOWPREC_GEMMS = ("rows_kernel", "features_kernel", "rows_blocked_kernel", "features_blocked_kernel",
                 "dequant_gemm_kernel", "mx_chunk_kernel")
LOWPREC_CASTS = ("cast_kernel", "amax_kernel", "dequant_kernel", "group_amax_kernel", "scales_kernel",
                 "padded_kernel", "transpose_kernel", "fold_kernel", "e4m3_codes_kernel")
LOWPREC_OPTIMIZER = ("adamw_kernel", "requantize_kernel")


def _named(names: tuple[str, ...]) -> str:
    return "^(" + "|".join(names) + ")$"


KINDS = (  # (kind, pattern on the kernel's name), the first match wins
    ("attention", r"flash|fmha|sdpa|attention|attn"),
    ("gemm", _named(LOWPREC_GEMMS) + r"|gemm|nvjet|xmma|cutlass|cublas|sm90_|"
             r"^aten::(mm|addmm|bmm|_scaled_mm|_scaled_grouped_mm|_grouped_mm|matmul|linear)$"),
    ("lowprec casts", _named(LOWPREC_CASTS)),
    # torch's own gathers, scatters and sorts: a mixture of experts' routing, the embedding's lookup
    # (inductor's fused kernels stay "inductor fused" whatever they index)
    ("gather/scatter/sort", r"^(?!triton_)(?!.*nccl).*(sort|topk|bincount|histc|cumsum|scan|scatter|gather|"
                            r"index_?(add|put|select|elementwise)|nonzero)"),
    ("optimizer", _named(LOWPREC_OPTIMIZER) + r"|multi_tensor|adam|foreach"),
    ("inductor fused", r"^triton_"),
    ("copies", r"memcpy|memset|copy_|direct_copy"),
)
OTHER = "other torch kernels"


def kind_of(name: str) -> str:
    for kind, pattern in KINDS:
        if re.search(pattern, name, flags=re.IGNORECASE):
            return kind
    return OTHER


def ceiling(size, bf16_step_ms: float, bf16_gemm_ms: float, speedup: float) -> dict:
    """``bf16_step_ms`` less what the converted linears save of ``bf16_gemm_ms`` (BF16's GEMM kernel time)
    at ``speedup`` times the speed, and the speed-up that gives. The converted share is of the FLOPs a token
    meets: a mixture of experts counts the routed experts it reaches (its ``top_k``), not all of them."""
    head = size.config.vocab_size * size.config.dim
    active = size.active_linear_params()  # 6 GEMM FLOPs per weight a token meets
    share = (active - head) / active
    saved = bf16_gemm_ms * share * (1 - 1 / speedup)
    return {"converted_gemm_share": share, "step_ms": bf16_step_ms - saved,
            "speedup": bf16_step_ms / (bf16_step_ms - saved)}


def _cast_shapes(c) -> list[tuple[int, int, int, int]]:
    """``(rows per token, K, N, copies of the weight)`` of each group of linears that share one input: q/k/v,
    the attention output, gate/up and down; a mixture of experts' FFN as its routed experts (``top_k`` rows
    per token, every expert's weight) and its shared experts (one SwiGLU ``n_shared`` experts wide)."""
    attn = [(1, c.dim, c.dim + 2 * c.n_kv_heads * c.head_dim, 1), (1, c.dim, c.dim, 1)]
    if c.moe is None:
        return attn + [(1, c.dim, 2 * c.ffn_dim, 1), (1, c.ffn_dim, c.dim, 1)]
    m, shared = c.moe, c.moe.n_shared * c.ffn_dim
    ffn = [(m.top_k, c.dim, 2 * c.ffn_dim, m.n_experts), (m.top_k, c.ffn_dim, c.dim, m.n_experts)]
    if shared:
        ffn += [(1, c.dim, 2 * shared, 1), (1, shared, c.dim, 1)]
    return attn + ffn


def cast_traffic(size, weight_bytes: int = 4) -> dict:
    """Bytes per step that per-tensor FP8 casts made as separate kernels must move at least, for every
    converted linear of ``size`` (every linear but the LM head and the routers; a policy that keeps more in
    BF16 moves less): an amax pass over each BF16 activation and gradient, then one pass reading it again
    and writing its E4M3/E5M2 copy in both orientations (the forward's and the weight gradient's); each
    weight read (``weight_bytes`` per element) and written in FP8 once for the forward's cast and once
    for backward's transposed one, its amax pass not counted. Inputs that several linears share
    (q/k/v, gate/up) are cast once; a routed expert's rows are its tokens' copies (``top_k`` per token)."""
    c = size.config
    shapes = _cast_shapes(c)
    # x and dy (BF16) read once for their amaxes
    amax = sum(2 * size.tokens * rows * (k + n) for rows, k, n, _ in shapes)
    cast = 2 * amax  # read once more, each element written as two FP8 bytes
    weights = sum(2 * copies * (weight_bytes * k * n + k * n) for _, k, n, copies in shapes)
    return {"bytes": c.n_layers * (amax + cast + weights), "amax_bytes": c.n_layers * amax,
            "weight_bytes": c.n_layers * weights}


def profile_variant(base, size, name: str, args, tokens) -> dict:
    if name.startswith("torchao:") and torchao_float8() is None:
        return {"skipped": TORCHAO_MISSING}
    dtype = torch.float32 if args.params == "fp32-autocast" else torch.bfloat16
    model, what, _ = place(base, name, dtype, "device", args.recompute)
    options = lowprec_options(name)[1] if name.startswith("lowprec:") else set()
    states = next((o.removesuffix("states") for o in options if o.endswith("states")), None)
    graphs = args.mode == "cudagraphs"
    step, _opt = make_step(model, args.params, args.mode != "eager", tokens, states, graphs)
    for _ in range(3):  # compiles, creates the optimizer state, settles
        step()
    sync(DEVICE)
    # replays allocate nothing, so under CUDA graphs the allocator's counters say nothing of the step
    saved = None if graphs else saved_bytes(step, model, tokens, args)
    issue = []
    # the CPU's time to issue a step: near the wall time, the step is CPU-bound (fp32-autocast only: the
    # bf16-master step synchronises in its optimizer's finiteness check, so there it is the whole step)
    walls = []  # the same steps waited for: the step time without the profiler's overhead
    for _ in range(args.steps):
        sync(DEVICE)
        t0 = time.perf_counter()
        step()
        issue.append((time.perf_counter() - t0) * 1e3)
        sync(DEVICE)
        walls.append((time.perf_counter() - t0) * 1e3)
    opt_ms = optimizer_wall_ms(step, _opt, args.steps)
    sync(DEVICE)
    if DEVICE == "cuda":
        torch.cuda.reset_peak_memory_stats()
    activities = [torch.profiler.ProfilerActivity.CPU] + (
        [torch.profiler.ProfilerActivity.CUDA] if DEVICE == "cuda" else [])
    sync(DEVICE)
    t0 = time.perf_counter()
    with torch.profiler.profile(activities=activities) as prof:
        for _ in range(args.steps):
            step()
        sync(DEVICE)
    wall_ms = (time.perf_counter() - t0) * 1e3 / args.steps
    per_kind, per_kernel, ranges = defaultdict(float), defaultdict(float), defaultdict(float)
    ops: dict[str, list[float]] = defaultdict(list)  # lowprec's ops: CPU microseconds of each call
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CPU and e.name.startswith("lowprec::"):
            ops[e.name].append(e.cpu_time_total)
    device_type = torch.autograd.DeviceType.CUDA if DEVICE == "cuda" else torch.autograd.DeviceType.CPU
    for e in prof.events():
        if e.device_type != device_type or (DEVICE != "cuda" and e.cpu_parent is not None):
            continue  # on the CPU (dry run) the top-level ops stand in for kernels
        ms = e.time_range.elapsed_us() / 1e3 / args.steps
        if getattr(e, "is_user_annotation", False):  # a record_function range on the GPU's timeline
            ranges[e.name] += ms
            continue
        per_kind[kind_of(e.name)] += ms
        per_kernel[e.name] += ms
    busy = sum(per_kind.values())
    row = {"conversion": what, "step_ms": wall_ms, "kernel_ms": busy, "idle_ms": max(0.0, wall_ms - busy),
           "kinds_ms": dict(per_kind), "saved_gib": saved,
           "optimizer_range_ms": sum(ms for n, ms in ranges.items() if n.startswith("Optimizer.step")),
           "cpu_issue_ms": sorted(issue)[len(issue) // 2], "optimizer_wall_ms": opt_ms,
           "unprofiled_step_ms": sorted(walls)[len(walls) // 2],
           "lowprec_ops": {n: {"calls_per_step": len(t) / args.steps, "cpu_us": sum(t) / len(t)}
                           for n, t in ops.items()},
           "peak_gib": torch.cuda.max_memory_allocated() / 2**30 if DEVICE == "cuda" and not graphs else None,
           "planned_ms": planned_parts(size, name, args),
           "top_kernels": sorted(per_kernel.items(), key=lambda kv: -kv[1])[:20]}
    del model, step, _opt, prof
    gc.collect()
    if DEVICE == "cuda":
        torch.cuda.empty_cache()
    torch._dynamo.reset()
    return row


def optimizer_wall_ms(step, opt, steps: int) -> float:
    """Median milliseconds of ``opt.step`` alone, from the device idle to the device idle again: with
    the GPU kernels of the update (``optimizer.step on GPU``) subtracted, what its launches cost the CPU
    while the GPU waits (after the finiteness check's synchronisation nothing hides them)."""
    inner, times = opt.step, []
    own = vars(opt).get("step")  # an instance attribute already there (a scheduler's wrapper) stays

    def timed_step(*a, **k):
        sync(DEVICE)
        t0 = time.perf_counter()
        out = inner(*a, **k)
        sync(DEVICE)
        times.append((time.perf_counter() - t0) * 1e3)
        return out

    opt.step = timed_step
    try:
        for _ in range(steps):
            step()
    finally:
        if own is None:
            del opt.step  # the class's method again
        else:
            opt.step = own
    return sorted(times)[len(times) // 2]


def saved_bytes(step, model, tokens, args) -> float | None:
    """GiB the forward keeps until the backward: allocated after the loss less allocated before."""
    if DEVICE != "cuda":
        return None
    forward = getattr(step, "forward", model)
    x, y = tokens[:, :-1], tokens[:, 1:]
    sync(DEVICE)
    before = torch.cuda.memory_allocated()
    with torch.autocast(DEVICE, dtype=torch.bfloat16, enabled=args.params == "fp32-autocast"):
        loss = F.cross_entropy(forward(x).float().flatten(0, 1), y.flatten())
    sync(DEVICE)
    after = torch.cuda.memory_allocated()
    loss.backward()
    model.zero_grad(set_to_none=True)
    return (after - before) / 2**30


PLANNED_KINDS = (  # the profile's kinds each of the planner's parts (lowprec.plan.step_time) stands for
    ("GEMMs", ("gemm",)),
    ("casts", ("lowprec casts",)),
    ("attention", ("attention",)),
    ("other kernels", ("inductor fused", "gather/scatter/sort", "copies", OTHER)),
    ("recomputation", ()),
    ("optimizer step", ("optimizer",)),
)


def planned_parts(size, name: str, args) -> dict[str, float] | None:
    """Milliseconds per step of each part the planner gives the variant's step on ``--gpu`` (BF16 parameters
    with FP32 masters, whatever ``--params`` says), keyed as :data:`PLANNED_KINDS`; None where it plans none."""
    p = planned(size, name, args.recompute, args.gpu)
    if p is None or p.step is None:
        return None
    out = {group: 0.0 for group, _ in PLANNED_KINDS}
    for part in p.step.parts:
        group = next(g for g, _ in PLANNED_KINDS if part.name.startswith(g))
        out[group] += 1e3 * part.seconds
    return out


def planned_rows(results: dict) -> list[list[str]]:
    """Per variant the planner has a step for: each part planned against the profiled kinds it stands for."""
    rows = []
    for name, r in results.items():
        plan_ms = r.get("planned_ms")
        if not plan_ms or "kinds_ms" not in r:
            continue
        measured = {g: sum(r["kinds_ms"].get(k, 0.0) for k in kinds) for g, kinds in PLANNED_KINDS}
        rows.append([name] + [f"{plan_ms[g]:.1f} / {measured[g]:.1f}" for g, _ in PLANNED_KINDS]
                    + [f"{sum(plan_ms.values()):.1f} / {r['unprofiled_step_ms']:.1f}"])
    return rows


def report(size, results: dict, args) -> None:
    kinds = [k for k, _ in KINDS] + [OTHER]
    bf = results.get("bf16", {})
    rows = []
    for name, r in results.items():
        if "step_ms" not in r:
            rows.append([name, r.get("skipped") or r.get("error", "")[:60]] + [""] * (len(kinds) + 5))
            continue
        rows.append([name, f"{r['step_ms']:.1f}", f"{bf['step_ms'] / r['step_ms']:.2f}x" if "step_ms" in bf else "-",
                     *(f"{r['kinds_ms'].get(k, 0.0):.1f}" for k in kinds), f"{r['idle_ms']:.1f}",
                     f"{r['optimizer_range_ms']:.1f}",
                     "-" if r["saved_gib"] is None else f"{r['saved_gib']:.2f}",
                     "-" if r["peak_gib"] is None else f"{r['peak_gib']:.2f}"])
    print_table(f"{args.size} / {args.mode} / {args.params} / recompute {args.recompute}: ms per step",
                ["variant", "step", "vs bf16", *kinds, "GPU idle", "optimizer.step on GPU", "saved GiB", "peak GiB"],
                rows)
    if "kinds_ms" in bf:
        # the profiler's own overhead lengthens the profiled step (as GPU idle time, which FP8 would not
        # shorten): the ceiling is of the step without it; the profiled one's is printed beside it
        gemm = bf["kinds_ms"].get("gemm", 0.0)
        c = ceiling(size, bf["unprofiled_step_ms"], gemm, args.fp8_gemm_speedup)
        profiled = ceiling(size, bf["step_ms"], gemm, args.fp8_gemm_speedup)
        results["ceiling"] = {**c, "profiled_step_speedup": profiled["speedup"]}
        print(f"\nceiling: converted linears' GEMMs {args.fp8_gemm_speedup}x faster ({c['converted_gemm_share']:.0%} "
              f"of BF16's GEMM time), all else as BF16: {c['step_ms']:.1f} ms per step against "
              f"{bf['unprofiled_step_ms']:.1f}, {c['speedup']:.2f}x BF16 (from the profiled step's "
              f"{bf['step_ms']:.1f} ms: {profiled['speedup']:.2f}x)")
        traffic = cast_traffic(size, 4 if args.params == "fp32-autocast" else 2)
        ms_per_byte = 1e3 / (args.hbm_tb_s * 1e12)
        ms, fused = traffic["bytes"] * ms_per_byte, (traffic["bytes"] - traffic["amax_bytes"]) * ms_per_byte
        results["cast_traffic"] = {**traffic, "ms_at_hbm": ms, "ms_at_hbm_amax_fused": fused,
                                   "hbm_tb_s": args.hbm_tb_s}
        print(f"separate per-tensor FP8 casts move at least {traffic['bytes'] / 1e9:.1f} GB per step "
              f"({traffic['amax_bytes'] / 1e9:.1f} in amax passes, {traffic['weight_bytes'] / 1e9:.1f} of weights): "
              f"{ms:.1f} ms at {args.hbm_tb_s} TB/s, {fused:.1f} ms where every amax fuses into the kernel that "
              f"produces its tensor; the ceiling with those casts: "
              f"{bf['unprofiled_step_ms'] / (c['step_ms'] + fused):.2f}x BF16")
    for name, r in results.items():
        if "cpu_issue_ms" in r:
            calls = ", ".join(f"{n} {v['calls_per_step']:.0f} calls x {v['cpu_us']:.0f} us"
                              for n, v in r["lowprec_ops"].items()) or "no lowprec op calls"
            print(f"{name}: the CPU issues a step in {r['cpu_issue_ms']:.1f} ms (wall {r['step_ms']:.1f}); "
                  f"optimizer.step alone {r['optimizer_wall_ms']:.1f} ms from idle to idle; {calls}")
    rows = planned_rows(results)
    if rows:
        print_table(f"lowprec plan's step on {args.gpu} against this profile, ms per step (planned / profiled; "
                    "recomputation is inside the profiled kinds; the step unprofiled)",
                    ["variant"] + [g for g, _ in PLANNED_KINDS] + ["step"], rows)
    for name, r in results.items():
        if "top_kernels" in r:
            print_table(f"{name}: longest kernels, ms per step", ["kernel", "ms", "kind"],
                        [[k[:110], f"{ms:.2f}", kind_of(k)] for k, ms in r["top_kernels"]])


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=".")
    ap.add_argument("--size", default="1b", choices=sorted(SIZES))
    ap.add_argument("--mode", default="compiled", choices=("compiled", "eager", "cudagraphs"),
                    help="cudagraphs: compiled with mode=\"reduce-overhead\", as bench_model.py's mode")
    ap.add_argument("--params", default="fp32-autocast", choices=("fp32-autocast", "bf16-master"))
    ap.add_argument("--variants", default="bf16,lowprec:fp8-current,torchao:tensorwise",
                    type=lambda s: [check_variant(v) for v in s.split(",")])
    ap.add_argument("--steps", type=int, default=3, help="profiled steps")
    ap.add_argument("--recompute", default="none", choices=[m.value for m in Recompute],
                    help="checkpoint every block of every variant as bench_model.py's --recompute does")
    ap.add_argument("--fp8-gemm-speedup", type=float, default=1.9)
    ap.add_argument("--gpu", default="h200", choices=sorted(GPUS),
                    help="the accelerator table's row lowprec plan's step is planned on")
    ap.add_argument("--hbm-tb-s", type=float, default=get_gpu("h200").hbm_tb_s,
                    help="the memory bandwidth the cast traffic is timed at (default: the H200's)")
    args = ap.parse_args(argv)
    size = SIZES[args.size]
    base = build_model(size.config, seed=0)
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(size.config.vocab_size, (size.batch, size.seq_len + 1), generator=gen).to(DEVICE)
    results: dict = {}
    for name in args.variants:
        try:
            results[name] = profile_variant(base, size, name, args, tokens)
        except Exception as e:  # one variant failing (out of memory, say) leaves the others' figures
            results[name] = {"error": f"{type(e).__name__}: {str(e)[:400]}"}
        print(name, {k: v for k, v in results[name].items() if k != "top_kernels"}, flush=True)
    report(size, results, args)
    suffix = "" if args.recompute == "none" else f"_recompute-{args.recompute}"
    write_json(args.out, f"bench_profile_{args.size}_{args.mode}_{args.params}{suffix}.json",
               {"env": environment(), "args": vars(args), "results": results})
    return results


if __name__ == "__main__":
    main()
