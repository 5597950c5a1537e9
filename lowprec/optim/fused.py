"""AdamWLP's step in one pass: decode the moments, update them and the parameter, encode them again.

[Note: the fused AdamW step]
One program takes one block of 2048 values of a parameter (the 8-bit moments' block, so a block's
absmax is a reduction within the program): it reads the float32 parameter, its gradient and both
moments' codes (with the block's scales), and writes the parameter and the new codes and scales, where
the torch step (:func:`lowprec.optim.adamw_batch.adamw_math` between ``states.load`` and
``states.store``) makes about forty passes over float32 copies. It equals that step bit for bit, on
the GPU and in Triton's CPU interpreter, because the step is written as single IEEE operations that
every backend rounds alike (see [Note: the AdamW update] in ``lowprec.optim.adamw_batch``) and the
kernel runs them in the same order with contraction into FMAs off (``enable_fp_fusion=False``),
constants passed as float32 arguments (the 8-bit decode multiplies by 1/127 and 1/255, as
``states.int8_decode`` does: CUDA's torch turns a division by a number into that product),
division and square root correctly rounded (``div_rn``, ``sqrt_rn``), and the roundings onto BF16 and
onto integer codes done on bits and integers (the interpreter truncates float32 -> bf16). FP32, BF16
and 8-bit moments are covered; FP8 moments raise values to per-group powers, whose last bit differs
between math libraries, so they keep the torch step. Equality holds for finite values: a NaN's payload
and the code of an infinite moment are the device's (the step guard skips non-finite gradients).

One launch updates every parameter of one device, gradient dtype and step count, from a table of
their addresses (:data:`ROW`; see [Note: one launch for many tensors] in ``lowprec.kernels.triton_multi``).
"""
from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from lowprec.kernels.triton_multi import MAX_NUMEL, on, tables, tensor_at
from lowprec.kernels.triton_numerics import abs_bits, bf16_bits, bf16_value, half_even_up
from lowprec.optim.states import INT8_BLOCK, INV_INT8_LEVELS, INV_UINT8_LEVELS, Moment, StateFormat

FP32, BF16, INT8 = 0, 1, 2
_KIND = {StateFormat.FP32: FP32, StateFormat.BF16: BF16, StateFormat.INT8: INT8}
COVERED = frozenset(_KIND)
"""The moment formats the kernel takes."""
BLOCK = INT8_BLOCK
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
"""Triton's CPU interpreter runs the kernel (on CPU tensors): the tests' way to check it without a GPU."""


@triton.jit
def _round_half_even(q):
    """``torch.round`` of float32 ``|q| < 2^31``, as int32."""
    a = tl.abs(q)
    fl = a.to(tl.int32)  # floor of a >= 0
    r = fl + half_even_up(fl, a - fl.to(tl.float32)).to(tl.int32)  # the fraction is exact
    return tl.where(q < 0, -r, r)


@triton.jit
def _block_absmax(v):
    """The block's largest magnitude (NaN if any value is NaN), and 1.0 where it is 0."""
    a = tl.max(abs_bits(v), axis=0).to(tl.float32, bitcast=True)
    return a, tl.where(a > 0, a, 1.0)


ROW = 8
"""Entries of a parameter's row in a launch's table: the addresses of the parameter, its gradient, both
moments' codes and their block scales, its length and its first block's index among the launch's."""
_GRAD = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}


@triton.jit
def adamw_kernel(rows_ptr, owner_ptr, decay, beta1, omb1, beta2, omb2, inv_bc2, eps, step_size, inv127, inv255,
                 STATES: tl.constexpr, GRAD: tl.constexpr, BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    row = rows_ptr + tl.load(owner_ptr + pid).to(tl.int64) * 8  # ROW
    blk = pid - tl.load(row + 7).to(tl.int32)
    n = tl.load(row + 6)
    offs = blk * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    p_ptr = tensor_at(row, 0, tl.float32)
    if GRAD == 0:
        g_ptr = tensor_at(row, 1, tl.float32)
    elif GRAD == 1:
        g_ptr = tensor_at(row, 1, tl.bfloat16)
    else:
        g_ptr = tensor_at(row, 1, tl.float16)
    p = tl.load(p_ptr + offs, mask=mask, other=0.0)
    g = tl.load(g_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    if STATES == 1:
        m_ptr, v_ptr = tensor_at(row, 2, tl.int16), tensor_at(row, 4, tl.int16)
        m = bf16_value(tl.load(m_ptr + offs, mask=mask, other=0))
        v = bf16_value(tl.load(v_ptr + offs, mask=mask, other=0))
    elif STATES == 2:
        m_ptr, v_ptr = tensor_at(row, 2, tl.int8), tensor_at(row, 4, tl.uint8)
        ms_ptr, vs_ptr = tensor_at(row, 3, tl.float32), tensor_at(row, 5, tl.float32)
        m = tl.load(m_ptr + offs, mask=mask, other=0).to(tl.float32) * (tl.load(ms_ptr + blk) * inv127)
        t = tl.load(v_ptr + offs, mask=mask, other=0).to(tl.float32) * inv255
        v = (t * t) * tl.load(vs_ptr + blk)
    else:
        m_ptr, v_ptr = tensor_at(row, 2, tl.float32), tensor_at(row, 4, tl.float32)
        m = tl.load(m_ptr + offs, mask=mask, other=0.0)
        v = tl.load(v_ptr + offs, mask=mask, other=0.0)
    # [Note: the AdamW update], one rounding per operation
    p = p * decay
    m = m * beta1 + g * omb1
    v = v * beta2 + (g * g) * omb2
    denom = tl.math.sqrt_rn(v) * inv_bc2 + eps
    p = p - tl.math.div_rn(m, denom) * step_size
    tl.store(p_ptr + offs, p, mask=mask)
    if STATES == 1:
        tl.store(m_ptr + offs, bf16_bits(m), mask=mask)
        tl.store(v_ptr + offs, bf16_bits(v), mask=mask)
    elif STATES == 2:  # masked lanes hold 0 and leave the absmax alone
        a, safe = _block_absmax(m)
        tl.store(m_ptr + offs, _round_half_even(tl.math.div_rn(m, safe) * 127.0).to(tl.int8), mask=mask)
        tl.store(ms_ptr + blk, a)
        a, safe = _block_absmax(v)
        q = _round_half_even(tl.math.sqrt_rn(tl.math.div_rn(v, safe)) * 255.0)
        q = tl.where(v > 0, tl.maximum(q, 1), q)  # a nonzero moment never gets code 0
        tl.store(v_ptr + offs, q.to(tl.uint8), mask=mask)
        tl.store(vs_ptr + blk, a)
    else:
        tl.store(m_ptr + offs, m, mask=mask)
        tl.store(v_ptr + offs, v, mask=mask)


def covers(p: torch.Tensor, state: dict, fmt: StateFormat) -> bool:
    """Whether :func:`step` takes this parameter: float32 and contiguous, its gradient (float32, BF16 or
    FP16) and every state tensor contiguous on its device (the kernel reads them as flat vectors)."""
    g = p.grad
    if not (fmt in COVERED and p.dtype == torch.float32 and p.is_contiguous() and g is not None
            and g.dtype in _GRAD and g.is_contiguous() and p.numel() <= MAX_NUMEL):
        return False
    return g.device == p.device and all(v.is_contiguous() and v.device == p.device
                                        for k, v in state.items() if k != "step")


def step(params: list[torch.Tensor], states: list[dict], fmt: StateFormat, scalars: dict[str, float]) -> None:
    """One AdamW step of every parameter in ``params`` (float32, on one device, their gradients of one
    dtype, each covered) and its state (in ``fmt``) in place, from ``p.grad``, in one launch;
    ``scalars``: the update's constants (``lowprec.optim.adamw_batch.constants``)."""
    work = [(p, s) for p, s in zip(params, states, strict=True) if p.numel()]
    if not work:
        return
    addresses = []
    for p, state in work:
        m, v = state[Moment.FIRST.value], state[Moment.SECOND.value]
        ms = state.get(Moment.FIRST.value + "_scale", m)  # read but for 8-bit moments
        vs = state.get(Moment.SECOND.value + "_scale", v)
        addresses.append([t.data_ptr() for t in (p, p.grad, m, ms, v, vs)])
    device = work[0][0].device
    table, own, programs = tables(addresses, [p.numel() for p, _ in work], BLOCK, device)
    with on(device):
        _launch(table, own, programs, _KIND[fmt], _GRAD[work[0][0].grad.dtype], scalars)


def _launch(table, owners, blocks, states, grad, scalars) -> None:
    adamw_kernel[(blocks,)](
        table, owners, scalars["decay"], scalars["beta1"], scalars["omb1"], scalars["beta2"], scalars["omb2"],
        scalars["inv_bc2"], scalars["eps"], scalars["step_size"], INV_INT8_LEVELS, INV_UINT8_LEVELS,
        STATES=states, GRAD=grad, BLOCK=BLOCK, enable_fp_fusion=False, num_warps=8)
