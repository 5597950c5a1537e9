"""Model shapes for planning: Llama-style decoders, dense or mixture-of-experts, with plain or
multi-head latent attention; named presets; lookup by name or Hugging Face ``config.json``.

A :class:`ModelSpec` holds only what the accounting needs: widths, head counts, the feed-forward
widths and the expert layout. Biases, rotary tables and per-head norms are left out (each is
under 0.01% of the parameters of the presets).
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

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


def _llama(name: str, *, d: int, layers: int, heads: int, kv: int, ffn: int, vocab: int,
           source: str, tied: bool = False) -> ModelSpec:
    return ModelSpec(name=name, vocab=vocab, d_model=d, n_layers=layers, n_heads=heads, n_kv_heads=kv,
                     head_dim=d // heads, ffn=ffn, tied_embeddings=tied, source=source)


PRESETS: dict[str, ModelSpec] = {m.name: m for m in (
    _llama("llama-2-7b", d=4096, layers=32, heads=32, kv=32, ffn=11008, vocab=32000,
           source="meta-llama/Llama-2-7b-hf config.json"),
    _llama("llama-3-8b", d=4096, layers=32, heads=32, kv=8, ffn=14336, vocab=128256,
           source="meta-llama/Meta-Llama-3-8B config.json"),
    _llama("llama-3-70b", d=8192, layers=80, heads=64, kv=8, ffn=28672, vocab=128256,
           source="meta-llama/Meta-Llama-3-70B config.json"),
    _llama("llama-3-405b", d=16384, layers=126, heads=128, kv=8, ffn=53248, vocab=128256,
           source="meta-llama/Llama-3.1-405B config.json"),
    ModelSpec(
        name="deepseek-v3", vocab=129280, d_model=7168, n_layers=61, n_heads=128, n_kv_heads=128,
        head_dim=128, ffn=18432,
        moe=MoESpec(n_experts=256, top_k=8, expert_ffn=2048, n_shared=1, shared_ffn=2048, n_dense_layers=3),
        mla=MLASpec(q_lora_rank=1536, kv_lora_rank=512, qk_nope_dim=128, qk_rope_dim=64, v_head_dim=128),
        source="deepseek-ai/DeepSeek-V3 config.json; the multi-token-prediction module is not counted "
               "(671B total, 37B active, as in the paper)"),
    ModelSpec(
        name="qwen3-30b-a3b", vocab=151936, d_model=2048, n_layers=48, n_heads=32, n_kv_heads=4,
        head_dim=128, ffn=6144, moe=MoESpec(n_experts=128, top_k=8, expert_ffn=768),
        source="Qwen/Qwen3-30B-A3B config.json (a Qwen-style MoE: 128 experts, 8 active, no shared)"),
    ModelSpec(
        name="mixtral-8x7b", vocab=32000, d_model=4096, n_layers=32, n_heads=32, n_kv_heads=8,
        head_dim=128, ffn=14336, moe=MoESpec(n_experts=8, top_k=2, expert_ffn=14336),
        source="mistralai/Mixtral-8x7B-v0.1 config.json"),
)}


def reference_presets() -> dict[str, ModelSpec]:
    """The reference trainer's model presets (``lowprec.train.model.PRESETS``) as ``ref-<name>``,
    with the vocabulary they are built with."""
    from lowprec.train.model import PRESETS as TRAIN_PRESETS  # the trainer owns these shapes

    return {
        f"ref-{key}": ModelSpec(
            name=f"ref-{key}", vocab=c.vocab_size, d_model=c.dim, n_layers=c.n_layers, n_heads=c.n_heads,
            n_kv_heads=c.n_kv_heads, head_dim=c.dim // c.n_heads, ffn=c.ffn_dim,
            source=f"lowprec.train.model preset {key!r}")
        for key, c in TRAIN_PRESETS.items()
    }


def all_presets() -> dict[str, ModelSpec]:
    return {**PRESETS, **reference_presets()}


def get_model(model: str | ModelSpec) -> ModelSpec:
    """A preset by name, or the model a Hugging Face ``config.json`` (or its folder) describes."""
    if isinstance(model, ModelSpec):
        return model
    if not isinstance(model, str):
        fail("model", "a preset name, a path to a config.json or a ModelSpec", repr(model), TypeError)
    presets = all_presets()
    if model.lower() in presets:
        return presets[model.lower()]
    if Path(model).exists():
        from lowprec.plan.hf_config import load_hf_config

        return load_hf_config(model)
    fail("model", "one of " + ", ".join(presets) + ", or a path to a Hugging Face config.json",
         repr(model))
