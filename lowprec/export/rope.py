"""From lowprec's RoPE convention to Hugging Face Llama's: a permutation of the query and key projections' rows.

[Note: two RoPE conventions]
lowprec's ``apply_rope`` rotates interleaved pairs of each head, ``(x[2i], x[2i+1])``, by the i-th angle;
Llama in transformers (``rotate_half``) rotates ``(x[i], x[i + hd/2])``. Attention scores are dot products
of queries and keys within a head, unchanged when both are permuted alike; so a lowprec model is a Llama
model once the rows of ``wq`` and ``wk`` are reordered within each head so that output ``j < hd/2`` is
lowprec's ``2j`` and output ``hd/2 + j`` is lowprec's ``2j + 1``. Values and ``wo`` are untouched.

A quantized weight keeps its codes under that permutation where its scales do: per tensor, per row (the
scales move with their rows), or blocks of rows that each head's rows stay inside (128x128 blocks with a
head width that divides 128). Otherwise the trained codes cannot be reordered and the format quantizes the
permuted master instead.
"""
from __future__ import annotations

import dataclasses

import torch

from lowprec.quant import QuantizedTensor


def rope_permutation(n_heads: int, head_dim: int) -> torch.Tensor:
    """The new order of the rows of a (n_heads * head_dim, in) projection: row ``r`` of the result is row
    ``perm[r]`` of lowprec's (see [Note: two RoPE conventions])."""
    within = torch.arange(head_dim).view(head_dim // 2, 2).t().reshape(-1)  # 0, 2, 4, ..., 1, 3, 5, ...
    return (torch.arange(n_heads)[:, None] * head_dim + within).reshape(-1)  # (n_heads * head_dim,)


def permute_rows(q: QuantizedTensor, perm: torch.Tensor) -> QuantizedTensor | None:
    """``q`` with its rows in the order ``perm`` when its scales allow (see [Note: two RoPE conventions]),
    else None."""
    rows = perm.numel()
    br, _ = q.block_shape
    data = q.data.clone()
    data[:rows] = q.data[perm]
    if br == 1:  # one scale per row: the scales move with their rows
        scale = q.scale.clone()
        scale[:rows] = q.scale[perm]
    elif torch.equal(perm // br, torch.arange(rows) // br):  # every row stays in its block: same scales
        scale = q.scale
    else:
        return None
    return dataclasses.replace(q, data=data, scale=scale)
