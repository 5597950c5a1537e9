"""FSDP2's resharding after forward, as ``lowprec train`` asks it of each block."""
from __future__ import annotations

import torch.distributed.fsdp

from lowprec.distributed.launch import reshard_after_forward, wrap
from lowprec.train.model import ModelConfig, build_model


def test_every_block_but_the_last_reshards():
    assert [reshard_after_forward(i, 4) for i in range(4)] == [True, True, True, False]
    assert reshard_after_forward(0, 1) is False  # one block: it is the last


def test_wrap_hands_each_block_its_choice(monkeypatch):
    calls = []
    monkeypatch.setattr(torch.distributed.fsdp, "fully_shard", lambda m, **kw: calls.append((m, kw)))
    model = build_model(ModelConfig(dim=32, n_layers=3, n_heads=2, n_kv_heads=1, ffn_dim=64, vocab_size=32), seed=0)
    assert wrap(model, "fsdp2") is model
    blocks = [(m, kw["reshard_after_forward"]) for m, kw in calls if "reshard_after_forward" in kw]
    assert blocks == [(model.layers[0], True), (model.layers[1], True), (model.layers[2], False)]
    assert calls[-1][0] is model and "reshard_after_forward" not in calls[-1][1]  # the root: FSDP2's own
