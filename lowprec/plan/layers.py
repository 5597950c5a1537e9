"""The linear layers of a decoder block and the parameter counts that follow from them.

[Note: one list of linears]
Every count the planner makes (parameters, the low-precision weight casts, the saved linear
inputs, GEMM FLOPs, tensor- and expert-parallel splits) is read off one list of
:class:`Linear` per block kind, so the counts cannot disagree with each other.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import NamedTuple

from lowprec._checks import fail
from lowprec.nn.plan import too_small
from lowprec.plan.models import ModelSpec


@dataclass(frozen=True, kw_only=True, slots=True)
class Linear:
    """A weight matrix ``d_in × d_out`` repeated ``copies`` times per block (experts)."""

    name: str
    d_in: int
    d_out: int
    input: str
    """Name of the tensor it reads: linears that read one tensor save one copy of it."""
    copies: int = 1
    """Stored copies per block (routed experts)."""
    active: int = 1
    """Copies each token passes through (top-k for routed experts)."""
    quantized: bool = True
    """False where the default policy keeps the layer in high precision (MoE routers)."""
    tp_ranks: int | None = None
    """Tensor-parallel ranks it can be split over; None: any, 1: replicated (small latents),
    n: at most n (key/value heads are replicated once tp exceeds their number)."""
    expert: bool = False
    """Split across expert-parallel ranks rather than data-parallel ones."""
    input_per_copy: bool = False
    """Each active copy reads its own input (routed experts, expert hiddens), so a token saves
    ``active`` inputs; otherwise the copies share one."""

    @property
    def numel(self) -> int:
        return self.d_in * self.d_out * self.copies

    @property
    def active_numel(self) -> int:
        return self.d_in * self.d_out * self.active

    def shards(self, tp: int) -> int:
        """How many pieces tensor parallelism of degree ``tp`` cuts this weight into."""
        return tp if self.tp_ranks is None else min(tp, self.tp_ranks)


def _swiglu(prefix: str, d: int, ffn: int, inp: str, copies: int = 1, active: int = 1,
            expert: bool = False) -> list[Linear]:
    common = dict(copies=copies, active=active, expert=expert)
    return [
        Linear(name=f"{prefix}.gate", d_in=d, d_out=ffn, input=inp, input_per_copy=expert, **common),
        Linear(name=f"{prefix}.up", d_in=d, d_out=ffn, input=inp, input_per_copy=expert, **common),
        Linear(name=f"{prefix}.down", d_in=ffn, d_out=d, input=f"{prefix}.hidden", input_per_copy=True, **common),
    ]


def attention_linears(m: ModelSpec) -> list[Linear]:
    d, h = m.d_model, m.n_heads
    if m.mla is None:
        kv = m.n_kv_heads * m.head_dim
        return [
            Linear(name="attn.q", d_in=d, d_out=h * m.head_dim, input="attn.in"),
            Linear(name="attn.k", d_in=d, d_out=kv, input="attn.in", tp_ranks=m.n_kv_heads),
            Linear(name="attn.v", d_in=d, d_out=kv, input="attn.in", tp_ranks=m.n_kv_heads),
            Linear(name="attn.o", d_in=h * m.head_dim, d_out=d, input="attn.out"),
        ]
    a = m.mla
    out = []
    if a.q_lora_rank:
        out += [Linear(name="attn.q_down", d_in=d, d_out=a.q_lora_rank, input="attn.in", tp_ranks=1),
                Linear(name="attn.q_up", d_in=a.q_lora_rank, d_out=h * m.qk_head_dim, input="attn.q_latent")]
    else:
        out += [Linear(name="attn.q", d_in=d, d_out=h * m.qk_head_dim, input="attn.in")]
    return out + [
        # the rotary key part is shared by all heads, so it rides with the latent
        Linear(name="attn.kv_down", d_in=d, d_out=a.kv_lora_rank + a.qk_rope_dim, input="attn.in", tp_ranks=1),
        Linear(name="attn.kv_up", d_in=a.kv_lora_rank, d_out=h * (a.qk_nope_dim + a.v_head_dim),
               input="attn.kv_latent"),
        Linear(name="attn.o", d_in=h * a.v_head_dim, d_out=d, input="attn.out"),
    ]


def ffn_linears(m: ModelSpec, moe: bool) -> list[Linear]:
    if not moe:
        return _swiglu("mlp", m.d_model, m.ffn, "mlp.in")
    e = m.moe
    out = [Linear(name="moe.router", d_in=m.d_model, d_out=e.n_experts, input="mlp.in", quantized=False,
                  tp_ranks=1)]
    out += _swiglu("moe.expert", m.d_model, e.expert_ffn, "moe.expert_in", copies=e.n_experts,
                   active=e.top_k, expert=True)
    if e.n_shared:
        out += _swiglu("moe.shared", m.d_model, e.shared_ffn, "mlp.in", copies=e.n_shared, active=e.n_shared)
    return out


def _kept_small(lin: Linear, min_features: int | None) -> bool:
    """The device's small-layer rule keeps this linear in BF16 (``lowprec.nn.plan.too_small``); experts
    are not linears to it (``lowprec.convert_grouped``)."""
    return min_features is not None and not lin.expert and too_small(lin.d_in, lin.d_out, min_features)


def block_linears(m: ModelSpec, moe: bool, quantized: bool = True, min_features: int | None = None) -> list[Linear]:
    """The linears of one block: attention, then a dense (``moe=False``) or MoE feed-forward;
    ``quantized=False``: a block the policy keeps in high precision, none of its linears quantized;
    ``min_features``: the small-layer rule where the planned GPU applies it (``RecipeCost.min_features``),
    which keeps a linear with a dimension under it in BF16."""
    lins = attention_linears(m) + ffn_linears(m, moe)
    if not quantized:
        return [replace(lin, quantized=False) for lin in lins]
    return [replace(lin, quantized=False) if lin.quantized and _kept_small(lin, min_features) else lin
            for lin in lins]


class BlockKind(NamedTuple):
    moe: bool
    """A MoE block (else dense)."""
    quantized: bool
    """Its linears take the recipe (else the policy keeps the block in BF16)."""
    min_features: int | None = None
    """The small-layer rule its linears follow (:func:`block_linears`)."""


def blocks_in(m: ModelSpec, lo: int, hi: int, hp_blocks: int = 0,
              min_features: int | None = None) -> dict[BlockKind, int]:
    """How many blocks of each kind layers ``lo``..``hi - 1`` hold. Dense blocks come first; the last
    ``hp_blocks`` are kept in BF16 (a recipe's ``hp_last_fraction``, as the default policy does);
    ``min_features``: the small-layer rule the quantized blocks' linears follow."""
    nd, hp_from = m.n_dense_layers, m.n_layers - hp_blocks
    q, hp = min_features, None
    spans = {BlockKind(False, True, q): (0, min(nd, hp_from)),
             BlockKind(False, False, hp): (min(nd, hp_from), nd),
             BlockKind(True, True, q): (nd, max(nd, hp_from)),
             BlockKind(True, False, hp): (max(nd, hp_from), m.n_layers)}
    counts = {k: max(0, min(hi, b) - max(lo, a)) for k, (a, b) in spans.items()}
    return {k: n for k, n in counts.items() if n}


def block_kinds(m: ModelSpec, hp_blocks: int = 0, min_features: int | None = None) -> list[tuple[BlockKind, int]]:
    """``(kind, number of blocks)`` for each kind of block the model has."""
    return list(blocks_in(m, 0, m.n_layers, hp_blocks, min_features).items())


def block_norm_params(m: ModelSpec) -> int:
    """RMSNorm weights of one block (two, plus MLA's two latent norms); kept replicated."""
    extra = (m.mla.q_lora_rank + m.mla.kv_lora_rank) if m.mla else 0
    return 2 * m.d_model + extra


@dataclass(frozen=True, kw_only=True, slots=True)
class ParamCount:
    total: int
    active: int
    """Parameters a token passes through (all but the unused routed experts)."""
    embedding: int
    """Input embedding table (a lookup: no GEMM FLOPs)."""
    lm_head: int
    """Output projection; 0 when tied to the embedding."""
    quantized: int
    """Weights of linears a recipe quantizes (block linears except routers)."""
    quantized_active: int
    norms: int


def count_params(m: ModelSpec, hp_blocks: int = 0, min_features: int | None = None) -> ParamCount:
    """``hp_blocks``: the last blocks kept in BF16, whose linears are not counted as quantized;
    ``min_features``: the small-layer rule (:func:`block_linears`)."""
    blocks = [(n, block_linears(m, *kind)) for kind, n in block_kinds(m, hp_blocks, min_features)]
    total = sum(n * sum(lin.numel for lin in lins) for n, lins in blocks)
    active = sum(n * sum(lin.active_numel for lin in lins) for n, lins in blocks)
    quant = sum(n * sum(lin.numel for lin in lins if lin.quantized) for n, lins in blocks)
    quant_active = sum(n * sum(lin.active_numel for lin in lins if lin.quantized) for n, lins in blocks)
    norms = m.n_layers * block_norm_params(m) + m.d_model
    embedding = m.vocab * m.d_model
    lm_head = 0 if m.tied_embeddings else embedding
    return ParamCount(total=total + norms + embedding + lm_head, active=active + norms + embedding + lm_head,
                      embedding=embedding, lm_head=lm_head, quantized=quant, quantized_active=quant_active,
                      norms=norms)


def check_parallel_fits(m: ModelSpec, tp: int, ep: int) -> None:
    """Tensor parallelism must split heads and hidden widths evenly; expert parallelism the experts."""
    if m.n_heads % tp:
        fail("tp", f"a divisor of the {m.n_heads} attention heads of {m.name}", tp)
    if m.mla is None and m.n_kv_heads % tp and tp % m.n_kv_heads:
        fail("tp", f"a divisor or multiple of the {m.n_kv_heads} key/value heads of {m.name}", tp)
    for lin in (lin for kind, _ in block_kinds(m) for lin in block_linears(m, kind.moe)):
        width = lin.d_out if lin.name.endswith(("gate", "up")) else lin.d_in
        if lin.tp_ranks is None and lin.name.endswith(("gate", "up", "down")) and width % tp:
            fail("tp", f"a divisor of the feed-forward width {width} ({lin.name}) of {m.name}", tp)
    if ep > 1 and (m.moe is None or m.moe.n_experts % ep):
        expected = f"a divisor of the {m.moe.n_experts} experts" if m.moe else "1 for a dense model"
        fail("ep", f"{expected} of {m.name}", ep)
