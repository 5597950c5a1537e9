"""Activations a decoder block saves for its backward pass, per token, by recompute mode.

[Note: what is saved]
This follows the per-layer accounting of Korthikanti et al., "Reducing Activation Recomputation
in Large Transformer Models" (arXiv 2205.05198), adapted to a Llama-style block:

* RMSNorm saves its input (the residual stream); SwiGLU saves the gate and up outputs; there is no
  dropout (its masks are gone).
* FlashAttention saves q, k, v, its output and one FP32 log-sum-exp per head and token; it keeps no
  s × s matrix (it recomputes the probabilities in backward), so the paper's 5·a·s/h term is 0.
* Each linear saves its input once, shared by the linears that read it (q/k/v, gate/up). A linear
  a recipe quantizes saves the quantized input (the recipe's :class:`Storage`), with no transposed
  copy; if another op saves the same tensor in BF16 (the attention output, a router's input), the
  quantized copy is extra, and for a BF16 recipe the two are one tensor.
* MoE: a router saves its input and FP32 probabilities; each token's copies sent to its top-k
  experts are saved (permuted, quantized), as are the expert outputs (needed for the gradient of
  the routing weights).

With ``Training.saved_activations`` (``--fp8-activations``) the norms' inputs and SwiGLU's gate and up
outputs are kept in FP8 with FP32 scales, as ``lowprec.nn.RMSNorm`` and ``lowprec.nn.SwiGLU`` keep them
(see [Note: saved activations] in ``lowprec.nn.saved``); they are the :data:`Kind.ACT` entries.

Recompute modes: ``none`` keeps all of it; ``selective`` recomputes what is cheap to recompute —
norms, activation functions, residual additions, quantization and token permutation — and keeps the
outputs of GEMMs and of attention, as ``lowprec.train.recompute`` does (the projections' outputs that a
residual addition reads are saved under ``selective`` alone, and the second norm's input, a residual
sum, under ``none`` alone); ``full`` keeps only each block's input and recomputes the block in backward.
Under ``selective`` the :data:`Kind.ACT` entries it keeps are the block's input and GEMM outputs, kept as
they are (BF16) whatever ``saved_activations`` says: the FP8 copies the norms and SwiGLU would keep are
made again in the recomputed forward (on one H200, ``--fp8-activations`` changed selective's peak by 0.1%).
"""
from __future__ import annotations

import enum
import math
from dataclasses import dataclass

from lowprec.plan.layers import Linear, block_linears
from lowprec.plan.models import ModelSpec
from lowprec.plan.recipes import BF16, HP_BYTES, RecipeCost, Storage
from lowprec.train.recompute import Recompute

RECOMPUTE = tuple(m.value for m in Recompute)
"""The recompute modes by the names ``lowprec train --recompute`` takes (``lowprec.train.recompute.Recompute``)."""


class Kind(enum.Enum):
    HP = "bf16"
    FP32 = "fp32"
    LP = "recipe"
    """A quantized linear's input, in the recipe's saved-input storage."""
    LP_EXTRA = "recipe, beside a bf16 copy"
    """A quantized copy of a tensor also saved in BF16; no extra bytes for a BF16 recipe."""
    ACT = "saved activation"
    """A norm's or SwiGLU's input: BF16, or FP8 under ``Training.saved_activations``."""


@dataclass(frozen=True, slots=True)
class Saved:
    name: str
    group: str
    """``attention``, ``mlp``, ``moe`` or ``output``: rows of the memory table."""
    elements: int
    """Elements per token."""
    kind: Kind
    row: int
    """Row length (for row-wise scales)."""
    keep_selective: bool
    only_selective: bool = False
    """Saved by selective recomputation alone: a GEMM's output, which without recomputation the op after
    it (a residual addition) reads without keeping."""

    def bytes(self, recipe: RecipeCost, act: Storage = BF16) -> float:
        """Bytes per token; ``act``: how norms and SwiGLU save their inputs."""
        if self.kind is Kind.ACT:
            return self.elements * act.bytes_per_element(self.row, math.inf)
        if self.kind is Kind.HP:
            return self.elements * HP_BYTES
        if self.kind is Kind.FP32:
            return self.elements * 4
        if self.kind is Kind.LP_EXTRA and not recipe.quantizes:
            return 0.0
        return self.elements * recipe.saved_input.bytes_per_element(self.row, math.inf)


def _group(name: str) -> str:
    return {"attn": "attention", "mlp": "mlp", "moe": "moe"}[name.split(".")[0]]


def _attention_core(m: ModelSpec) -> list[Saved]:
    h, qk, v = m.n_heads, m.qk_head_dim, m.v_head_dim
    kv_heads = h if m.mla else m.n_kv_heads  # MLA expands keys and values per head
    out = [
        Saved("attn.residual", "attention", m.d_model, Kind.ACT, m.d_model, True),
        Saved("attn.q", "attention", h * qk, Kind.HP, qk, True),
        Saved("attn.k", "attention", kv_heads * qk, Kind.HP, qk, True),
        Saved("attn.v", "attention", kv_heads * v, Kind.HP, v, True),
        Saved("attn.out", "attention", h * v, Kind.HP, h * v, True),
        Saved("attn.logsumexp", "attention", h, Kind.FP32, 1, True),
        Saved("attn.proj_out", "attention", m.d_model, Kind.HP, m.d_model, True, only_selective=True),
    ]
    if m.mla:  # the latent norms save their inputs, the down-projections' outputs
        a = m.mla
        out.append(Saved("attn.kv_latent_raw", "attention", a.kv_lora_rank, Kind.ACT, a.kv_lora_rank, True))
        if a.q_lora_rank:
            out.append(Saved("attn.q_latent_raw", "attention", a.q_lora_rank, Kind.ACT, a.q_lora_rank, True))
    return out


def _ffn_core(m: ModelSpec, moe: bool) -> list[Saved]:
    d = m.d_model
    if not moe:
        return [Saved("mlp.residual", "mlp", d, Kind.ACT, d, False),
                Saved("mlp.gate_up", "mlp", 2 * m.ffn, Kind.ACT, m.ffn, True),
                Saved("mlp.down_out", "mlp", d, Kind.HP, d, True, only_selective=True)]
    e = m.moe
    out = [
        Saved("mlp.residual", "moe", d, Kind.ACT, d, False),
        Saved("moe.router_probs", "moe", e.n_experts, Kind.FP32, e.n_experts, True),
        Saved("moe.expert.gate_up", "moe", 2 * e.top_k * e.expert_ffn, Kind.ACT, e.expert_ffn, True),
        Saved("moe.expert.out", "moe", e.top_k * d, Kind.HP, d, True),
    ]
    if e.n_shared:
        out.append(Saved("moe.shared.gate_up", "moe", 2 * e.n_shared * e.shared_ffn, Kind.ACT, e.shared_ffn, True))
        out.append(Saved("moe.shared.out", "moe", d, Kind.HP, d, True, only_selective=True))
    return out


def _linear_inputs(lins: list[Linear], core: list[Saved], moe: bool) -> list[Saved]:
    """One saved input per distinct tensor the linears read, in BF16 and/or quantized."""
    core_hp = {s.name for s in core if s.kind is Kind.HP}
    group = "moe" if moe else "mlp"
    out: list[Saved] = []
    for name in dict.fromkeys(lin.input for lin in lins):
        readers = [lin for lin in lins if lin.input == name]
        lin = readers[0]
        elements = lin.d_in * (lin.active if lin.input_per_copy else 1)
        grp = "attention" if name.startswith("attn") else group
        hp = name in core_hp or any(not r.quantized for r in readers)
        if hp and name not in core_hp:  # a high-precision linear (router) keeps the BF16 tensor
            out.append(Saved(name, grp, elements, Kind.HP, lin.d_in, False))
        if any(r.quantized for r in readers):
            out.append(Saved(f"{name} (quantized)", grp, elements, Kind.LP_EXTRA if hp else Kind.LP,
                             lin.d_in, False))
    return out


def block_saved(m: ModelSpec, moe: bool, quantized: bool = True, min_features: int | None = None) -> list[Saved]:
    """Everything one block saves under ``recompute="none"``, per token, before any parallel split;
    ``quantized=False``: a block kept in BF16, whose linears save their inputs in BF16; ``min_features``:
    the small-layer rule, whose linears save theirs in BF16 too."""
    core = _attention_core(m) + _ffn_core(m, moe)
    return core + _linear_inputs(block_linears(m, moe, quantized, min_features), core, moe)


def output_saved(m: ModelSpec) -> list[Saved]:
    """The head of the model, kept in BF16 by policy; the loss works on FP32 logits."""
    d = m.d_model
    return [
        Saved("final_norm.in", "output", d, Kind.ACT, d, True),
        Saved("lm_head.in", "output", d, Kind.HP, d, True),
        Saved("loss.logits", "output", m.vocab, Kind.FP32, m.vocab, True),
    ]


def block_bytes(m: ModelSpec, moe: bool, recipe: RecipeCost, recompute: str, act: Storage = BF16,
                quantized: bool = True, min_features: int | None = None) -> dict[str, float]:
    """Bytes per token one block keeps until its backward, by group; ``act``: how norms and SwiGLU save
    their inputs; ``quantized=False``: a block kept in BF16; ``min_features``: the small-layer rule."""
    if recompute == "full":  # only the block's input, the residual stream
        return {"layer inputs": float(m.d_model * HP_BYTES)}
    if recompute == "selective":  # what it keeps of the norms' and SwiGLU's inputs are the block's input and
        act = BF16                # GEMM outputs, as they are: their FP8 copies are made again in backward
    out: dict[str, float] = {}
    for s in block_saved(m, moe, quantized, min_features):
        if (recompute == "none" and not s.only_selective) or (recompute == "selective" and s.keep_selective):
            out[s.group] = out.get(s.group, 0.0) + s.bytes(recipe, act)
    return out
