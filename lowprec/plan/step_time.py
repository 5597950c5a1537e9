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
* the casts of the native (or folded) low-precision GEMMs' operands, as memory traffic: each distinct input,
  output gradient and weight read once more for an amax where one scale covers it, read again and written
  as each operand those GEMMs take of it (the two orientations of Hopper's K-major FP8 GEMMs; the weight's
  once per micro-batch, once per step where gradient accumulation keeps its casts, never for FP8 primary
  weights the GEMMs read as stored);
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

from lowprec import recipes as R
from lowprec.optim.states import StateFormat
from lowprec.plan.activations import block_saved, output_saved
from lowprec.plan.efficiency import Curve, Efficiency, efficiency_for
from lowprec.plan.gemm_paths import GemmPath, Path, gemm_paths
from lowprec.plan.gpus import GPU, GPUS
from lowprec.plan.layers import BlockKind, Linear, block_linears
from lowprec.plan.memory import Parallel, Training, stage_blocks, updated_params
from lowprec.plan.models import ModelSpec
from lowprec.plan.recipes import GRAD_BYTES, HP_BYTES, MASTER_BYTES, RECIPES, TENSOR, RecipeCost
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
    stage: int = 0
    """The pipeline stage whose step this is: the slowest."""

    @property
    def step_s(self) -> float:
        return sum(p.seconds for p in self.parts)


class _Parts:
    """Seconds per token by part name, for one GPU doing a stage's whole work for each token."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}
        self.how: dict[str, str] = {}

    def add(self, name: str, seconds: float, how: str) -> None:
        self.seconds[name] = self.seconds.get(name, 0.0) + seconds
        self.how.setdefault(name, how)


@dataclass(frozen=True, slots=True)
class _Setting:
    """What every linear's parts are computed with."""

    recipe: RecipeCost
    paths: tuple[GemmPath, ...] | None
    """The recipe's GEMM paths on the planned GPU; None where it quantizes nothing."""
    gpu: GPU
    eff: Efficiency
    tokens: int
    """Tokens per micro-batch on a data-parallel rank."""
    weight_casts: float
    """A weight's casts per micro-batch: 1, 1 / grad_accum where the step keeps them (``cached_weight_casts``),
    0 for FP8 primary weights the GEMMs read as stored."""
    par: Parallel
    experts_measured: Curve | None
    """The recipe's experts' measured speed against BF16's where it stands on this GPU (:func:`_measured_experts`)."""


def _flops_seconds(flops: float, tflops: float, fraction: float) -> float:
    return flops / (tflops * 1e12 * fraction)


def _peak(gpu: GPU, fmt: str) -> tuple[float, str]:
    """``(TFLOP/s, the format whose peak it is)``: a format the row lists none for runs at the BF16 peak."""
    tflops, listed = gpu.peak(fmt)
    return tflops, fmt if listed else "bf16"


# (tensor, GEMM index, operand index): the three tensors a linear casts and the operands each becomes:
# fprop x @ w, dgrad dy @ w.T, wgrad dy.T @ x.T
_USES = (("x", 0, 0), ("x", 2, 1), ("dy", 1, 0), ("dy", 2, 0), ("w", 0, 1), ("w", 1, 1))


def _native_casts(s: _Setting, lin: Linear, elements: dict[str, float]) -> float:
    """Bytes per token of a linear's native or folded GEMMs' casts: each tensor read once (once more before
    for an amax where one scale covers it) and written as every operand those GEMMs take of it."""
    total = 0.0
    rows = {"x": lin.d_in, "dy": lin.d_out, "w": lin.d_in}
    for tensor, n in elements.items():
        used = [s.recipe.operands[g][o] for t, g, o in _USES if t == tensor and s.paths[g].path is not Path.EMULATED
                and s.paths[g].path is not Path.HP]
        if not used or not n:
            continue
        amax = HP_BYTES if any(u.scale_every == TENSOR for u in used) else 0.0
        total += n * (amax + HP_BYTES + sum(u.bytes_per_element(rows[tensor], float("inf")) for u in used))
    return total


def _gemms(parts: _Parts, s: _Setting, lin: Linear, n: int, what: str, fraction: Callable[[str], float],
           cast_input: bool) -> None:
    """One linear's three GEMMs (``n`` blocks of it), each at ``fraction(format)`` of its format's peak, and
    its operands' casts (the input only where ``cast_input``: linears that read one tensor share its cast)."""
    flops = 2 * lin.d_in * lin.d_out * lin.active * n  # per GEMM, per token
    if not lin.quantized or s.paths is None:
        tflops, _ = _peak(s.gpu, "bf16")
        parts.add(f"GEMMs: {what} in bf16", 3 * _flops_seconds(flops, tflops, fraction("bf16")),
                  f"bf16 peak x {fraction('bf16'):.3g}")
        return
    share = 1 / s.par.ep if lin.expert else 1.0  # a rank casts its own experts' weights
    inputs, outputs = lin.d_in * lin.active * n, lin.d_out * lin.active * n
    weights = lin.numel * n * share / s.tokens * s.weight_casts
    sides = ((inputs, weights), (outputs, weights), (outputs, inputs))
    rows = ((lin.d_in, lin.d_in), (lin.d_out, lin.d_out), (s.tokens, s.tokens))
    hbm = s.gpu.hbm_tb_s * 1e12 * s.eff.hbm
    for gp, fmt, (lhs, rhs), (n_l, n_r), (r_l, r_r) in zip(s.paths, s.recipe.gemms, s.recipe.operands, sides, rows):
        if gp.path is Path.EMULATED:
            tflops, at = _peak(s.gpu, gp.emulated_in)
            wide = 4 if gp.emulated_in == "fp32" else HP_BYTES
            parts.add(f"GEMMs: {what} in {fmt} (emulated in {gp.emulated_in})",
                      _flops_seconds(flops, tflops, fraction(at)), f"{at} peak x {fraction(at):.3g}")
            traffic = n_l * cast_and_widen_bytes(lhs, r_l, wide) + n_r * cast_and_widen_bytes(rhs, r_r, wide)
            parts.add("casts (emulated GEMMs: cast, then widened)", traffic / hbm, f"HBM x {s.eff.hbm:g}")
            continue
        gemm_fmt = "fp8" if gp.path is Path.FOLDED else fmt
        tflops, at = _peak(s.gpu, gemm_fmt)
        label = f"GEMMs: {what} in {fmt}" + (" (folded to fp8)" if gp.path is Path.FOLDED else "")
        parts.add(label, _flops_seconds(flops, tflops, fraction(at)), f"{at} peak x {fraction(at):.3g}")
        if gp.path is Path.FOLDED:
            parts.add("casts (folding MX operands)", (n_l + n_r) * FOLD_BYTES / hbm, f"HBM x {s.eff.hbm:g}")
    native = _native_casts(s, lin, {"x": inputs if cast_input else 0.0, "dy": outputs, "w": weights})
    if native:
        parts.add("casts (amax, cast, every orientation)", native / hbm, f"HBM x {s.eff.hbm:g}")


def _measured_experts(recipe: RecipeCost, paths: tuple[GemmPath, ...] | None, eff: Efficiency) -> Curve | None:
    """The measured speed of the recipe's experts against BF16's, where it applies on the planned GPU (whose
    GEMM paths are ``paths``): a preset recipe as it is, whose GEMMs take there the paths they took where they
    were measured; else None."""
    r = recipe.recipe
    if paths is None or r is None or r.name not in R.names() or R.get(r.name) != r:
        return None
    return eff.grouped_relative(r.name) if gemm_paths(r, GPUS[eff.gpu].capability) == paths else None


def _experts(parts: _Parts, s: _Setting, lin: Linear, n: int, cast_input: bool) -> None:
    """One routed-expert projection's three grouped GEMMs (``n`` blocks), SwiGLU and casts included."""
    rows = s.tokens * lin.active * s.par.ep / lin.copies  # an expert's rows on its rank
    per_call = 2 * rows * lin.d_in * lin.d_out / lin.shards(s.par.tp)
    fraction = s.eff.grouped.at(per_call)
    in_bf16 = not lin.quantized or s.paths is None
    relative = s.eff.grouped_relative("bf16") if in_bf16 else s.experts_measured
    if relative is None:  # not measured: its GEMM paths at the grouped fraction, with the dense linears' casts
        _gemms(parts, s, lin, n, "routed experts (modelled, not measured)", lambda fmt: fraction, cast_input)
        return
    speed = relative.at(per_call)
    name = "bf16" if in_bf16 else s.recipe.name
    how = f"bf16 grouped at {fraction:.3g} of peak ({per_call:.3g} FLOPs per expert GEMM)"
    parts.add(f"GEMMs: routed experts in {name} (grouped)",
              _flops_seconds(6 * lin.d_in * lin.d_out * lin.active * n, s.gpu.peak("bf16")[0], fraction) / speed,
              how + ("" if name == "bf16" else f" / {speed:.3g}, its experts' measured speed against bf16's"))


def _stage_parts(m: ModelSpec, s: _Setting, train: Training, blocks: dict[BlockKind, int], head: bool) -> _Parts:
    """Seconds per token of one pipeline stage's work on one GPU (before tensor parallelism splits it)."""
    parts = _Parts()
    bf16, dense = s.gpu.peak("bf16")[0], s.eff.gemm_fraction("bf16")
    router_flops = 0.0
    for kind, n in blocks.items():
        cast: set[str] = set()
        for lin in block_linears(m, *kind):
            if lin.name == "moe.router":
                router_flops += 6 * lin.active_numel * n
                continue
            first = lin.quantized and lin.input not in cast
            cast |= {lin.input} if lin.quantized else set()
            if lin.expert:
                _experts(parts, s, lin, n, first)
            else:
                _gemms(parts, s, lin, n, "linears", s.eff.gemm_fraction, first)
    layers = sum(blocks.values())
    head_flops = 6 * m.vocab * m.d_model if head else 0.0
    if head_flops or router_flops:
        parts.add("GEMMs: LM head and routers in bf16", _flops_seconds(head_flops + router_flops, bf16, dense),
                  f"bf16 peak x {dense:g}")
    attn = s.eff.attention.at(train.seq)
    attn_fwd = attention_fwd_flops(m, train.seq) * layers / m.n_layers
    if layers:
        parts.add("attention", _flops_seconds(3 * attn_fwd, bf16, attn), f"bf16 peak x {attn:.3g} at seq {train.seq}")
    bf16_cost = RECIPES["bf16"]
    in_blocks = sum(n * sum(x.bytes(bf16_cost) for x in block_saved(m, kind.moe, quantized=False)
                            if not x.only_selective and x.name != EXPERT_SWIGLU) for kind, n in blocks.items())
    saved = in_blocks + (sum(x.bytes(bf16_cost) for x in output_saved(m)) if head else 0.0)
    per_byte = s.eff.elementwise / (s.gpu.hbm_tb_s * 1e12)  # seconds of the other kernels per saved byte
    other = per_byte * saved
    parts.add("other kernels (norms, activations, routing, loss)", other,
              f"{s.eff.elementwise:g} x {saved / 1e6:.3g} MB saved per token at the HBM bandwidth")
    if train.recompute == "full":  # the blocks' GEMMs (not the head's) and casts, attention, the blocks' kernels
        forward = sum(v for k, v in parts.seconds.items()
                      if k.startswith(("GEMMs: linears", "GEMMs: routed", "casts"))) / 3
        parts.add("recomputation (full: each block's forward again)",
                  forward + _flops_seconds(attn_fwd, bf16, attn) + per_byte * in_blocks / 3,
                  "a third of the blocks' GEMMs and casts, of attention and of their other kernels")
    elif train.recompute == "selective":
        parts.add("recomputation (selective: the other kernels' forward)", other / 3, "a third of the other kernels")
    return parts


def step_time(m: ModelSpec, recipe: RecipeCost, gpu: GPU, train: Training, par: Parallel,
              tokens_per_step: int) -> StepTime:
    """The parts of one optimizer step on one GPU of the slowest pipeline stage ([Note: the step's parts])."""
    eff, measured = efficiency_for(gpu.key)
    paths = gemm_paths(recipe.recipe, gpu.capability) if recipe.recipe is not None and recipe.quantizes else None
    weight_casts = 0.0 if train.fp8_weights and recipe.fp8_weight_direct else (
        1 / train.grad_accum if train.grad_accum > 1 else 1.0)
    setting = _Setting(recipe, paths, gpu, eff, train.tokens, weight_casts, par,
                       _measured_experts(recipe, paths, eff))
    micro = max(train.grad_accum, par.pp)
    bubble = (micro + par.pp - 1) / micro
    per_gpu = tokens_per_step / (par.dp * par.tp)  # tokens a stage's GPU works on, its tp share of each
    moment = StateFormat(train.optim_states).bytes_per_value
    per_param = GRAD_BYTES[train.grad_dtype] + (2 * MASTER_BYTES + HP_BYTES if train.master_weights else
                                                 2 * HP_BYTES) + 4 * moment
    stages = []
    for stage in range(par.pp):
        parts = _stage_parts(m, setting, train, stage_blocks(m, recipe, par.pp, stage), stage == par.pp - 1)
        out = [TimePart(name, v * per_gpu * bubble, parts.how[name]) for name, v in parts.seconds.items()]
        params = updated_params(m, recipe, par, stage)
        out.append(TimePart("optimizer step", params * per_param / (gpu.hbm_tb_s * 1e12 * eff.hbm),
                            f"{params / 1e9:.3g}B params x {per_param:g} B at HBM x {eff.hbm:g}"))
        stages.append(StepTime(tuple(out), eff, measured, bubble, stage))
    return max(stages, key=lambda t: t.step_s)
