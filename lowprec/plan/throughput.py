"""Training FLOPs per token, split by the GEMM format each part runs in, and the time they take.

[Note: FLOPs and time]
Per token, the GEMMs of the linears a recipe quantizes cost 2·P in each of fprop, dgrad and
wgrad (P: their active parameters), 6·P in all — the "6 × active parameters" rule. How each of
the three runs is the kernels' decision for the GPU (``lowprec.plan.gemm_paths``): a native GEMM
at the accelerator's dense peak for its format; an emulated one as the high-precision GEMM it is
(BF16, or FP32 where the values are not exact in BF16) plus the memory traffic of its casts, which
a BF16 step does not have: each operand element is written by its cast (read 2 bytes, write its
low-precision bytes) and read back and widened for the GEMM (read those bytes, write 2 or 4), at
the accelerator's HBM bandwidth. The weight's elements count once per micro-batch. The LM head,
MoE routers and the blocks a recipe keeps in BF16 (NVFP4's last 15%) run in BF16 (6·P at the BF16
peak); the input embedding is a lookup and costs nothing. Attention scores and their weighted sum
cost, per layer and token, 2·s·h·(d_qk + d_v) forward and twice that backward:
6·s·h·(d_qk + d_v), which is PaLM's 12·s·d_model for d_qk = d_v = d_model / h (arXiv 2204.02311,
appendix B; the causal mask is not credited, as in published MFU figures); they run in BF16. Full
recomputation adds one more forward of every block; selective recomputation adds no GEMMs.

Time per token on one GPU is ``sum(flops / peak) / mfu + sum(cast bytes / bandwidth)``, so ``mfu``
is the fraction of each format's peak the GEMMs achieve (the casts of native GEMMs are in it too),
and tokens/s is ``gpus`` over that.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from lowprec._checks import fail
from lowprec.plan.gemm_paths import Path, gemm_paths
from lowprec.plan.gpus import GPU
from lowprec.plan.layers import Linear, block_kinds, block_linears, count_params
from lowprec.plan.models import ModelSpec
from lowprec.plan.recipes import HP_BYTES, RecipeCost, Storage
from lowprec.plan.units import count

HP_GEMM = "bf16"
"""Format of the GEMMs kept in high precision (LM head, routers, attention, BF16 blocks)."""
FOLD_BYTES = 2.0
"""Bytes one element's folding moves (``lowprec.kernels.fold``): its code read, its FP8 code written."""


@dataclass(frozen=True, slots=True)
class FlopTerm:
    name: str
    flops: float
    """FLOPs per token."""
    gemm: str
    tflops: float
    """Dense peak used for it."""
    native: bool
    """Run in its own format at its own peak (a GEMM lowprec emulates is not)."""
    formula: str
    recompute: bool = False
    """Extra work of recomputation, not counted as model FLOPs."""
    path: Path = Path.HP
    emulated_in: str | None = None
    """The high-precision dtype an emulated GEMM multiplies in (``bf16``, ``fp32``)."""
    cast_bytes: float = 0.0
    """Bytes per token an emulated GEMM's casts move (see [Note: FLOPs and time])."""
    hbm_tb_s: float = 1.0

    @property
    def seconds(self) -> float:
        """Seconds per token on one GPU at 100% of peak, GEMM only."""
        return self.flops / (self.tflops * 1e12)

    @property
    def cast_seconds(self) -> float:
        """Seconds per token of an emulated GEMM's cast traffic at the HBM bandwidth."""
        return self.cast_bytes / (self.hbm_tb_s * 1e12)

    @property
    def label(self) -> str:
        if self.path is Path.FOLDED:
            return f"{self.gemm} (MX folded to row scales: fp8 GEMM + folding traffic)"
        if self.path is Path.EMULATED:
            listed = "" if self.native else ", no fp32 peak listed: timed at bf16"
            return f"{self.gemm} (emulated: {self.emulated_in} GEMM{listed} + cast traffic)"
        return self.gemm if self.native else f"{self.gemm} (no peak listed: bf16 peak)"


def _hp_term(gpu: GPU, name: str, flops: float, formula: str, recompute: bool = False) -> FlopTerm:
    tflops, listed = gpu.peak(HP_GEMM)
    return FlopTerm(name, flops, HP_GEMM, tflops, listed, formula, recompute)


@dataclass(frozen=True, slots=True)
class _Elements:
    """Per token, summed over the quantized linears: input and output elements of each token's
    active copies, and weight elements per micro-batch over its tokens."""

    inputs: float
    outputs: float
    weights: float


def _elements(m: ModelSpec, hp_blocks: int, tokens: int, min_features: int | None) -> _Elements:
    lins: list[tuple[int, Linear]] = [(n, lin) for kind, n in block_kinds(m, hp_blocks, min_features)
                                      for lin in block_linears(m, *kind) if lin.quantized]
    return _Elements(inputs=sum(n * lin.d_in * lin.active for n, lin in lins),
                     outputs=sum(n * lin.d_out * lin.active for n, lin in lins),
                     weights=sum(n * lin.numel for n, lin in lins) / tokens)


def cast_and_widen_bytes(s: Storage, row: int, wide: int) -> float:
    """Bytes one element's cast moves: written (read BF16, write it) and widened (read it, write ``wide``)."""
    lp = s.bytes_per_element(row, math.inf)
    return (HP_BYTES + lp) + (lp + wide)


def _linear_terms(m: ModelSpec, recipe: RecipeCost, gpu: GPU, tokens: int, p_q: float,
                  recompute: bool = False) -> list[FlopTerm]:
    if not p_q:  # every linear kept in BF16 (the small-layer rule, a recipe that quantizes nothing)
        return []
    paths = gemm_paths(recipe.recipe, gpu.capability)
    e = _elements(m, recipe.hp_blocks(m.n_layers), tokens, recipe.min_features)
    # (lhs, rhs) elements per token: fprop input x weight, dgrad grad_output x weight.T, wgrad grad_output.T x input.T
    sides = ((e.inputs, e.weights), (e.outputs, e.weights), (e.outputs, e.inputs))
    out = []
    for i, (gp, fmt, (lhs, rhs), (n_l, n_r)) in enumerate(zip(paths, recipe.gemms, recipe.operands, sides)):
        if recompute and i:
            break  # recomputation runs fprop again
        name = f"recompute: linears ({gp.gemm})" if recompute else f"linears: {gp.gemm}"
        formula = f"2 x {count(p_q)} active quantized params"
        flops = 2 * p_q
        if gp.path is Path.EMULATED:
            tflops, listed = gpu.peak(gp.emulated_in)
            wide = 4 if gp.emulated_in == "fp32" else HP_BYTES
            cast = n_l * cast_and_widen_bytes(lhs, m.d_model, wide) + n_r * cast_and_widen_bytes(rhs, m.d_model, wide)
            out.append(FlopTerm(name, flops, fmt, tflops, listed, formula + f" + {count(cast)} B of cast traffic",
                                recompute, gp.path, gp.emulated_in, cast, gpu.hbm_tb_s))
            continue
        if gp.path is Path.FOLDED:  # FP8 tensor cores, after a pass that reads and writes a byte per element
            tflops, listed = gpu.peak("fp8")
            fold = (n_l + n_r) * FOLD_BYTES
            out.append(FlopTerm(name, flops, "fp8", tflops, listed, formula + f" + {count(fold)} B of folding",
                                recompute, gp.path, None, fold, gpu.hbm_tb_s))
            continue
        tflops, listed = gpu.peak(fmt)
        if gp.path is Path.NATIVE and not listed:
            fail("gpu", f"a {fmt} peak in the {gpu.key} row (lowprec runs {recipe.name}'s {gp.gemm} natively on "
                 f"{gpu.arch})", "none listed")
        out.append(FlopTerm(name, flops, fmt, tflops, listed, formula, recompute, gp.path))
    return out


def _hp_linear_params(m: ModelSpec, hp_blocks: int, min_features: int | None) -> tuple[float, float, float]:
    """(router, BF16-block linear, small linear) active parameters: the block linears that run in BF16."""
    routers = sum(n * lin.active_numel for kind, n in block_kinds(m) for lin in block_linears(m, kind.moe)
                  if not lin.quantized)
    every = count_params(m).quantized_active
    small = every - count_params(m, 0, min_features).quantized_active
    kept = every - small - count_params(m, hp_blocks, min_features).quantized_active
    return routers, kept, small


def attention_fwd_flops(m: ModelSpec, seq: int) -> float:
    """Attention's scores and weighted values in one forward, per token, all layers."""
    return 2 * seq * m.n_heads * (m.qk_head_dim + m.v_head_dim) * m.n_layers


def flop_terms(m: ModelSpec, recipe: RecipeCost, gpu: GPU, seq: int, recompute: str,
               tokens: int | None = None) -> list[FlopTerm]:
    """``tokens``: per micro-batch (default ``seq``), over which a weight's casts are spread."""
    hp_blocks = recipe.hp_blocks(m.n_layers)
    p_q = count_params(m, hp_blocks, recipe.min_features).quantized_active
    head = m.vocab * m.d_model
    routers, kept, small = _hp_linear_params(m, hp_blocks, recipe.min_features)
    attn_fwd = attention_fwd_flops(m, seq)
    attn_formula = f"2 x s {seq} x h {m.n_heads} x (d_qk {m.qk_head_dim} + d_v {m.v_head_dim}) x L {m.n_layers}"
    terms = _linear_terms(m, recipe, gpu, tokens or seq, p_q)
    if kept:
        terms.append(_hp_term(gpu, f"linears of the last {hp_blocks} blocks (bf16 by policy)", 6 * kept,
                              f"6 x {count(kept)} active params"))
    if small:
        terms.append(_hp_term(gpu, f"linears with a dimension under {recipe.min_features} (bf16 by policy)",
                              6 * small, f"6 x {count(small)} active params"))
    terms += [
        _hp_term(gpu, "LM head and routers", 6 * (head + routers),
                 f"6 x ({count(head)} head + {count(routers)} router params)"),
        _hp_term(gpu, "attention scores and values", 3 * attn_fwd, "3 x " + attn_formula),
    ]
    if recompute == "full":
        terms += _linear_terms(m, recipe, gpu, tokens or seq, p_q, recompute=True)
        terms.append(_hp_term(gpu, "recompute: bf16 linears, routers and attention",
                              2 * (routers + kept + small) + attn_fwd,
                              f"2 x {count(routers + kept + small)} + " + attn_formula, True))
    return terms


@dataclass(frozen=True, kw_only=True, slots=True)
class Throughput:
    model_flops_per_token: float
    """6 x active matmul parameters + attention (recomputation excluded)."""
    effective_peak_tflops: float
    """Model FLOPs over the time they take at peak: the recipe's blended peak on this GPU."""
    tokens_per_s: float
    """Whole cluster."""
    tokens_per_step: int
    step_s: float
    tokens: float | None
    days: float | None
    gpu_hours: float | None
    cost: float | None


def throughput(terms: list[FlopTerm], *, gpus: int, tokens_per_step: int, mfu: float | None = None,
               step_s: float | None = None, tokens: float | None = None,
               price_per_gpu_hour: float | None = None) -> Throughput:
    """Tokens/s, days and cost from the FLOPs and either an ``mfu`` (time per token ``sum(flops / peak) /
    mfu + cast traffic``) or the ``step_s`` a step takes (``lowprec.plan.step_time``)."""
    if (mfu is None) == (step_s is None):
        fail("mfu, step_s", "exactly one of the two", f"mfu={mfu}, step_s={step_s}")
    model_flops = sum(t.flops for t in terms if not t.recompute)
    if mfu is not None:
        if not 0 < mfu <= 1:
            fail("mfu", "a fraction in (0, 1]", mfu)
        seconds_per_token = sum(t.seconds for t in terms) / mfu + sum(t.cast_seconds for t in terms)  # one GPU
        tokens_per_s = gpus / seconds_per_token
    else:
        tokens_per_s = tokens_per_step / step_s
    # the blended peak: model FLOPs over the time they take at 100% of every peak, cast traffic included
    peak = model_flops / sum(t.seconds + t.cast_seconds for t in terms if not t.recompute) / 1e12
    days = gpu_hours = cost = None
    if tokens is not None:
        days = tokens / tokens_per_s / 86400
        gpu_hours = days * 24 * gpus
        cost = gpu_hours * price_per_gpu_hour if price_per_gpu_hour is not None else None
    return Throughput(model_flops_per_token=model_flops, effective_peak_tflops=peak, tokens_per_s=tokens_per_s,
                      tokens_per_step=tokens_per_step, step_s=tokens_per_step / tokens_per_s, tokens=tokens,
                      days=days, gpu_hours=gpu_hours, cost=cost)
