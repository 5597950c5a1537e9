"""FP8 primary weights under FSDP2: each rank stores its rows of a weight as E4M3 codes, and the ranks
all-gather the codes.

[Note: FP8 primary weights under FSDP2]
With ``--fp8-weights`` a converted layer's weight is an :class:`~lowprec.nn.fp8_weight.FP8Weight`: E4M3
codes and a scale, with its FP32 master in the optimizer (see [Note: FP8 primary weights]). Under FSDP2
(``fully_shard``) each rank keeps a shard of every weight: here that shard is an :class:`FP8WeightShard`,
this rank's rows of the codes with the **whole weight's** per-tensor scale, 1 byte per element where a
BF16 shard takes 2. Before a block runs, FSDP2 all-gathers the codes (half of BF16's bytes) and the layer
gets a :class:`~lowprec.distributed.fp8_weights.GatheredFP8Weight`, the codes and the scale, which its
GEMMs read as they are (fprop the codes, dgrad the codes transposed): nothing is cast.

*One scale on every rank.* Codes made from rows with the whole weight's scale are, element by element,
the codes of the whole weight: so the ranks take the maximum of their rows' amaxes before they
quantize. After each optimizer step, every shard is requantized from its FP32 master shard
(``lowprec.nn.fp8_requantize.requantize_all``) with one all-reduce (MAX) for all the weights; the same
holds for a ``load_state_dict`` into the shard (``copy_``), a weight at a time. The model therefore
trains bit for bit as FSDP2 with BF16 weights, FP32 masters and the FP8 all-gather of
``lowprec.distributed.fp8_weights`` (the codes are the cast that run makes of its gathered weight).

*Storage in blocks.* A weight stored in 128x128 blocks (``fp8-blockwise``, and the recipes that decode and
cast) shards where every rank gets whole blocks of rows (``out_features`` a multiple of 128 x ranks, checked by
:func:`shard_fp8_weights`, which refuses any other by name): each rank holds its blocks' codes and scales,
FSDP2 gathers both (packed as one input: at one rank FSDP2 copies only the first), and no amax is exchanged
(a block lies within one rank's rows).

*How FSDP2 makes the shard.* ``fully_shard`` chunks the parameter by rows, pads a chunk with ``new_zeros``
and ``copy_``, views it flat and narrows it back (again at its lazy initialisation, on a rank with fewer
rows): :class:`FP8WeightShard` carries those ops on the codes (each view shares the scale, or takes its
rows' block scales), and ``copy_`` from another FP8 weight copies its codes and scales exactly. The initial
high-precision value, which the optimizer's master starts from, is not chunked along: :func:`shard_fp8_weights`
keeps each weight's whole initial value before ``fully_shard`` and hands every shard its rows after
(:func:`finish_fp8_weight_shards`), quantized with the agreed scale; views share its holder, and an exact copy
carries it, so FSDP2's padding keeps it. Each rank shards its own weights, as FSDP2 does, so ranks must start
from the same model.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.utils import _pytree as pytree

from lowprec._checks import fail
from lowprec.distributed.fp8_weights import GatheredFP8Weight
from lowprec.nn import Linear
from lowprec.nn.fp8_convert import BLOCK
from lowprec.nn.fp8_weight import FP8Weight
from lowprec.ranks import is_dtensor

aten = torch.ops.aten

_ROWS = {aten.split.Tensor, aten.split_with_sizes.default, aten.slice.Tensor}
"""Ops taking rows of the weight (dim 0): FSDP2's chunking and padding."""
_VIEWS = {aten.view.default, aten._unsafe_view.default}


class _Agreement:
    """The maximum of a tensor of amaxes over the ranks of a device mesh (every dimension), in place."""

    def __init__(self, mesh) -> None:
        self.groups = [mesh.get_group(i) for i in range(mesh.ndim)]

    def __call__(self, amaxes: torch.Tensor) -> None:
        for group in self.groups:
            if dist.get_world_size(group) > 1:
                dist.all_reduce(amaxes, op=dist.ReduceOp.MAX, group=group)


class FP8WeightShard(FP8Weight):
    """An :class:`FP8Weight` that FSDP2 shards by rows and all-gathers as its codes (see [Note: FP8
    primary weights under FSDP2])."""

    agreement: _Agreement | None = None

    @property
    def _initial(self) -> torch.Tensor | None:
        # views share one holder (FSDP2 pads a shard, then narrows it back): the value is the rows', so
        # only a tensor of its shape holds it
        value = self._held.value
        return value if value is not None and value.shape == self.shape else None

    @_initial.setter
    def _initial(self, value: torch.Tensor | None) -> None:
        self._held.value = value

    @property
    def initial(self) -> torch.Tensor | None:
        return self._initial

    def _like(self, data: torch.Tensor, shape: torch.Size | tuple, scale: torch.Tensor | None = None
              ) -> FP8WeightShard:
        # a view of the codes: the same scale (or the view's blocks'), amax, agreement and initial value's holder
        out = FP8WeightShard(data, self._scale if scale is None else scale, self._amax, self._granularity,
                             torch.Size(shape), self.dtype, self._held)
        out.agreement = self.agreement
        return out

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        t = args[0] if args else None
        if isinstance(t, cls):
            if func in _ROWS:
                return _rows(func, t, args[1:], kwargs)
            if func in _VIEWS:  # FSDP2 keeps a flat view of the padded shard; it reads it as no weight
                data = t._data.view(args[1])
                return t._like(data, data.shape)
            if func is aten.new_zeros.default and kwargs.get("dtype", t.dtype) == t.dtype:
                size = torch.Size(args[1])
                rows, cols = size[0], t._data.shape[1]  # block codes: padded to whole blocks along K
                data = torch.zeros((rows, *t._data.shape[1:]) if len(size) == 2 else size, dtype=t._data.dtype,
                                   device=t.device)
                scale = t._scale.clone() if t._granularity.per_tensor else \
                    t._scale.new_ones(rows // BLOCK, -(-cols // BLOCK))
                out = FP8WeightShard(data, scale, None if t._amax is None else t._amax.clone(), t._granularity, size,
                                     t.dtype)
                out.agreement = t.agreement
                return out
            if func is aten.copy_.default and isinstance(args[1], FP8Weight) and \
                    args[1].granularity == t.granularity:
                _copy_codes(t, args[1])
                return t
        out = super().__torch_dispatch__(func, types, args, kwargs)
        if isinstance(out, cls) and isinstance(t, cls):  # detach, alias, a move: keeps the agreement
            out.agreement = t.agreement
        return out

    @staticmethod
    def __tensor_unflatten__(inner, meta, outer_size, outer_stride):
        granularity, dtype = meta
        return FP8WeightShard(inner["_data"], inner["_scale"], inner.get("_amax"), granularity, outer_size, dtype)

    # ---- FSDP2's all-gather extension --------------------------------------------------------

    def fsdp_pre_all_gather(self, mesh, outer_size, outer_stride, module, mp_policy):
        if not self._granularity.per_tensor:  # whole blocks on every rank (shard_fp8_weights checks): no padding
            if mesh.size() == 1:  # FSDP2 at one rank copies a single input: the codes, then the scales' bytes
                return (torch.cat([self._data.view(torch.uint8).reshape(-1),
                                   self._scale.reshape(-1).view(torch.uint8)]),), (None,)
            return (self._data.view(torch.uint8), self._scale), (None,)  # gathered by rows, each whole
        codes = self._data.view(torch.uint8)
        rows = -(-outer_size[0] // mesh.size())  # FSDP2's padded shard: every rank sends as many rows
        if codes.shape[0] < rows:
            padded = self._data._base  # FSDP2 narrowed the padded shard: its storage, zero rows after
            if padded is not None and padded.shape[0] == rows and padded.data_ptr() == self._data.data_ptr():
                codes = padded.view(torch.uint8)
            else:
                codes = torch.cat([codes, codes.new_zeros(rows - codes.shape[0], *codes.shape[1:])])
        return (codes,), (self._scale, self._amax)

    def _gathered_blocks(self, outputs: tuple) -> tuple[torch.Tensor, torch.Tensor]:
        """The block-stored codes (rows, K padded) and scales of every rank: views of FSDP2's all-gather
        outputs (refilled in place for every gather, versions kept), so nothing is held besides them."""
        if len(outputs) == 2:
            codes, scale = outputs
        else:  # one rank, packed: the codes then the scales (at a multiple of 16384 bytes: aligned)
            n = self._data.numel()
            codes, scale = outputs[0][:n], outputs[0][n:].view(torch.float32)
        return codes.view(torch.float8_e4m3fn).view(-1, self._data.shape[1]), scale.view(-1, self._scale.shape[1])

    def fsdp_post_all_gather(self, all_gather_outputs, metadata, param_dtype, *, out=None):
        if not self._granularity.per_tensor:  # the codes and the blocks' scales, gathered by rows
            if out is not None:
                return None  # FSDP2 refilled its buffers, which the gathered weight views
            data, scale = self._gathered_blocks(tuple(all_gather_outputs))
            gathered = GatheredFP8Weight(data, scale, None, param_dtype, self._granularity,
                                         torch.Size((data.shape[0], *self.shape[1:])))
            return gathered, ()
        (codes,), (scale, amax) = all_gather_outputs, metadata
        if out is not None:  # FSDP2 refilled the same buffer; the scale tensors are the shard's own
            out._scale, out._amax = scale, amax
            return None
        return GatheredFP8Weight(codes.view(torch.float8_e4m3fn), scale, amax, param_dtype), (codes,)


def _rows(func, t: FP8WeightShard, rest: tuple, kwargs: dict):
    # split(self, size, dim), split_with_sizes(self, sizes, dim), slice(self, dim, ...) (narrow decomposes to slice)
    dim = rest[1] if len(rest) > 1 else kwargs.get("dim", 0)
    if func is aten.slice.Tensor:
        dim = rest[0] if rest else kwargs.get("dim", 0)
    if dim not in (0, -t.dim()):
        fail("weight", "rows of an FP8 weight shard (FSDP2 splits dim 0)", f"{func.name()} along dim {dim}")
    out = func(t._data, *rest, **kwargs)
    if t._granularity.per_tensor:
        return pytree.tree_map_only(torch.Tensor, lambda d: t._like(d, d.shape), out)
    # 128x128 blocks: the rows are whole blocks (shard_fp8_weights checks), each piece with its blocks' scales
    pieces = out if isinstance(out, (list, tuple)) else [out]
    start, shards = 0, []
    if func is aten.slice.Tensor:  # slice(self, dim, start, end, step)
        start = rest[1] if len(rest) > 1 and rest[1] is not None else 0
        start = max(start + t.shape[0], 0) if start < 0 else min(start, t.shape[0])
        if len(rest) > 3 and rest[3] != 1:
            fail("weight", "contiguous rows of an FP8 weight stored in blocks", f"a slice with step {rest[3]}")
    for d in pieces:
        if start % BLOCK or d.shape[0] % BLOCK:
            fail("weight", f"rows of an FP8 weight stored in {BLOCK}x{BLOCK} blocks taken on block edges",
                 f"rows {start} to {start + d.shape[0]}")
        scale = t._scale[start // BLOCK:(start + d.shape[0]) // BLOCK]
        shards.append(t._like(d, (d.shape[0], *t.shape[1:]), scale))
        start += d.shape[0]
    return shards if isinstance(out, (list, tuple)) else shards[0]


@torch.no_grad()
def _copy_codes(dst: FP8WeightShard, src: FP8Weight) -> None:
    """``dst`` takes ``src``'s codes and scale as they are (FSDP2 copying a chunk into its padded shard):
    quantizing the decoded chunk again would take the chunk's own scale."""
    if dst.shape != src.shape:
        fail("src", f"an FP8 weight of shape {tuple(dst.shape)}", f"shape {tuple(src.shape)}")
    initial = src.initial  # the same values: the optimizer still takes their high-precision origin
    dst._data.copy_(src._data)
    dst._scale.copy_(src._scale)
    if dst._amax is not None and src._amax is not None:
        dst._amax.copy_(src._amax)
    dst._stored()
    dst._initial = initial


@dataclass(frozen=True, slots=True)
class _Pending:
    layer: Linear
    initial: torch.Tensor


def shard_fp8_weights(model: nn.Module, mesh=None) -> list[_Pending]:
    """Before ``fully_shard`` over ``mesh`` (None: every rank): every FP8 primary weight of ``model`` made an
    :class:`FP8WeightShard` (the same codes), its whole initial value kept for :func:`finish_fp8_weight_shards`.
    A weight stored in 128x128 blocks whose rows the ranks would cut inside a block, or a mesh of more than
    one dimension, is refused before anything changes."""
    layers = [(name, m) for name, m in model.named_modules()
              if isinstance(m, Linear) and isinstance(m.weight, FP8Weight)]
    if layers and mesh is not None and mesh.ndim != 1:
        fail("mesh", "a 1-D FSDP2 mesh for FP8 primary weights", f"{mesh.ndim} dimensions")
    ranks = mesh.size() if mesh is not None else (dist.get_world_size() if dist.is_initialized() else 1)
    for name, m in layers:
        w = m.weight
        if not w.granularity.per_tensor and (w.shape[0] % (BLOCK * ranks) or w._data.shape[0] != w.shape[0]):
            fail("fp8_weights", f"out_features a multiple of {BLOCK} x {ranks} ranks for FP8 weights stored in "
                 f"{BLOCK}x{BLOCK} blocks under FSDP2 (every rank whole blocks of rows)",
                 f"{w.shape[0]} in {name!r} ({m.recipe.name})")
    pending = []
    for _, m in layers:
        w = m.weight
        shard = FP8WeightShard(w._data, w._scale, w._amax, w.granularity, w.shape, w.dtype)
        pending.append(_Pending(m, w.initial if w.initial is not None else w.dequantize()))
        m.weight = nn.Parameter(shard, requires_grad=w.requires_grad)
        m.hold_weight()
    return pending


@torch.no_grad()
def finish_fp8_weight_shards(pending: list[_Pending]) -> None:
    """After ``fully_shard``: each shard agrees over its mesh, takes its rows of the initial value and is
    quantized from them with the whole weight's scale; the layers drop the codes they held before. Shards
    over the same mesh share one agreement, so the optimizer requantizes them together (one exchange)."""
    agreements: dict = {}
    for p in pending:
        w = p.layer.weight
        shard = w._local_tensor if is_dtensor(w) else None
        if not isinstance(shard, FP8WeightShard):
            fail("model", "FP8 weights sharded by fully_shard after shard_fp8_weights", type(w).__name__)
        mesh = w.device_mesh  # 1-D: checked by shard_fp8_weights
        rank, n = mesh.get_local_rank(), mesh.size()
        chunks = torch.chunk(p.initial, n, dim=0)
        rows = chunks[rank] if rank < len(chunks) else p.initial[:0]
        if rows.shape != shard.shape:
            fail("weight", f"this rank's rows of shape {tuple(rows.shape)}", f"a shard of {tuple(shard.shape)}")
        shard.agreement = agreements.setdefault(mesh, _Agreement(mesh))
        shard.share_initial_(rows.clone())  # not a view: the whole initial value goes
        p.layer.hold_weight()


def sharded_fp8_weights(model: nn.Module) -> list[FP8WeightShard]:
    """The :class:`FP8WeightShard` shards of ``model`` (inside FSDP2's DTensors), in module order."""
    return [p._local_tensor for p in model.parameters()
            if is_dtensor(p) and isinstance(p._local_tensor, FP8WeightShard)]

