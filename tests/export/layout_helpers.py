"""Independent decoders for the serving layouts' tests, weights as a recipe trained them, and tiny trained models.

The decoders follow the layouts' documentation with ml_dtypes as the oracle for element values, not lowprec's own
code: FP4 bytes are unpacked low nibble first and decoded by ``ml_dtypes.float4_e2m1fn``, E8M0 codes as
``2^(code - 127)``.
"""
from __future__ import annotations

import copy
import warnings
from collections.abc import Callable
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
import torch
from safetensors import safe_open
from torch import nn

from lowprec import recipes as R
from lowprec.export.layout import LayerWeight
from lowprec.quant import QuantizedTensor, quantize
from lowprec.train.config import TrainConfig
from lowprec.train.data import load_data
from lowprec.train.loop import train
from lowprec.train.model import ModelConfig, build_model


def fp4_values(packed: torch.Tensor) -> torch.Tensor:
    """float32 values of FP4 bytes: element ``2j`` in the low nibble of byte ``j``, ``2j + 1`` in the high."""
    nibbles = torch.stack([packed & 0xF, packed >> 4], dim=-1).flatten(-2)
    decoded = nibbles.numpy().view(ml_dtypes.float4_e2m1fn).astype(np.float32)
    return torch.from_numpy(decoded)


def e8m0_values(codes: torch.Tensor) -> torch.Tensor:
    """float32 values of E8M0 codes: ``2^(code - 127)`` (255, NaN, never written)."""
    return torch.ldexp(torch.ones(codes.shape), codes.to(torch.int32) - 127)


def nvfp4_as_compressed_tensors_reads(t: dict[str, torch.Tensor]) -> torch.Tensor:
    """compressed-tensors' NVFP4 decompression by the arithmetic it documents: the codes (low nibble first)
    times ``fp32(weight_scale / weight_global_scale)`` per 16-element group, rounded to bfloat16."""
    eff = t["weight_scale"].float() / t["weight_global_scale"]  # (out, in/16)
    return (fp4_values(t["weight_packed"]) * eff.repeat_interleave(16, dim=1)).to(torch.bfloat16)


def trained_weight(master: torch.Tensor, recipe: str) -> QuantizedTensor:
    """``master`` cast as ``recipe``'s forward GEMM casts its weight (the fprop rhs)."""
    cast = R.get(recipe).fprop.rhs
    return quantize(master, cast.fmt, cast.granularity)


def layer(master: torch.Tensor, recipe: str | None = None, name: str = "model.layers.0.mlp.up_proj") -> LayerWeight:
    """A LayerWeight of ``master``, trained under ``recipe`` (None: no trained weight)."""
    q = trained_weight(master, recipe) if recipe is not None else None
    return LayerWeight(name, master, q, recipe)


TINY = dict(dim=128, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=256, max_seq_len=64)
"""A reference decoder small enough to train in a second on a CPU: every width a multiple of 32 (MX blocks), the
keys' and values' 64 rows under fp8-blockwise's 128 (kept in high precision there)."""
_RUNS: dict[str, nn.Module] = {}


@pytest.fixture(scope="session")
def trained_tiny(tmp_path_factory) -> Callable[[str], nn.Module]:
    """``trained_tiny(recipe)``: the :data:`TINY` decoder trained 2 steps by lowprec's trainer in ``recipe``, once
    per test process (the models are shared by the layouts' test files, which must not change them)."""

    def get(recipe: str) -> nn.Module:
        if recipe not in _RUNS:
            data = load_data()
            model = build_model(ModelConfig(vocab_size=data.vocab_size, **TINY), 0)
            cfg = TrainConfig(recipe=recipe, steps=2, batch_size=2, seq_len=32, eval_every=2, val_batches=1,
                              warmup_steps=1, lr=3e-3, tensorboard=False, progress=False, telemetry_every=0)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # "emulated on cpu"
                train(model, data, cfg, out_dir=tmp_path_factory.mktemp(f"tiny-{recipe}"))
            _RUNS[recipe] = model.eval()
        return _RUNS[recipe]

    return get


@torch.no_grad()
def quantized_logits(model: nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    """``model``'s own forward: the recipe's quantized GEMMs (weights and activations), rounding to nearest."""
    return copy.deepcopy(model).eval()(tokens).float()


def safetensors_of(path: Path) -> dict[str, torch.Tensor]:
    with safe_open(str(path / "model.safetensors"), "pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}


def tokens_of(seed: int = 0) -> torch.Tensor:
    """A batch of token ids (2, 32) of the byte vocabulary."""
    return torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(seed))
