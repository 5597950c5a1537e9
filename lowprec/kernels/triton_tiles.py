"""The Triton quantization kernels: a pass that reduces amaxes, and a pass that casts.

[Note: tiles and sides]
Both kernels walk the 2-D view ``x (M, K)`` in tiles of ``BM x BK`` and read each tile once. From
that tile they serve up to two *sides*: side A quantizes ``x`` along K (row-major output), side B
quantizes ``x.T`` along M (its output is written transposed, as the weight-gradient GEMM wants it).
Each side has its own format, granularity, rounding and optional Hadamard transform, so one read of
``x`` gives both casts a linear layer needs. A side's scale comes from one of:

=============  ======================================================================  ==========
mode           scale                                                                   passes
=============  ======================================================================  ==========
LOCAL          blocks that fit in the tile (1x128, 128x128, MX-32, NVFP4-16, ...)      one (NVFP4:
                                                                                       two, global)
TENSOR         one amax, reduced beforehand by ``amax_kernel``                         two
LINES          one amax per line along the side's reduction dimension (row-wise)        two
GIVEN          a known scale (delayed scaling); the cast can record the new amax       one
=============  ======================================================================  ==========

A LOCAL side with MX blocks may also be *folded* (``FOLD``): its codes, once cast, are moved onto one
power-of-two scale per line, as ``lowprec.kernels.fold`` folds an MX operand, and the side writes those
FP8 codes with one scale per line instead of the MX codes and block scales (see [Note: folding MX blocks
into rows]). A line's scale follows from its largest finite block amax (the block scale is monotone in
it), which the amax pass reduces first (``AMAX_FOLD``): two passes, and no second pass over the codes.

Block shapes are given in ``x``'s coordinates (side B's ``br x bc`` blocks of ``x.T`` are ``bc x br``
blocks of ``x``). Padding follows ``lowprec.quant``: each side's output covers its blocks, and the
padded region holds zero codes.
"""
from __future__ import annotations

import triton
import triton.language as tl

from lowprec.kernels.triton_numerics import (
    F32_MAX,
    abs_bits,
    bf16_value,
    decode_codes,
    e2m1_codes,
    exp2i,
    exponent_of,
    fold_factor,
    folded_value,
    nvfp4_encode,
    nvfp4_global_encode,
    round_to_dtype,
    scale_from_amax,
    to_codes,
)

MODE_LOCAL, MODE_TENSOR, MODE_LINES, MODE_GIVEN = 0, 1, 2, 3
ROUND_NEAREST, ROUND_RAND, ROUND_PHILOX = 0, 1, 2
AMAX_NONE, AMAX_TENSOR, AMAX_LINES, AMAX_FINITE_BLOCKS, AMAX_FOLD = 0, 1, 2, 3, 4


@triton.jit
def load_tile(x_ptr, sxm, sxk, M, K, BM: tl.constexpr, BK: tl.constexpr, EVEN: tl.constexpr):
    """This program's tile of x; ``EVEN``: the tiles cover x exactly, so no masks."""
    pid_m = tl.program_id(0)
    pid_k = tl.program_id(1)
    offs_m = pid_m * BM + tl.arange(0, BM)
    offs_k = pid_k * BK + tl.arange(0, BK)
    ptrs = x_ptr + offs_m[:, None].to(tl.int64) * sxm + offs_k[None, :] * sxk  # int64: past 2^31 elements
    if EVEN:
        x = tl.load(ptrs)
    else:
        x = tl.load(ptrs, mask=(offs_m[:, None] < M) & (offs_k[None, :] < K), other=0.0)
    return x, pid_m, pid_k, offs_m, offs_k


@triton.jit
def to_f32(x):
    """x as float32, exactly: bf16 by its bits, since Triton's interpreter flushes bf16 subnormals."""
    if x.dtype == tl.bfloat16:
        v = bf16_value(x.to(tl.int16, bitcast=True))
    else:
        v = x.to(tl.float32)
    return v


@triton.jit
def _dot16(t, h, DT: tl.constexpr):
    if DT == tl.bfloat16:  # bf16 values and +-1/4 are exact in tf32: tensor cores, FP32 accumulation
        out = tl.dot(t, h, input_precision="tf32")
    else:
        out = tl.dot(t, h, input_precision="ieee")
    return out


@triton.jit
def _transform(v, h_ptr, DT: tl.constexpr, HAD: tl.constexpr, TRANS: tl.constexpr,
               BM: tl.constexpr, BK: tl.constexpr):
    """The values a side quantizes: the tile, Hadamard-transformed along the side's reduction
    dimension and rounded back to x's dtype (as ``lowprec.quant.hadamard`` returns it)."""
    if HAD:
        ho = tl.arange(0, 16)
        h = tl.load(h_ptr + ho[:, None] * 16 + ho[None, :])  # (16, 16) = D H / 4
        if TRANS:
            t = tl.reshape(tl.trans(v), (BK * BM // 16, 16))
            v = tl.trans(tl.reshape(_dot16(t, h, DT), (BK, BM)))
        else:
            t = tl.reshape(v, (BM * BK // 16, 16))
            v = tl.reshape(_dot16(t, h, DT), (BM, BK))
        v = round_to_dtype(v, DT)
    return v


@triton.jit
def _block_max(bits, BM: tl.constexpr, BK: tl.constexpr, BR: tl.constexpr, BC: tl.constexpr):
    """(BM // BR, BK // BC) maxima of int32 ``bits`` over ``BR x BC`` blocks."""
    if BR == 1:
        out = tl.max(tl.reshape(bits, (BM, BK // BC, BC)), axis=2)
    elif BC == 1:
        out = tl.max(tl.reshape(bits, (BM // BR, BR, BK)), axis=1)
    else:
        out = tl.max(tl.max(tl.reshape(bits, (BM // BR, BR, BK // BC, BC)), axis=3), axis=1)
    return out


@triton.jit
def _expand(s, BM: tl.constexpr, BK: tl.constexpr, BR: tl.constexpr, BC: tl.constexpr):
    """Per-block values ``(BM // BR, BK // BC)`` -> per element ``(BM, BK)``."""
    if BR == 1:
        out = tl.reshape(tl.broadcast_to(s[:, :, None], (BM, BK // BC, BC)), (BM, BK))
    elif BC == 1:
        out = tl.reshape(tl.broadcast_to(s[:, None, :], (BM // BR, BR, BK)), (BM, BK))
    else:
        out = tl.reshape(tl.broadcast_to(s[:, None, :, None], (BM // BR, BR, BK // BC, BC)), (BM, BK))
    return out


@triton.jit
def _side_amax(v, offs_m, offs_k, M, K, amax_ptr, KIND: tl.constexpr, TRANS: tl.constexpr,
               BM: tl.constexpr, BK: tl.constexpr, BR: tl.constexpr, BC: tl.constexpr):
    bits = abs_bits(v)
    if KIND == 1:
        tl.atomic_max(amax_ptr, tl.max(tl.max(bits, axis=1), axis=0))
    elif KIND == 2:
        if TRANS:
            tl.atomic_max(amax_ptr + offs_k, tl.max(bits, axis=0), mask=offs_k < K)
        else:
            tl.atomic_max(amax_ptr + offs_m, tl.max(bits, axis=1), mask=offs_m < M)
    elif KIND == 3:  # NVFP4's global amax: the largest finite block amax
        blk = _block_max(bits, BM, BK, BR, BC)
        blk = tl.where(blk < 0x7F800000, blk, 0)
        tl.atomic_max(amax_ptr, tl.max(tl.max(blk, axis=1), axis=0))
    elif KIND == 4:  # a folded side: per line, its largest finite block amax's bits plus one (0: none finite)
        blk = _block_max(bits, BM, BK, BR, BC)
        if TRANS:  # blocks of BR x 1 along m: each column of the tile one line of x.T; blocks past M are no blocks
            starts = tl.program_id(0) * BM + tl.arange(0, BM // BR) * BR
            blk = tl.where((blk < 0x7F800000) & (starts[:, None] < M), blk + 1, 0)
            tl.atomic_max(amax_ptr + offs_k, tl.max(blk, axis=0), mask=offs_k < K)
        else:
            starts = tl.program_id(1) * BK + tl.arange(0, BK // BC) * BC
            blk = tl.where((blk < 0x7F800000) & (starts[None, :] < K), blk + 1, 0)
            tl.atomic_max(amax_ptr + offs_m, tl.max(blk, axis=1), mask=offs_m < M)


@triton.jit
def amax_kernel(x_ptr, sxm, sxk, M, K, h_ptr, amax_a, amax_b,
                BM: tl.constexpr, BK: tl.constexpr, EVEN: tl.constexpr,
                KIND_A: tl.constexpr, HAD_A: tl.constexpr, BR_A: tl.constexpr, BC_A: tl.constexpr,
                KIND_B: tl.constexpr, HAD_B: tl.constexpr, BR_B: tl.constexpr, BC_B: tl.constexpr):
    """Atomic maxima of ``|x|`` bits into int32 buffers (zero-initialized), per side."""
    x, pid_m, pid_k, offs_m, offs_k = load_tile(x_ptr, sxm, sxk, M, K, BM, BK, EVEN)
    v = to_f32(x)
    if KIND_A != 0:
        va = _transform(v, h_ptr, x.dtype, HAD_A, False, BM, BK)
        _side_amax(va, offs_m, offs_k, M, K, amax_a, KIND_A, False, BM, BK, BR_A, BC_A)
    if KIND_B != 0:
        vb = _transform(v, h_ptr, x.dtype, HAD_B, True, BM, BK)
        _side_amax(vb, offs_m, offs_k, M, K, amax_b, KIND_B, True, BM, BK, BR_B, BC_B)


@triton.jit
def divisor_of(eff):
    """(divisor, its reciprocal rounded to nearest, dead, in_range) for effective scales: NaN, inf
    and zero scales mark dead blocks, whose data is zero; ``in_range`` says whether every divisor
    lies in [2^-100, 2^100], where the reciprocal is a normal number (see ``divide``)."""
    eb = abs_bits(eff)
    dead = (eb >= 0x7F800000) | (eb == 0)
    d = tl.where(dead, 1.0, eff)
    db = abs_bits(d)
    in_range = (tl.min(db) >= 0x0D800000) & (tl.max(db) <= 0x71800000)  # 2^-100 .. 2^100
    return d, tl.math.div_rn(1.0, d), dead, in_range


@triton.jit
def divide(v, d, r, in_range, KIND: tl.constexpr):
    """``v / d`` rounded to nearest, given ``r = RN(1/d)``.

    KIND 0: powers of two, a product (exact); also NVFP4, whose ``r`` is its encode scale and whose
    rule is this product (see [Note: NVFP4's order of operations] in ``lowprec.quant.scales``).
    KIND 1: Markstein's correction, one exact FMA residual and one FMA update, correctly rounded
    when ``r`` is normal and the quotient is above FP32's subnormals (which round to zero in every
    target format anyway); amax scales always qualify.
    KIND 2: scales of any size (given): the same where the whole tile's divisors are in range,
    else a full division. A quotient that overflows keeps its inf, and a zero one its sign, as the
    division would."""
    if KIND == 0:
        out = v * r
    else:
        q = v * r
        out = tl.fma(tl.fma(-q, d, v), r, q)
        # an infinite quotient keeps its inf, a zero one its sign (the FMAs give -0 / d as +0)
        out = tl.where((abs_bits(q) == 0x7F800000) | (q == 0), q, out)
        if KIND == 2:
            if not in_range:
                out = tl.math.div_rn(v, d)
    return out


@triton.jit
def _side_scale(v, pid_m, pid_k, offs_m, offs_k, M, K, amax_ptr, given_ptr, scale_ptr, g_ptr, s_rows, s_cols,
                MODE: tl.constexpr, RULE: tl.constexpr, FMAX: tl.constexpr, EMAX: tl.constexpr,
                TRANS: tl.constexpr, BM: tl.constexpr, BK: tl.constexpr, BR: tl.constexpr, BC: tl.constexpr,
                STORE: tl.constexpr):
    """(divisor, reciprocal, dead, in_range), broadcastable to the tile, and the scales as found (per block,
    per line or once, never per element); stores the side's scales (and NVFP4's global scale) unless
    ``STORE`` is off (a folded side stores its lines' scales itself)."""
    first = (pid_m == 0) & (pid_k == 0)
    if MODE == 0:
        big = 1.0
        g = 1.0
        if RULE == 3:  # NVFP4: global encode and decode scales, as lowprec.quant.scales computes them
            big = nvfp4_global_encode(tl.load(amax_ptr), FMAX)
            g = tl.math.div_rn(1.0, big)
            if first:
                tl.store(g_ptr, g)
        elif RULE == 4:  # NVFP4, a global amax given per block row of x (in x's coordinates on either side)
            lines = pid_m * (BM // BR) + tl.arange(0, BM // BR)
            n_lines = s_cols if TRANS else s_rows  # side B stores its scales transposed
            big = nvfp4_global_encode(tl.load(amax_ptr + lines, mask=lines < n_lines, other=0), FMAX)[:, None]
            g = tl.math.div_rn(1.0, big)  # (BM // BR, 1)
            if pid_k == 0:
                tl.store(g_ptr + lines[:, None], g, mask=lines[:, None] < n_lines)
        s = scale_from_amax(_block_max(abs_bits(v), BM, BK, BR, BC), big, RULE, FMAX, EMAX)  # (BM/BR, BK/BC)
        bi = pid_m * (BM // BR) + tl.arange(0, BM // BR)
        bj = pid_k * (BK // BC) + tl.arange(0, BK // BC)
        if not STORE:
            pass
        elif TRANS:
            tl.store(scale_ptr + bj[None, :] * s_cols + bi[:, None], s,
                     mask=(bj[None, :] < s_rows) & (bi[:, None] < s_cols))
        else:
            tl.store(scale_ptr + bi[:, None] * s_cols + bj[None, :], s,
                     mask=(bi[:, None] < s_rows) & (bj[None, :] < s_cols))
        if RULE >= 3:  # NVFP4: elements are multiplied by the encode scale (divide's KIND 0), never divided
            r = nvfp4_encode(s, g)
            d, dead, ok = r, s != s, True
        else:
            d, r, dead, ok = divisor_of(s)
        d = _expand(d, BM, BK, BR, BC)
        r = _expand(r, BM, BK, BR, BC)
        dead = _expand(dead, BM, BK, BR, BC)
        found = s
    elif MODE == 1:
        s = scale_from_amax(tl.load(amax_ptr), 1.0, RULE, FMAX, EMAX)
        if first:
            tl.store(scale_ptr, s)
        d, r, dead, ok = divisor_of(tl.zeros((1, 1), tl.float32) + s)
        found = s
    elif MODE == 2:
        if TRANS:
            s = scale_from_amax(tl.load(amax_ptr + offs_k, mask=offs_k < K, other=0), 1.0, RULE, FMAX, EMAX)
            if pid_m == 0:
                tl.store(scale_ptr + offs_k, s, mask=offs_k < K)
            d, r, dead, ok = divisor_of(s[None, :])
            found = s
        else:
            s = scale_from_amax(tl.load(amax_ptr + offs_m, mask=offs_m < M, other=0), 1.0, RULE, FMAX, EMAX)
            if pid_k == 0:
                tl.store(scale_ptr + offs_m, s, mask=offs_m < M)
            d, r, dead, ok = divisor_of(s[:, None])
            found = s
    else:
        found = tl.load(given_ptr)
        d, r, dead, ok = divisor_of(tl.zeros((1, 1), tl.float32) + found)
    return d, r, dead, ok, found


@triton.jit
def hw_fp8(scaled, nan_sign, EXP: tl.constexpr, FIX: tl.constexpr):
    """FP8 codes by the GPU's conversion (round to nearest even, saturating: the reference's rule
    for finite values). With ``FIX``, inf and NaN get the reference's codes (satfinite would clamp inf)."""
    if EXP == 4:
        c = scaled.to(tl.float8e4nv).to(tl.uint8, bitcast=True).to(tl.int32)
    else:
        c = scaled.to(tl.float8e5).to(tl.uint8, bitcast=True).to(tl.int32)
    if FIX:
        ab = abs_bits(scaled)
        sign = (scaled.to(tl.int32, bitcast=True) >> 31) & 1
        if EXP == 4:
            special = tl.where(ab > 0x7F800000, nan_sign, sign) * 128 + 0x7F
        else:
            special = tl.where(ab > 0x7F800000, nan_sign * 128 + 0x7F, sign * 128 + 0x7C)
        c = tl.where(ab >= 0x7F800000, special, c)
    return c


@triton.jit
def _philox_uniforms(seed, offs_m, offs_k, M, K, TRANS: tl.constexpr, BM: tl.constexpr, BK: tl.constexpr):
    """(BM, BK) uniforms in [0, 1) for a side's stochastic rounding, one Philox draw per four
    neighbours along the side's rows: element ``(r, c)`` of the side's view (x, or x.T for side B)
    takes one of the four outputs of Philox(seed, r * ceil(cols / 4) + c // 4), each neighbour its
    own. A draw yields four numbers, so this costs a quarter of one draw per element."""
    if TRANS:  # rows of x.T run along k, its columns along m: groups of four along the tile's dim 0
        q = tl.arange(0, BM // 4) + tl.program_id(0) * (BM // 4)
        ctr = offs_k[None, :] * tl.cdiv(M, 4) + q[:, None]  # (BM/4, BK)
        r0, r1, r2, r3 = tl.rand4x(seed, ctr)
        u = tl.join(tl.join(r0, r1), tl.join(r2, r3))  # (BM/4, BK, 2, 2): lanes 0..3 take r0, r2, r1, r3
        u = tl.reshape(tl.permute(u, (0, 2, 3, 1)), (BM, BK))
    else:
        q = tl.arange(0, BK // 4) + tl.program_id(1) * (BK // 4)
        ctr = offs_m[:, None] * tl.cdiv(K, 4) + q[None, :]  # (BM, BK/4)
        r0, r1, r2, r3 = tl.rand4x(seed, ctr)
        u = tl.reshape(tl.join(tl.join(r0, r1), tl.join(r2, r3)), (BM, BK))
    return u


@triton.jit
def _side_codes(x, v, pid_m, pid_k, offs_m, offs_k, M, K, h_ptr, amax_ptr, given_ptr, rand_ptr, seed_ptr,
                scale_ptr, s_rows, s_cols, g_ptr,
                EXP: tl.constexpr, MAN: tl.constexpr, SPECIAL: tl.constexpr, FMAX: tl.constexpr,
                EMAX: tl.constexpr, MODE: tl.constexpr, RULE: tl.constexpr, BR: tl.constexpr,
                BC: tl.constexpr, ROUND: tl.constexpr, HAD: tl.constexpr, SAT: tl.constexpr,
                FOLD: tl.constexpr, T_EXP: tl.constexpr, T_MAN: tl.constexpr, T_SPECIAL: tl.constexpr,
                H: tl.constexpr, NAN_E: tl.constexpr, MIN_D: tl.constexpr,
                TRANS: tl.constexpr, HW: tl.constexpr, BM: tl.constexpr, BK: tl.constexpr):
    """uint8 codes of one side's tile, in x's coordinates; the side's scales stored on the way. A folded
    side (``FOLD``) writes its codes folded onto one scale per line (``amax_ptr``: the lines' fold amaxes)."""
    v = _transform(v, h_ptr, x.dtype, HAD, TRANS, BM, BK)
    d, r, dead, ok, found = _side_scale(v, pid_m, pid_k, offs_m, offs_k, M, K, amax_ptr, given_ptr, scale_ptr,
                                        g_ptr, s_rows, s_cols, MODE, RULE, FMAX, EMAX, TRANS, BM, BK, BR, BC, not FOLD)
    if RULE >= 1:
        scaled = divide(v, d, r, ok, 0)
    elif MODE == 3:
        scaled = divide(v, d, r, ok, 2)
    else:
        scaled = divide(v, d, r, ok, 1)
    if RULE >= 3:  # NVFP4: a block whose E4M3 scale underflowed to 0 (r = FP32 max): TE clamps its x * r
        scaled = tl.where(r == F32_MAX, tl.minimum(tl.maximum(scaled, -FMAX), FMAX), scaled)
    nan_sign = (v.to(tl.int32, bitcast=True) >> 31) & 1  # a NaN keeps the input's sign
    if FOLD:
        factor = _expand(_fold_factors(found, pid_m, pid_k, offs_m, offs_k, M, K, amax_ptr, scale_ptr, FMAX, EMAX,
                                       RULE, H, NAN_E, MIN_D, TRANS), BM, BK, BR, BC)
    if FOLD and HW and (MAN + EXP == 7) and SAT and ROUND == 0:
        # the element's value by the GPU's conversions, there and back; a dead block's factor is NaN
        if EXP == 4:
            x = folded_value(scaled.to(tl.float8e4nv).to(tl.float32), factor)
        else:
            x = folded_value(scaled.to(tl.float8e5).to(tl.float32), factor)
        codes = hw_fp8(x, 0, T_EXP, False)  # on the grid or onto its subnormal step, never past its max
    elif HW and (MAN + EXP == 7) and SAT and ROUND == 0:
        codes = hw_fp8(scaled, nan_sign, EXP, MODE == 3)
    else:
        # Linear index in the side's own 2-D view: the reference's rand has that view's shape.
        if TRANS:
            lin = offs_k[None, :] * M + offs_m[:, None]
            in_view = (offs_k[None, :] < K) & (offs_m[:, None] < M)
        else:
            lin = offs_m[:, None] * K + offs_k[None, :]
            in_view = (offs_m[:, None] < M) & (offs_k[None, :] < K)
        if ROUND == 1:
            rnd = tl.load(rand_ptr + lin, mask=in_view, other=0.0)
        elif ROUND == 2:
            rnd = _philox_uniforms(tl.load(seed_ptr), offs_m, offs_k, M, K, TRANS, BM, BK)
        else:
            rnd = scaled
        if (EXP == 2) & (MAN == 1):
            codes = e2m1_codes(scaled, rnd, ROUND != 0)
        else:
            codes = to_codes(scaled, nan_sign, rnd, EXP, MAN, SPECIAL, SAT, ROUND != 0)
    if FOLD and not (HW and (MAN + EXP == 7) and SAT and ROUND == 0):
        x = folded_value(decode_codes(tl.where(dead, 0, codes), EXP, MAN), factor)
        if HW and (T_EXP + T_MAN == 7):
            codes = hw_fp8(x, 0, T_EXP, False)
        else:
            codes = to_codes(x, (x.to(tl.int32, bitcast=True) >> 31) & 1, 0.0, T_EXP, T_MAN, T_SPECIAL, False, False)
    elif not FOLD:
        codes = tl.where(dead, 0, codes)
    return codes.to(tl.uint8)


@triton.jit
def _fold_factors(blocks, pid_m, pid_k, offs_m, offs_k, M, K, line_ptr, scale_ptr, FMAX: tl.constexpr,
                  EMAX: tl.constexpr, RULE: tl.constexpr, H: tl.constexpr, NAN_E: tl.constexpr, MIN_D: tl.constexpr,
                  TRANS: tl.constexpr):
    """A folded side's per-block factors (see [Note: tiles and sides]): what each MX block of scales
    ``blocks`` multiplies its element values by to move them onto its line's scale ``2^r``; stores ``2^r`` per
    line. ``r`` is the line's largest block exponent less ``H``, from the amax pass's largest finite block
    amax (plus one; 0: no finite block, and ``r = 0``), as ``lowprec.kernels.fold.fold_reference`` finds it
    from the block scales (the scale is monotone in the amax)."""
    if TRANS:  # lines along k; blocks (BM / BR, BK)
        line = tl.load(line_ptr + offs_k, mask=offs_k < K, other=0)[None, :]
    else:  # lines along m; blocks (BM, BK / BC)
        line = tl.load(line_ptr + offs_m, mask=offs_m < M, other=0)[:, None]
    top = exponent_of(scale_from_amax(tl.maximum(line - 1, 0), 1.0, RULE, FMAX, EMAX), NAN_E)
    r = tl.where(line == 0, 0, top - H)
    if TRANS:
        if pid_m == 0:
            tl.store(scale_ptr + offs_k[None, :], exp2i(r), mask=offs_k[None, :] < K)
    else:
        if pid_k == 0:
            tl.store(scale_ptr + offs_m[:, None], exp2i(r), mask=offs_m[:, None] < M)
    return fold_factor(exponent_of(blocks, NAN_E), r, NAN_E, MIN_D)


@triton.jit
def _store(codes, offs_m, offs_k, out_ptr, o_rows, o_cols, TRANS: tl.constexpr, EVEN: tl.constexpr):
    """Codes to the side's output; with ``EVEN`` the output is x's shape (or x.T's): no masks."""
    if TRANS:  # side B's output is x.T: rows along k
        ptrs = out_ptr + offs_k[:, None] * o_cols + offs_m[None, :]
        if EVEN:
            tl.store(ptrs, tl.trans(codes))
        else:
            tl.store(ptrs, tl.trans(codes), mask=(offs_k[:, None] < o_rows) & (offs_m[None, :] < o_cols))
    else:
        ptrs = out_ptr + offs_m[:, None] * o_cols + offs_k[None, :]
        if EVEN:
            tl.store(ptrs, codes)
        else:
            tl.store(ptrs, codes, mask=(offs_m[:, None] < o_rows) & (offs_k[None, :] < o_cols))


@triton.jit
def cast_kernel(
    x_ptr, sxm, sxk, M, K, h_ptr, given_ptr, seed_ptr, record_ptr,
    amax_a, rand_a, out_a, o_rows_a, o_cols_a, scale_a, s_rows_a, s_cols_a, g_a,
    amax_b, rand_b, out_b, o_rows_b, o_cols_b, scale_b, s_rows_b, s_cols_b, g_b,
    BM: tl.constexpr, BK: tl.constexpr, EVEN: tl.constexpr, RECORD: tl.constexpr, HW: tl.constexpr,
    SHARE: tl.constexpr,
    ON_A: tl.constexpr, EXP_A: tl.constexpr, MAN_A: tl.constexpr, SPECIAL_A: tl.constexpr,
    FMAX_A: tl.constexpr, EMAX_A: tl.constexpr, MODE_A: tl.constexpr, RULE_A: tl.constexpr,
    BR_A: tl.constexpr, BC_A: tl.constexpr, ROUND_A: tl.constexpr, HAD_A: tl.constexpr, SAT_A: tl.constexpr,
    FOLD_A: tl.constexpr, T_EXP_A: tl.constexpr, T_MAN_A: tl.constexpr, T_SPECIAL_A: tl.constexpr, H_A: tl.constexpr,
    ON_B: tl.constexpr, EXP_B: tl.constexpr, MAN_B: tl.constexpr, SPECIAL_B: tl.constexpr,
    FMAX_B: tl.constexpr, EMAX_B: tl.constexpr, MODE_B: tl.constexpr, RULE_B: tl.constexpr,
    BR_B: tl.constexpr, BC_B: tl.constexpr, ROUND_B: tl.constexpr, HAD_B: tl.constexpr, SAT_B: tl.constexpr,
    FOLD_B: tl.constexpr, T_EXP_B: tl.constexpr, T_MAN_B: tl.constexpr, T_SPECIAL_B: tl.constexpr, H_B: tl.constexpr,
    NAN_E: tl.constexpr, MIN_D: tl.constexpr,
):
    """Quantize one tile for side A (x along K) and side B (x.T along M); see [Note: tiles and sides].
    ``SHARE``: side B is side A's cast transposed (one scale for the whole tensor), so its codes are
    A's; ``HW``: FP8 codes by the GPU's conversion instruction (never in the CPU interpreter)."""
    x, pid_m, pid_k, offs_m, offs_k = load_tile(x_ptr, sxm, sxk, M, K, BM, BK, EVEN)
    v = to_f32(x)
    if RECORD:  # delayed scaling: this tensor's amax, for the next step's scale
        tl.atomic_max(record_ptr, tl.max(tl.max(abs_bits(v), axis=1), axis=0))
    if ON_A:
        codes = _side_codes(x, v, pid_m, pid_k, offs_m, offs_k, M, K, h_ptr, amax_a, given_ptr, rand_a, seed_ptr,
                            scale_a, s_rows_a, s_cols_a, g_a, EXP_A, MAN_A, SPECIAL_A, FMAX_A, EMAX_A, MODE_A,
                            RULE_A, BR_A, BC_A, ROUND_A, HAD_A, SAT_A, FOLD_A, T_EXP_A, T_MAN_A, T_SPECIAL_A,
                            H_A, NAN_E, MIN_D, False, HW, BM, BK)
        _store(codes, offs_m, offs_k, out_a, o_rows_a, o_cols_a, False, EVEN)
    if ON_B:
        if not SHARE:
            codes = _side_codes(x, v, pid_m, pid_k, offs_m, offs_k, M, K, h_ptr, amax_b, given_ptr, rand_b,
                                seed_ptr + 1, scale_b, s_rows_b, s_cols_b, g_b, EXP_B, MAN_B, SPECIAL_B, FMAX_B,
                                EMAX_B, MODE_B, RULE_B, BR_B, BC_B, ROUND_B, HAD_B, SAT_B, FOLD_B, T_EXP_B,
                                T_MAN_B, T_SPECIAL_B, H_B, NAN_E, MIN_D, True, HW, BM, BK)
        _store(codes, offs_m, offs_k, out_b, o_rows_b, o_cols_b, True, EVEN)
