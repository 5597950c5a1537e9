"""What a model's shape is for planning: :class:`ModelSpec`, with its expert (:class:`MoESpec`) and latent
attention (:class:`MLASpec`) layouts. Presets and lookup are in ``lowprec.plan.models``."""
from __future__ import annotations

from dataclasses import dataclass

from lowprec._checks import fail


def _check_positive(owner: str, **values: int) -> None:
    for name, value in values.items():
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            fail(f"{owner}.{name}", "a positive int", repr(value))


@dataclass(frozen=True, kw_only=True, slots=True)
class MoESpec:
    """Routed experts (each a SwiGLU of width ``expert_ffn``) plus always-on shared experts."""

    n_experts: int
    """Routed experts per MoE layer."""
    top_k: int
    """Routed experts each token passes through."""
    expert_ffn: int
    """Hidden width of one routed expert."""
    n_shared: int = 0
    """Shared experts every token passes through."""
    shared_ffn: int = 0
    """Hidden width of one shared expert (0 when there are none)."""
    n_dense_layers: int = 0
    """Layers with a dense feed-forward instead of experts; counted as the first layers."""

    def __post_init__(self) -> None:
        _check_positive("moe", n_experts=self.n_experts, top_k=self.top_k, expert_ffn=self.expert_ffn)
        if self.top_k > self.n_experts:
            fail("moe.top_k", f"at most n_experts={self.n_experts}", self.top_k)
        if self.n_shared < 0 or self.n_dense_layers < 0:
            fail("moe.n_shared/n_dense_layers", "non-negative ints", (self.n_shared, self.n_dense_layers))
        if self.n_shared and self.shared_ffn <= 0:
            fail("moe.shared_ffn", "a positive width when n_shared > 0", self.shared_ffn)


@dataclass(frozen=True, kw_only=True, slots=True)
class MLASpec:
    """Multi-head latent attention (DeepSeek-V2/V3): queries and keys/values pass through
    low-rank latents; each head's query/key is a no-position part plus a rotary part."""

    q_lora_rank: int
    """Query latent width; 0 for a direct query projection."""
    kv_lora_rank: int
    """Key/value latent width."""
    qk_nope_dim: int
    qk_rope_dim: int
    v_head_dim: int

    def __post_init__(self) -> None:
        _check_positive("mla", kv_lora_rank=self.kv_lora_rank, qk_nope_dim=self.qk_nope_dim,
                        qk_rope_dim=self.qk_rope_dim, v_head_dim=self.v_head_dim)
        if self.q_lora_rank < 0:
            fail("mla.q_lora_rank", "a non-negative int", self.q_lora_rank)


@dataclass(frozen=True, kw_only=True, slots=True)
class ModelSpec:
    """The shape of a decoder-only transformer (RMSNorm, RoPE, SwiGLU, grouped-query attention)."""

    name: str
    vocab: int
    d_model: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    """Width of one query/key/value head (ignored under MLA, which has its own widths)."""
    ffn: int
    """Hidden width of the dense SwiGLU feed-forward (used by dense layers)."""
    tied_embeddings: bool = False
    """The LM head reuses the input embedding matrix."""
    moe: MoESpec | None = None
    mla: MLASpec | None = None
    source: str = ""
    """Where the shape comes from."""

    def __post_init__(self) -> None:
        _check_positive(self.name or "model", vocab=self.vocab, d_model=self.d_model,
                        n_layers=self.n_layers, n_heads=self.n_heads, n_kv_heads=self.n_kv_heads,
                        head_dim=self.head_dim, ffn=self.ffn)
        if self.n_heads % self.n_kv_heads:
            fail(f"{self.name}.n_kv_heads", f"a divisor of n_heads={self.n_heads}", self.n_kv_heads)
        if self.moe and self.moe.n_dense_layers > self.n_layers:
            fail(f"{self.name}.moe.n_dense_layers", f"at most n_layers={self.n_layers}",
                 self.moe.n_dense_layers)

    @property
    def qk_head_dim(self) -> int:
        return self.mla.qk_nope_dim + self.mla.qk_rope_dim if self.mla else self.head_dim

    @property
    def v_head_dim(self) -> int:
        return self.mla.v_head_dim if self.mla else self.head_dim

    @property
    def n_moe_layers(self) -> int:
        return self.n_layers - self.moe.n_dense_layers if self.moe else 0

    @property
    def n_dense_layers(self) -> int:
        return self.n_layers - self.n_moe_layers
