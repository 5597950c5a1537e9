"""Read a model's shape from a Hugging Face ``config.json``.

Understood: Llama-style decoders (llama, mistral, qwen2, qwen3, ...), Mixtral
(``num_local_experts``), Qwen MoE (``num_experts``, ``moe_intermediate_size``, shared experts,
``decoder_sparse_step``/``mlp_only_layers``) and DeepSeek-V2/V3 (``n_routed_experts``,
``first_k_dense_replace``, multi-head latent attention). A multimodal config's ``text_config``
is used when present. Dense layers of a MoE model are counted as its first layers.

A config must state the model's shape: :data:`REQUIRED_FIELDS` lists, per ``model_type``, the fields
that are refused when missing (``transformers`` would fill them from a 7B model's defaults).
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from lowprec._checks import describe, fail
from lowprec.plan.specs import MLASpec, ModelSpec, MoESpec
from lowprec.train.hf_fields import REQUIRED_FIELDS, check_fields, missing_fields

__all__ = ["REQUIRED_FIELDS", "check_fields", "from_hf_config", "load_hf_config", "missing_fields"]


class _Config:
    """Typed reads from a config dict, with errors naming the argument and the key (``model.hidden_size``)."""

    def __init__(self, cfg: dict, where: str) -> None:
        self.cfg, self.where = cfg, where

    def has(self, key: str) -> bool:
        return self.cfg.get(key) is not None

    def get_int(self, key: str, default: Any = ...) -> int:
        if not self.has(key):
            if default is ...:
                fail(f"{self.where}.{key}", "an int", "nothing (the key is missing)")
            return default
        value = self.cfg[key]
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            fail(f"{self.where}.{key}", "a non-negative int", describe(value))
        return value


def _moe(c: _Config, n_layers: int) -> MoESpec | None:
    n_experts = (c.get_int("n_routed_experts", None) or c.get_int("num_local_experts", None)
                 or c.get_int("num_experts", None))
    if not n_experts:
        return None
    top_k = c.get_int("num_experts_per_tok")
    if c.has("n_routed_experts"):  # DeepSeek: first_k_dense_replace dense layers, then MoE
        shared, width = c.get_int("n_shared_experts", 0), c.get_int("moe_intermediate_size")
        return MoESpec(n_experts=n_experts, top_k=top_k, expert_ffn=width, n_shared=shared,
                       shared_ffn=width if shared else 0, n_dense_layers=c.get_int("first_k_dense_replace", 0))
    if c.has("num_local_experts"):  # Mixtral: every layer is MoE, experts as wide as intermediate_size
        return MoESpec(n_experts=n_experts, top_k=top_k, expert_ffn=c.get_int("intermediate_size"))
    step = max(c.get_int("decoder_sparse_step", 1), 1)  # Qwen MoE
    dense_only = set(c.cfg.get("mlp_only_layers") or [])
    n_moe = sum(1 for i in range(n_layers) if i not in dense_only and (i + 1) % step == 0)
    shared = c.get_int("shared_expert_intermediate_size", 0)
    return MoESpec(n_experts=n_experts, top_k=top_k, expert_ffn=c.get_int("moe_intermediate_size"),
                   n_shared=1 if shared else 0, shared_ffn=shared, n_dense_layers=n_layers - n_moe)


def _mla(c: _Config) -> MLASpec | None:
    if not c.has("kv_lora_rank"):
        return None
    return MLASpec(q_lora_rank=c.get_int("q_lora_rank", 0), kv_lora_rank=c.get_int("kv_lora_rank"),
                   qk_nope_dim=c.get_int("qk_nope_head_dim"), qk_rope_dim=c.get_int("qk_rope_head_dim"),
                   v_head_dim=c.get_int("v_head_dim"))


def from_hf_config(cfg: dict, name: str = "hf-model", *, where: str = "cfg", got: str = "one") -> ModelSpec:
    """A :class:`ModelSpec` named ``name`` from the dict of a Hugging Face ``config.json``; errors name the
    argument ``where`` (and ``got``, the config as the user gave it)."""
    if not isinstance(cfg, dict):
        fail(where, "a dict (the parsed config.json)", describe(cfg), TypeError)
    check_fields(cfg, where, got=got)
    c = _Config(cfg.get("text_config") or cfg, where)
    d, heads, layers = c.get_int("hidden_size"), c.get_int("num_attention_heads"), c.get_int("num_hidden_layers")
    return ModelSpec(
        name=name, vocab=c.get_int("vocab_size"), d_model=d, n_layers=layers, n_heads=heads,
        n_kv_heads=c.get_int("num_key_value_heads", heads), head_dim=c.get_int("head_dim", d // max(heads, 1)),
        ffn=c.get_int("intermediate_size"), tied_embeddings=bool(c.cfg.get("tie_word_embeddings", False)),
        moe=_moe(c, layers), mla=_mla(c), source=f"Hugging Face config ({c.cfg.get('model_type', 'unknown type')})",
    )


def load_hf_config(path: str | Path) -> ModelSpec:
    """The model a ``config.json`` describes; ``path`` may be the file or the folder holding it."""
    p = Path(path)
    if p.is_dir():
        p = p / "config.json"
    if not p.is_file():
        raise FileNotFoundError(f"model: expected a config.json file or a folder holding one, got {str(path)!r}")
    try:
        cfg = json.loads(p.read_text())
    except json.JSONDecodeError as e:
        fail("model", "a config.json holding valid JSON", f"{str(p)!r} ({e.msg} at line {e.lineno})")
    return from_hf_config(cfg, name=p.parent.name or p.stem, where="model", got=repr(str(p)))
