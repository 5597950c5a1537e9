"""The Triton kernel of ``kernels.fold``: MX operands folded to one power-of-two scale per row, in one pass.

Each program takes ``BM`` rows: first their block scales, for each row's largest exponent, then their codes,
block by block, each decoded exactly to FP32, multiplied by its block's power of two and rounded onto the
target's grid on bits (``to_codes``: the interpreter's own float8 conversion misrounds where rounding carries
into the next binade). Bit for bit :func:`lowprec.kernels.fold.fold_reference`, NaN's sign aside (a NaN
block's elements are NaN codes of either sign on both sides).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from lowprec import formats as F
from lowprec.kernels import triton_launch as launch
from lowprec.kernels.triton_numerics import decode_codes, exponent_of, fold_factor, folded_value, to_codes
from lowprec.kernels.triton_plan import SPECIALS
from lowprec.kernels.triton_tiles import _expand
from lowprec.quant import QuantizedTensor, rowwise


@triton.jit
def fold_kernel(c_ptr, s_ptr, out_ptr, r_ptr, M, K, KB, SRC_EXP: tl.constexpr, SRC_MAN: tl.constexpr,
                NATIVE: tl.constexpr, T_EXP: tl.constexpr, T_MAN: tl.constexpr, T_SPECIAL: tl.constexpr,
                H: tl.constexpr, MIN_D: tl.constexpr, NAN_E: tl.constexpr, BC: tl.constexpr, BM: tl.constexpr,
                BKB: tl.constexpr, BK: tl.constexpr):
    """Rows ``pid * BM ...``: ``r`` (int32, their scales' exponent) and ``out`` (uint8 codes of the target).
    A NaN scale stands for exponent ``NAN_E``, below every real one (E8M0's smallest is -127)."""
    offs_m = tl.program_id(0) * BM + tl.arange(0, BM)
    rows = offs_m < M
    top = tl.full((BM,), NAN_E, tl.int32)
    for j0 in range(0, KB, BKB):
        sj = j0 + tl.arange(0, BKB)
        s = tl.load(s_ptr + offs_m[:, None].to(tl.int64) * KB + sj[None, :],
                    mask=rows[:, None] & (sj[None, :] < KB), other=float("nan"))
        top = tl.maximum(top, tl.max(exponent_of(s, NAN_E), axis=1))
    r = tl.where(top == NAN_E, 0, top - H)
    tl.store(r_ptr + offs_m, r, mask=rows)
    for k0 in range(0, K, BK):
        offs_k = k0 + tl.arange(0, BK)
        sj = k0 // BC + tl.arange(0, BKB)
        s = tl.load(s_ptr + offs_m[:, None].to(tl.int64) * KB + sj[None, :],
                    mask=rows[:, None] & (sj[None, :] < KB), other=1.0)
        factor = fold_factor(exponent_of(s, NAN_E), r[:, None], NAN_E, MIN_D)  # (BM, BKB)
        mask = rows[:, None] & (offs_k[None, :] < K)
        c = tl.load(c_ptr + offs_m[:, None].to(tl.int64) * K + offs_k[None, :], mask=mask, other=0)
        if NATIVE == 1:
            v = c.to(tl.float8e4nv, bitcast=True).to(tl.float32)
        elif NATIVE == 2:
            v = c.to(tl.float8e5, bitcast=True).to(tl.float32)
        else:
            v = decode_codes(c.to(tl.int32), SRC_EXP, SRC_MAN)
        x = folded_value(v, _expand(factor, BM, BK, 1, BC))
        sign = (x.to(tl.int32, bitcast=True) >> 31) & 1
        codes = to_codes(x, sign, 0.0, T_EXP, T_MAN, T_SPECIAL, False, False)
        tl.store(out_ptr + offs_m[:, None].to(tl.int64) * K + offs_k[None, :], codes.to(tl.uint8), mask=mask)


_NATIVE = {F.get("e4m3"): 1, F.get("e5m2"): 2}


def fold_triton(q: QuantizedTensor, tgt: F.Format, h: int, min_shift: int, nan_exponent: int,
                rows_per_program: int = 16) -> QuantizedTensor:
    """:func:`lowprec.kernels.fold.fold_reference` in one Triton pass (MX ``q``, checked by the caller, folded
    into ``tgt`` with headroom ``h``, shifts below ``min_shift`` clamped to it, a NaN scale's exponent
    taken as ``nan_exponent``)."""
    m, k = q.data.shape
    kb = q.scale.shape[1]
    bc = k // kb if kb else 32
    codes = torch.empty(m, k, dtype=torch.uint8, device=q.data.device)
    r = torch.empty(m, dtype=torch.int32, device=q.data.device)
    if m and k:
        data = q.data.view(torch.uint8) if q.data.element_size() == 1 else q.data
        bkb = max(1, 128 // bc)
        args = (data, q.scale.contiguous(), codes, r, m, k, kb)
        consts = dict(SRC_EXP=q.fmt.exp_bits, SRC_MAN=q.fmt.man_bits, NATIVE=_NATIVE.get(q.fmt, 0),
                      T_EXP=tgt.exp_bits, T_MAN=tgt.man_bits, T_SPECIAL=SPECIALS[tgt.special], H=h,
                      MIN_D=min_shift, NAN_E=nan_exponent, BC=bc, BM=rows_per_program, BKB=bkb, BK=bkb * bc)
        grid = (triton.cdiv(m, rows_per_program),)
        launch.launch(fold_kernel, grid, args, consts, ("fold", q.fmt.name, bc, rows_per_program),
                      q.data.device.type == "cuda")
    scale = torch.ldexp(torch.ones(m, 1, dtype=torch.float32, device=q.data.device), r[:, None])
    return QuantizedTensor(codes.view(tgt.torch_dtype), scale, tgt, rowwise(), q.shape, q.dtype)


__all__ = ["fold_triton"]
