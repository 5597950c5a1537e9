"""lowprec's reference decoder as a Hugging Face model: the dense presets as ``LlamaForCausalLM``, the MoE
preset as ``Ernie4_5_MoeForCausalLM``.

[Note: which Hugging Face architecture]
A dense reference model is Llama exactly (RMSNorm normalising in FP32 then scaling in the model's dtype,
grouped-query attention scaled by ``1/sqrt(head_dim)``, SwiGLU, no biases, an untied head), once its query
and key rows follow Llama's RoPE convention (see [Note: two RoPE conventions] in ``lowprec.export.rope``).

The MoE reference layer (``lowprec.train.moe_model``) routes by a softmax over all experts in FP32, takes
the top k, renormalises their weights to sum to one, and adds one ungated shared SwiGLU of ``n_shared``
experts' width. Among transformers' MoE architectures, ERNIE 4.5's computes exactly that: a softmax in
FP32, top-k on it (plus a correction bias written as zeros), the weights divided by their sum (clamped
below at ``moe_norm_min`` = 1e-12, which a sum of the k largest of E probabilities, at least k/E, never
reaches), and ungated shared experts of ``moe_intermediate_size * moe_num_shared_experts``; with
``moe_layer_start_index`` 0 and interval 1 every layer is MoE, and its RoPE rotates interleaved pairs as
lowprec's does (no permutation). Its router runs in FP32 (transformers keeps that weight in FP32) where
lowprec's runs in the model's dtype: the same function, rounded differently. Mixtral and Qwen3-MoE have no
shared expert; Qwen2-MoE gates its shared expert by a sigmoid; DeepSeek-V2/V3 use other attention (MLA)
and routing (groups, sigmoid scores): none of these computes what the reference layer computes.
"""
from __future__ import annotations

import torch

from lowprec.export.rope import permute_rows, rope_permutation
from lowprec.export.walk import ExportLinear, Masters, WalkedModel, experts, linear
from lowprec.train.model import Transformer

_ATTENTION = {"wq": "q_proj", "wk": "k_proj", "wv": "v_proj", "wo": "o_proj"}
_FFN = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}
ROUTER_KEPT = "the MoE router: ERNIE 4.5 keeps it in FP32, outside the linears it converts"


def _config(model: Transformer) -> dict:
    c = model.config
    return {
        "vocab_size": c.vocab_size, "hidden_size": c.dim, "num_hidden_layers": c.n_layers,
        "num_attention_heads": c.n_heads, "num_key_value_heads": c.n_kv_heads, "head_dim": c.head_dim,
        "hidden_act": "silu", "max_position_embeddings": c.max_seq_len, "rms_norm_eps": c.norm_eps,
        "rope_theta": c.rope_theta, "rope_parameters": {"rope_type": "default", "rope_theta": c.rope_theta},
        "tie_word_embeddings": False, "use_cache": True, "initializer_range": 0.02,
        "bos_token_id": None, "eos_token_id": None, "pad_token_id": None,
    }


def _llama_config(model: Transformer) -> dict:
    return {"architectures": ["LlamaForCausalLM"], "model_type": "llama", **_config(model),
            "intermediate_size": model.config.ffn_dim, "attention_bias": False, "mlp_bias": False}


def _ernie_config(model: Transformer) -> dict:
    c, moe = model.config, model.config.moe
    return {"architectures": ["Ernie4_5_MoeForCausalLM"], "model_type": "ernie4_5_moe", **_config(model),
            "intermediate_size": c.ffn_dim * max(moe.n_shared, 1), "moe_intermediate_size": c.ffn_dim,
            "moe_k": moe.top_k, "moe_num_experts": moe.n_experts, "moe_num_shared_experts": moe.n_shared,
            "moe_layer_start_index": 0, "moe_layer_end_index": c.n_layers - 1, "moe_layer_interval": 1,
            "moe_norm_min": 1e-12, "use_bias": False}


def _attention(walked: WalkedModel, model: Transformer, i: int, masters: Masters, device, permute: bool) -> None:
    c = model.config
    block = model.layers[i].attention
    for ours, theirs in _ATTENTION.items():
        source, name = f"layers.{i}.attention.{ours}", f"model.layers.{i}.self_attn.{theirs}"
        heads = {"wq": c.n_heads, "wk": c.n_kv_heads}.get(ours)
        if not permute or heads is None:
            walked.linears.append(linear(name, source, getattr(block, ours), masters, device))
            continue
        perm = rope_permutation(heads, c.head_dim)
        lin = linear(name, source, getattr(block, ours), masters, device,
                     master=masters(f"{source}.weight")[perm])
        walked.linears.append(_permuted(lin, perm))


def _permuted(lin: ExportLinear, perm: torch.Tensor) -> ExportLinear:
    """``lin`` (its master already permuted) with its trained weight's rows permuted too, or dropped with a
    note where its scales do not allow it."""
    w = lin.weight
    if w.trained is None:
        return lin
    q = permute_rows(w.trained, perm)
    note = "" if q is not None else "its trained scales span rows the RoPE re-layout moves apart"
    return ExportLinear(type(w)(w.name, w.master, q, w.recipe), lin.source, lin.kept, note or lin.note, lin.bias)


def _dense_ffn(walked: WalkedModel, prefix: str, source: str, ffn, masters: Masters, device) -> None:
    for ours, theirs in _FFN.items():
        walked.linears.append(linear(f"{prefix}.{theirs}", f"{source}.{ours}", getattr(ffn, ours), masters, device))


def _moe_ffn(walked: WalkedModel, model: Transformer, i: int, masters: Masters, device) -> None:
    ffn, source, prefix = model.layers[i].feed_forward, f"layers.{i}.feed_forward", f"model.layers.{i}.mlp"
    router = linear(f"{prefix}.gate", f"{source}.router", ffn.router, masters, device)
    walked.linears.append(ExportLinear(router.weight, router.source, router.kept or ROUTER_KEPT))
    n = ffn.experts.w1.num_experts
    for ours, theirs in _FFN.items():
        names = [f"{prefix}.experts.{e}.{theirs}" for e in range(n)]
        walked.linears += experts(names, f"{source}.experts.{ours}", getattr(ffn.experts, ours), masters, device)
    if ffn.shared is not None:
        _dense_ffn(walked, f"{prefix}.shared_experts", f"{source}.shared", ffn.shared, masters, device)
    # the routing bias of auxiliary-loss-free balancing (zeros without): ERNIE 4.5 adds it to the
    # probabilities to choose the experts and weighs them without it, as lowprec's layer does
    bias = getattr(ffn, "expert_bias", None)
    walked.tensors[f"{prefix}.moe_statics.e_score_correction_bias"] = (
        bias.detach().float().cpu().reshape(1, n).clone() if bias is not None else torch.zeros(1, n))


def walk_reference(model: Transformer, masters: Masters, device: torch.device | None) -> WalkedModel:
    """``model`` as Llama (dense) or ERNIE 4.5 MoE (see [Note: which Hugging Face architecture])."""
    moe = model.config.moe is not None
    walked = WalkedModel("Ernie4_5_MoeForCausalLM" if moe else "LlamaForCausalLM",
                         _ernie_config(model) if moe else _llama_config(model))
    walked.tensors["model.embed_tokens.weight"] = masters("tok_embeddings.weight")
    for i, block in enumerate(model.layers):
        _attention(walked, model, i, masters, device, permute=not moe)
        walked.tensors[f"model.layers.{i}.input_layernorm.weight"] = masters(f"layers.{i}.attention_norm.weight")
        walked.tensors[f"model.layers.{i}.post_attention_layernorm.weight"] = masters(f"layers.{i}.ffn_norm.weight")
        if moe:
            _moe_ffn(walked, model, i, masters, device)
        else:
            _dense_ffn(walked, f"model.layers.{i}.mlp", f"layers.{i}.feed_forward", block.feed_forward, masters,
                       device)
    walked.tensors["model.norm.weight"] = masters("norm.weight")
    walked.linears.append(linear("lm_head", "output", model.output, masters, device))
    return walked
