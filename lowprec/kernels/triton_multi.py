"""Kernels over many tensors in one launch, and the tables they read.

[Note: one launch for many tensors]
After each optimizer step every parameter is updated and every FP8 weight cast again. Launched tensor
by tensor, the host's work per launch (some tens of microseconds) outlasts the kernels of all but the
largest tensors, and after the step's host sync nothing hides it: a 1B model's optimizer step took 37 ms
from idle to idle with 10 ms of kernels. A multi-tensor kernel takes a table instead: one row of int64
per tensor (the addresses it reads and writes, its length, the index of its first block among the
launch's blocks) and, per program, the index of its tensor's row. A program loads its row and works on
its block. The rows are copied to the device once for addresses that recur step after step (the
caching allocator gives a step's new gradients the addresses of the last step's), else once per launch,
from pinned memory so that the copy does not wait for the GPU; the program-to-row table depends on the
lengths alone and is kept.
"""
from __future__ import annotations

import contextlib
import functools

import torch
import triton
import triton.language as tl

from lowprec.kernels.triton_launch import host_table
from lowprec.kernels.triton_numerics import bf16_bits, bf16_value, to_codes
from lowprec.kernels.triton_tiles import divide, divisor_of, hw_fp8

MAX_NUMEL = 2**31 - 2**16
"""Largest tensor a multi-tensor kernel takes: its offsets are int32."""


@triton.jit
def tensor_at(row, i: tl.constexpr, dtype: tl.constexpr):
    """The tensor whose address is the row's entry ``i``, seen as ``dtype``."""
    return tl.load(row + i).to(tl.pointer_type(dtype))


def tables(addresses: list[list[int]], numels: list[int], block: int,
           device: torch.device) -> tuple[torch.Tensor, torch.Tensor, int]:
    """(rows, program-to-row table, program count) of a launch over tensors of ``numels`` elements,
    ``block`` elements a program: each tensor's row is its ``addresses``, its length and its first
    block's index among the launch's (see [Note: one launch for many tensors])."""
    rows, first = [], 0
    for a, n in zip(addresses, numels, strict=True):
        rows += [*a, n, first]
        first += triton.cdiv(n, block)
    if device.type == "cuda" and torch.cuda.is_current_stream_capturing():  # a graph replays its copies
        return _rows_on(tuple(rows), device), _owners_on(tuple(numels), block, device), first
    # keyed by the stream too: a table is used on the stream whose copy made it
    stream = torch.cuda.current_stream(device).stream_id if device.type == "cuda" else 0
    return _device_rows(tuple(rows), device, stream), _owners(tuple(numels), block, device, stream), first


def on(device: torch.device):
    """The context a launch on ``device`` runs in (its CUDA device; nothing elsewhere)."""
    return torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()


def _rows_on(rows: tuple[int, ...], device: torch.device) -> torch.Tensor:
    return host_table(torch.tensor(rows, dtype=torch.int64), device)


def _owners_on(numels: tuple[int, ...], block: int, device: torch.device) -> torch.Tensor:
    counts = torch.tensor([triton.cdiv(n, block) for n in numels])
    return host_table(torch.repeat_interleave(torch.arange(len(numels), dtype=torch.int32), counts), device)


@functools.lru_cache(maxsize=16)
def _device_rows(rows: tuple[int, ...], device: torch.device, stream: int) -> torch.Tensor:
    return _rows_on(rows, device)


@functools.lru_cache(maxsize=16)
def _owners(numels: tuple[int, ...], block: int, device: torch.device, stream: int) -> torch.Tensor:
    return _owners_on(numels, block, device)


# ---- FP8 weights cast again after a step: E4M3 per tensor, from a given scale ----------------------

REQUANT_ROW = 5
"""A row: the float32 source, the E4M3 codes, the scale's destination, the length, the first block."""
REQUANT_BLOCK = 4096


@triton.jit
def requantize_kernel(rows_ptr, owner_ptr, scales_ptr, HW: tl.constexpr, BLOCK: tl.constexpr):
    """codes = E4M3(RN_bf16(src) / scale), saturating, zero where the scale is not finite or zero; the
    scale stored beside them: ``lowprec.quant.quantize(src.to(bfloat16), "e4m3", tensorwise(),
    scale=scale)`` bit for bit (the division correctly rounded as the tile kernels do it), but for the sign
    of a NaN's code, which follows the device's rounding to BF16 (torch's on the CPU may turn a NaN
    negative). A NaN in a weight's master makes its amax, so its scale, NaN, and its codes zero."""
    pid = tl.program_id(0)
    t = tl.load(owner_ptr + pid)
    row = rows_ptr + t.to(tl.int64) * 5  # REQUANT_ROW
    blk = pid - tl.load(row + 4).to(tl.int32)
    offs = blk * BLOCK + tl.arange(0, BLOCK)
    mask = offs < tl.load(row + 3)
    s = tl.load(scales_ptr + t)
    x = tl.load(tensor_at(row, 0, tl.float32) + offs, mask=mask, other=0.0)
    v = bf16_value(bf16_bits(x))
    d, r, dead, ok = divisor_of(tl.zeros((1,), tl.float32) + s)
    scaled = divide(v, d, r, ok, 2)
    nan_sign = (x.to(tl.int32, bitcast=True) >> 31) & 1  # the source's (a NaN's sign is the device's)
    if HW:
        codes = hw_fp8(scaled, nan_sign, 4, True)
    else:
        codes = to_codes(scaled, nan_sign, scaled, 4, 3, 1, True, False)
    tl.store(tensor_at(row, 1, tl.uint8) + offs, tl.where(dead, 0, codes).to(tl.uint8), mask=mask)
    if blk == 0:
        tl.store(tensor_at(row, 2, tl.float32), s)


def requantize(sources: list[torch.Tensor], scales: torch.Tensor, codes: list[torch.Tensor],
               scale_outs: list[torch.Tensor]) -> None:
    """For each i, ``codes[i]`` (E4M3, contiguous, ``sources[i]``'s length) and ``scale_outs[i]`` (one
    float32) in place from ``sources[i]`` (float32, contiguous, non-empty) rounded to BF16 and cast with
    the scale ``scales[i]``, in one launch (callers check the layouts: ``lowprec.kernels.requantize_many``)."""
    addresses = [[src.data_ptr(), out.data_ptr(), so.data_ptr()] for src, out, so in zip(sources, codes, scale_outs)]
    device = sources[0].device
    table, own, programs = tables(addresses, [s.numel() for s in sources], REQUANT_BLOCK, device)
    with on(device):
        requantize_kernel[(programs,)](table, own, scales.float().contiguous(), HW=device.type == "cuda",
                                       BLOCK=REQUANT_BLOCK, num_warps=8)
    for t in (*codes, *scale_outs):  # written through their addresses: autograd must see new versions
        torch.autograd.graph.increment_version(t)
