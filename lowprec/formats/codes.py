"""Bit codes: encoding values on a format's grid to their codes, and decoding codes back to values.

Computed in float32 (float64 where a format needs it) with exact operations, so the codes and values
are bit-exact on every device. Codes of formats of 8 bits or fewer are uint8, one per byte
(:mod:`lowprec.formats.packing` packs FP4/FP6 densely).
"""
from __future__ import annotations

import math

import torch

from lowprec._checks import describe, fail
from lowprec.formats.rounding import pow2, round_to
from lowprec.formats.table import Format, Kind, Special, get


def _decode_fields(codes: torch.Tensor, f: Format, dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """Decode integer codes by the format's formula (float64: exact for every format; float32:
    exact for formats of 8 bits or fewer)."""
    c = codes.to(torch.int64) if dtype == torch.float64 else codes.to(torch.int32)
    if f.kind is Kind.INT:
        return torch.where(c >= 2 ** (f.bits - 1), c - 2**f.bits, c).to(dtype)
    sign_bit = f.bits - 1
    body = c & ((1 << sign_bit) - 1) if f.signed else c
    ef = body >> f.man_bits
    man = (body & ((1 << f.man_bits) - 1)).to(dtype)
    frac = man / 2**f.man_bits
    if f.kind is Kind.EXPONENT:
        v = torch.ldexp(torch.ones_like(frac), ef - f.bias)
    else:
        normal = torch.ldexp(1 + frac, ef - f.bias)
        sub = torch.ldexp(frac, torch.full_like(ef, f.emin))
        v = torch.where(ef == 0, sub, normal)
    all_ones_exp = ef == 2**f.exp_bits - 1
    if f.special is Special.IEEE:
        v = torch.where(all_ones_exp, torch.where(man == 0, math.inf, math.nan), v)
    elif f.special is Special.FN:
        v = torch.where(body == (1 << (f.bits - f.signed)) - 1, math.nan, v)
    if f.signed:
        v = torch.where((c >> sign_bit) & 1 == 1, -v, v)
    return v


_LUTS: dict[tuple[str, torch.device], torch.Tensor] = {}


def decode_table(fmt: str | Format, device: torch.device | str = "cpu") -> torch.Tensor:
    """float32 value of every code of a format of 8 bits or fewer, indexed by code."""
    f = get(fmt)
    if f.bits > 8:
        fail("fmt", "a format of 8 bits or fewer", f.name)
    key = (f.name, torch.device(device))
    if key not in _LUTS:
        _LUTS[key] = _decode_fields(torch.arange(2**f.bits), f).float().to(device)
    return _LUTS[key]


def _as_codes(codes: torch.Tensor, f: Format) -> torch.Tensor:
    if not isinstance(codes, torch.Tensor):
        fail("codes", "a torch.Tensor of codes", describe(codes), TypeError)
    if f.bits <= 8:
        if codes.dtype == f.storage_dtype:  # only the format's own dtype: another's bits mean other values
            codes = codes.view(torch.uint8)
        if codes.dtype != torch.uint8:
            fail("codes", f"a uint8 tensor (or {f.storage_dtype}) of {f.name} codes", describe(codes), TypeError)
        if f.bits < 8 and codes.numel() and int(codes.max()) >= 2**f.bits:
            fail("codes", f"values below {2**f.bits} ({f.name} has {f.bits} bits)", f"max {int(codes.max())}")
        return codes
    if codes.dtype not in (torch.int32, torch.int64):
        fail("codes", f"an int32 or int64 tensor of {f.name} codes", describe(codes), TypeError)
    bits_view = codes.dtype == torch.int32 and f.bits == 32  # float32 bits viewed as int32 may be negative
    if codes.numel() and not bits_view and (int(codes.min()) < 0 or int(codes.max()) >= 2**f.bits):
        fail("codes", f"values in [0, 2^{f.bits}) ({f.name} has {f.bits} bits)",
             f"values in [{int(codes.min())}, {int(codes.max())}]")
    return codes


def decode_unchecked(codes: torch.Tensor, fmt: str | Format) -> torch.Tensor:
    """:func:`decode` of uint8 codes of a format of 8 bits or fewer with no range check, so it needs no
    host sync: a table lookup in eager mode, the formula in float32 (exact there) under torch.compile."""
    f = get(fmt)
    if codes.dtype != torch.uint8:
        codes = codes.view(torch.uint8)
    if not torch.compiler.is_compiling():  # eager: one gather from the table
        return decode_table(f, codes.device)[codes.long()]
    return _decode_fields(codes.to(torch.int32), f, torch.float32)


def decode(codes: torch.Tensor, fmt: str | Format) -> torch.Tensor:
    """The float32 values named by ``codes`` (uint8, or the format's float8 dtype; int64 beyond 8 bits)."""
    f = get(fmt)
    codes = _as_codes(codes, f)
    if f.bits <= 8:
        return decode_table(f, codes.device)[codes.long()]
    return _decode_fields(codes, f).float()


def encode(x: torch.Tensor, fmt: str | Format, saturate: bool = True) -> torch.Tensor:
    """Bit codes of ``round_to(x, fmt, saturate=saturate)``: uint8 for formats of 8 bits or fewer
    (one code per byte, see :func:`pack`), int64 beyond. NaN gets the all-ones code with x's sign."""
    f = get(fmt)
    return codes_of(round_to(x, f, saturate=saturate), f)


def codes_of(y: torch.Tensor, fmt: str | Format) -> torch.Tensor:
    """Bit codes of float32 values already on ``fmt``'s grid (the output of :func:`round_to`)."""
    f = get(fmt)
    if f.kind is Kind.INT:
        codes = y.long() & (2**f.bits - 1)
    else:
        nan = torch.isnan(y)
        a = torch.where(nan, 0.0, y.abs())
        _, e = torch.frexp(a)
        normal = a >= f.min_normal
        binade = torch.where(normal, e - 1, f.emin)
        if -f.emax >= -126 and -f.emin <= 127:  # 2^-binade is a normal float32: build it from bits
            unit = a * pow2(-binade, torch.float32, -f.emax)
        else:
            unit = torch.ldexp(a, -binade)
        man = (unit - normal.float()) * 2**f.man_bits  # exact integer
        ef = torch.where(normal, binade + f.bias, 0).long()
        codes = (ef << f.man_bits) | man.long()
        if f.has_inf:
            codes = torch.where(torch.isinf(a), (2**f.exp_bits - 1) << f.man_bits, codes)
        codes = torch.where(nan, (1 << (f.bits - f.signed)) - 1, codes)
        if f.signed:
            codes = codes | (torch.signbit(y).long() << (f.bits - 1))
    return codes.to(torch.uint8) if f.bits <= 8 else codes
