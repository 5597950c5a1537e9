"""The fields a Hugging Face ``config.json`` must state for lowprec to take its shape: the trainer
refuses a config without them, and the planner reads them (``lowprec.plan.hf_config``)."""
from __future__ import annotations

from collections.abc import Mapping

from lowprec._checks import fail

_DENSE = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size")
_DEEPSEEK = (*_DENSE, "n_routed_experts", "num_experts_per_tok", "moe_intermediate_size", "kv_lora_rank",
             "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")
_QWEN_MOE = (*_DENSE, "num_experts", "num_experts_per_tok", "moe_intermediate_size")
REQUIRED_FIELDS: dict[str, tuple[str, ...]] = {
    **dict.fromkeys(("llama", "mistral", "qwen2", "qwen3", "gemma", "gemma2", "phi3", "olmo2", "granite"), _DENSE),
    "mixtral": (*_DENSE, "num_local_experts", "num_experts_per_tok"),
    "qwen2_moe": _QWEN_MOE, "qwen3_moe": _QWEN_MOE, "deepseek_v2": _DEEPSEEK, "deepseek_v3": _DEEPSEEK,
}
"""The fields a config of each ``model_type`` must state. Any other type must state its width, depth,
heads and vocabulary (``_DENSE`` less ``intermediate_size``, which some types derive from the width)."""


def missing_fields(cfg: dict, aliases: Mapping[str, str] | None = None) -> list[str]:
    """The required fields (:data:`REQUIRED_FIELDS`) that ``cfg`` (a parsed ``config.json``, or its
    ``text_config``) lacks or sets to null; ``aliases`` maps a field to the name a type stores it under
    (``transformers``' ``attribute_map``: GPT-2's ``n_embd`` for ``hidden_size``)."""
    cfg = cfg.get("text_config") or cfg
    required = REQUIRED_FIELDS.get(cfg.get("model_type"), _DENSE[:4])
    aliases = aliases or {}
    return [k for k in required if cfg.get(k) is None and cfg.get(aliases.get(k, k)) is None]


def check_fields(cfg: dict, where: str, aliases: Mapping[str, str] | None = None, got: str = "one") -> None:
    """``ValueError`` naming every required field ``cfg`` lacks, in one line; ``got`` names the config."""
    missing = missing_fields(cfg, aliases)
    if missing:
        model_type = (cfg.get("text_config") or cfg).get("model_type")
        whose = f"a {model_type!r} model's shape" if model_type else "its model's shape and its model_type"
        fail(where, f"a config.json stating every field of {whose} (lowprec fills in no model's defaults)",
             f"{got} without " + ", ".join(missing))
