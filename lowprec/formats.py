"""The element formats: one table, rounding onto a format, encoding to bit codes, packing.

[Note: what a format is]
A format is a set of numbers plus the bit codes that name them. Floating-point formats are
described by exponent bits, mantissa bits and a bias, and by how they spend their top codes:

* ``IEEE``  the all-ones exponent holds inf (mantissa 0) and NaN (fp32, tf32, bf16, fp16, e5m2);
* ``FN``    "finite": only the all-ones code S.1..1.1..1 is NaN, there is no inf (OCP e4m3, e8m0);
* ``NONE``  every code is a finite number, there is neither inf nor NaN (OCP FP6 and FP4).

``e8m0`` is an exponent alone (no sign, no mantissa, no zero): 2^-127 .. 2^127, 0xFF = NaN. It is
the scale format of the MX block formats. ``int8``/``int4`` are two's complement integers.

Everything here is computed in float32 (float64 for float64 inputs, so they are rounded once, not
twice) with operations that are exact (scaling by powers of two, ``torch.round``), so the results
are bit-exact on every device.
"""
from __future__ import annotations

import enum
import math
from dataclasses import dataclass

import torch

from lowprec._checks import check_choice, check_tensor, describe, fail


class Kind(enum.Enum):
    FLOAT = "float"
    EXPONENT = "exponent"  # e8m0: a power of two, no sign, no zero
    INT = "int"


class Rounding(str, enum.Enum):
    """How a value between two neighbours of a format is rounded. A ``str`` enum, so ``"nearest"`` is
    accepted wherever a ``Rounding`` is; code that decides by it resolves the name once
    (``Rounding(name)``) and compares members, never strings."""

    NEAREST = "nearest"
    """Round half to even."""
    STOCHASTIC = "stochastic"
    """Round away from zero with probability equal to the distance from the lower neighbour, over the
    gap (unbiased)."""


ROUNDINGS = tuple(r.value for r in Rounding)


def as_rounding(rounding: str | Rounding, name: str = "rounding") -> Rounding:
    """``rounding`` as a :class:`Rounding` member; an unknown name is an error naming ``name``."""
    check_choice(name, rounding, ROUNDINGS)
    return Rounding(rounding)


class Special(enum.Enum):
    IEEE = "ieee"  # all-ones exponent: inf (mantissa 0), NaN (mantissa != 0)
    FN = "fn"  # only the all-ones code is NaN; no inf
    NONE = "none"  # neither inf nor NaN


@dataclass(frozen=True, slots=True)
class Format:
    """One element format. Build through the table (:func:`get`), not by hand."""

    name: str
    kind: Kind
    bits: int
    exp_bits: int
    man_bits: int
    bias: int
    special: Special
    signed: bool
    max: float
    """Largest finite value."""
    lowest: float
    """Most negative finite value (``-max`` for floats, ``-2^(bits-1)`` for ints)."""
    min_normal: float
    min_subnormal: float
    """Smallest positive value (equal to ``min_normal`` where there are no subnormals)."""
    emin: int
    """Exponent of the smallest binade (subnormals share it)."""
    torch_dtype: torch.dtype | None
    """The torch dtype holding exactly these values, where torch has one."""
    doc: str

    @property
    def has_inf(self) -> bool:
        return self.special is Special.IEEE

    @property
    def has_nan(self) -> bool:
        return self.special is not Special.NONE

    @property
    def emax(self) -> int:
        """Exponent of the largest binade, ``floor(log2(max))``."""
        return math.floor(math.log2(self.max))

    @property
    def binades(self) -> float:
        """Dynamic range, ``log2(max / min_subnormal)``."""
        return math.log2(self.max / self.min_subnormal)

    @property
    def storage_dtype(self) -> torch.dtype:
        """The dtype a quantized tensor of this format stores its data in."""
        if self.torch_dtype is not None:
            return self.torch_dtype
        if self.bits > 8:  # tf32: float32 whose low 13 mantissa bits are zero
            return torch.float32
        return torch.uint8  # codes, one per byte (pack() packs FP4/FP6 for storage)

    def __str__(self) -> str:
        return self.name


def _float(name, exp_bits, man_bits, bias, special, dtype=None, doc="", bits=None) -> Format:
    all_ones = 2**exp_bits - 1
    top_exp = all_ones - 1 if special is Special.IEEE else all_ones
    top_man = 2**man_bits - (2 if special is Special.FN else 1)
    mx = 2.0 ** (top_exp - bias) * (1 + top_man / 2**man_bits)
    emin = 1 - bias
    return Format(
        name, Kind.FLOAT, bits or 1 + exp_bits + man_bits, exp_bits, man_bits, bias, special, True,
        mx, -mx, 2.0**emin, 2.0 ** (emin - man_bits), emin, dtype, doc,
    )


def _int(name, bits, dtype=None, doc="") -> Format:
    mx = 2 ** (bits - 1) - 1
    return Format(name, Kind.INT, bits, 0, bits - 1, 0, Special.NONE, True,
                  float(mx), float(-mx - 1), 1.0, 1.0, 0, dtype, doc)


_E8M0 = Format("e8m0", Kind.EXPONENT, 8, 8, 0, 127, Special.FN, False, 2.0**127, 2.0**-127,
               2.0**-127, 2.0**-127, -127, None, "MX block scales (OCP MX v1.0): 2^-127..2^127, 0xFF NaN")

FORMATS: dict[str, Format] = {f.name: f for f in (
    _float("fp32", 8, 23, 127, Special.IEEE, torch.float32, "IEEE single"),
    _float("tf32", 8, 10, 127, Special.IEEE, None, "TensorFloat-32 (tensor-core input, stored as fp32)"),
    _float("bf16", 8, 7, 127, Special.IEEE, torch.bfloat16, "bfloat16"),
    _float("fp16", 5, 10, 15, Special.IEEE, torch.float16, "IEEE half"),
    _float("e4m3", 4, 3, 7, Special.FN, torch.float8_e4m3fn, "FP8 E4M3 (OCP 'fn'), forward tensors"),
    _float("e5m2", 5, 2, 15, Special.IEEE, torch.float8_e5m2, "FP8 E5M2, gradients"),
    _float("e3m2", 3, 2, 3, Special.NONE, None, "FP6 E3M2 (OCP MX)"),
    _float("e2m3", 2, 3, 1, Special.NONE, None, "FP6 E2M3 (OCP MX)"),
    _float("e2m1", 2, 1, 1, Special.NONE, None, "FP4 E2M1 (OCP MX, NVFP4)"),
    _E8M0,
    _int("int8", 8, torch.int8, "8-bit two's complement integer"),
    _int("int4", 4, None, "4-bit two's complement integer"),
)}

_ALIASES = {
    "float32": "fp32", "bfloat16": "bf16", "float16": "fp16", "half": "fp16",
    "fp8_e4m3": "e4m3", "e4m3fn": "e4m3", "float8_e4m3fn": "e4m3",
    "fp8_e5m2": "e5m2", "float8_e5m2": "e5m2",
    "fp6_e3m2": "e3m2", "fp6_e2m3": "e2m3", "fp4": "e2m1", "fp4_e2m1": "e2m1", "float4_e2m1fn": "e2m1",
    "float8_e8m0fnu": "e8m0",
}


def get(fmt: str | Format) -> Format:
    """A format by name (``"e4m3"``, ``"fp8_e4m3"``, ``"e2m1"``, ...) or the format itself."""
    if isinstance(fmt, Format):
        return fmt
    if not isinstance(fmt, str):
        fail("fmt", "a format name or lowprec.formats.Format", describe(fmt), TypeError)
    key = _ALIASES.get(fmt.lower(), fmt.lower())
    if key not in FORMATS:
        fail("fmt", "one of " + ", ".join(FORMATS), repr(fmt))
    return FORMATS[key]


# --------------------------------------------------------------------------------------------
# rounding


def _quantum(a: torch.Tensor, f: Format) -> torch.Tensor:
    """The grid spacing at |x| = a: 2^(E - man_bits), E the binade of a (at least emin)."""
    if f.kind is Kind.INT:
        return torch.ones_like(a)
    _, e = torch.frexp(a)  # a = m * 2^e, m in [0.5, 1)
    binade = (e - 1).clamp_min(f.emin)
    return pow2(binade - f.man_bits, a.dtype, f.emin - f.man_bits)


def pow2(e: torch.Tensor, dtype: torch.dtype = torch.float32, lowest: int = -1074) -> torch.Tensor:
    """``2.0 ** e`` exactly, for integer ``e`` no smaller than ``lowest``. Where every result is a
    normal float32 this writes the exponent bits directly (``torch.ldexp`` computes a power)."""
    if dtype == torch.float32 and lowest >= -126:
        return ((e.to(torch.int32) + 127).clamp(1, 254) << 23).view(torch.float32)
    return torch.ldexp(torch.ones(e.shape, dtype=dtype, device=e.device), e)


def round_to(
    x: torch.Tensor,
    fmt: str | Format,
    rounding: str | Rounding = Rounding.NEAREST,
    saturate: bool = True,
    generator: torch.Generator | None = None,
    rand: torch.Tensor | None = None,
) -> torch.Tensor:
    """``x`` rounded onto the grid of ``fmt``, returned as float32.

    ``rounding="nearest"`` rounds half to even. ``"stochastic"`` rounds away from zero with
    probability equal to the distance from the lower grid point (in units of the grid spacing),
    so ``E[round_to(x)] = x``; it uses ``rand`` (uniform float32 in [0, 1), x's shape) when given,
    else draws it from ``generator``. A value rounds away from zero exactly when ``rand < frac``.

    Overflow: with ``saturate`` a finite value beyond the largest finite goes to the largest finite
    of its sign (the training-cast convention); without, it follows the format's own rule (inf
    where there is inf, NaN where there is NaN, an error where there is neither).
    Inf and NaN inputs are never made finite: inf stays inf where the format has it, else becomes
    NaN; a format without NaN (FP6, FP4, ints) raises for them. Block formats keep NaN in the
    block scale instead (see ``lowprec.quant``).
    """
    f = get(fmt)
    x = check_tensor("x", x)
    stochastic = as_rounding(rounding) is Rounding.STOCHASTIC
    # float64 stays float64: going through float32 first would round twice (wrong ties) and turn
    # finite values beyond float32's range into inf before saturation could see them.
    x = x.double() if x.dtype == torch.float64 else x.float()
    finite = torch.isfinite(x)
    if not f.has_nan and not bool(finite.all()):
        fail("x", f"finite values ({f.name} has no inf or NaN; block formats carry them in the scale)",
             "a tensor containing inf or NaN")
    if f.kind is Kind.EXPONENT and bool((x <= 0).any()):
        fail("x", "positive values (e8m0 has no sign and no zero)", "a tensor with values <= 0")
    if stochastic:
        if rand is None:
            rand = torch.rand(x.shape, generator=generator, device=x.device)
        elif not isinstance(rand, torch.Tensor) or rand.shape != x.shape or rand.dtype != torch.float32:
            fail("rand", f"a float32 tensor of shape {tuple(x.shape)}", describe(rand),
                 ValueError if isinstance(rand, torch.Tensor) else TypeError)
    y = round_unchecked(x, f, rand if stochastic else None, saturate=saturate)
    if not saturate and not f.has_nan and bool(torch.isnan(y).any()):  # x is finite here: NaN = overflow
        fail("x", f"values within [{f.lowest}, {f.max}] ({f.name} has no inf or NaN to overflow to)",
             "values beyond it with saturate=False")
    return y


def round_unchecked(x: torch.Tensor, fmt: str | Format, rand: torch.Tensor | None = None,
                    saturate: bool = True) -> torch.Tensor:
    """:func:`round_to` without argument checks and without host synchronisation (no data-dependent
    branch), for callers that guarantee a float32/float64 ``x``, finite wherever ``fmt`` has no NaN, and
    positive for e8m0: ``lowprec.quant`` and the kernels. ``rand`` given: stochastic rounding.
    Without ``saturate``, overflow goes to inf or NaN (NaN where the format has neither)."""
    f = get(fmt)
    if rand is None and saturate and f.kind is Kind.FLOAT and f.torch_dtype is not None and f.bits <= 16 \
            and x.dtype == torch.float32:
        return _round_native(x, f)
    return _round_formula(x, f, rand, saturate)


def _round_native(x: torch.Tensor, f: Format) -> torch.Tensor:
    """Round-to-nearest-even by torch's own cast (one kernel instead of a dozen), after the clamp that
    makes it saturate and the rule that keeps non-finite values non-finite. Tested bit for bit
    against :func:`_round_formula` on every tie and binade edge."""
    nonfinite = x if f.has_inf else torch.copysign(torch.full_like(x, math.nan), x)
    y = x.clamp(f.lowest, f.max).to(f.torch_dtype).float()
    return torch.where(torch.isfinite(x), y, nonfinite)


def _round_formula(x: torch.Tensor, f: Format, rand: torch.Tensor | None, saturate: bool) -> torch.Tensor:
    finite = torch.isfinite(x)
    a = torch.where(finite, x.abs(), 0.0)
    q = _quantum(a, f)
    t = a / q  # exact: q is a power of two
    if rand is None:
        r = torch.round(t)  # half to even
    else:
        low = torch.floor(t)
        r = low + (rand.to(x.device) < (t - low)).to(t.dtype)
    y = r * q
    if f.kind is Kind.EXPONENT:  # no zero: values below 2^-127 round to it
        y = y.clamp_min(f.min_subnormal)
    y = torch.copysign(y, x) if f.signed else y
    over = finite & ((y > f.max) | (y < f.lowest))
    if saturate:
        y = torch.where(over, torch.where(y > 0, f.max, f.lowest), y)
    else:
        y = torch.where(over, torch.copysign(torch.full_like(y, math.inf if f.has_inf else math.nan), x), y)
    # NaN keeps x's sign, so encode gives -inf and -NaN the negative NaN code
    y = torch.where(finite, y, x if f.has_inf else torch.copysign(torch.full_like(x, math.nan), x))
    return y.float()


# --------------------------------------------------------------------------------------------
# bit codes


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


# --------------------------------------------------------------------------------------------
# packing: FP4 two codes per byte (low nibble first, as torch.float4_e2m1fn_x2);
# FP6 four codes in three bytes (code i in bits 6i..6i+5 of a little-endian 24-bit word).


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
