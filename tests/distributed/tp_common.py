"""What the tensor-parallel checks and their tests share: a small decoder, its tokens, and a few training steps
that run the same in one process (the tests' references) and on every tensor-parallel rank."""
from __future__ import annotations

import torch
import torch.nn.functional as F

import lowprec
from lowprec.distributed.amax import sync_amaxes
from lowprec.ranks import is_dtensor
from lowprec.train.model import ModelConfig, build_model

CONFIG = ModelConfig(dim=192, n_layers=2, n_heads=6, n_kv_heads=2, ffn_dim=512, max_seq_len=64)
"""Two blocks; split over two ranks, each rank's widths (96, 256) are multiples of 32: whole MX blocks."""
RECIPES = ("bf16", "fp8-current", "fp8-rowwise", "mxfp8", "fp8-delayed")
STEPS = 3
WATCHED = ("layers.0.attention.wq.weight", "layers.1.feed_forward.w2.weight", "layers.0.attention_norm.weight",
           "layers.1.ffn_norm.weight", "tok_embeddings.weight")
"""Parameters compared after the steps: a colwise and a rowwise weight, two norms (their gradients are summed
over the ranks), the embedding (split after it, gathered in backward)."""


def model(recipe: str) -> torch.nn.Module:
    m = build_model(CONFIG, seed=0)
    lowprec.convert(m, recipe, lowprec.Policy(min_features=1))  # every block linear converted, small as they are
    return m


def hf_llama(recipe: str) -> torch.nn.Module:
    """A two-block Hugging Face Llama of the same widths, converted."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    m = LlamaForCausalLM(LlamaConfig(vocab_size=CONFIG.vocab_size, hidden_size=CONFIG.dim, intermediate_size=512,
                                     num_hidden_layers=2, num_attention_heads=6, num_key_value_heads=2,
                                     max_position_embeddings=64, attn_implementation="sdpa"))
    lowprec.convert(m, recipe, lowprec.Policy(min_features=1))
    return m


def tokens() -> torch.Tensor:
    return torch.randint(0, CONFIG.vocab_size, (2, 33), generator=torch.Generator().manual_seed(1))


def step(m: torch.nn.Module) -> None:
    """One forward and backward on the tokens."""
    toks = tokens()
    F.cross_entropy(m(toks[:, :-1]).flatten(0, 1).float(), toks[:, 1:].flatten()).backward()


def train(m: torch.nn.Module, hf: bool = False) -> dict:
    """``STEPS`` AdamW steps on the same tokens; the losses and the watched parameters, whole (``hf``: a Hugging
    Face model, the losses alone)."""
    opt = torch.optim.AdamW(m.parameters(), lr=1e-3)
    toks, losses = tokens(), []
    for _ in range(STEPS):
        logits = m(toks[:, :-1]).logits if hf else m(toks[:, :-1])
        loss = F.cross_entropy(logits.flatten(0, 1).float(), toks[:, 1:].flatten())
        loss.backward()
        sync_amaxes(m)  # delayed histories agree over the ranks, as the training loop makes them
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    if hf:
        return {"losses": losses}
    params = dict(m.named_parameters())
    return {"losses": losses, "params": {n: (params[n].full_tensor() if is_dtensor(params[n]) else params[n]).detach()
                                        for n in WATCHED}}
