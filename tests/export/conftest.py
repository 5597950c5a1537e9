"""Trained models every export test shares: each trained once per session by lowprec's own trainer, with its
run directory (checkpoints) beside it. Tests that change a model take a copy (:func:`copy_of`)."""
from __future__ import annotations

import copy
import warnings
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from torch import nn

from lowprec.autocast import autocast
from lowprec.train.config import TrainConfig
from lowprec.train.data import load_data
from lowprec.train.loop import train
from lowprec.train.models import load_model


@dataclass(frozen=True)
class TrainedRun:
    """A model trained a few steps with ``recipe``, as the trainer left it, and its run directory."""

    model: nn.Module
    run_dir: Path
    recipe: str
    preset: str


def _train(preset: str, recipe: str, out: Path, steps: int = 2) -> TrainedRun:
    data = load_data()
    model, _ = load_model(preset, vocab_size=data.vocab_size, seed=0)
    cfg = TrainConfig(recipe=recipe, steps=steps, batch_size=2, seq_len=32, eval_every=steps, val_batches=1,
                      warmup_steps=1, lr=3e-3, tensorboard=False, progress=False, telemetry_every=0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "emulated on cpu"
        train(model, data, cfg, out_dir=out)
    return TrainedRun(model.eval(), out, recipe, preset)


@pytest.fixture(scope="session")
def tiny_fp8_current(tmp_path_factory) -> TrainedRun:
    """The ``tiny`` preset (dense, 192 wide: partial 128-blocks) trained 2 steps in ``fp8-current``."""
    return _train("tiny", "fp8-current", tmp_path_factory.mktemp("tiny-fp8-current"))


@pytest.fixture(scope="session")
def moe_fp8_blockwise(tmp_path_factory) -> TrainedRun:
    """The ``moe-tiny`` preset (128 wide: its attention's q/o and experts take 128x128 blocks, k/v do not)
    trained 2 steps in ``fp8-blockwise``."""
    return _train("moe-tiny", "fp8-blockwise", tmp_path_factory.mktemp("moe-fp8-blockwise"))


@pytest.fixture
def tokens() -> torch.Tensor:
    """A batch of token ids (2, 32) of the byte vocabulary, the same in every test."""
    return torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(0))


def copy_of(model: nn.Module) -> nn.Module:
    return copy.deepcopy(model)


@torch.no_grad()
def hp_logits(model: nn.Module, tokens: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``model``'s logits with its parameters cast to ``dtype`` and every GEMM in high precision."""
    m = copy_of(model).to(dtype)
    with autocast(enabled=False):
        return m(tokens).float()


@torch.no_grad()
def bf16_weights_fp32_logits(model: nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    """``model``'s logits in FP32 with every parameter rounded to BF16 first: what an ``hf`` export holds,
    computed in FP32, where only the order of FP32 sums can differ from another implementation."""
    m = copy_of(model)
    for p in m.parameters():
        p.copy_(p.to(torch.bfloat16).float())
    with autocast(enabled=False):
        return m(tokens).float()
