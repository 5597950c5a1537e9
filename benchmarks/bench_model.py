"""Benchmark 4: the whole training step of the reference model, BF16 against every recipe and torchao.

    python benchmarks/bench_model.py --out results/ [--sizes 125m,1b,3b] [--modes compiled,eager]
        [--params fp32-autocast,bf16-master] [--variants bf16,lowprec:fp8-current,torchao:tensorwise]
        [--steps 10] [--warmup 3] [--convert-on device|cpu|cpu,device] [--recompute none,selective,full]
    python benchmarks/bench_model.py --sizes tiny --modes eager --steps 2   # dry run, any machine

A step is what a user writes: zero the gradients, the forward on a fixed batch of random tokens,
cross-entropy, backward, the optimizer step. Two ways to hold the parameters:
``fp32-autocast``: FP32 parameters, forward under ``torch.autocast`` to BF16, fused AdamW;
``bf16-master``: BF16 parameters in ``lowprec.optim.Optimizer`` (FP32 masters, inner fused AdamW),
the same for every variant so they compare alike. Variants: ``bf16`` (the plain model),
``lowprec:<recipe>`` (``lowprec.convert`` with the default policy), ``torchao:<recipe>``
(``convert_to_float8_training``, when torchao is importable). The LM head stays BF16 in all.
``torch.compile`` compiles the model (mode ``cudagraphs``: ``mode="reduce-overhead"``, forward and backward
replayed as CUDA graphs); the optimizer step runs eagerly, as in most training scripts.
``--recompute`` checkpoints every block of every variant (``lowprec.train.recompute.recompute_blocks``),
one group per mode.

For each (size, mode, params) group, in one process: tokens/s (median step), the ratio to BF16,
peak memory over the timed steps and its ratio, the peak ``lowprec.plan`` predicts (``bf16-master``
variants: the planner models BF16 parameters with FP32 masters), the first step's seconds (compilation included)
apart from the steady state, graph breaks, and MFU against the dense BF16 peak of ``--gpu``.
The JSON is rewritten after every variant, so a run cut short keeps what it measured.
"""
from __future__ import annotations

import argparse
import copy
import gc
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict

import torch
import torch._inductor.config
import torch.nn.functional as F
from _common import DEVICE, environment, print_table, result_name, sync, timed, write_json
from _models import ADAMW, SIZES, Size
from torch import nn

import lowprec
from lowprec import recipes
from lowprec.distributed.launch import transformer_blocks
from lowprec.nn.saved import fp8_activations
from lowprec.plan import PlanConfig, Training, plan
from lowprec.plan.activations import RECOMPUTE
from lowprec.plan.gpus import GPUS, get_gpu
from lowprec.plan.models import reference_spec
from lowprec.train.model import build_model
from lowprec.train.recompute import Recompute, recompute_blocks, recompute_mode

MODES = ("compiled", "eager", "cudagraphs")
PARAMS = ("fp32-autocast", "bf16-master")
CONVERT_ON = ("device", "cpu")
TORCHAO_RECIPES = ("tensorwise", "rowwise", "rowwise_with_gw_hp")
TORCHAO_MISSING = "skipped: torchao not importable"
DEFAULT_VARIANTS = ["bf16", *(f"lowprec:{r}" for r in ("fp8-current", "fp8-delayed", "fp8-rowwise", "fp8-blockwise",
                                                        "mxfp8", "mxfp4", "nvfp4")),
                    "torchao:tensorwise", "torchao:rowwise"]


def torchao_float8():
    """``torchao.float8``, or None where torchao is not installed."""
    try:
        from torchao import float8
    except ImportError:
        return None
    return float8


MEMORY_OPTIONS = {"fp8w": "FP8 primary weights", "fp8act": "FP8 saved activations (1x128)",
                  "bf16states": "BF16 AdamW moments", "fp8states": "FP8 AdamW moments", "int8states": "8-bit moments",
                  "recast": "inputs recast in a compiled backward (Policy(recast_inputs=True))"}
"""``lowprec:<recipe>+<option>+...``: the memory options of a lowprec variant (the last three need
``--params bf16-master``, whose optimizer is lowprec's; FP8 weights too, for their masters)."""


def lowprec_options(name: str) -> tuple[str, set[str]]:
    """The recipe of a ``lowprec:`` variant and its memory options."""
    recipe, *options = name.partition(":")[2].split("+")
    return recipe, set(options)


def check_variant(name: str) -> str:
    kind, _, rest = name.partition(":")
    recipe, options = lowprec_options(name) if kind == "lowprec" else (rest, set())
    ok = (name == "bf16" or (kind == "lowprec" and recipe in recipes.names() and options <= set(MEMORY_OPTIONS)
                             and sum(o.endswith("states") for o in options) <= 1)
          or (kind == "torchao" and recipe in TORCHAO_RECIPES))
    if not ok:
        raise argparse.ArgumentTypeError(
            f"--variants: expected bf16, lowprec:<{'|'.join(recipes.names())}>[+{'|+'.join(MEMORY_OPTIONS)}] "
            f"or torchao:<{'|'.join(TORCHAO_RECIPES)}>, got {name!r}")
    return name


def convert(model: nn.Module, name: str) -> str:
    """Set ``model`` up in place as ``name`` says; a one-line description of what was converted."""
    kind, _, recipe = name.partition(":")
    if kind == "lowprec":
        recipe, options = lowprec_options(name)
        policy = lowprec.Policy(saved_activations=fp8_activations("1x128") if "fp8act" in options else None,
                                recast_inputs="recast" in options)
        # the default policy keeps the LM head
        return lowprec.convert(model, recipe, policy, fp8_weights="fp8w" in options).summary()
    if kind == "torchao":
        float8 = torchao_float8()
        config = float8.Float8LinearConfig.from_recipe_name(recipe)
        float8.convert_to_float8_training(model, config=config, module_filter_fn=lambda _m, fqn: fqn != "output")
        return f"torchao {recipe}, output kept"
    return "plain nn.Linear"


def memory_options(name: str) -> tuple[str, set[str], str]:
    """The recipe (``bf16`` for the plain model), the memory options and AdamW's moments (``fp32``:
    the inner optimizer's own) of a variant."""
    recipe, options = lowprec_options(name) if name.startswith("lowprec:") else (name.partition(":")[2] or name, set())
    states = next((o.removesuffix("states") for o in options if o.endswith("states")), "fp32")
    return recipe, options, states


def planned(size: Size, name: str, recompute: str, gpu: str):
    """``lowprec.plan``'s plan of the variant's step on one ``gpu`` (BF16 parameters with FP32 masters); None
    where it models no such step: torchao, inputs recast in backward."""
    recipe, options, states = memory_options(name)
    if name.startswith("torchao:") or "recast" in options:
        return None
    training = Training(seq=size.seq_len, micro_batch=size.batch, recompute=recompute, optim_states=states,
                        fp8_weights="fp8w" in options,
                        saved_activations=fp8_activations("1x128") if "fp8act" in options else None)
    return plan(PlanConfig(model=reference_spec("bench", size.config), recipe=recipe, gpu=gpu, gpus=1,
                           training=training))


def planned_gib(size: Size, name: str, params: str, recompute: str, gpu: str) -> float | None:
    """The peak ``lowprec.plan`` predicts for the variant on one ``gpu``; None where it models no such step:
    FP32 parameters under autocast, torchao, inputs recast in backward."""
    p = planned(size, name, recompute, gpu) if params == "bf16-master" else None
    return None if p is None else p.memory.total / 2**30


def place(base: nn.Module, name: str, dtype: torch.dtype, convert_on: str,
          recompute: str = "none") -> tuple[nn.Module, str, float]:
    """A copy of ``base`` in ``dtype`` on ``DEVICE`` set up as ``name``, converted on the CPU then moved,
    or moved then converted, its blocks checkpointed as ``recompute`` says; with the description and the
    seconds conversion and move took."""
    model = copy.deepcopy(base).to(dtype)  # cast before conversion: delayed-scaling state stays FP32
    sync(DEVICE)
    t0 = time.perf_counter()
    if convert_on == "device":
        model.to(DEVICE)
    what = convert(model, name)
    recompute_blocks(model, recompute)
    model.to(DEVICE)
    sync(DEVICE)
    return model, what, time.perf_counter() - t0


def gib(n: int) -> float:
    return n / 2**30


def make_step(model: nn.Module, params: str, compiled: bool, tokens: torch.Tensor,
              states: str | None = None, graphs: bool = False) -> tuple[Callable, object]:
    """The training step as a user writes it, and its optimizer (AdamW; ``states``: lowprec's AdamW with
    moments in ``bf16``, ``fp8`` or ``int8``); ``graphs``: compiled with CUDA graphs."""
    forward = (torch.compile(model, mode="reduce-overhead") if graphs
               else torch.compile(model) if compiled else model)
    begin = torch.compiler.cudagraph_mark_step_begin if graphs else (lambda: None)
    x, y = tokens[:, :-1], tokens[:, 1:]  # (B, T) inputs, next tokens as targets
    fused = {"fused": True}  # fused AdamW exists on CUDA and on CPU: the dry run takes the same path
    if params == "fp32-autocast":
        opt = torch.optim.AdamW(model.parameters(), **ADAMW, **fused)

        def step() -> torch.Tensor:
            begin()  # the last step's graph outputs are dead from here
            opt.zero_grad(set_to_none=True)
            with torch.autocast(DEVICE, dtype=torch.bfloat16):
                logits = forward(x)  # (B, T, vocab)
                loss = F.cross_entropy(logits.float().flatten(0, 1), y.flatten())
            loss.backward()
            opt.step()
            return loss.detach()
    else:
        inner = (torch.optim.AdamW, fused) if states is None else (lowprec.optim.AdamWLP, {"states": states})
        opt = lowprec.optim.Optimizer(model.parameters(), inner[0], master_weights=True, **ADAMW, **inner[1])

        def step() -> torch.Tensor:
            begin()
            opt.zero_grad()
            logits = forward(x)  # (B, T, vocab)
            loss = F.cross_entropy(logits.float().flatten(0, 1), y.flatten())
            opt.backward(loss)
            opt.step(loss=loss.detach())  # the finiteness check shares the step's one host sync
            return loss.detach()
    step.forward = forward  # the (compiled) model the step calls, for bench_profile's forward alone
    return step, opt


def measure(model: nn.Module, size: Size, params: str, compiled: bool, tokens: torch.Tensor, args,
            states: str | None = None, graphs: bool = False) -> dict:
    """First step, warmup, then ``args.steps`` timed steps of ``model``."""
    step, opt = make_step(model, params, compiled, tokens, states, graphs)
    counters = torch._dynamo.utils.counters
    counters.clear()
    sync(DEVICE)
    t0 = time.perf_counter()
    first_loss = step().item()  # compiles, autotunes, creates the optimizer state
    first_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    for _ in range(args.warmup):  # recompilations and delayed-scaling histories settle here
        step()
    sync(DEVICE)
    warmup_s = time.perf_counter() - t0
    if DEVICE == "cuda":
        torch.cuda.reset_peak_memory_stats()
    seconds, loss = timed(step, args.steps, DEVICE)
    row = {"tokens_per_s": size.tokens / statistics.median(seconds), "step_ms": [s * 1e3 for s in seconds],
           # a replayed CUDA graph allocates nothing: its pool would be missing from the peak
           "peak_gib": gib(torch.cuda.max_memory_allocated()) if DEVICE == "cuda" and not graphs else None,
           "first_step_s": first_s, "warmup_s": warmup_s, "graph_breaks": sum(counters["graph_break"].values()),
           "graphs": counters["stats"]["unique_graphs"], "cudagraph_skips": counters["inductor"]["cudagraph_skips"],
           "loss_first": first_loss, "loss_last": loss.item(),
           "skipped_steps": getattr(opt, "skipped_steps", 0)}
    if DEVICE == "cuda":
        row["mfu"] = size.tokens * size.flops_per_token() / statistics.median(seconds) / args.peak_flops
    return row


def run_variant(base: nn.Module, size: Size, name: str, where: str, params: str, mode: str,
                tokens: torch.Tensor, args, recompute: str = "none") -> dict:
    if name.startswith("torchao:") and torchao_float8() is None:
        return {"skipped": TORCHAO_MISSING}
    planned = {"planned_gib": planned_gib(size, name, params, recompute, args.gpu)}
    try:
        row = {**planned, **_variant(base, size, name, where, params, mode, tokens, args, recompute)}
    except Exception as e:  # a variant that fails (out of memory, say) is recorded and the group goes on
        row = {"convert_on": where, **planned, "error": f"{type(e).__name__}: {str(e)[:400]}"}
    # the model, optimizer and compiled graphs died with _variant's frame (or its traceback's)
    gc.collect()
    if DEVICE == "cuda":
        torch.cuda.empty_cache()
    torch._dynamo.reset()
    return row


def _variant(base: nn.Module, size: Size, name: str, where: str, params: str, mode: str,
             tokens: torch.Tensor, args, recompute: str = "none") -> dict:
    _, options, states = memory_options(name)
    if (states != "fp32" or "fp8w" in options) and params != "bf16-master":
        raise ValueError(f"{name}: its memory options need --params bf16-master (lowprec's optimizer)")
    dtype = torch.float32 if params == "fp32-autocast" else torch.bfloat16
    model, what, setup_s = place(base, name, dtype, where, recompute)
    model_gib = gib(torch.cuda.memory_allocated()) if DEVICE == "cuda" else None  # parameters, buffers, batch
    row = measure(model, size, params, mode != "eager", tokens, args, None if states == "fp32" else states,
                  graphs=mode == "cudagraphs")
    checkpointed = sum(recompute_mode(b) is not Recompute.NONE for b in transformer_blocks(model))
    return {"convert_on": where, "conversion": what, "setup_s": setup_s, "model_gib": model_gib,
            "checkpointed_blocks": checkpointed, **row}


def runs(variants: list[str], convert_on: list[str]) -> list[tuple[str, str, str]]:
    """(label, variant, where to convert) in order; the plain model has nothing to convert, so it runs once."""
    out = []
    for name in variants:
        for where in convert_on[:1] if name == "bf16" else convert_on:
            label = name if len(convert_on) == 1 or name == "bf16" else f"{name} (converted on {where})"
            out.append((label, name, where))
    return out


def json_name(args) -> str:
    variants = "all" if args.variants == DEFAULT_VARIANTS else "-".join(args.variants)
    parts = [args.sizes, args.modes, args.params, variants] + ([] if args.convert_on == ["device"] else
                                                               ["convert-on-" + "-".join(args.convert_on)])
    parts += [] if args.recompute == ["none"] else ["recompute-" + "-".join(args.recompute)]
    return result_name("bench_model", *parts)


def run_size(size_name: str, args, env: dict, results: dict) -> None:
    size = SIZES[size_name]
    base = build_model(size.config, seed=0)  # FP32 on the CPU; every variant starts from a copy
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(size.config.vocab_size, (size.batch, size.seq_len + 1), generator=gen).to(DEVICE)
    for params in args.params.split(","):
        for mode in args.modes.split(","):
            for recompute in args.recompute:
                group = f"{size_name} / {mode} / {params}" + ("" if args.recompute == ["none"] else
                                                              f" / recompute {recompute}")
                rows = results.setdefault(group, {})
                for label, name, where in runs(args.variants, args.convert_on):
                    rows[label] = run_variant(base, size, name, where, params, mode, tokens, args, recompute)
                    print(group, label, {k: v for k, v in rows[label].items() if k != "step_ms"}, flush=True)
                    write_json(args.out, json_name(args), {"env": env, "args": vars(args),
                                                           "sizes": sizes_info(args), "results": results})


def sizes_info(args) -> dict:
    return {name: {**asdict(SIZES[name]), "n_params": SIZES[name].config.num_params(),
                   "tokens_per_step": SIZES[name].tokens, "flops_per_token": SIZES[name].flops_per_token()}
            for name in args.sizes.split(",")}


def _ratio(num: float | None, den: float | None) -> str:
    return f"{num / den:.2f}x" if num and den else "-"


def _num(v: float | None, fmt: str) -> str:
    return "-" if v is None else format(v, fmt)


def table(results: dict) -> None:
    headers = ["variant", "tokens/s", "speed vs bf16", "peak GiB", "memory vs bf16", "planned GiB", "MFU",
               "first step s", "convert s", "breaks"]
    for group, rows in results.items():
        bf = rows.get("bf16", {})
        out = []
        for label, r in rows.items():
            if "tokens_per_s" not in r:
                row = [label, r.get("skipped") or r.get("error", "")[:80]] + [""] * (len(headers) - 2)
                row[headers.index("planned GiB")] = _num(r.get("planned_gib"), ".2f")  # what did not fit, say
                out.append(row)
                continue
            out.append([label, f"{r['tokens_per_s']:.0f}", _ratio(r["tokens_per_s"], bf.get("tokens_per_s")),
                        _num(r["peak_gib"], ".2f"), _ratio(r["peak_gib"], bf.get("peak_gib")),
                        _num(r.get("planned_gib"), ".2f"), _num(r.get("mfu"), ".1%"), f"{r['first_step_s']:.2f}",
                        f"{r['setup_s']:.2f}", r["graph_breaks"]])
        print_table(group, headers, out)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=".", help="directory for the JSON")
    ap.add_argument("--sizes", default="125m,1b,3b", help=f"comma-separated, of {', '.join(SIZES)}")
    ap.add_argument("--modes", default="compiled,eager", help="comma-separated, of " + ", ".join(MODES))
    ap.add_argument("--params", default=",".join(PARAMS), help="comma-separated, of " + ", ".join(PARAMS))
    ap.add_argument("--variants", default=",".join(DEFAULT_VARIANTS),
                    help="comma-separated: bf16, lowprec:<recipe>, torchao:<tensorwise|rowwise|rowwise_with_gw_hp>")
    ap.add_argument("--convert-on", default="device",
                    help="device (move, then convert), cpu (convert, then move), or both: cpu,device")
    ap.add_argument("--steps", type=int, default=10, help="timed steps (after the first and the warmup)")
    ap.add_argument("--warmup", type=int, default=3, help="untimed steps after the first")
    ap.add_argument("--recompute", default="none",
                    help="comma-separated, of " + ", ".join(RECOMPUTE) + ": every block checkpointed so, a group each")
    ap.add_argument("--compile-cache", action="store_true",
                    help="let torch.compile reuse its on-disk caches (default: every first step compiles cold)")
    ap.add_argument("--gpu", default="h200", choices=sorted(GPUS), help="whose dense BF16 peak MFU is against")
    args = ap.parse_args(argv)
    for flag, choices in (("sizes", SIZES), ("modes", MODES), ("params", PARAMS), ("convert_on", CONVERT_ON),
                          ("recompute", RECOMPUTE)):
        for v in getattr(args, flag).split(","):
            if v not in choices:
                ap.error(f"--{flag.replace('_', '-')}: expected one of {', '.join(choices)}, got {v!r}")
    try:
        args.variants = [check_variant(v) for v in args.variants.split(",")]
    except argparse.ArgumentTypeError as e:
        ap.error(str(e))
    if args.steps < 1 or args.warmup < 0:
        ap.error(f"--steps: expected at least 1 and --warmup at least 0, got {args.steps} and {args.warmup}")
    args.convert_on = args.convert_on.split(",")
    args.recompute = args.recompute.split(",")
    args.peak_flops = get_gpu(args.gpu).peak("bf16")[0] * 1e12
    return args


def torchao_version() -> str | None:
    try:
        import torchao
    except ImportError:
        return None
    return torchao.__version__


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    torch.manual_seed(0)  # stochastic rounding draws from the global generators
    # a cache warmed by an earlier variant, or an earlier run, would shorten only some first steps
    torch._inductor.config.force_disable_caches = not args.compile_cache
    env = {**environment(), "torchao": torchao_version()}
    results: dict = {}
    for size_name in args.sizes.split(","):
        run_size(size_name, args, env, results)
    print(env)
    table(results)
    return results


if __name__ == "__main__":
    main()
