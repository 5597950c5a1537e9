"""Small runs and checkpoint edits shared by the resume tests."""
from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from lowprec.train.checkpoint import latest_checkpoint, load_checkpoint, save_checkpoint
from lowprec.train.config import TrainConfig
from lowprec.train.loop import train
from lowprec.train.model import ModelConfig, build_model

MICRO = ModelConfig(dim=64, n_layers=2, n_heads=2, n_kv_heads=1, ffn_dim=128, max_seq_len=64)
CFG = TrainConfig(steps=2, batch_size=4, seq_len=32, eval_every=2, val_batches=1, warmup_steps=1, lr=3e-3,
                  tensorboard=False, progress=False)


def run(data, cfg: TrainConfig = CFG, model: torch.nn.Module | None = None, **kw):
    return train(model if model is not None else build_model(MICRO, seed=cfg.seed), data, cfg, **kw)


def nan_model(cfg: TrainConfig = CFG) -> torch.nn.Module:
    """The micro model with one NaN in a weight: every step it takes is skipped."""
    model = build_model(MICRO, seed=cfg.seed)
    with torch.no_grad():
        model.layers[0].attention.wq.weight[3, 5] = float("nan")
    return model


def edit_json(json_path: Path, change: Callable[[dict[str, Any]], None]) -> None:
    """Change the body of a checkpoint JSON as an editor would, leaving the recorded sha256 as it was."""
    data = json_path.read_bytes()
    marker = b'"checkpoint": '
    head = data[:data.index(marker) + len(marker)]
    body = json.loads(data[len(head):-2])
    change(body)
    json_path.write_bytes(head + json.dumps(body, indent=1).encode() + b"}\n")


def resave(directory: Path, change: Callable[[dict[str, Any]], None]) -> Path:
    """Rewrite the newest checkpoint in ``directory`` with its state changed, through ``save_checkpoint``: a
    checkpoint whose checksums all hold."""
    path = latest_checkpoint(directory)
    step, state = load_checkpoint(path)
    change(state)
    return save_checkpoint(directory, step, state)


class Stop(Exception):
    """Raised by :func:`stop_at`'s hook: the run ends there, as if killed."""


def stop_at(k: int) -> Callable[[dict[str, Any]], None]:
    """An ``on_step`` hook that stops the run after step ``k``'s row is written and checkpointed."""
    def hook(row: dict[str, Any]) -> None:
        if row["step"] == k:
            raise Stop

    return hook
