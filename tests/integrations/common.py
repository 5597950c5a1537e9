"""What the integration tests share: a tiny reference decoder, its data, a hand loop to compare against,
and exact comparisons of weights and optimizer state."""
from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

import lowprec
from lowprec.train.model import ModelConfig, Transformer, build_model

CONFIG = ModelConfig(dim=64, n_layers=2, n_heads=2, n_kv_heads=1, ffn_dim=128, vocab_size=256, max_seq_len=16)
"""Two blocks of 64-wide layers: every linear but the head is one the recipes convert."""
POLICY = lowprec.Policy(skip_small=False)
"""Converts the small layers on every device (a GPU's rule would keep 64-wide layers in high precision)."""
LR = 1e-2
BLOCK_LINEARS = 7 * CONFIG.n_layers
"""wq, wk, wv, wo, w1, w2, w3 per block (the head, ``output``, stays in high precision)."""


def tiny_model() -> Transformer:
    return build_model(CONFIG, seed=0)


def batches(n: int, batch_size: int = 2, seq_len: int = 12) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``n`` (inputs, targets) batches of token ids from a fixed generator: (B, T) each."""
    gen = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, CONFIG.vocab_size, (n, batch_size, seq_len + 1), generator=gen)  # (n, B, T+1)
    return [(t[:, :-1], t[:, 1:]) for t in tokens]


def lm_loss(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(model(x).float().flatten(0, 1), y.flatten())


def hand_loop(recipe: str, data: list[tuple[torch.Tensor, torch.Tensor]], *, dtype: torch.dtype | None = None,
              master_weights: bool = False,
              loss_scale: str | None = None) -> tuple[Transformer, lowprec.optim.Optimizer, list[float]]:
    """What the plugins must do: convert, then ``lowprec.optim.Optimizer`` around AdamW, one step a batch."""
    model = tiny_model()
    if dtype is not None:
        model.to(dtype=dtype)
    lowprec.convert(model, recipe, POLICY)
    opt = lowprec.optim.Optimizer(model.parameters(), torch.optim.AdamW, master_weights=master_weights,
                                  loss_scale=loss_scale, lr=LR)
    losses = []
    for x, y in data:
        loss = lm_loss(model, x, y)
        opt.backward(loss)
        opt.step(loss=loss)
        losses.append(loss.item())
    return model, opt, losses


def assert_same_tensors(a: Any, b: Any, where: str = "") -> None:
    """``a`` and ``b`` (nested dicts, lists and tensors) are equal bit for bit."""
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape, where
        assert torch.equal(a, b) or (a.isnan() == b.isnan()).all() and torch.equal(a.nan_to_num(), b.nan_to_num()), \
            where
    elif isinstance(a, dict):
        assert isinstance(b, dict) and set(a) == set(b), f"{where}: {sorted(a)} != {sorted(b)}"
        for k in a:
            assert_same_tensors(a[k], b[k], f"{where}.{k}")
    elif isinstance(a, (list, tuple)):
        assert isinstance(b, (list, tuple)) and len(a) == len(b), where
        for i, (u, v) in enumerate(zip(a, b)):
            assert_same_tensors(u, v, f"{where}[{i}]")
    else:
        assert a == b, f"{where}: {a!r} != {b!r}"
