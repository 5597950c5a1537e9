"""Benchmark 5: the whole training step on N GPUs, DDP and FSDP2, BF16 against FP8 with FP8 on the wire.

    torchrun --nproc-per-node 2 benchmarks/bench_distributed.py --out results/ [--sizes 1b]
        [--variants ddp:bf16,fsdp2:bf16,fsdp2:fp8-current+fp8ag] [--steps 10] [--warmup 3] [--compile]
    torchrun --nproc-per-node 2 benchmarks/bench_distributed.py --sizes tiny --steps 2   # dry run: gloo, CPU

Every rank trains the same model on its own batch (``--sizes``: batch and sequence per GPU); NCCL on
GPUs, gloo on a CPU. A variant is ``<parallel>:<recipe>[+option...]``: ``ddp`` (DistributedDataParallel)
or ``fsdp2`` (``fully_shard`` on each block, resharding as ``lowprec train`` does, then the root); ``bf16``
is the plain model, any other recipe goes through ``lowprec.convert`` with the default policy. Options:
``+fp8comm`` (DDP gradients all-reduced in FP8, ``lowprec.distributed.register_ddp``), ``+fp8ag``
(FSDP2 all-gathers per-tensor FP8 weights in E4M3, ``fp8_weights.fp8_all_gather``, scales precomputed
after every optimizer step), ``+fp8rs`` (FSDP2 reduce-scatters gradients in FP8, ``register_fsdp``),
``+fp8w`` (FP8 primary weights, ``convert(..., fp8_weights=True)``: under FSDP2 each rank stores its rows as
codes and the ranks gather the codes, ``fp8_weight_shards``). Parameters are BF16 in every variant (stored as
E4M3 codes with ``+fp8w``), in ``lowprec.optim.Optimizer`` (FP32 masters, fused AdamW), so all compare alike.

A step: zero the gradients, forward, cross-entropy, backward, ``sync_amaxes`` (delayed recipes; nothing
for current scaling), the optimizer step (the group's one agreement all-reduce), and for ``+fp8ag`` the
scales' all-reduce. ``--compile`` compiles each transformer block in place before DDP / FSDP2 wrap them.

``--rounds N`` (N > 1) sets every variant up first, then times N rounds of ``--steps`` steps of each in
turn: the speed of a shared machine drifts between calls and within one (15% and more), and a ratio of
variants timed in the same rounds holds better than one of variants timed one after another. It reports no
peak memory (every variant is resident), and each round's median step beside the whole median.

Per variant, the slowest rank decides: tokens/s per GPU from the largest of the ranks' median step times
(CUDA events; wall clock on a CPU), the ratio to the same parallelism's ``bf16``, peak memory per GPU
(``torch.cuda.max_memory_allocated`` over the timed steps, max over ranks), the first step's seconds
(compilation included), and the bytes each rank hands to torch.distributed per step, by collective,
counted over the timed steps with ``lowprec.distributed.traffic.count_traffic``. DDP's own reducer
all-reduces from C++, where nothing can count it, so DDP without ``+fp8comm`` runs torch's
``allreduce_hook``, the same all-reduce from Python. The JSON is rewritten after every variant; a
variant that fails records its error on every rank and the run goes on.
"""
from __future__ import annotations

import argparse
import copy
import gc
import os
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from datetime import timedelta

import torch
import torch._inductor.config
import torch.distributed as dist
import torch.nn.functional as F
from _common import environment, print_table, result_name, sync, timed, write_json
from _models import ADAMW, Size
from _models import SIZES as MODEL_SIZES
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.nn.parallel import DistributedDataParallel as DDP

import lowprec
from lowprec import recipes
from lowprec.distributed import register_ddp, register_fsdp, sync_amaxes
from lowprec.distributed.fp8_weight_shards import finish_fp8_weight_shards, shard_fp8_weights
from lowprec.distributed.fp8_weights import fp8_all_gather, precompute_fp8_scales
from lowprec.distributed.launch import reshard_after_forward
from lowprec.distributed.traffic import count_traffic
from lowprec.optim import Optimizer
from lowprec.train.model import build_model

OPTIONS = {"ddp": ("fp8comm", "fp8w"), "fsdp2": ("fp8ag", "fp8rs", "fp8w")}
"""What each parallelism can add: FP8 gradient all-reduce (DDP); FP8 weight all-gather, FP8 reduce-scatter (FSDP2);
FP8 primary weights (both)."""
DEFAULT_VARIANTS = ["ddp:bf16", "ddp:fp8-current", "ddp:fp8-current+fp8comm", "fsdp2:bf16", "fsdp2:fp8-current",
                    "fsdp2:fp8-current+fp8ag", "fsdp2:fp8-current+fp8ag+fp8rs"]
KINDS = ("all_gather", "reduce_scatter", "all_reduce", "all_to_all", "broadcast")
"""Collectives ``count_traffic`` counts, in the order they travel in the ranks' one reduction."""


def sent_bytes(kind: str, handed: int, world: int) -> int:
    """Bytes a rank sends for a collective it handed ``handed`` bytes of input, under the collective's
    bandwidth-optimal schedule (lowprec's grad_comm counts the same way): an all-gather sends its shard to
    the W-1 others, a reduce-scatter and an all-to-all send (W-1)/W of their input, an all-reduce (a
    reduce-scatter then an all-gather) 2 (W-1)/W, a pipelined broadcast its input once. Runs of different
    collectives (a BF16 all-reduce against FP8 all-to-all + all-gather) compare only in these bytes."""
    factor = {"all_gather": (world - 1, 1), "reduce_scatter": (world - 1, world), "all_to_all": (world - 1, world),
              "all_reduce": (2 * (world - 1), world), "broadcast": (1, 1)}[kind]
    return handed * factor[0] // factor[1]


SIZES = {name: MODEL_SIZES[name] for name in ("tiny", "1b")}
"""The sizes this script offers, of bench_model.py's: the dry run, and the model of the two-GPU figures."""


@dataclass(frozen=True, slots=True)
class Variant:
    """One way to train: the parallelism, the recipe, and what goes on the wire in FP8."""

    parallel: str
    """``ddp`` or ``fsdp2``."""
    recipe: str
    """``bf16`` (the plain model) or a lowprec recipe."""
    options: tuple[str, ...] = ()
    """Of :data:`OPTIONS` for the parallelism, in the order given."""

    @classmethod
    def parse(cls, name: str) -> Variant:
        parallel, _, rest = name.partition(":")
        recipe, *options = rest.split("+")
        allowed = OPTIONS.get(parallel)
        if (allowed is None or recipe not in recipes.names() or len(set(options)) != len(options)
                or any(o not in allowed for o in options)):
            forms = "; ".join(f"{p}:<recipe>[+{'|+'.join(o)}]" for p, o in OPTIONS.items())
            raise argparse.ArgumentTypeError(f"--variants: expected {forms} with a recipe of "
                                             f"{', '.join(recipes.names())}, got {name!r}")
        return cls(parallel, recipe, tuple(options))

    @property
    def name(self) -> str:
        return "+".join((f"{self.parallel}:{self.recipe}", *self.options))

    @property
    def baseline(self) -> str:
        return f"{self.parallel}:bf16"


@dataclass
class Setup:
    """A variant ready to step: the module to call, the model inside it, and its optimizer."""

    call: nn.Module
    model: nn.Module
    opt: Optimizer
    info: dict
    comm: object = None
    """The ``GradCommState`` of lowprec's gradient communication, when the variant has one."""


def setup(base: nn.Module, v: Variant, device: torch.device, mesh: DeviceMesh, compiled: bool) -> Setup:
    """A copy of ``base`` in BF16 on ``device``, converted, wrapped and given its optimizer as ``v`` says."""
    model = copy.deepcopy(base).to(torch.bfloat16).to(device)  # cast before conversion: delayed state stays FP32
    fp8w = "fp8w" in v.options
    info = {"conversion": "plain nn.Linear" if v.recipe == "bf16" else
            lowprec.convert(model, v.recipe, fp8_weights=fp8w).summary()}
    if "fp8ag" in v.options:  # after convert, before fully_shard and the optimizer: the weights become new parameters
        info["fp8_all_gather_layers"] = len(fp8_all_gather(model))
    if compiled:
        for block in model.layers:
            block.compile()  # in place, so DDP and fully_shard see the same modules
    comm = None
    if v.parallel == "ddp":
        call = DDP(model, device_ids=[device.index] if device.type == "cuda" else None)
        if "fp8comm" in v.options:
            comm = register_ddp(call, "fp8")
        else:
            call.register_comm_hook(None, allreduce_hook)  # DDP's own all-reduce, made from Python: counted
    else:
        n = len(model.layers)
        pending = shard_fp8_weights(model)  # FP8 primary weights: rows of codes, gathered as codes
        for i, block in enumerate(model.layers):  # resharding as lowprec's trainer does
            fully_shard(block, mesh=mesh, reshard_after_forward=reshard_after_forward(i, n))
        fully_shard(model, mesh=mesh)  # the root: embedding, final norm, LM head
        finish_fp8_weight_shards(pending)
        call = model
        if "fp8rs" in v.options:
            comm = register_fsdp(model, "fp8")
    opt = Optimizer(call.parameters(), torch.optim.AdamW, master_weights=True, fused=True, **ADAMW)
    return Setup(call, model, opt, info, comm)


def make_step(s: Setup, v: Variant, tokens: torch.Tensor) -> Callable[[], float]:
    """The training step as a user writes it; returns the group's mean loss."""
    x, y = tokens[:, :-1], tokens[:, 1:]  # (B, T) inputs, next tokens as targets
    precompute = "fp8ag" in v.options

    def step() -> float:
        s.opt.zero_grad()
        logits = s.call(x)  # (B, T, vocab)
        loss = F.cross_entropy(logits.float().flatten(0, 1), y.flatten())
        s.opt.backward(loss)
        sync_amaxes(s.model)  # delayed recipes: one all-reduce for all layers; nothing for current scaling
        result = s.opt.step(loss=loss.detach())  # the finiteness check shares the step's one host sync
        if precompute:
            precompute_fp8_scales(s.model)  # every FP8-gathered weight's scale, one all-reduce for all
        return result.loss

    return step


@dataclass
class Timing:
    """A variant being measured: its step, the first step's figures, and what its timed steps gave so far."""

    step: Callable[[], float]
    first_s: float
    loss_first: float
    seconds: list[float]
    traffic: dict
    loss_last: float = float("nan")


def start(s: Setup, v: Variant, tokens: torch.Tensor, device: torch.device, args) -> Timing:
    """The first step (compilation, the optimizer state, FSDP2's lazy init) and the warmup."""
    step = make_step(s, v, tokens)
    sync(device)
    t0 = time.perf_counter()
    loss_first = step()
    first_s = time.perf_counter() - t0
    for _ in range(args.warmup):
        step()
    sync(device)
    if s.comm is not None:
        s.comm.take()  # drop what the untimed steps sent
    return Timing(step, first_s, loss_first, [], dict.fromkeys(KINDS, 0))


def time_steps(t: Timing, device: torch.device, steps: int) -> None:
    """``steps`` more timed steps of ``t``, their bytes counted."""
    with count_traffic() as traffic:
        seconds, t.loss_last = timed(t.step, steps, device)
    t.seconds += seconds
    for k in KINDS:
        t.traffic[k] += traffic[k]


def figures(s: Setup, t: Timing, peak_bytes: int) -> dict:
    """This rank's figures of a measured variant (bytes: summed over its timed steps)."""
    out = {"median_s": statistics.median(t.seconds), "first_s": t.first_s, "peak_bytes": peak_bytes, **t.traffic,
           "loss_first": t.loss_first, "loss_last": t.loss_last, "skipped_steps": s.opt.skipped_steps,
           "info": s.info}
    if s.comm is not None:  # the hook's own count: bandwidth-optimal schedule, see grad_comm's [Note: counting bytes]
        out["info"] = {**s.info, "grad_comm_hook_bytes_per_step": s.comm.take() // len(t.seconds)}
    return out


def measure(s: Setup, v: Variant, tokens: torch.Tensor, device: torch.device, args) -> dict:
    """This rank's figures: first step, warmup, then ``args.steps`` timed steps inside ``count_traffic``."""
    t = start(s, v, tokens, device, args)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    time_steps(t, device, args.steps)
    return figures(s, t, torch.cuda.max_memory_allocated(device) if device.type == "cuda" else 0)


def reduce_ranks(local: dict | None, error: str | None, device: torch.device) -> dict:
    """The group's figures from one all-reduce (MAX), which every rank makes whether its variant ran or not;
    if any rank failed, every rank's error (one all-gather)."""
    fields = ["median_s", "first_s", "peak_bytes", *KINDS]
    vec = [1.0 if local is None else 0.0] + [0.0 if local is None else float(local[f]) for f in fields]
    t = torch.tensor(vec, dtype=torch.float64, device=device)  # float64: byte counts stay exact
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    if t[0].item() > 0:
        errors: list = [None] * dist.get_world_size()
        dist.all_gather_object(errors, error)
        return {"error": "; ".join(f"rank {r}: {e}" for r, e in enumerate(errors) if e) or "failed on a rank"}
    return dict(zip(fields, t[1:].tolist()))


def row_of(group: dict, local: dict, size: Size, steps: int) -> dict:
    """The JSON row of a variant that ran on every rank."""
    world = dist.get_world_size()
    handed = {k: int(group[k]) // steps for k in KINDS}  # the same every step
    sent = {k: sent_bytes(k, n, world) for k, n in handed.items()}
    peak = group["peak_bytes"] / 2**30 if torch.cuda.is_available() else None
    return {"tokens_per_s_per_gpu": size.tokens / group["median_s"],
            "tokens_per_s": world * size.tokens / group["median_s"], "step_ms": group["median_s"] * 1e3,
            "peak_gib": peak, "first_step_s": group["first_s"], "bytes_per_step": handed,
            "sent_bytes_per_step": sent, "sent_bytes_per_step_total": sum(sent.values()),
            **{k: local[k] for k in ("loss_first", "loss_last", "skipped_steps")}, **local["info"]}


def _free(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    torch._dynamo.reset()


def run_variant(base: nn.Module, size: Size, v: Variant, tokens: torch.Tensor, device: torch.device,
                mesh: DeviceMesh, args) -> dict:
    local, error, s = None, None, None
    try:
        s = setup(base, v, device, mesh, args.compile)
        local = measure(s, v, tokens, device, args)
    except Exception as e:  # recorded; the ranks still meet in reduce_ranks
        error = f"{type(e).__name__}: {str(e)[:400]}"
    s = None  # the model, its wrappers and optimizer go before the next variant is built
    _free(device)
    group = reduce_ranks(local, error, device)
    dist.barrier()
    return group if "error" in group else row_of(group, local, size, args.steps)


def run_rounds(base: nn.Module, size: Size, names: list[str], tokens: torch.Tensor, device: torch.device,
               mesh: DeviceMesh, args) -> dict:
    """``--rounds``: every variant set up and warmed, then ``args.rounds`` rounds of ``args.steps`` timed steps
    of each in turn, so that a drift of the machine's speed meets every variant alike; the median over all of
    a variant's timed steps. The variants are resident together, so no peak is taken. A variant that fails
    to set up is left out on every rank; a failure while the rounds run ends the run."""
    runs: dict[str, tuple[Setup, Timing]] = {}
    rows: dict[str, dict] = {}
    for name in names:
        v, error = Variant.parse(name), None
        try:
            s = setup(base, v, device, mesh, args.compile)
            runs[name] = (s, start(s, v, tokens, device, args))
        except Exception as e:
            error = f"{type(e).__name__}: {str(e)[:400]}"
            runs.pop(name, None)
            _free(device)
        ok = reduce_ranks(None if error else {f: 0.0 for f in ("median_s", "first_s", "peak_bytes", *KINDS)},
                          error, device)
        if "error" in ok:
            rows[name] = ok
            runs.pop(name, None)
    for _ in range(args.rounds):
        for _s, t in runs.values():
            time_steps(t, device, args.steps)
    for name, (s, t) in runs.items():
        local = figures(s, t, 0)
        group = reduce_ranks(local, None, device)
        row = row_of(group, local, size, args.steps * args.rounds)
        rows[name] = {**row, "peak_gib": None, "rounds": args.rounds,
                      "round_median_ms": [statistics.median(t.seconds[i:i + args.steps]) * 1e3
                                          for i in range(0, len(t.seconds), args.steps)]}
    runs.clear()
    _free(device)
    dist.barrier()
    return {name: rows[name] for name in names}


def with_ratios(rows: dict) -> dict:
    """Each row with its ratios to the same parallelism's ``bf16`` row (where that ran)."""
    out = {}
    for name, r in rows.items():
        bf = rows.get(Variant.parse(name).baseline, {})
        if "tokens_per_s_per_gpu" not in r or "tokens_per_s_per_gpu" not in bf:
            out[name] = r
            continue
        ratios = {"speed_vs_bf16": r["tokens_per_s_per_gpu"] / bf["tokens_per_s_per_gpu"],
                  "memory_vs_bf16": r["peak_gib"] / bf["peak_gib"] if r["peak_gib"] and bf["peak_gib"] else None,
                  "sent_bytes_vs_bf16": (r["sent_bytes_per_step_total"] / bf["sent_bytes_per_step_total"]
                                         if bf["sent_bytes_per_step_total"] else None),  # one rank sends nothing
                  "all_gather_vs_bf16": (r["bytes_per_step"]["all_gather"] / bf["bytes_per_step"]["all_gather"]
                                         if bf["bytes_per_step"]["all_gather"] else None)}
        out[name] = {**r, **ratios}
    return out


def _fmt(v: float | None, spec: str, suffix: str = "") -> str:
    return "-" if v is None else format(v, spec) + suffix


def table(results: dict) -> None:
    headers = ["variant", "tokens/s/GPU", "speed vs bf16", "peak GiB", "memory vs bf16", "first step s",
               "all-gather in MiB", "reduce-scatter in MiB", "all-reduce in MiB", "all-to-all in MiB", "sent MiB",
               "sent vs bf16", "all-gather vs bf16"]
    for group, rows in results.items():
        out = []
        for name, r in with_ratios(rows).items():
            if "tokens_per_s_per_gpu" not in r:
                out.append([name, r.get("error", "")[:100]] + [""] * (len(headers) - 2))
                continue
            mib = [f"{r['bytes_per_step'][k] / 2**20:.2f}" for k in ("all_gather", "reduce_scatter", "all_reduce",
                                                                     "all_to_all")]
            out.append([name, f"{r['tokens_per_s_per_gpu']:.0f}", _fmt(r.get("speed_vs_bf16"), ".2f", "x"),
                        _fmt(r["peak_gib"], ".2f"), _fmt(r.get("memory_vs_bf16"), ".2f", "x"),
                        f"{r['first_step_s']:.2f}", *mib, f"{r['sent_bytes_per_step_total'] / 2**20:.2f}",
                        _fmt(r.get("sent_bytes_vs_bf16"), ".2f", "x"), _fmt(r.get("all_gather_vs_bf16"), ".2f", "x")])
        print_table(group, headers, out)
    print("\n'in': bytes a rank hands to each kind of collective per step (count_traffic); 'sent': bytes it "
          "sends under each collective's bandwidth-optimal schedule; ratios against the same parallelism's bf16")


def json_name(args) -> str:
    variants = "all" if args.variants == DEFAULT_VARIANTS else "-".join(args.variants)
    mode = "compiled" if args.compile else "eager"
    rounds = [f"rounds{args.rounds}"] if args.rounds > 1 else []
    return result_name("bench_distributed", args.sizes, mode, f"{dist.get_world_size()}ranks", variants, *rounds)


def run_size(size_name: str, device: torch.device, mesh: DeviceMesh, args, env: dict, results: dict) -> None:
    size = SIZES[size_name]
    base = build_model(size.config, seed=0)  # FP32 on the CPU, the same on every rank
    gen = torch.Generator().manual_seed(1000 + dist.get_rank())  # each rank its own batch
    tokens = torch.randint(size.config.vocab_size, (size.batch, size.seq_len + 1), generator=gen).to(device)
    group = f"{size_name} / {'compiled' if args.compile else 'eager'} / {dist.get_world_size()} ranks"
    rows = results.setdefault(group, {})

    def record(name: str) -> None:
        if dist.get_rank() == 0:
            print(group, name, rows[name], flush=True)
            write_json(args.out, json_name(args), {"env": env, "args": vars(args), "sizes": sizes_info(args),
                                                   "results": {g: with_ratios(r) for g, r in results.items()}})

    if args.rounds > 1:
        rows.update(run_rounds(base, size, args.variants, tokens, device, mesh, args))
        for name in args.variants:
            record(name)
        return
    for name in args.variants:
        rows[name] = run_variant(base, size, Variant.parse(name), tokens, device, mesh, args)
        record(name)


def sizes_info(args) -> dict:
    return {name: {**asdict(SIZES[name]), "n_params": SIZES[name].config.num_params(),
                   "tokens_per_step_per_gpu": SIZES[name].tokens} for name in args.sizes.split(",")}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=".", help="directory for the JSON (rank 0 writes it)")
    ap.add_argument("--sizes", default="1b", help=f"comma-separated, of {', '.join(SIZES)}")
    ap.add_argument("--variants", default=",".join(DEFAULT_VARIANTS),
                    help="comma-separated <ddp|fsdp2>:<recipe>[+fp8comm (ddp) | +fp8ag, +fp8rs (fsdp2) | +fp8w]")
    ap.add_argument("--steps", type=int, default=10, help="timed steps (after the first and the warmup)")
    ap.add_argument("--warmup", type=int, default=3, help="untimed steps after the first")
    ap.add_argument("--rounds", type=int, default=1,
                    help="with more than 1: every variant set up at once, then this many rounds of --steps timed "
                         "steps of each in turn (speed only: no peak memory)")
    ap.add_argument("--compile", action="store_true", help="torch.compile each transformer block")
    ap.add_argument("--compile-cache", action="store_true",
                    help="let torch.compile reuse its on-disk caches (default: every first step compiles cold)")
    ap.add_argument("--timeout-s", type=int, default=900,
                    help="the process group's timeout: how long a rank waits in a collective for the others")
    args = ap.parse_args(argv)
    for v in args.sizes.split(","):
        if v not in SIZES:
            ap.error(f"--sizes: expected one of {', '.join(SIZES)}, got {v!r}")
    try:
        args.variants = [Variant.parse(v).name for v in args.variants.split(",")]
    except argparse.ArgumentTypeError as e:
        ap.error(str(e))
    if args.steps < 1 or args.warmup < 0 or args.rounds < 1:
        ap.error(f"--steps, --warmup, --rounds: expected at least 1, 0 and 1, got {args.steps}, {args.warmup} "
                 f"and {args.rounds}")
    if "LOCAL_RANK" not in os.environ:
        ap.error("expected a launch by torchrun, got none: torchrun --nproc-per-node N "
                 "benchmarks/bench_distributed.py ...")
    return args


def init() -> tuple[torch.device, DeviceMesh]:
    """This rank's device (its GPU, or the CPU) and the 1-D mesh of all ranks."""
    if torch.cuda.is_available():
        device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    return device, init_device_mesh(device.type, (dist.get_world_size(),))


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    dist.init_process_group(backend, timeout=timedelta(seconds=args.timeout_s))
    try:
        device, mesh = init()
        torch.manual_seed(0)
        # a cache warmed by an earlier variant, or an earlier run, would shorten only some first steps
        torch._inductor.config.force_disable_caches = not args.compile_cache
        env = {**environment(), "world_size": dist.get_world_size(), "backend": backend}
        results: dict = {}
        for size_name in args.sizes.split(","):
            run_size(size_name, device, mesh, args, env, results)
        if dist.get_rank() == 0:
            print(env)
            table(results)
        return results
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
