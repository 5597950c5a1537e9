"""Training FLOPs per token, split by the GEMM format each part runs in, and the time they take.

[Note: FLOPs and time]
Per token, the GEMMs of the linears a recipe quantizes cost 2·P in each of fprop, dgrad and
wgrad (P: their active parameters), 6·P in all — the "6 × active parameters" rule — and each GEMM
runs at the accelerator's dense peak for that GEMM's format (the BF16 peak where the format is
emulated). The LM head and MoE routers stay BF16 (6·P at the BF16 peak); the input embedding is a
lookup and costs nothing. Attention scores and their weighted sum cost, per layer and token,
2·s·h·(d_qk + d_v) forward and twice that backward: 6·s·h·(d_qk + d_v), which is PaLM's
12·s·d_model for d_qk = d_v = d_model / h (arXiv 2204.02311, appendix B; the causal mask is not
credited, as in published MFU figures); they run in BF16. Full recomputation adds one more
forward of every block; selective recomputation adds no GEMMs.

Time per token on one GPU is ``sum(flops / peak) / mfu``, so ``mfu`` is the fraction of the peak
of each format that the run achieves, and tokens/s is ``gpus`` over that.
"""
from __future__ import annotations

from dataclasses import dataclass

from lowprec._checks import fail
from lowprec.plan.gpus import GPU
from lowprec.plan.layers import block_kinds, block_linears, count_params
from lowprec.plan.models import ModelSpec
from lowprec.plan.recipes import RecipeCost
from lowprec.plan.units import count

HP_GEMM = "bf16"
"""Format of the GEMMs kept in high precision (LM head, routers, attention)."""


@dataclass(frozen=True, slots=True)
class FlopTerm:
    name: str
    flops: float
    """FLOPs per token."""
    gemm: str
    tflops: float
    """Dense peak used for it."""
    native: bool
    formula: str
    recompute: bool = False
    """Extra work of recomputation, not counted as model FLOPs."""

    @property
    def seconds(self) -> float:
        """Seconds per token on one GPU at 100% of peak."""
        return self.flops / (self.tflops * 1e12)


def _term(gpu: GPU, name: str, flops: float, gemm: str, formula: str, recompute: bool = False) -> FlopTerm:
    tflops, native = gpu.peak(gemm)
    return FlopTerm(name, flops, gemm, tflops, native, formula, recompute)


def _router_params(m: ModelSpec) -> int:
    return sum(n * lin.active_numel for moe, n in block_kinds(m) for lin in block_linears(m, moe)
               if not lin.quantized)


def flop_terms(m: ModelSpec, recipe: RecipeCost, gpu: GPU, seq: int, recompute: str) -> list[FlopTerm]:
    counts = count_params(m)
    p_q = counts.quantized_active
    fprop, dgrad, wgrad = recipe.gemms
    head = m.vocab * m.d_model
    routers = _router_params(m)
    attn_fwd = 2 * seq * m.n_heads * (m.qk_head_dim + m.v_head_dim) * m.n_layers
    attn_formula = f"2 x s {seq} x h {m.n_heads} x (d_qk {m.qk_head_dim} + d_v {m.v_head_dim}) x L {m.n_layers}"
    terms = [
        _term(gpu, "linears: fprop", 2 * p_q, fprop, f"2 x {count(p_q)} active quantized params"),
        _term(gpu, "linears: dgrad", 2 * p_q, dgrad, f"2 x {count(p_q)} active quantized params"),
        _term(gpu, "linears: wgrad", 2 * p_q, wgrad, f"2 x {count(p_q)} active quantized params"),
        _term(gpu, "LM head and routers", 6 * (head + routers), HP_GEMM,
              f"6 x ({count(head)} head + {count(routers)} router params)"),
        _term(gpu, "attention scores and values", 3 * attn_fwd, HP_GEMM, "3 x " + attn_formula),
    ]
    if recompute == "full":
        terms += [
            _term(gpu, "recompute: linears", 2 * p_q, fprop, f"2 x {count(p_q)} (one more forward)", True),
            _term(gpu, "recompute: routers and attention", 2 * routers + attn_fwd, HP_GEMM,
                  f"2 x {count(routers)} + " + attn_formula, True),
        ]
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


def throughput(terms: list[FlopTerm], *, gpus: int, mfu: float, tokens_per_step: int,
               tokens: float | None = None, price_per_gpu_hour: float | None = None) -> Throughput:
    if not 0 < mfu <= 1:
        fail("mfu", "a fraction in (0, 1]", mfu)
    model_flops = sum(t.flops for t in terms if not t.recompute)
    seconds_per_token = sum(t.seconds for t in terms) / mfu  # one GPU
    tokens_per_s = gpus / seconds_per_token
    peak = model_flops / sum(t.seconds for t in terms if not t.recompute) / 1e12
    days = gpu_hours = cost = None
    if tokens is not None:
        days = tokens / tokens_per_s / 86400
        gpu_hours = days * 24 * gpus
        cost = gpu_hours * price_per_gpu_hour if price_per_gpu_hour is not None else None
    return Throughput(model_flops_per_token=model_flops, effective_peak_tflops=peak, tokens_per_s=tokens_per_s,
                      tokens_per_step=tokens_per_step, step_s=tokens_per_step / tokens_per_s, tokens=tokens,
                      days=days, gpu_hours=gpu_hours, cost=cost)
