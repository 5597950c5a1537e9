"""The reference model: a Llama-style decoder (RMSNorm, RoPE, SwiGLU, grouped-query attention).

It is built from plain ``torch.nn.Linear`` layers and knows nothing of low precision:
:func:`lowprec.convert` swaps its linears afterwards. Its norms and SwiGLU are ``lowprec.nn``'s, which
keep only their inputs for backward, in the model's dtype until ``convert`` is given a policy with
``saved_activations`` (FP8; see [Note: saved activations] in ``lowprec.nn.saved``). The module names follow Llama's
(``tok_embeddings``, ``layers.{i}.attention.wq``, ``layers.{i}.feed_forward.w1``, ``norm``,
``output``) so that the default conversion policy, which keeps embeddings and the LM head
(``output``) in high precision, finds them.

Every width is a multiple of 32 so each linear can be quantized in 32-element MX blocks.

With ``moe`` set (the ``moe-tiny`` preset) every block's feed-forward is a mixture of experts instead
(:mod:`lowprec.train.moe_model`): a ``router`` linear, routed experts held as ``lowprec.nn.GroupedLinear``
(``layers.{i}.feed_forward.experts.w1``/``w3``/``w2``) and a shared SwiGLU (``...feed_forward.shared``).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from lowprec._checks import check_choice, fail
from lowprec.nn import RMSNorm, SwiGLU
from lowprec.train.moe_model import MoEConfig, MoEFeedForward

MX_BLOCK = 32
"""Widths must be multiples of this so MX and NVFP4 blocks tile every GEMM operand."""


@dataclass(frozen=True, kw_only=True, slots=True)
class ModelConfig:
    """Shape of the reference decoder. Presets are in :data:`PRESETS`."""

    dim: int
    """Model (residual stream) width; a multiple of 32."""
    n_layers: int
    n_heads: int
    """Query heads; ``dim / n_heads`` is the head width."""
    n_kv_heads: int
    """Key/value heads (grouped-query attention); divides ``n_heads``."""
    ffn_dim: int
    """Hidden width of the SwiGLU feed-forward (of each expert, with ``moe``); a multiple of 32."""
    vocab_size: int = 256
    """256 for the byte-level default corpus."""
    max_seq_len: int = 2048
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    moe: MoEConfig | None = None
    """Experts in every block's feed-forward; None: a dense SwiGLU."""

    def __post_init__(self) -> None:
        for name in ("dim", "n_layers", "n_heads", "n_kv_heads", "ffn_dim", "vocab_size", "max_seq_len"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                fail(name, "a positive int", repr(value))
        for name in ("dim", "ffn_dim"):
            if getattr(self, name) % MX_BLOCK:
                fail(name, f"a multiple of {MX_BLOCK} (the MX block size)", getattr(self, name))
        if self.dim % self.n_heads:
            fail("n_heads", f"a divisor of dim={self.dim}", self.n_heads)
        if self.n_heads % self.n_kv_heads:
            fail("n_kv_heads", f"a divisor of n_heads={self.n_heads}", self.n_kv_heads)
        if self.head_dim % 2:
            fail("n_heads", f"a head width dim/n_heads that is even (RoPE rotates pairs), dim={self.dim}",
                 self.n_heads)

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    def num_params(self) -> int:
        """Parameter count, computed from the shapes (equals the built model's)."""
        kv_dim = self.n_kv_heads * self.head_dim
        attention = 2 * self.dim * self.dim + 2 * self.dim * kv_dim
        feed_forward = 3 * self.dim * self.ffn_dim
        if self.moe is not None:  # routed experts, the shared ones' SwiGLU, the router
            moe = self.moe
            feed_forward *= moe.n_experts + moe.n_shared
            feed_forward += self.dim * moe.n_experts
        per_layer = attention + feed_forward + 2 * self.dim
        return self.n_layers * per_layer + 2 * self.vocab_size * self.dim + self.dim


PRESETS: dict[str, ModelConfig] = {
    # ~1.7M parameters: trains a few hundred steps a minute on two CPU cores
    "tiny": ModelConfig(dim=192, n_layers=4, n_heads=6, n_kv_heads=2, ffn_dim=512, max_seq_len=1024),
    # ~13M: a quick check on one GPU
    "small": ModelConfig(dim=384, n_layers=8, n_heads=6, n_kv_heads=2, ffn_dim=1024),
    # the names quote parameters with a 32k-token vocabulary (1b: 0.85B; 1.25B with Llama-3's 128k);
    # with the 256-byte vocabulary they have 76M, 284M and 723M
    "125m": ModelConfig(dim=768, n_layers=12, n_heads=12, n_kv_heads=4, ffn_dim=2048),
    "350m": ModelConfig(dim=1024, n_layers=24, n_heads=16, n_kv_heads=8, ffn_dim=2816),
    "1b": ModelConfig(dim=2048, n_layers=16, n_heads=32, n_kv_heads=8, ffn_dim=5632),
    # ~1.1M: a mixture of experts for CPU tests (8 experts of width 128, 2 per token, 1 shared); widths of
    # 128 so that every recipe's blocks, 128x128 included, tile the experts
    "moe-tiny": ModelConfig(dim=128, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=128, max_seq_len=1024,
                            moe=MoEConfig(n_experts=8, top_k=2, n_shared=1)),
    # ~0.95B with a 32k-token vocabulary, ~0.24B active per token: 32 experts of width 512, 4 per token, 1
    # shared, in each of 16 blocks of width 1024 (DeepSeek-style fine-grained experts balanced without a
    # loss, for one GPU)
    "moe-1b": ModelConfig(dim=1024, n_layers=16, n_heads=16, n_kv_heads=8, ffn_dim=512,
                          moe=MoEConfig(n_experts=32, top_k=4, n_shared=1, balance_rate=0.001)),
}


def preset(name: str) -> ModelConfig:
    """The named model shape; ``ValueError`` naming the presets otherwise."""
    return PRESETS[check_choice("model", name, PRESETS)]


def rope_tables(seq_len: int, head_dim: int, theta: float, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of the rotary angles, fp32, each (seq_len, head_dim / 2).

    Computed per call rather than kept as buffers, so casting the model to bf16 never rounds them.
    """
    inv_freq = theta ** (-torch.arange(0, head_dim, 2, device=device, dtype=torch.float32) / head_dim)
    angles = torch.outer(torch.arange(seq_len, device=device, dtype=torch.float32), inv_freq)  # (T, hd/2)
    return angles.cos(), angles.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate interleaved pairs of ``x`` (B, nh, T, hd) by the angles of each position."""
    x32 = x.float().unflatten(-1, (-1, 2))  # (B, nh, T, hd/2, 2)
    even, odd = x32[..., 0], x32[..., 1]  # (B, nh, T, hd/2)
    rotated = torch.stack((even * cos - odd * sin, even * sin + odd * cos), dim=-1)  # (B, nh, T, hd/2, 2)
    return rotated.flatten(-2).type_as(x)  # (B, nh, T, hd)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
        kv_dim = cfg.n_kv_heads * cfg.head_dim
        self.wq = nn.Linear(cfg.dim, cfg.dim, bias=False)
        self.wk = nn.Linear(cfg.dim, kv_dim, bias=False)
        self.wv = nn.Linear(cfg.dim, kv_dim, bias=False)
        self.wo = nn.Linear(cfg.dim, cfg.dim, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        B, T, _ = x.shape
        q = self.wq(x).view(B, T, self.n_heads, self.head_dim).transpose(1, 2)  # (B, nh, T, hd)
        k = self.wk(x).view(B, T, self.n_kv_heads, self.head_dim).transpose(1, 2)  # (B, nkv, T, hd)
        v = self.wv(x).view(B, T, self.n_kv_heads, self.head_dim).transpose(1, 2)  # (B, nkv, T, hd)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True,
                                           enable_gqa=self.n_heads != self.n_kv_heads)  # (B, nh, T, hd)
        return self.wo(y.transpose(1, 2).reshape(B, T, -1))  # (B, T, dim)


class FeedForward(nn.Module):
    """SwiGLU: ``w2(silu(w1 x) * w3 x)``."""

    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.w1 = nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden, bias=False)
        self.act = SwiGLU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(self.act(self.w1(x), self.w3(x)))  # (B, T, dim)


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.attention_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.attention = Attention(cfg)
        self.ffn_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.feed_forward = FeedForward(cfg.dim, cfg.ffn_dim) if cfg.moe is None else MoEFeedForward(
            cfg.dim, cfg.ffn_dim, cfg.moe,
            FeedForward(cfg.dim, cfg.moe.n_shared * cfg.ffn_dim) if cfg.moe.n_shared else None)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.attention_norm(x), cos, sin)  # (B, T, dim)
        return x + self.feed_forward(self.ffn_norm(x))  # (B, T, dim)


class Transformer(nn.Module):
    """Token ids (B, T) in, next-token logits (B, T, vocab) out."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.config = cfg
        self.tok_embeddings = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.layers = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layers))
        self.norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.output = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        T = tokens.shape[1]
        if T > self.config.max_seq_len:
            fail("tokens", f"at most max_seq_len={self.config.max_seq_len} positions", T)
        cos, sin = rope_tables(T, self.config.head_dim, self.config.rope_theta, tokens.device)
        h = self.tok_embeddings(tokens)  # (B, T, dim)
        for layer in self.layers:
            h = layer(h, cos, sin)  # (B, T, dim)
        return self.output(self.norm(h))  # (B, T, vocab)


def init_weights(model: Transformer, seed: int) -> Transformer:
    """Normal(0, 0.02) weights, residual projections scaled by 1/sqrt(2 n_layers) (GPT-2), norms 1, MoE
    routing biases 0.

    Draws from its own generator, so the initialisation depends on ``seed`` alone and not on
    whatever used the global random state before.
    """
    gen = torch.Generator().manual_seed(seed)
    residual_std = 0.02 / math.sqrt(2 * model.config.n_layers)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
                continue
            std = residual_std if name.endswith(("wo.weight", "w2.weight")) else 0.02
            # drawn on the CPU in fp32 so every device and dtype starts from the same numbers
            p.copy_(torch.randn(p.shape, generator=gen) * std)
        for m in model.modules():
            if isinstance(m, MoEFeedForward):
                m.reset_balance()  # the routing biases and their counts start at zero
    return model


def build_model(cfg: ModelConfig, seed: int = 0) -> Transformer:
    """A freshly initialised reference decoder in fp32 on the CPU."""
    with torch.device("meta"):
        # built without storage so nn.Linear's own init neither runs nor draws from the global RNG
        model = Transformer(cfg)
    return init_weights(model.to_empty(device="cpu"), seed)
