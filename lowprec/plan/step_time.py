"""The planner's step time, part by part, each part at the fraction of its peak measured for it.

[Note: the step's parts]
Where no ``--mfu`` is given, a step on one GPU is the sum of (per token, times the tokens each GPU handles
in a step, ``tokens_per_step / gpus``):

* the GEMMs of every linear, fprop, dgrad and wgrad, 2 x d_in x d_out FLOPs each per active copy, at their
  format's dense peak times the measured fraction for dense GEMMs (``lowprec.plan.efficiency``); a GEMM
  lowprec emulates at its high-precision peak plus its casts' traffic, a folded one at the FP8 peak plus
  its folding's, as [Note: FLOPs and time] in ``lowprec.plan.throughput`` counts them;
* the routed experts, fwd+bwd, as BF16's grouped GEMM at the fraction measured for the FLOPs of one expert's
  GEMM (``tokens x top_k x ep / experts`` rows), divided by the speed measured for the recipe's experts
  relative to BF16's (casts included); a recipe whose experts were not measured as its dense linears are;
* the casts of the native low-precision GEMMs' operands, as memory traffic: each distinct input, output
  gradient and weight (once per micro-batch) read once for a per-tensor amax, read again and written in
  both orientations (Hopper's FP8 GEMMs take K-major operands only);
* the LM head and the routers in BF16, attention at the fraction measured for the sequence length;
* the other kernels (norms, SwiGLU, residuals, rotary embeddings, the loss, routing), taken as a multiple of
  the bytes the blocks save for backward in BF16 (the routed experts' SwiGLU is inside their figure);
* recomputation: ``full`` runs each block's forward again (a third of its GEMMs, attention and other
  kernels), ``selective`` its other kernels' forward (a third of them);
* the optimizer step: the parameters the GPU updates (its ZeRO shard), each moving its gradient, its
  master weight or weight, its BF16 copy and both moments, at the measured fraction of the HBM bandwidth.

A pipeline of ``pp`` stages and ``k`` micro-batches per step idles ``(pp - 1) / (k + pp - 1)`` of the
compute (1F1B's bubble). Communication is not modelled: a plan with more than one GPU is a bound.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from lowprec.optim.states import StateFormat
from lowprec.plan.activations import block_saved, output_saved
from lowprec.plan.efficiency import Efficiency, efficiency_for
from lowprec.plan.gemm_paths import GemmPath, Path, gemm_paths
from lowprec.plan.gpus import GPU
from lowprec.plan.layers import Linear, block_kinds, block_linears
from lowprec.plan.memory import Parallel, Training, updated_params
from lowprec.plan.models import ModelSpec
from lowprec.plan.recipes import GRAD_BYTES, HP_BYTES, MASTER_BYTES, RECIPES, TENSOR, RecipeCost, Storage
from lowprec.plan.throughput import FOLD_BYTES, attention_fwd_flops, cast_and_widen_bytes

EXPERT_SWIGLU = "moe.expert.gate_up"
"""The routed experts' SwiGLU input: its kernels are inside the experts' measured figure."""


@dataclass(frozen=True, slots=True)
class TimePart:
    name: str
    seconds: float
    """Per step on one GPU."""
    how: str


@dataclass(frozen=True, slots=True)
class StepTime:
    parts: tuple[TimePart, ...]
    efficiency: Efficiency
    measured: bool
    """The fractions were measured on the planned GPU (else the H200's are assumed)."""
    bubble: float
    """The pipeline's factor on the compute (1 without a pipeline)."""

    @property
    def step_s(self) -> float:
        return sum(p.seconds for p in self.parts)


class _Parts:
    """Seconds per token on one GPU by part name, then scaled to a step."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}
        self.how: dict[str, str] = {}

    def add(self, name: str, seconds: float, how: str) -> None:
        self.seconds[name] = self.seconds.get(name, 0.0) + seconds
        self.how.setdefault(name, how)


def _flops_seconds(flops: float, tflops: float, fraction: float) -> float:
    return flops / (tflops * 1e12 * fraction)


def _cast_bytes(s: Storage, row: int) -> float:
    """Bytes one element's native cast moves: an amax pass where one scale covers the tensor, then a read
    and both orientations written."""
    amax = HP_BYTES if s.scale_every == TENSOR else 0.0
    return amax + HP_BYTES + 2 * s.bytes_per_element(row, float("inf"))


def _gemms(parts: _Parts, lin: Linear, n: int, recipe: RecipeCost, paths: tuple[GemmPath, ...] | None,
           gpu: GPU, eff: Efficiency, tokens: int, what: str, fraction: Callable[[str], float],
           cast_input: bool, cast_weight: bool = True) -> None:
    """One linear's three GEMMs (``n`` blocks of it), each at ``fraction(format)`` of its format's peak, and
    where they are native or folded its operands' casts (the input only where ``cast_input``: linears that
    read one tensor share its cast; the weight only where ``cast_weight``: FP8 primary weights the GEMMs
    read as stored are not cast)."""
    flops = 2 * lin.d_in * lin.d_out * lin.active * n  # per GEMM, per token
    if not lin.quantized or paths is None:
        parts.add(f"GEMMs: {what} in bf16", 3 * _flops_seconds(flops, gpu.peak("bf16")[0], fraction("bf16")),
                  f"bf16 peak x {fraction('bf16'):.3g}")
        return
    inputs, outputs, weights = lin.d_in * lin.active * n, lin.d_out * lin.active * n, lin.numel * n / tokens
    sides = ((inputs, weights), (outputs, weights), (outputs, inputs))
    rows = ((lin.d_in, lin.d_in), (lin.d_out, lin.d_out), (tokens, tokens))
    hbm = gpu.hbm_tb_s * 1e12 * eff.hbm
    for gp, fmt, (lhs, rhs), (n_l, n_r), (r_l, r_r) in zip(paths, recipe.gemms, recipe.operands, sides, rows):
        if gp.path is Path.EMULATED:
            wide = 4 if gp.emulated_in == "fp32" else HP_BYTES
            parts.add(f"GEMMs: {what} in {fmt} (emulated in {gp.emulated_in})",
                      _flops_seconds(flops, gpu.peak(gp.emulated_in)[0], fraction(gp.emulated_in)),
                      f"{gp.emulated_in} peak x {fraction(gp.emulated_in):.3g}")
            traffic = n_l * cast_and_widen_bytes(lhs, r_l, wide) + n_r * cast_and_widen_bytes(rhs, r_r, wide)
            parts.add("casts (emulated GEMMs: cast, then widened)", traffic / hbm, f"HBM x {eff.hbm:g}")
            continue
        gemm_fmt = "fp8" if gp.path is Path.FOLDED else fmt
        label = f"GEMMs: {what} in {fmt}" + (" (folded to fp8)" if gp.path is Path.FOLDED else "")
        parts.add(label, _flops_seconds(flops, gpu.peak(gemm_fmt)[0], fraction(gemm_fmt)),
                  f"{gemm_fmt} peak x {fraction(gemm_fmt):.3g}")
        if gp.path is Path.FOLDED:
            parts.add("casts (folding MX operands)", (n_l + n_r) * FOLD_BYTES / hbm, f"HBM x {eff.hbm:g}")
    if any(gp.path is not Path.EMULATED for gp in paths):  # native or folded: each tensor cast once
        x, dy, w = recipe.operands[0][0], recipe.operands[1][0], recipe.operands[0][1]
        traffic = _cast_bytes(dy, lin.d_out) * outputs + (_cast_bytes(w, lin.d_in) * weights if cast_weight else 0.0)
        traffic += _cast_bytes(x, lin.d_in) * inputs if cast_input else 0.0
        parts.add("casts (amax, cast, both orientations)", traffic / hbm, f"HBM x {eff.hbm:g}")


def _experts(parts: _Parts, lin: Linear, n: int, recipe: RecipeCost, paths: tuple[GemmPath, ...] | None,
             gpu: GPU, eff: Efficiency, tokens: int, ep: int) -> None:
    """One routed-expert projection's three grouped GEMMs (``n`` blocks), SwiGLU and casts included."""
    rows = tokens * lin.active * ep / lin.copies  # an expert's rows on its rank
    per_call = 2 * rows * lin.d_in * lin.d_out
    fraction = eff.grouped.at(per_call)
    flops = 6 * lin.d_in * lin.d_out * lin.active * n
    how = f"bf16 grouped at {fraction:.3g} of peak ({per_call:.3g} FLOPs per expert GEMM)"
    relative = eff.grouped_relative(recipe.name if lin.quantized and paths is not None else "bf16")
    if relative is None:  # not measured: its GEMM paths at the grouped fraction, with the dense linears' casts
        _gemms(parts, lin, n, recipe, paths, gpu, eff, tokens, "routed experts (modelled, not measured)",
               lambda fmt: fraction, True)
        return
    speed = relative.at(per_call)
    name = recipe.name if lin.quantized and paths is not None else "bf16"
    parts.add(f"GEMMs: routed experts in {name} (grouped)",
              _flops_seconds(flops, gpu.peak("bf16")[0], fraction) / speed,
              how + ("" if name == "bf16" else f" / {speed:.3g}, its experts' measured speed against bf16's"))


def step_time(m: ModelSpec, recipe: RecipeCost, gpu: GPU, train: Training, par: Parallel, stage: int,
              tokens_per_step: int) -> StepTime:
    """The parts of one optimizer step on one GPU of ``stage`` ([Note: the step's parts])."""
    eff, measured = efficiency_for(gpu.key)
    parts = _Parts()
    paths = gemm_paths(recipe.recipe, gpu.capability) if recipe.recipe is not None and recipe.quantizes else None
    tokens = train.tokens
    bf16, dense = gpu.peak("bf16")[0], eff.gemm_fraction("bf16")
    router_flops = 0.0
    cast_weights = not (train.fp8_weights and recipe.fp8_weight_direct)
    for kind, n in block_kinds(m, recipe.hp_blocks(m.n_layers), recipe.min_features):
        cast: set[str] = set()
        for lin in block_linears(m, *kind):
            if lin.expert:
                _experts(parts, lin, n, recipe, paths, gpu, eff, tokens, par.ep)
            elif lin.name == "moe.router":
                router_flops += 6 * lin.active_numel * n
            else:
                _gemms(parts, lin, n, recipe, paths, gpu, eff, tokens, "linears", eff.gemm_fraction,
                       lin.quantized and lin.input not in cast, cast_weights)
                cast |= {lin.input} if lin.quantized else set()
    parts.add("GEMMs: LM head and routers in bf16",
              _flops_seconds(6 * m.vocab * m.d_model + router_flops, bf16, dense), f"bf16 peak x {dense:g}")
    attn = eff.attention.at(train.seq)
    attn_fwd = attention_fwd_flops(m, train.seq)
    parts.add("attention", _flops_seconds(3 * attn_fwd, bf16, attn), f"bf16 peak x {attn:.3g} at seq {train.seq}")
    bf16_cost = RECIPES["bf16"]
    saved = sum(n * sum(s.bytes(bf16_cost) for s in block_saved(m, kind.moe, quantized=False)
                        if not s.only_selective and s.name != EXPERT_SWIGLU)
                for kind, n in block_kinds(m)) + sum(s.bytes(bf16_cost) for s in output_saved(m))
    other = eff.elementwise * saved / (gpu.hbm_tb_s * 1e12)
    parts.add("other kernels (norms, activations, routing, loss)", other,
              f"{eff.elementwise:g} x {saved / 1e6:.3g} MB saved per token at the HBM bandwidth")
    if train.recompute == "full":  # the blocks' GEMMs (not the head's) and casts, attention, the other kernels
        forward = sum(v for k, v in parts.seconds.items()
                      if k.startswith(("GEMMs: linears", "GEMMs: routed", "casts"))) / 3
        parts.add("recomputation (full: each block's forward again)",
                  forward + _flops_seconds(attn_fwd, bf16, attn) + other / 3,
                  "a third of the blocks' GEMMs and casts, of attention and of the other kernels")
    elif train.recompute == "selective":
        parts.add("recomputation (selective: the other kernels' forward)", other / 3, "a third of the other kernels")
    per_gpu = tokens_per_step / par.gpus
    micro = max(train.grad_accum, par.pp)
    bubble = (micro + par.pp - 1) / micro
    out = [TimePart(name, s * per_gpu * bubble, parts.how[name]) for name, s in parts.seconds.items()]
    moment = StateFormat(train.optim_states).bytes_per_value
    per_param = GRAD_BYTES[train.grad_dtype] + (2 * MASTER_BYTES + HP_BYTES if train.master_weights else
                                                 2 * HP_BYTES) + 4 * moment
    params = updated_params(m, recipe, par, stage)
    out.append(TimePart("optimizer step", params * per_param / (gpu.hbm_tb_s * 1e12 * eff.hbm),
                        f"{params / 1e9:.3g}B params x {per_param:g} B at HBM x {eff.hbm:g}"))
    return StepTime(tuple(out), eff, measured, bubble)
