"""Benchmark 1: the Triton quantization kernels, bit-exact against the reference, then timed.

    python benchmarks/bench_quant.py --out results/

For every cast a recipe uses (and its fused transposed pair): checks the kernel's codes and scales
against ``lowprec.quant.quantize`` on the same GPU (random data at full size, then a tensor full of
NaN/inf/zero blocks, subnormals and saturating values), then times it with ``do_bench`` for a few
warp counts and reports effective GB/s (input read once + outputs written once) and its share of
the measured device-to-device copy bandwidth, beside eager torch and ``torch.compile`` baselines.
Last, the host's side: CPU microseconds per cast call (the op a compiled graph calls, its Triton launch
with and without lowprec's launch cache, its output allocations), which set the pace of a step whose
GPU work is shorter than the host's.
"""
from __future__ import annotations

import argparse

import torch
from _common import DEVICE, bench_ms, copy_bandwidth, environment, print_table, same_quantized, write_json

from lowprec import formats as F
from lowprec.kernels import triton_launch as launch_cache
from lowprec.kernels import triton_quant as TQ
from lowprec.kernels.route import CastSpec
from lowprec.kernels.triton_plan import Launch, Plan, side
from lowprec.quant import blockwise, hadamard, mx, nvfp4, quantize, rowwise, tensorwise

SEED = 0x5EED
# name, (fmt, granularity, rounding) of side A, of side B (None: single), Hadamard on B, given scale
CASES = [
    ("fp8 tensor current", ("e4m3", tensorwise(), "nearest"), None, False, False),
    ("fp8 tensor delayed", ("e4m3", tensorwise(), "nearest"), None, False, True),
    ("fp8 tensor current +T", ("e4m3", tensorwise(), "nearest"), ("e4m3", tensorwise(), "nearest"), False, False),
    ("fp8 tensor delayed +T", ("e5m2", tensorwise(), "nearest"), ("e5m2", tensorwise(), "nearest"), False, True),
    ("fp8 row", ("e4m3", rowwise(), "nearest"), None, False, False),
    ("fp8 row +T", ("e4m3", rowwise(), "nearest"), ("e4m3", rowwise(), "nearest"), False, False),
    ("fp8 1x128", ("e4m3", blockwise(1, 128), "nearest"), None, False, False),
    ("fp8 1x128 +T", ("e4m3", blockwise(1, 128), "nearest"), ("e4m3", blockwise(1, 128), "nearest"), False, False),
    ("fp8 128x128", ("e4m3", blockwise(128, 128), "nearest"), None, False, False),
    ("fp8 128x128 +T", ("e4m3", blockwise(128, 128), "nearest"), ("e4m3", blockwise(128, 128), "nearest"),
     False, False),
    ("mxfp8 ceil", ("e4m3", mx(32, "ceil"), "nearest"), None, False, False),
    ("mxfp8 ceil +T", ("e4m3", mx(32, "ceil"), "nearest"), ("e4m3", mx(32, "ceil"), "nearest"), False, False),
    ("mxfp6 e3m2 floor", ("e3m2", mx(32, "floor"), "nearest"), None, False, False),
    ("mxfp4 ceil SR", ("e2m1", mx(32, "ceil"), "stochastic"), None, False, False),
    ("nvfp4 1x16", ("e2m1", nvfp4(16), "nearest"), None, False, False),
    ("nvfp4 16x16", ("e2m1", nvfp4(16, True), "nearest"), None, False, False),
    ("nvfp4 1x16 +T(RHT,SR)", ("e2m1", nvfp4(16), "nearest"), ("e2m1", nvfp4(16), "stochastic"), True, False),
]


def _plan(x2, case, warps: int, rand: bool) -> tuple[Plan, torch.Tensor | None]:
    _, a, b, had, given = case
    m, k = x2.shape
    finite_amax = float(torch.nan_to_num(x2.float(), 0.0, 0.0, 0.0).abs().amax())
    scale = torch.tensor(finite_amax / 2000.0, device=x2.device) if given else None  # some saturate
    spec_a = CastSpec.of(a[0], a[1], a[2], delayed=given)
    sa = side(spec_a, True, transposed=False, rows=m, cols=k, given=given, rand=rand)
    spec_b = None if b is None else CastSpec.of(b[0], b[1], b[2], SEED if had else None, delayed=given)
    sb = None if b is None else side(spec_b, True, transposed=True, rows=k, cols=m, given=given, rand=rand)
    return Plan(m, k, sa, sb, record=given, num_warps=warps), scale


def _reference(x2, case, scale, rand_a, rand_b):
    _, a, b, had, _ = case
    ra = quantize(x2, a[0], a[1], rounding=a[2], scale=scale, rand=rand_a)
    if b is None:
        return ra, None
    xt = x2.t()
    if had:
        xt = hadamard(torch.nn.functional.pad(xt, (0, (-xt.shape[1]) % 16)), 16, seed=SEED)
    return ra, quantize(xt, b[0], b[1], rounding=b[2], scale=scale, rand=rand_b)


def check(x2, case) -> dict:
    """Bit-exactness against the reference run on the CPU (the reference's own CUDA run divides by a
    Python float through a rounded reciprocal, an ulp away from IEEE division, so the CPU is the
    arbiter); stochastic rounding given the reference's uniforms."""
    _, a, b, had, given = case
    plan, scale = _plan(x2, case, 0, rand=True)
    ra_u = torch.rand(x2.shape, device=x2.device) if a[2] == "stochastic" else None
    rb_u = torch.rand(x2.t().shape, device=x2.device) if b is not None and b[2] == "stochastic" else None
    if b is None:
        q, qt = TQ.quantize(x2, a[0], a[1], rounding=a[2], scale=scale, rand=ra_u), None
    else:
        q, qt, _ = TQ.quantize_pair(x2, a[0], a[1], b[0], b[1], rounding=a[2], rounding_t=b[2], scale=scale,
                                    rand=ra_u, rand_t=rb_u, hadamard_t=SEED if had else None, record_amax=given)
    cpu = lambda t: None if t is None else t.cpu()  # noqa: E731
    r, rt = _reference(x2.cpu(), case, cpu(scale), cpu(ra_u), cpu(rb_u))
    out = {"exact_a": same_quantized(_to_cpu(q), r)}
    if b is not None:
        out["exact_b"] = same_quantized(_to_cpu(qt), rt)
        if not out["exact_b"]:
            out["mismatch_b"] = (qt.data.view(torch.uint8).cpu() != rt.data.view(torch.uint8)).float().mean().item()
    return out


def _to_cpu(q):
    from lowprec.quant import QuantizedTensor

    g = None if q.global_scale is None else q.global_scale.cpu()
    return QuantizedTensor(q.data.cpu(), q.scale.cpu(), q.fmt, q.granularity, q.shape, q.dtype, g)


def special_tensor(m: int, k: int) -> torch.Tensor:
    """Random data with NaN, inf, all-zero, subnormal-only and huge blocks and negative zeros sprinkled in."""
    x = torch.randn(m, k, device=DEVICE) * torch.logspace(-4, 4, k, device=DEVICE)
    x[5, 7], x[m // 3, k // 4], x[m // 2, 3] = float("nan"), float("inf"), -float("inf")
    x[m // 16:m // 8, k // 16:k // 8] = 0
    x[m // 4:m // 4 + 8, :] = 1e-40  # FP32 subnormals
    x[m // 5:m // 5 + 10, k // 5:k // 5 + 100] = 3e38
    x[m // 7, 1::3] = -0.0  # negative zeros keep their sign bit in the codes
    return x.bfloat16()


def _bytes(x2, case) -> int:
    _, a, b, _, _ = case
    n = x2.numel()
    out = n * F.get(a[0]).bits / 8 + (n * F.get(b[0]).bits / 8 if b is not None else 0)
    return int(n * x2.element_size() + out)


def time_case(x2, case, warps_list, graph: bool) -> dict:
    """Milliseconds per warp count: GPU time (CUDA graph replay) with ``graph``, else eager time
    (launch overheads included)."""
    import triton.testing

    best = {}
    for w in warps_list:
        plan, scale = _plan(x2, case, w, rand=False)
        hm = TQ._hmat(SEED if case[3] else None, x2.device)
        fn = lambda plan=plan, hm=hm, scale=scale: TQ._run(x2, Launch.of(plan), hm, scale, None, None, None)  # noqa: E731
        fn()
        if graph and DEVICE == "cuda":
            best[w] = float(triton.testing.do_bench_cudagraph(fn, rep=100, return_mode="median"))
        else:
            best[w] = bench_ms(fn)
    return best


def baselines(x2) -> dict[str, float]:
    def eager():
        amax = x2.abs().amax().float()
        s = (amax / 448.0).clamp_min(1e-12)
        return (x2.float() / s).to(torch.float8_e4m3fn), s

    compiled = torch.compile(eager)
    compiled()
    return {"torch eager amax+cast": bench_ms(eager), "torch.compile amax+cast": bench_ms(compiled),
            "lowprec.quant reference": bench_ms(lambda: quantize(x2, "e4m3", tensorwise()), rep=20)}


def host_costs(calls: int = 3000) -> dict[str, float]:
    """CPU microseconds per call of what one cast costs the host, on a 256 x 256 BF16 tensor cast per
    tensor to E4M3 in both orientations (GPU time a few microseconds: the host's time is what is seen)."""
    import time

    import triton
    import triton.language as tl

    from lowprec.kernels import triton_ops as ops
    from lowprec.kernels import triton_tiles as T
    from lowprec.kernels.triton_plan import launch

    @triton.jit
    def tiny(x_ptr, n, B: tl.constexpr):
        o = tl.arange(0, B)
        tl.store(x_ptr + o, tl.load(x_ptr + o, mask=o < n) + 1, mask=o < n)

    spec = CastSpec.of("e4m3", tensorwise())
    x = torch.randn(256, 256, device=DEVICE, dtype=torch.bfloat16)
    plan = launch(spec, spec, 256, 256, True, False, False, False, False)
    ints = list(plan.ints)
    amax = x.float().abs().amax().reshape(1).view(torch.int32) & 0x7FFFFFFF
    _, grid, args, kw = ops.cast_launch(x, plan.ints, None, amax, amax, None, None, None, None)
    meta = {**kw, "HW": True}
    out_a, out_b = ops._config(plan.ints)[4]
    small = torch.zeros(16, device=DEVICE)

    def per_call(f) -> float:
        for _ in range(200):
            f()
        torch.cuda.synchronize()
        t = time.perf_counter()
        for _ in range(calls):
            f()
        us = (time.perf_counter() - t) / calls * 1e6
        torch.cuda.synchronize()
        return us

    return {
        "cast op, as a compiled graph calls it": per_call(
            lambda: ops.tile_cast(x, ints, None, amax, amax, None, None, None, None, None)),
        "cast kernel launch, ordinary": per_call(lambda: T.cast_kernel[grid](*args, **meta)),
        "cast kernel launch, launch cache": per_call(
            lambda: launch_cache.run(T.cast_kernel, grid, args, meta, plan.ints)),
        "the cast's 7 output allocations": per_call(
            lambda: (ops._outputs(x, out_a), ops._outputs(x, out_b), x.new_empty(0, dtype=torch.int32))),
        "a Triton kernel of 2 arguments": per_call(lambda: tiny[(1,)](small, 16, B=16)),
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=".")
    ap.add_argument("--m", type=int, default=16384)
    ap.add_argument("--k", type=int, default=8192)
    ap.add_argument("--check-m", type=int, default=1024, help="rows of the tensor checked against the CPU")
    ap.add_argument("--quick", action="store_true", help="default warps only, no torch baselines")
    args = ap.parse_args()
    torch.manual_seed(0)
    env = environment()
    copy_bw = copy_bandwidth()
    x2 = (torch.randn(args.m, args.k, device=DEVICE) * torch.logspace(-3, 3, args.k, device=DEVICE)).bfloat16()
    xs = special_tensor(min(args.m, 1024), min(args.k, 2048))
    xc = x2[: args.check_m, :4096]
    results, rows = [], []
    for case in CASES:
        name = case[0]
        res = {"case": name, **check(xc, case)}
        sp = check(xs, case)
        res.update({f"special_{k}": v for k, v in sp.items()})
        # the same cast again: now through the launch cache (see lowprec.kernels.triton_launch)
        res.update({f"relaunched_{k}": v for k, v in check(xc, case).items() if k.startswith("exact")})
        res["launch_cache"] = bool(launch_cache._CACHE) and not (launch_cache._REFUSED or launch_cache.DISABLED)
        warps = (0,) if args.quick else ((4, 8, 16) if name.startswith("fp8 tensor") else (8, 16))
        times = time_case(x2, case, warps, graph=True)
        if name.startswith("fp8 tensor current"):
            res["eager_ms"] = time_case(x2, case, (0,), graph=False)[0]
        w, ms = min(times.items(), key=lambda kv: kv[1])
        gbs = _bytes(x2, case) / (ms * 1e-3) / 1e9
        res.update({"ms_by_warps": times, "best_warps": w, "ms": ms, "GB/s": gbs,
                    "pct_copy": 100 * gbs * 1e9 / copy_bw})
        results.append(res)
        exact = all(v for k, v in res.items() if k.startswith(("exact", "special_exact", "relaunched_exact")))
        rows.append([name, "yes" if exact else "NO", f"{ms * 1e3:.0f}", f"{gbs:.0f}", f"{res['pct_copy']:.0f}%", w])
        print(res, flush=True)
    base = {} if args.quick else baselines(x2[:, :4096].contiguous())
    n = args.m * min(args.k, 4096)
    base_rows = [[k, f"{v * 1e3:.0f}", f"{3 * n / (v * 1e-3) / 1e9:.0f}", f"{300 * n / (v * 1e-3) / copy_bw:.0f}%"]
                 for k, v in base.items()]
    try:  # measured last, and never at the cost of the results above
        host = host_costs()
    except Exception as e:
        host = {f"not measured: {e!r}": None}
    write_json(args.out, "bench_quant.json", {"env": env, "copy_GBs": copy_bw / 1e9, "shape": [args.m, args.k],
                                              "cases": results, "baselines_16384x4096": base, "host_us": host})
    print(f"\n{env}\ncopy bandwidth {copy_bw / 1e9:.0f} GB/s; x {args.m}x{args.k} bf16")
    print_table("baselines (16384x4096 bf16 -> e4m3)", ["what", "us", "GB/s", "% copy"], base_rows)
    print_table("Triton quantization kernels", ["cast", "bit-exact", "us", "GB/s", "% copy", "warps"], rows)
    print_table("host time per call (256 x 256, E4M3 per tensor, both orientations)", ["what", "CPU us"],
                [[k, "-" if v is None else f"{v:.1f}"] for k, v in host.items()])


if __name__ == "__main__":
    main()
