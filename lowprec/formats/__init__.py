"""The element formats: one table, rounding onto a format, encoding to bit codes, packing.

``table`` says what each format is (bits, bias, largest value, inf/NaN rules) and looks one up by name;
``rounding`` rounds a tensor onto a format's grid; ``codes`` turns values on the grid into bit codes and
back; ``packing`` stores FP4/FP6 codes densely. Everything is exact in float32 (float64 where needed),
so the results are bit-exact on every device.
"""
from lowprec.formats.codes import codes_of, decode, decode_table, decode_unchecked, encode
from lowprec.formats.packing import pack, unpack
from lowprec.formats.rounding import (
    ROUNDINGS,
    Rounding,
    as_rounding,
    pow2,
    round_to,
    round_unchecked,
)
from lowprec.formats.rounding import _quantum as _quantum  # lowprec.quant.error_bound: the grid step at a value
from lowprec.formats.table import FORMATS, Format, Kind, Special, get

__all__ = [
    "FORMATS", "ROUNDINGS", "Format", "Kind", "Rounding", "Special", "as_rounding", "codes_of", "decode",
    "decode_table", "decode_unchecked", "encode", "get", "pack", "pow2", "round_to", "round_unchecked", "unpack",
]
