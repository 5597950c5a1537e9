"""Dense storage of FP4 and FP6 codes: FP4 two codes per byte (low nibble first, as
torch.float4_e2m1fn_x2); FP6 four codes in three bytes (code i in bits 6i..6i+5 of a little-endian
24-bit word). 8-bit codes pack to themselves.
"""
from __future__ import annotations

import torch

from lowprec._checks import describe, fail
from lowprec.formats.codes import _as_codes
from lowprec.formats.table import Format, get


def pack(codes: torch.Tensor, fmt: str | Format) -> torch.Tensor:
    """Pack uint8 codes of a 4- or 6-bit format densely along the last dimension."""
    f = get(fmt)
    codes = _as_codes(codes, f)
    if codes.dim() == 0:
        fail("codes", "a tensor with a last dimension to pack along", describe(codes))
    n = codes.shape[-1]
    if f.bits == 4:
        if n % 2:
            fail("codes", "an even last dimension to pack FP4 codes two per byte", describe(codes))
        return codes[..., 0::2] | (codes[..., 1::2] << 4)
    if f.bits == 6:
        if n % 4:
            fail("codes", "a last dimension divisible by 4 to pack FP6 codes four in three bytes", describe(codes))
        c = codes.unflatten(-1, (n // 4, 4)).to(torch.int32)
        word = c[..., 0] | (c[..., 1] << 6) | (c[..., 2] << 12) | (c[..., 3] << 18)
        out = torch.stack([word & 0xFF, (word >> 8) & 0xFF, word >> 16], dim=-1)
        return out.flatten(-2).to(torch.uint8)
    if f.bits == 8:
        return codes
    fail("fmt", "a format of 4, 6 or 8 bits to pack", f.name)


def unpack(packed: torch.Tensor, fmt: str | Format) -> torch.Tensor:
    """Undo :func:`pack`: one uint8 code per element."""
    f = get(fmt)
    if not isinstance(packed, torch.Tensor) or packed.dtype != torch.uint8:
        fail("packed", "a uint8 tensor", describe(packed), TypeError)
    if packed.dim() == 0:
        fail("packed", "a tensor with a last dimension to unpack along", describe(packed))
    if f.bits == 4:
        return torch.stack([packed & 0xF, packed >> 4], dim=-1).flatten(-2)
    if f.bits == 6:
        n = packed.shape[-1]
        if n % 3:
            fail("packed", "a last dimension divisible by 3 (FP6 packs 4 codes in 3 bytes)", describe(packed))
        b = packed.unflatten(-1, (n // 3, 3)).to(torch.int32)
        word = b[..., 0] | (b[..., 1] << 8) | (b[..., 2] << 16)
        return torch.stack([(word >> s) & 0x3F for s in (0, 6, 12, 18)], dim=-1).flatten(-2).to(torch.uint8)
    if f.bits == 8:
        return packed
    fail("fmt", "a format of 4, 6 or 8 bits to unpack", f.name)
