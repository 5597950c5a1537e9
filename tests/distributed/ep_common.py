"""The reference MoE model, data and training steps shared by the expert-parallel checks (workers) and
their tests (the one-process references)."""
from __future__ import annotations

import torch
import torch.nn.functional as nnf

import lowprec
from lowprec.optim import Optimizer
from lowprec.train.model import build_model, preset

EP_STEPS = 3
ROWS, SEQ = 4, 16
"""Sequences per step for the whole group (rank ``r`` of 2 takes rows ``2r, 2r+1``) and their length."""
E, D = 4, 200
"""The exchange check's experts and row width (not a multiple of 128: the FP8 rows are padded)."""


def moe(recipe: str | None, seed: int = 0) -> torch.nn.Module:
    """``moe-tiny`` (2 blocks of 8 routed experts, top 2, a shared expert) from ``seed``, converted."""
    model = build_model(preset("moe-tiny"), seed=seed)
    if recipe is not None:
        lowprec.convert(model, recipe)
    return model


def tokens(step: int, rank: int = 0, world: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's inputs and targets of step ``step`` (all of them for ``world=1``)."""
    t = torch.randint(0, 256, (ROWS, SEQ + 1), generator=torch.Generator().manual_seed(500 + step))
    per = ROWS // world
    rows = t[rank * per:(rank + 1) * per]
    return rows[:, :-1], rows[:, 1:]


def lm_loss(model, x, y) -> torch.Tensor:
    return nnf.cross_entropy(model(x).float().flatten(0, 1), y.flatten())


def sgd(params) -> Optimizer:
    """SGD with momentum: linear in the gradients, so a small gradient difference stays a small weight
    difference (Adam's first steps would amplify it; see ``tests.distributed.common.sgd``)."""
    return Optimizer(params, torch.optim.SGD, lr=0.5, momentum=0.9)


def train(model, opt: Optimizer, rank: int = 0, world: int = 1) -> list[float]:
    """``EP_STEPS`` steps on this rank's rows; each step's loss on them."""
    losses = []
    for step in range(EP_STEPS):
        opt.zero_grad()
        x, y = tokens(step, rank, world)
        loss = lm_loss(model, x, y)
        opt.backward(loss)
        opt.step(loss=loss)
        losses.append(loss.item())
    return losses


EXCHANGES = {"spread": ([3, 0, 5, 0], [2, 4, 1, 0]), "one rank idle": ([3, 2, 0, 0], [1, 4, 0, 0])}
"""Each rank's rows per expert: rank 0 sends no row to expert 1 and neither rank to expert 3; or no row to
rank 1's experts at all (rank 1 runs its experts on nothing)."""


def exchange_rows(rank: int, case: str = "spread") -> tuple[torch.Tensor, torch.Tensor]:
    """Rank ``rank``'s rows for the exchange check, grouped by expert, and its (E,) counts (``EXCHANGES``);
    rows span 2^-10 .. 2^10 (so FP8 blocks differ)."""
    counts = torch.tensor(EXCHANGES[case][rank])
    g = torch.Generator().manual_seed(40 + rank)
    x = torch.randn(int(counts.sum()), D, generator=g) * 2.0 ** torch.randint(-10, 11, (int(counts.sum()), 1),
                                                                             generator=g)
    return x.to(torch.bfloat16), counts


def expert_of_rows(counts: torch.Tensor) -> torch.Tensor:
    return torch.arange(counts.numel()).repeat_interleave(counts)


def scaled_by_expert(rows: torch.Tensor, offsets: torch.Tensor, first: int) -> torch.Tensor:
    """The exchange check's experts: local expert ``e`` (expert ``first + e``) multiplies its rows by
    ``first + e + 1``, exactly in any float dtype."""
    counts = torch.diff(offsets, prepend=offsets.new_zeros(1))
    return rows * (expert_of_rows(counts) + first + 1).to(rows.dtype).unsqueeze(1)
