"""Triton device functions for exact rounding and scale rules, shared by the quantization kernels.

[Note: exact arithmetic in Triton]
The kernels must equal ``lowprec.quant.quantize`` bit for bit, on the GPU and in Triton's CPU
interpreter alike, so nothing here trusts a float conversion or an approximate instruction:

* rounding onto a format is done on integers: ``a = t * 2^(binade - man_bits)`` with ``t`` split into
  ``floor(t)`` and its exact fraction, then rounded half to even (or up when ``rand < frac``), and the
  bit code assembled from the binade and the rounded ``t``. FP8 data is stored as these codes (a uint8
  view of the float8 tensor), so no fp32 -> fp8 conversion runs (the interpreter gets those wrong
  where rounding carries into the next binade; it also truncates fp32 -> bf16);
* powers of two are built from their bits (:func:`exp2i`), so 2^-127 (an FP32 subnormal, the
  smallest E8M0 scale) is exact and never flushed to zero;
* division is ``div_rn`` (IEEE round-to-nearest); Triton's ``/`` on float32 may be approximate;
* maxima are taken on the int32 bits of ``|x|``: for non-negative floats integer order is float order
  and every NaN sorts above inf, so a NaN propagates where ``tl.max`` on floats would drop it.
"""
from __future__ import annotations

import triton
import triton.language as tl

# Format specials (see lowprec.formats.Special) and scale rules (lowprec.quant.ScaleRule), as ints.
SPECIAL_NONE, SPECIAL_FN, SPECIAL_IEEE = 0, 1, 2
RULE_AMAX, RULE_FLOOR, RULE_CEIL, RULE_NVFP4 = 0, 1, 2, 3
RULE_NVFP4_LINES = 4
"""NVFP4 with a global amax per block row of x (the experts of a mixture cast together, each under its own
global scale), given to the cast; elsewhere the rule of :data:`RULE_NVFP4`."""

_F32_INF_BITS = tl.constexpr(0x7F800000)
_F32_NAN_BITS = tl.constexpr(0x7FC00000)  # torch.nan: the NaN every non-finite block's scale holds
_F32_TINY = tl.constexpr(1.1754943508222875e-38)  # 2^-126, FP32's smallest normal (quant.scales._TINY)
_E4M3_MAX = tl.constexpr(448.0)
F32_MAX = tl.constexpr(3.4028234663852886e38)  # FP32's largest finite, exactly


@triton.jit
def exp2i(e):
    """``2^e`` as float32 for int32 ``e`` in [-149, 127], exactly (subnormals included)."""
    normal = (e + 127) << 23
    sub = 1 << tl.minimum(tl.maximum(e + 149, 0), 30)  # e <= -127: a subnormal's single bit
    return tl.where(e >= -126, normal, sub).to(tl.float32, bitcast=True)


@triton.jit
def decode_codes(c, EXP: tl.constexpr, MAN: tl.constexpr):
    """float32 value of the (finite or NaN-free) codes ``c`` of a float format with a sign bit."""
    bias = (1 << (EXP - 1)) - 1
    ef = (c >> MAN) & ((1 << EXP) - 1)
    man = c & ((1 << MAN) - 1)
    sig = tl.where(ef > 0, man + (1 << MAN), man)
    mag = sig.to(tl.float32) * exp2i(tl.maximum(ef, 1) - bias - MAN)  # exact: few bits times 2^e
    # the sign set on the bits: Triton negates as 0 - x, which makes the code of -0 +0 on a GPU
    return (mag.to(tl.int32, bitcast=True) | (((c >> (EXP + MAN)) & 1) << 31)).to(tl.float32, bitcast=True)


@triton.jit
def exponent_of(s, NAN_E: tl.constexpr):
    """int32 ``log2`` of power-of-two float32 ``s`` (2^-127, FP32's one subnormal here, included); NaN ->
    ``NAN_E``."""
    biased = (s.to(tl.int32, bitcast=True) >> 23) & 0xFF
    e = tl.where(biased == 0, -127, biased - 127)
    return tl.where(s != s, NAN_E, e)


@triton.jit
def fold_factor(e, r, NAN_E: tl.constexpr, MIN_D: tl.constexpr):
    """What an MX block of scale exponent ``e`` multiplies its elements by to move them onto their row's
    scale ``2^r``: ``2^max(e - r, MIN_D)``, NaN where the block's scale is NaN (``e == NAN_E``); see [Note:
    folding MX blocks into rows] in ``lowprec.kernels.fold``."""
    return tl.where(e == NAN_E, float("nan"), exp2i(tl.maximum(e - r, MIN_D)))


@triton.jit
def folded_value(v, factor):
    """An MX element's exact value ``v`` times its block's :func:`fold_factor` (exact), every zero +0: the
    value to round onto the target's grid."""
    x = v * factor
    return tl.where(x == 0, 0.0, x)


@triton.jit
def bf16_value(bits):
    """float32 of BF16 codes (int16 bits), exactly: the interpreter flushes bf16 subnormals."""
    return ((bits.to(tl.int32) & 0xFFFF) << 16).to(tl.float32, bitcast=True)


@triton.jit
def half_even_up(fl, frac):
    """Whether ``fl + frac`` (``fl`` an int32 floor, ``frac`` its exact fraction) rounds up, half to even."""
    return (frac > 0.5) | ((frac == 0.5) & ((fl & 1) == 1))


@triton.jit
def bf16_bits(v):
    """int16 bits of float32 ``v`` rounded to nearest-even BF16, as torch's ``.to(torch.bfloat16)`` rounds
    finite values and infinities (a NaN becomes 0x7FC0; torch keeps the device's payload): on bits,
    since the interpreter's conversion truncates."""
    bits = v.to(tl.int32, bitcast=True)
    rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
    return tl.where(v != v, 0x7FC0, rounded).to(tl.int16)


@triton.jit
def abs_bits(v):
    """int32 bits of ``|v|`` (float32): ordered like the magnitudes, NaN above inf."""
    return v.to(tl.int32, bitcast=True) & 0x7FFFFFFF


@triton.jit
def grid_round(a, rnd, EMIN: tl.constexpr, MAN: tl.constexpr, STOCH: tl.constexpr):
    """Round finite ``a >= 0`` onto a grid of ``MAN`` mantissa bits with smallest binade ``EMIN``.

    Returns ``(binade, r)`` with the rounded value ``r * 2^(binade - MAN)``; ``r`` may reach
    ``2^(MAN+1)`` when rounding carries into the next binade. Nearest rounds half to even; stochastic
    rounds up exactly when ``rnd < frac`` (``lowprec.formats.round_to``'s rule)."""
    binade = tl.maximum((abs_bits(a) >> 23) - 127, EMIN)
    t = a * exp2i(MAN - binade)  # exact: a power of two, and t < 2^(MAN+1) is normal
    fl = t.to(tl.int32)  # floor, t >= 0
    frac = t - fl.to(tl.float32)  # exact
    if STOCH:
        up = rnd < frac
    else:
        up = half_even_up(fl, frac)
    return binade, fl + up.to(tl.int32)


@triton.jit
def to_codes(v, nan_sign, rnd, EXP: tl.constexpr, MAN: tl.constexpr, SPECIAL: tl.constexpr,
             SAT: tl.constexpr, STOCH: tl.constexpr):
    """Bit codes (int32, sign at bit EXP+MAN) of float32 ``v`` rounded onto a float format.

    ``nan_sign`` (0/1) is the sign a NaN result carries: the sign of the unscaled input, as the
    reference's CPU division keeps it. Overflow saturates with ``SAT``, else goes to inf (IEEE) or NaN
    (FN); inf becomes NaN where the format has no inf. Formats without NaN never see non-finite values
    (their callers zero non-finite blocks, or run the reference)."""
    BIAS = (1 << (EXP - 1)) - 1
    NAN_CODE = (1 << (EXP + MAN)) - 1
    INF_CODE = ((1 << EXP) - 1) << MAN
    if SPECIAL == 2:
        MAX_CODE = INF_CODE - 1
    elif SPECIAL == 1:
        MAX_CODE = NAN_CODE - 1
    else:
        MAX_CODE = NAN_CODE
    vb = v.to(tl.int32, bitcast=True)
    ab = vb & 0x7FFFFFFF
    is_nan = ab > 0x7F800000
    is_inf = ab == 0x7F800000
    a = tl.where(is_nan | is_inf, 0, ab).to(tl.float32, bitcast=True)
    binade, r = grid_round(a, rnd, 1 - BIAS, MAN, STOCH)
    mag = ((binade + BIAS - 1) << MAN) + r  # the code's magnitude bits; carries move up a binade
    if SAT:
        mag = tl.minimum(mag, MAX_CODE)
    elif SPECIAL == 2:
        mag = tl.where(mag > MAX_CODE, INF_CODE, mag)
    else:
        mag = tl.where(mag > MAX_CODE, NAN_CODE, mag)
    if SPECIAL == 2:
        mag = tl.where(is_inf, INF_CODE, mag)
    else:
        mag = tl.where(is_inf, NAN_CODE, mag)
    mag = tl.where(is_nan, NAN_CODE, mag)
    sign = tl.where(is_nan, nan_sign, (vb >> 31) & 1)
    return mag | (sign << (EXP + MAN))


@triton.jit
def e2m1_codes(v, rnd, STOCH: tl.constexpr):
    """E2M1 codes (int32) of finite float32 ``v``, saturating at 6: :func:`to_codes`'s result for
    E2M1, found by comparing ``|v|`` with the format's eight grid points instead of rounding on
    integers (a third of the instructions; FP4 has no conversion instruction before sm100).

    Nearest: the code is the number of rounding thresholds below ``|v|``, each tie going to the even
    code (``>`` where the lower neighbour's code is even, ``>=`` where the upper one's is). Stochastic:
    the floor's code is the number of grid points at or below ``|v|``, and it rounds up exactly when
    ``rnd`` is below the exact fraction of the step (to_codes's rule)."""
    a = tl.abs(v)
    if STOCH:
        fl = ((a >= 0.5).to(tl.int32) + (a >= 1.0).to(tl.int32) + (a >= 1.5).to(tl.int32)
              + (a >= 2.0).to(tl.int32) + (a >= 3.0).to(tl.int32) + (a >= 4.0).to(tl.int32)
              + (a >= 6.0).to(tl.int32))
        f = fl.to(tl.float32)
        lo = tl.where(fl < 4, f * 0.5, tl.where(fl < 6, f - 2.0, tl.where(fl == 6, 4.0, 6.0)))
        inv_step = tl.where(fl < 4, 2.0, tl.where(fl < 6, 1.0, 0.5))  # steps are 0.5, 1 and 2
        frac = (a - lo) * inv_step  # exact: a - lo is, and the step is a power of two
        mag = fl + ((rnd < frac) & (fl < 7)).to(tl.int32)
    else:
        mag = ((a > 0.25).to(tl.int32) + (a >= 0.75).to(tl.int32) + (a > 1.25).to(tl.int32)
               + (a >= 1.75).to(tl.int32) + (a > 2.5).to(tl.int32) + (a >= 3.5).to(tl.int32)
               + (a > 5.0).to(tl.int32))
    sign = (v.to(tl.int32, bitcast=True) >> 31) & 1
    return mag | (sign << 3)


@triton.jit
def round_e4m3(s):
    """Finite ``s >= 0`` rounded to nearest E4M3, saturating at 448, as float32 (an NVFP4 block scale)."""
    binade, r = grid_round(s, s, -6, 3, False)
    value = r.to(tl.float32) * exp2i(binade - 3)
    return tl.minimum(value, _E4M3_MAX)


@triton.jit
def round_to_dtype(v, DTYPE: tl.constexpr):
    """float32 ``v`` rounded to nearest-even bf16 / fp16 and back, on integers (see the module note)."""
    if DTYPE == tl.bfloat16:
        b = v.to(tl.int32, bitcast=True)
        rounded = (b + 0x7FFF + ((b >> 16) & 1)) & -65536  # 0xFFFF0000
        is_nan = (b & 0x7FFFFFFF) > 0x7F800000
        out = tl.where(is_nan, b, rounded).to(tl.float32, bitcast=True)
    elif DTYPE == tl.float16:
        vb = v.to(tl.int32, bitcast=True)
        ab = vb & 0x7FFFFFFF
        finite = ab < 0x7F800000
        a = tl.where(finite, ab, 0).to(tl.float32, bitcast=True)
        binade, r = grid_round(a, a, -14, 10, False)
        mag = r.to(tl.float32) * exp2i(binade - 10)
        mag = tl.where(mag > 65504.0, float("inf"), mag)
        signed = (mag.to(tl.int32, bitcast=True) | (vb & -2147483648)).to(tl.float32, bitcast=True)
        out = tl.where(finite, signed, v)
    else:
        out = v
    return out


@triton.jit
def scale_from_amax(amax_bits, big, RULE: tl.constexpr, FMAX: tl.constexpr, EMAX: tl.constexpr):
    """Dequantizing float32 scale of a block from the int32 bits of its amax (``lowprec.quant.scales``):
    NaN for a block holding inf or NaN. ``big`` is NVFP4's global encode scale (unused by other rules)."""
    finite = amax_bits < _F32_INF_BITS
    amax = tl.where(finite, amax_bits, 0).to(tl.float32, bitcast=True)
    if RULE == 0:
        s = tl.where(amax > 0, tl.maximum(tl.math.div_rn(amax, FMAX), _F32_TINY), 1.0)
    elif RULE == 1:
        e = (amax_bits >> 23) - 127 - EMAX  # floor(log2(amax)) - emax; subnormal amax clamps below
        e = tl.where(finite & (amax > 0), e, -127)
        s = exp2i(tl.minimum(tl.maximum(e, -127), 127))
    elif RULE == 2:
        ratio = tl.math.div_rn(amax, FMAX)
        rb = ratio.to(tl.int32, bitcast=True)
        ef = rb >> 23
        mant = rb & 0x7FFFFF
        # ceil(log2(ratio)): exact powers of two keep their exponent; a subnormal ratio is above
        # 2^-127 exactly when its mantissa exceeds 2^22 (and the result clamps to -127 anyway).
        e = tl.where(ef > 0, ef - 127 + (mant != 0).to(tl.int32), tl.where(mant > 0x400000, -126, -127))
        e = tl.where(finite & (ratio > 0), e, -127)
        s = exp2i(tl.minimum(tl.maximum(e, -127), 127))
    else:  # NVFP4, TE's order: the multiplier big * fp32(1 / fmax) rounds, then the product (1 / FMAX, a
        # Python float, becomes an FP32 constant: one rounding of the exact reciprocal). Anything
        # beyond 448 saturates, so capping at 1e4 stands for TE's cap at FP32's max.
        s = round_e4m3(tl.minimum(amax * (big * (1.0 / FMAX)), 1e4))
    return tl.where(finite, s.to(tl.int32, bitcast=True), _F32_NAN_BITS).to(tl.float32, bitcast=True)


@triton.jit
def nvfp4_global_encode(amax_bits, FMAX: tl.constexpr):
    """NVFP4's FP32 global encode scale ``min(448 * fmax / amax, FP32 max)`` from the bits of the
    finite-block amax; 1 when 0 (``lowprec.quant.scales.nvfp4_global_scales``)."""
    amax = amax_bits.to(tl.float32, bitcast=True)
    big = tl.minimum(tl.math.div_rn(_E4M3_MAX * FMAX, tl.where(amax > 0, amax, 1.0)), F32_MAX)
    return tl.where(amax > 0, big, 1.0)


@triton.jit
def nvfp4_encode(s, g):
    """Per block, what NVFP4 multiplies elements by: ``min(1 / (s * g), FP32 max)`` for the E4M3
    scale ``s`` and global decode scale ``g``; FP32's max where ``s`` is 0 (or NaN: a dead block)."""
    dq = s * g
    live = dq > 0
    return tl.where(live, tl.minimum(tl.math.div_rn(1.0, tl.where(live, dq, 1.0)), F32_MAX), F32_MAX)
