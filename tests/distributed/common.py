"""Models, data and training steps shared by the distributed checks (workers) and tests (references)."""
from __future__ import annotations

import contextlib

import torch

import lowprec
from lowprec.optim import Optimizer

IN, HIDDEN = 64, 128
STEPS = 4
"""Optimizer steps of every training check."""
GLOBAL_BATCH = 64
"""Rows per step for the whole group; rank ``r`` of ``W`` takes rows ``[r*B/W, (r+1)*B/W)``. Each half is a
whole number of 32-row MX blocks, so splitting the batch does not move a block boundary."""


def mlp(recipe: str | None, dtype: torch.dtype = torch.float32, seed: int = 0) -> torch.nn.Module:
    """A 64 -> 128 -> 64 MLP, initialised from ``seed``, cast to ``dtype``, converted to ``recipe``."""
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(IN, HIDDEN), torch.nn.GELU(), torch.nn.Linear(HIDDEN, IN))
    model = model.to(dtype)
    if recipe is not None:
        lowprec.convert(model, recipe)
    return model


def batch(step: int, rank: int = 0, world: int = 1, dtype: torch.dtype = torch.float32,
          rows: int = GLOBAL_BATCH) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's share of step ``step``'s global batch (all of it for ``world=1``)."""
    g = torch.Generator().manual_seed(1000 + step)
    x = torch.randn(rows, IN, generator=g)  # (B, IN)
    y = torch.randn(rows, IN, generator=g) * 0.5  # (B, IN)
    per = rows // world
    return x[rank * per:(rank + 1) * per].to(dtype), y[rank * per:(rank + 1) * per]


def mse(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return (model(x).float() - y).pow(2).mean()


def sgd(params, **kw) -> Optimizer:
    """The optimizer of the recipe-equality runs: SGD with momentum is linear in the gradients, so a
    small gradient difference stays a small weight difference (Adam's first steps would amplify it)."""
    return Optimizer(params, torch.optim.SGD, lr=0.5, momentum=0.9, **kw)


def adamw(params, **kw) -> Optimizer:
    return Optimizer(params, torch.optim.AdamW, lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1, **kw)


def train(model, opt: Optimizer, steps: range, rank: int = 0, world: int = 1, dtype=torch.float32,
          before_step=None, around_step=contextlib.nullcontext) -> list:
    """Plain steps on this rank's share of each batch; ``before_step(model)`` runs after backward,
    ``opt.step`` inside a fresh ``around_step()`` context."""
    results = []
    for step in steps:
        opt.zero_grad()
        x, y = batch(step, rank, world, dtype)
        loss = mse(model, x, y)
        opt.backward(loss)
        if before_step is not None:
            before_step(model)
        with around_step():
            results.append(opt.step(loss=loss))
    return results


def flat_weights(model: torch.nn.Module) -> torch.Tensor:
    """Every parameter, full (a DTensor is gathered), as one float32 vector."""
    parts = []
    for p in model.parameters():
        full = p.full_tensor() if hasattr(p, "full_tensor") else p
        parts.append(full.detach().float().reshape(-1))
    return torch.cat(parts)


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.detach().contiguous().reshape(-1).view(torch.uint8)


def one_process(recipe: str | None, dtype=torch.float32, **opt_kw) -> torch.Tensor:
    """The reference: the same steps in one process on the whole batch."""
    model = mlp(recipe, dtype)
    train(model, sgd(model.parameters(), **opt_kw), range(STEPS), dtype=dtype)
    return flat_weights(model)


def tolerance(recipe: str, dtype=torch.float32, **opt_kw) -> tuple[float, float]:
    """[Note: how close a data-parallel run must be]
    A data-parallel run differs from the one-process run only in where quantization scales are taken
    (the per-tensor amax of half a batch) and in the order of float sums, so it may miss the
    one-process weights by no more than twice the distance quantization itself puts between the
    one-process run and its high-precision twin. A run that summed instead of averaging, or lost a
    rank's gradient, misses by about the whole update; returns (tolerance, size of the update)."""
    quantized, high = one_process(recipe, dtype, **opt_kw), one_process(None, dtype, **opt_kw)
    update = (quantized - flat_weights(mlp(None, dtype))).norm().item()
    return 2 * (quantized - high).norm().item(), update
