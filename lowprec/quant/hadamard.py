"""The block Hadamard transform used by the NVFP4 recipe on the weight-gradient GEMM.

``hadamard(x, block)`` multiplies each run of ``block`` elements along the last dimension by the
orthonormal matrix ``M = D H / sqrt(block)`` (``H`` the Sylvester Hadamard matrix, ``D`` a diagonal
of random signs from ``seed``, or the identity without one). Applied to both operands along the
reduction dimension it leaves a GEMM unchanged, ``(A M)(B M)^T = A B^T``, while spreading outliers
across the block so that 4-bit quantization loses less (arXiv 2509.25149).
"""
from __future__ import annotations

import functools
import math

import torch
import torch.nn.functional as nnf

from lowprec._checks import check_tensor, describe, fail

RHT_BLOCK = 16
"""The block of the random Hadamard transform the recipes apply (NVFP4's weight-gradient operands)."""
RHT_SEED = 0x5EED
"""The seed of its random signs: both operands of a GEMM must use the same transform."""


def hadamard_matrix(block: int, seed: int | None = None, device=None, dtype=torch.float32) -> torch.Tensor:
    """The orthonormal ``block x block`` matrix ``D H / sqrt(block)`` (cached: do not modify it)."""
    if isinstance(block, bool) or not isinstance(block, int) or block < 1 or block & (block - 1):
        fail("block", "a power of two", describe(block))
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
        fail("seed", "an int or None", describe(seed), TypeError)
    return _matrix(block, seed, torch.device(device) if device is not None else torch.device("cpu"), dtype)


@functools.lru_cache(maxsize=64)
def _matrix(block: int, seed: int | None, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < block:  # Sylvester: H_2n = [[H, H], [H, -H]]
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    if seed is not None:
        gen = torch.Generator().manual_seed(seed)  # on CPU: the same signs on every device
        signs = torch.randint(0, 2, (block,), generator=gen).double() * 2 - 1
        h = signs[:, None] * h
    return (h / math.sqrt(block)).to(device=device, dtype=dtype)


def hadamard(x: torch.Tensor, block: int = 16, seed: int | None = None, inverse: bool = False) -> torch.Tensor:
    """Transform each run of ``block`` elements along x's last dimension (see module doc)."""
    check_tensor("x", x)
    m = hadamard_matrix(block, seed, device=x.device, dtype=torch.float32)  # checks block before x % block
    if x.dim() == 0 or x.shape[-1] % block:
        fail("x", f"a last dimension divisible by block={block}", describe(x))
    if inverse:
        m = m.T
    xb = x.float().unflatten(-1, (-1, block))  # (..., K / block, block)
    return (xb @ m).flatten(-2).to(x.dtype)


def hadamard_padded(x: torch.Tensor, block: int, seed: int | None) -> torch.Tensor:
    """:func:`hadamard` of ``x`` zero-padded along its last dimension to a multiple of ``block``: as
    both operands of a GEMM are padded alike along the reduction dimension, the product is unchanged."""
    pad = (-x.shape[-1]) % block
    return hadamard(nnf.pad(x, (0, pad)) if pad else x, block, seed=seed)
