"""The models the whole-step benchmarks train, one definition for ``bench_model.py`` (one GPU) and
``bench_distributed.py`` (N GPUs), so that their figures are of the same models, batches and optimizer."""
from __future__ import annotations

from dataclasses import dataclass, replace

import _common  # noqa: F401  (puts the checkout on sys.path before lowprec is imported)

from lowprec.train.model import ModelConfig, preset

VOCAB = 32000
ADAMW = {"lr": 1e-4, "betas": (0.9, 0.95), "weight_decay": 0.1}
"""The optimizer of every variant; small enough that no variant's loss leaves the finite range."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Size:
    """A model shape and the batch each GPU trains on."""

    config: ModelConfig
    batch: int
    """Sequences per GPU per step."""
    seq_len: int

    @property
    def tokens(self) -> int:
        """Tokens per GPU per step."""
        return self.batch * self.seq_len

    def linear_params(self) -> int:
        """Weights of every linear, the LM head's included (parameters less the embedding and the norms)."""
        c = self.config
        return c.num_params() - c.vocab_size * c.dim - (2 * c.n_layers + 1) * c.dim

    def active_linear_params(self) -> int:
        """:meth:`linear_params` less the routed experts a token does not reach (a mixture of experts: its
        ``top_k`` of ``n_experts``)."""
        c = self.config
        if c.moe is None:
            return self.linear_params()
        idle = c.moe.n_experts - c.moe.top_k
        return self.linear_params() - c.n_layers * idle * 3 * c.dim * c.ffn_dim

    def flops_per_token(self) -> int:
        """Model FLOPs of one token's forward and backward, as ``lowprec.plan`` counts them: 6 per
        parameter of every linear a token goes through (the LM head too, not the embedding lookup; a
        mixture's routed experts: its top k), plus attention's scores and weighted sum, 12 x seq x dim
        per layer (PaLM's count; the causal mask is not credited)."""
        c = self.config
        return 6 * self.active_linear_params() + 12 * self.seq_len * c.dim * c.n_layers


def llama_ffn(dim: int) -> int:
    """The presets' SwiGLU width: two thirds of 4 x dim, rounded up to a multiple of 256."""
    return -(-(8 * dim // 3) // 256) * 256


SIZES: dict[str, Size] = {
    # the dry run: the byte-vocabulary preset, a few hundred tokens a GPU, seconds on a CPU
    "tiny": Size(config=preset("tiny"), batch=2, seq_len=64),
    "125m": Size(config=replace(preset("125m"), vocab_size=VOCAB), batch=16, seq_len=2048),
    # the 1b preset's widths with 16 query heads of 128 (the preset has 32 of 64)
    "1b": Size(config=replace(preset("1b"), n_heads=16, vocab_size=VOCAB), batch=8, seq_len=2048),
    "3b": Size(config=ModelConfig(dim=3072, n_layers=26, n_heads=24, n_kv_heads=8, ffn_dim=llama_ffn(3072),
                                  vocab_size=VOCAB, max_seq_len=4096), batch=4, seq_len=4096),
    # Llama 3 8B's shape and vocabulary: what one H200 trains with lowprec's memory options and recomputation
    "8b": Size(config=ModelConfig(dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, ffn_dim=14336, vocab_size=128256,
                                  max_seq_len=4096), batch=2, seq_len=4096),
    # a mixture of experts: 32 experts of 512 per block, 4 per token (its MFU counts the 4, as the planner)
    "moe-1b": Size(config=replace(preset("moe-1b"), vocab_size=VOCAB), batch=8, seq_len=2048),
}
