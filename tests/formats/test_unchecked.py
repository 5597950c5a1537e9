"""``round_unchecked`` and ``decode_unchecked`` (no checks, no host sync, for quant and kernels) give
bit for bit what ``round_to`` and ``decode`` give on every input they are allowed."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from lowprec import formats as F
from tests.formats._oracle import BITS, SMALL, finite_grid, rounding_probe, same_bits


@pytest.mark.parametrize("name", SMALL)
def test_decode_unchecked_equals_decode_on_every_code(name):
    codes = torch.arange(2 ** BITS[name], dtype=torch.uint8)
    assert same_bits(F.decode_unchecked(codes, name).numpy(), F.decode(codes, name).numpy()).all()
    typed = F.get(name).storage_dtype
    if typed != torch.uint8:
        assert same_bits(F.decode_unchecked(codes.view(typed), name).numpy(), F.decode(codes, name).numpy()).all()


@pytest.mark.parametrize("name", ["e4m3", "e5m2", "e3m2", "e2m3", "e2m1", "e8m0", "int8", "bf16", "fp16"])
@pytest.mark.parametrize("saturate", [True, False])
def test_round_unchecked_equals_round_to(name, saturate):
    f = F.get(name)
    rng = np.random.default_rng(31)
    x = rng.choice(rounding_probe(finite_grid(name), rng, 20_000), 30_000)  # ties of all kinds, sampled
    if name == "e8m0":
        x = x[x > 0]
    if not saturate and not f.has_nan:
        x = x[np.abs(x) <= f.max]  # round_to raises beyond; round_unchecked gives NaN there (below)
    if f.has_nan:
        x = np.concatenate([x, np.float32([np.nan, np.inf] if name == "e8m0" else [np.nan, np.inf, -np.inf])])
    xt = torch.from_numpy(x)
    rand = torch.rand(xt.shape, generator=torch.Generator().manual_seed(32))
    pairs = [(F.round_unchecked(xt, name, saturate=saturate), F.round_to(xt, name, saturate=saturate)),
             (F.round_unchecked(xt, name, rand, saturate=saturate),
              F.round_to(xt, name, "stochastic", saturate=saturate, rand=rand))]
    for got, ref in pairs:
        assert got.dtype == torch.float32
        assert same_bits(got.numpy(), ref.numpy()).all()


def test_round_unchecked_overflow_without_nan_is_nan():
    got = F.round_unchecked(torch.tensor([7.0, -100.0, 5.0]), "e2m1", saturate=False)
    assert torch.isnan(got[:2]).all() and got[2] == 4.0
