"""Model shapes for planning: Llama-style decoders, dense or mixture-of-experts, with plain or
multi-head latent attention; named presets; lookup by name or Hugging Face ``config.json``.

A :class:`ModelSpec` holds only what the accounting needs: widths, head counts, the feed-forward
widths and the expert layout. Biases, rotary tables and per-head norms are left out (each is
under 0.01% of the parameters of the presets).
"""
from __future__ import annotations

from pathlib import Path

from lowprec._checks import fail
from lowprec.plan.hf_config import load_hf_config
from lowprec.plan.specs import MLASpec, ModelSpec, MoESpec

__all__ = ["PRESETS", "MLASpec", "ModelSpec", "MoESpec", "all_presets", "get_model", "reference_presets"]


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


def _moe(moe, width: int) -> MoESpec | None:
    """A reference preset's experts (``lowprec.train.moe_model.MoEConfig``, each expert ``width`` wide)."""
    if moe is None:
        return None
    return MoESpec(n_experts=moe.n_experts, top_k=moe.top_k, expert_ffn=width, n_shared=moe.n_shared,
                   shared_ffn=width if moe.n_shared else 0)


def reference_spec(name: str, c, source: str | None = None) -> ModelSpec:
    """The planner's view of a reference-model shape (``lowprec.train.model.ModelConfig``) named ``name``;
    ``source``: where the shape comes from, as ``lowprec plan`` prints it (default: a config of that name)."""
    return ModelSpec(name=name, vocab=c.vocab_size, d_model=c.dim, n_layers=c.n_layers, n_heads=c.n_heads,
                     n_kv_heads=c.n_kv_heads, head_dim=c.dim // c.n_heads, ffn=c.ffn_dim, moe=_moe(c.moe, c.ffn_dim),
                     source=source or f"lowprec.train.model config {name!r}")


def reference_presets() -> dict[str, ModelSpec]:
    """The reference trainer's model presets (``lowprec.train.model.PRESETS``) as ``ref-<name>``,
    with the vocabulary they are built with."""
    from lowprec.train.model import PRESETS as TRAIN_PRESETS  # the trainer owns these shapes

    return {f"ref-{key}": reference_spec(f"ref-{key}", c, f"lowprec.train.model preset {key!r}")
            for key, c in TRAIN_PRESETS.items()}


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
        return load_hf_config(model)
    fail("model", "one of " + ", ".join(presets) + ", or a path to a Hugging Face config.json",
         repr(model))
