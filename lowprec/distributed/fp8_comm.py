"""FP8 collectives for gradients: a reduce-scatter and an all-gather whose wire carries E4M3 codes with a
float32 scale per 128 values, and whose sums are taken in float32.

[Note: FP8 on the wire, never summed in FP8]
A reduce-scatter in FP8 cannot be left to the backend: NCCL and gloo would add FP8 numbers in FP8
(or not at all), rounding at every hop. So the sum is split from the transport:

1. each rank views its flat input as ``W`` chunks (chunk ``j`` is rank ``j``'s shard), each padded
   to a multiple of 128, and quantizes it in 1x128 blocks (``lowprec.quant.blockwise(1, 128)``);
2. one ``all_to_all_single`` sends chunk ``j`` -- FP8 codes and their float32 scales packed side by
   side, 132 bytes per 128 values, as uint8 (gloo has no float8 dtype; it does have the all-to-all,
   so the CPU runs the same path as NCCL) -- to rank ``j``;
3. each rank dequantizes the ``W`` chunks it received and sums them in float32, rank order fixed.

The all-gather that follows under DDP quantizes each rank's summed shard the same way and gathers
codes and scales; every rank dequantizes the same bytes, so all end with identical gradients.

Why E4M3 and not E5M2: E5M2's extra exponent bit buys range for per-tensor scales, where one scale
must cover gradients spread over many octaves. With a scale per 128 neighbouring values the block
amax sets the range, and E4M3's extra mantissa bit halves the rounding error (at most 2^-4 of a
value rather than 2^-3). Values more than about 2^17 below their block's amax fall to E4M3's
subnormals or zero; their absolute error is still bounded, by half the smallest step times the
scale, which ``lowprec.quant.error_bound`` includes.

A block holding inf or NaN gets a NaN scale (``lowprec.quant``'s rule for formats without inf), so
non-finite gradients arrive as NaN and the step guard skips the step.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as nnf

from lowprec import formats as F
from lowprec.quant import QuantizedTensor, blockwise, quantize

FP8_FORMAT = F.get("e4m3")
BLOCK = 128
"""Values per scale: a block is 128 consecutive elements of the flattened gradient bucket."""
GRANULARITY = blockwise(1, BLOCK)
_SCALE_BYTES = 4  # float32
PACKED_ROW = BLOCK + _SCALE_BYTES
"""Bytes per block on the wire: 128 one-byte codes, then the block's float32 scale."""

# torch 2.13 renamed these (the old names warn); older releases have only the old ones
def _reduce_scatter(*args, **kwargs):
    # looked up at call time, as torch.distributed's own users do (so lowprec.distributed.count_traffic sees it)
    return (getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor)(*args, **kwargs)


def _all_gather(*args, **kwargs):
    return (getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor)(*args, **kwargs)


def padded_len(n: int) -> int:
    """``n`` rounded up to whole 128-value blocks."""
    return -(-n // BLOCK) * BLOCK


def pack(x: torch.Tensor) -> torch.Tensor:
    """Quantize ``x`` (any float tensor, length a multiple of 128) in 1x128 blocks and lay each block
    out as its 128 E4M3 codes followed by the 4 bytes of its float32 scale: a ``(len/128, 132)``
    uint8 tensor, ready for one collective."""
    q = quantize(x.reshape(-1, BLOCK), FP8_FORMAT, GRANULARITY)  # data (rows, 128), scale (rows, 1)
    codes = q.data.view(torch.uint8)  # (rows, 128)
    scales = q.scale.contiguous().view(torch.uint8)  # (rows, 4)
    return torch.cat([codes, scales], dim=1)  # (rows, 132)


def unpack(packed: torch.Tensor) -> torch.Tensor:
    """The float32 values of ``pack``'s bytes, as a ``(rows, 128)`` tensor: ``decode(code) * scale``."""
    rows = packed.shape[0]
    codes = packed[:, :BLOCK].contiguous().view(FP8_FORMAT.storage_dtype)  # (rows, 128)
    scales = packed[:, BLOCK:].contiguous().view(torch.float32)  # (rows, 1)
    q = QuantizedTensor(codes, scales, FP8_FORMAT, GRANULARITY, torch.Size((rows, BLOCK)), torch.float32)
    return q.dequantize()  # (rows, 128)


def fp8_reduce_scatter(x: torch.Tensor, group: dist.ProcessGroup | None = None) -> tuple[torch.Tensor, int]:
    """The float32 sum over ranks of chunk ``rank`` of each rank's flat ``x`` (length ``W * S``; chunk
    ``j`` is ``x[j*S:(j+1)*S]``), sent in FP8: ``((S,) float32, bytes this rank sent)``.
    See [Note: FP8 on the wire, never summed in FP8]."""
    w = dist.get_world_size(group)
    s = x.numel() // w
    chunks = x.detach().reshape(w, s).float()  # (W, S)
    sp = padded_len(s)
    if sp != s:
        chunks = nnf.pad(chunks, (0, sp - s))  # (W, Sp)
    send = pack(chunks)  # (W * Sp/128, 132): rank j's rows are the j-th W-th
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send, group=group)
    summed = unpack(recv).view(w, sp).sum(dim=0)  # (Sp,) float32: received chunk i came from rank i
    return summed[:s], (w - 1) * send.numel() // w


def fp8_all_gather(shard: torch.Tensor, group: dist.ProcessGroup | None = None) -> tuple[torch.Tensor, int]:
    """Every rank's ``shard`` (all of length ``S``) concatenated in rank order, sent in FP8 with
    1x128 scales: ``((W * S,) float32, bytes this rank sent)``. Every rank gets the same values,
    its own shard included (it is dequantized from the bytes the others received)."""
    w = dist.get_world_size(group)
    s = shard.numel()
    sp = padded_len(s)
    flat = shard.detach().reshape(-1).float()
    send = pack(nnf.pad(flat, (0, sp - s)) if sp != s else flat)  # (Sp/128, 132)
    recv = send.new_empty((w * send.shape[0], PACKED_ROW))
    _all_gather(recv, send, group=group)
    gathered = unpack(recv).view(w, sp)[:, :s]  # (W, S)
    return gathered.reshape(-1), (w - 1) * send.numel()


def reduce_scatter(output: torch.Tensor, x: torch.Tensor, group: dist.ProcessGroup | None = None) -> int:
    """``output`` = the sum over ranks of chunk ``rank`` of ``x``, by ``dist``'s own reduce-scatter in
    ``x``'s dtype; returns the bytes this rank sent (a ring reduce-scatter sends ``(W-1)/W`` of x)."""
    w = dist.get_world_size(group)
    _reduce_scatter(output, x, op=dist.ReduceOp.SUM, group=group)
    return (w - 1) * x.numel() * x.element_size() // w


def all_reduce(x: torch.Tensor, group: dist.ProcessGroup | None = None) -> int:
    """Sum ``x`` in place over ranks in its own dtype; returns the bytes this rank sent (a ring
    all-reduce is a reduce-scatter then an all-gather: ``2 (W-1)/W`` of x)."""
    w = dist.get_world_size(group)
    dist.all_reduce(x, op=dist.ReduceOp.SUM, group=group)
    return 2 * (w - 1) * x.numel() * x.element_size() // w
