"""The table of element formats: what each format is, and :func:`get` to look one up by name.

[Note: what a format is]
A format is a set of numbers plus the bit codes that name them. Floating-point formats are
described by exponent bits, mantissa bits and a bias, and by how they spend their top codes:

* ``IEEE``  the all-ones exponent holds inf (mantissa 0) and NaN (fp32, tf32, bf16, fp16, e5m2);
* ``FN``    "finite": only the all-ones code S.1..1.1..1 is NaN, there is no inf (OCP e4m3, e8m0);
* ``NONE``  every code is a finite number, there is neither inf nor NaN (OCP FP6 and FP4).

``e8m0`` is an exponent alone (no sign, no mantissa, no zero): 2^-127 .. 2^127, 0xFF = NaN. It is
the scale format of the MX block formats. ``int8``/``int4`` are two's complement integers.
"""
from __future__ import annotations

import enum
import math
from dataclasses import dataclass

import torch

from lowprec._checks import describe, fail


class Kind(enum.Enum):
    FLOAT = "float"
    EXPONENT = "exponent"  # e8m0: a power of two, no sign, no zero
    INT = "int"


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

    def __reduce_ex__(self, protocol):
        # A table format pickles (and deep-copies) as its name, so it comes back as the table's own
        # object: code tells formats apart by identity (``fmt is E4M3``), as it does enum members.
        if FORMATS.get(self.name) is self:
            return get, (self.name,)
        return object.__reduce_ex__(self, protocol)


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
