"""The batches ``lowprec export --calibrate N`` calibrates on: the run's own validation data, or ``--data``.

A checkpoint records its data's description and fingerprint, not where to read it. The embedded corpus is
rebuilt here and checked against the fingerprint; other data must be named again (``--data PATH``). The
batches are the first ``N`` of the data's fixed validation set, in the run's batch size and sequence length:
data the run never trained on.
"""
from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from lowprec._checks import fail
from lowprec.export.source import TrainedModel
from lowprec.train.data import load_data
from lowprec.train.model import Transformer
from lowprec.train.models import HFCausalLM

_CORPUS = "embedded corpus"
"""How the embedded corpus's description begins (``lowprec.train.data.corpus_data``)."""


def _vocab(model: nn.Module) -> int:
    if isinstance(model, Transformer):
        return model.tok_embeddings.num_embeddings
    inner = model.model if isinstance(model, HFCausalLM) else model
    return inner.get_input_embeddings().num_embeddings


def calibration_batches(trained: TrainedModel, n: int, data_path: str | Path | None = None
                        ) -> tuple[list[torch.Tensor], str]:
    """``n`` validation batches (int64 (B, T), the run's B and T) of the run's data or of ``data_path``, and
    a line saying what they are."""
    cfg, recorded = trained.config, trained.data or {}
    if cfg is None:
        fail("checkpoint", "a run's settings (batch size, sequence length) to calibrate with", "none")
    source, fingerprint = str(recorded.get("source", "data it does not name")), recorded.get("fingerprint")
    if data_path is None and not source.startswith(_CORPUS):
        fail("--data", f"the data to calibrate on: the run trained on {source}, and a checkpoint does not "
             "record where to read it", "none")
    data = load_data(data_path, vocab_size=_vocab(trained.model))
    if data_path is None and data.fingerprint != fingerprint:
        fail("--data", f"the data to calibrate on: the embedded corpus here is not the run's ({source})",
             f"fingerprint {data.fingerprint[:12]}, the run's {str(fingerprint)[:12]}")
    batches = [x for x, _ in data.val_batches(n, cfg.batch_size, cfg.seq_len)]  # each (B, T)
    whose = "the run's validation data" if data.fingerprint == fingerprint else "the validation part of"
    return batches, f"calibration: {n} batches of {cfg.batch_size}x{cfg.seq_len} tokens from {whose} ({data.source})"
