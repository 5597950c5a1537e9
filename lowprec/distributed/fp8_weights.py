"""FSDP2 all-gathers the weights of per-tensor FP8 layers in E4M3: half of BF16's bytes on the wire.

[Note: FP8 all-gather]
Under FSDP2 (``fully_shard``) each rank holds a shard of every weight and all-gathers the whole
weight before a layer's forward and backward. A layer whose recipe casts the weight to E4M3 with one
scale per tensor (fp8-current, fp8-delayed) needs only those codes and the scale, so each rank
casts its shard with the weight's scale and the ranks gather one byte per element: quantizing a shard
with the whole weight's scale gives exactly the codes of quantizing the whole weight, element by
element. The scale must therefore be the whole weight's, on every rank: :func:`precompute_fp8_scales`
takes every such weight's amax after the optimizer step in one all-reduce (MAX) for all of them, so
the scale is the current one (the recipe's own for fp8-current; for fp8-delayed the weight then
takes its current scale too, while its history still records its amax). A weight whose scale was not
precomputed takes its own all-reduce in the all-gather.

The gathered weight is a :class:`GatheredFP8Weight`: the codes and the scale, which the layer uses as
its fprop operand as they are, and transposed as its dgrad operand (the same scale serves both).
Autograd sees a parameter of the model's dtype; its gradient is the high-precision one, which FSDP2
reduce-scatters as usual.

The sharded weight is a :class:`FP8ShardedWeight`: a wrapper subclass that behaves exactly as its
high-precision data for everything else (the optimizer, ``state_dict``, clipping), and carries the
two FSDP2 extension hooks (``fsdp_pre_all_gather`` / ``fsdp_post_all_gather``).

Other recipes all-gather their weights in the parameters' dtype (or FSDP2's ``param_dtype``): their
weight operands take scales along different axes in the two GEMMs (rows of W for fprop, rows of W.T
for dgrad with row-wise, MX and NVFP4 scales), so no single low-precision copy serves both without a
second rounding; a gathered FP8 copy would also have to be dequantized and cast again.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.utils import _pytree as pytree

from lowprec import formats as F
from lowprec import kernels as K
from lowprec._checks import describe, fail
from lowprec.nn import Linear
from lowprec.nn.casts import QuantizedWeight
from lowprec.nn.fp8_requantize import amaxes_of
from lowprec.nn.fp8_weight import FP8Weight
from lowprec.quant import Granularity, tensorwise
from lowprec.quant.scales import amax_scale
from lowprec.ranks import like

aten = torch.ops.aten
E4M3 = F.get("e4m3")


class ScaleBox:
    """A weight's all-gather scale and amax, set by :func:`precompute_fp8_scales`, and the count of
    writes into the weight they were taken after. Every in-place op on the weight or any view of it
    counts a write (:class:`FP8ShardedWeight` sees them all, whether an optimizer writes through the
    DTensor parameter or into its local shard); autograd's version counters do not, as the writes
    happen below autograd and views made there get counters of their own."""

    __slots__ = ("scale", "amax", "version", "writes")

    def __init__(self) -> None:
        self.scale: torch.Tensor | None = None  # (1, 1) float32
        self.amax: torch.Tensor | None = None  # () float32
        self.version = -1
        self.writes = 0


_ALIASING = {aten.view.default, aten.as_strided.default, aten.slice.Tensor, aten.split.Tensor, aten.narrow.default,
             aten.chunk.default, aten.t.default, aten.detach.default, aten.alias.default, aten._unsafe_view.default,
             aten.split_with_sizes.default, aten.unflatten.int, aten.flatten.using_ints, aten.reshape.default}
"""Ops whose outputs share the wrapper's data: FSDP2 shards and views a parameter through them, so the
outputs stay :class:`FP8ShardedWeight` (and keep the hooks)."""
_SAME_KIND = {aten.clone.default, aten.empty_like.default, aten.zeros_like.default, aten.new_zeros.default,
              aten.new_empty.default, aten.new_empty_strided.default, aten._to_copy.default}
"""Ops making a new tensor of the same kind, which stays a weight when its dtype is the weight's."""


def _unwrap(t):
    return t._data if isinstance(t, FP8ShardedWeight) else t


def _count_writes(schema, args, kwargs) -> None:
    for i, a in enumerate(schema.arguments):
        if a.alias_info is None or not a.alias_info.is_write:
            continue
        value = args[i] if i < len(args) else kwargs.get(a.name)
        for t in pytree.tree_leaves(value):
            if isinstance(t, FP8ShardedWeight):
                t._box.writes += 1


class FP8ShardedWeight(torch.Tensor):
    """A converted layer's high-precision weight that FSDP2 all-gathers in E4M3 (see [Note: FP8
    all-gather]); for everything else it is its data."""

    @staticmethod
    def __new__(cls, data: torch.Tensor, box: ScaleBox):
        return torch.Tensor._make_wrapper_subclass(
            cls, data.size(), strides=data.stride(), storage_offset=data.storage_offset(), dtype=data.dtype,
            layout=data.layout, device=data.device, requires_grad=data.requires_grad)

    def __init__(self, data: torch.Tensor, box: ScaleBox) -> None:
        self._data = data
        self._box = box

    __torch_function__ = torch._C._disabled_torch_function_impl

    def __repr__(self) -> str:
        return f"FP8ShardedWeight({self._data!r})"

    def __reduce_ex__(self, protocol):
        # saved as its data: checkpoints (and optimizer states made alike, zeros_like) hold plain tensors
        return self._data.__reduce_ex__(protocol)

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        box = next(t._box for t in pytree.tree_leaves((args, kwargs)) if isinstance(t, cls))
        out = func(*pytree.tree_map(_unwrap, args), **pytree.tree_map(_unwrap, kwargs))
        schema = func._schema
        _count_writes(schema, args, kwargs)
        if not schema.returns:  # in place on lists (foreach updates): nothing to return
            return out
        first = schema.arguments[0].alias_info if schema.arguments else None
        if first is not None and first.is_write:
            return args[0]  # in place (an optimizer's update, copy_): the wrapper itself
        if func in _ALIASING or func in _SAME_KIND:
            dtype = args[0].dtype if isinstance(args[0], torch.Tensor) else None

            def rewrap(t):
                return cls(t, box) if t.dtype == dtype else t

            return pytree.tree_map_only(torch.Tensor, rewrap, out)
        return out

    def __tensor_flatten__(self):
        return ["_data"], self._box

    @staticmethod
    def __tensor_unflatten__(inner, box, outer_size, outer_stride):
        return FP8ShardedWeight(inner["_data"], box)

    # ---- FSDP2's all-gather extension --------------------------------------------------------

    def fsdp_pre_all_gather(self, mesh, outer_size, outer_stride, module, mp_policy):
        box = self._box
        if box.version != box.writes:  # not precomputed since the last update: its own all-reduce
            _set_scales([self], mesh.get_group())
        q = K.quantize(self._data, E4M3, tensorwise(), scale=box.scale)  # the route's backend: the same bits
        return (q.data.view(torch.uint8),), (box.scale, box.amax)

    def fsdp_post_all_gather(self, all_gather_outputs, metadata, param_dtype, *, out=None):
        (codes,), (scale, amax) = all_gather_outputs, metadata
        if out is not None:  # FSDP2 refilled the same buffer: only this step's scale is new
            out._scale, out._amax = scale, amax
            return None
        data = codes.view(torch.float8_e4m3fn)
        return GatheredFP8Weight(data, scale, amax, param_dtype), (codes,)


class GatheredFP8Weight(QuantizedWeight):
    """An all-gathered weight held as E4M3 codes and their scales (one per tensor, or one per 128x128 block
    with the codes padded to whole blocks), seen by autograd as a weight of ``dtype`` and ``shape`` (default:
    the codes'): the layer takes its codes as its GEMM operands; any other use dequantizes it."""

    @staticmethod
    def __new__(cls, data: torch.Tensor, scale: torch.Tensor, amax: torch.Tensor | None, dtype: torch.dtype,
                granularity: Granularity | None = None, shape: torch.Size | None = None):
        return torch.Tensor._make_wrapper_subclass(cls, shape if shape is not None else data.size(), dtype=dtype,
                                                   device=data.device)

    def __init__(self, data, scale, amax, dtype, granularity: Granularity | None = None, shape=None) -> None:
        self._data, self._scale, self._amax = data, scale, amax
        self._granularity = granularity if granularity is not None else tensorwise()

    __torch_function__ = torch._C._disabled_torch_function_impl

    def __repr__(self) -> str:
        return f"GatheredFP8Weight(shape={tuple(self.shape)}, dtype={self.dtype}, granularity={self._granularity})"

    @property
    def granularity(self) -> Granularity:
        """How the codes are scaled: per tensor, the E4M3 operand (or its transpose, with the same scale) is
        bit for bit the cast of the whole high-precision weight with this scale; in 128x128 blocks, each
        block's."""
        return self._granularity

    @property
    def amax(self) -> torch.Tensor:
        if self._amax is None:
            fail("weight", "a gathered weight with an amax (one made for a recipe that records it)",
                 "one gathered from FP8 weights made for a recipe without delayed weight scaling")
        return self._amax

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _GATHERED_ALIASING:  # FSDP2 views the gathered buffer as the parameter's shape
            t = args[0]
            if t._granularity.per_tensor:  # the codes are the weight's shape (FSDP2 cuts the padded rows)
                return cls(func(t._data, *args[1:], **kwargs), t._scale, t._amax, t.dtype)
            if func in (aten.detach.default, aten.alias.default) or tuple(args[1]) == tuple(t.shape):
                return cls(t._data, t._scale, t._amax, t.dtype, t._granularity, t.shape)  # blocks: whole already
            fail("weight", f"a view of the gathered block-scaled weight as its shape {tuple(t.shape)}",
                 f"{func.name()} to {tuple(args[1])}")

        def hp(t):
            return t.quantized().dequantize(t.dtype) if isinstance(t, cls) else t

        return func(*pytree.tree_map(hp, args), **pytree.tree_map(hp, kwargs))

    def __tensor_flatten__(self):
        # no amax from an FP8 primary weight made for a recipe that records none
        return ["_data", "_scale"] + (["_amax"] if self._amax is not None else []), (self.dtype, self._granularity)

    @staticmethod
    def __tensor_unflatten__(inner, meta, outer_size, outer_stride):
        dtype, granularity = meta
        return GatheredFP8Weight(inner["_data"], inner["_scale"], inner.get("_amax"), dtype, granularity, outer_size)


_GATHERED_ALIASING = {aten.detach.default, aten.alias.default, aten.as_strided.default, aten.view.default,
                      aten._unsafe_view.default}


@dataclass(frozen=True, slots=True)
class _Eligible:
    ok: bool
    why: str = ""


def _eligible(lin: Linear) -> _Eligible:
    plan = lin.plan()
    if plan is None or not plan.scaled:
        return _Eligible(False, "not converted here")
    op = plan.weight
    specs = [r for r in (op.both.along_k, op.both.transposed)] if op.both is not None else []
    if len(specs) != 2 or not all(s.fmt is E4M3 and s.granularity.per_tensor and not s.stochastic for s in specs):
        return _Eligible(False, f"{lin.recipe.name} does not cast weights to E4M3 per tensor")
    return _Eligible(True)


def fp8_all_gather(model: nn.Module) -> list[str]:
    """Make FSDP2 all-gather the weights of ``model``'s per-tensor FP8 layers in E4M3 (see [Note: FP8
    all-gather]). Call after ``lowprec.convert`` and before ``fully_shard`` and before building the
    optimizer (the weights become new parameters). Returns the layers' names."""
    if not isinstance(model, nn.Module):
        fail("model", "a torch.nn.Module", describe(model), TypeError)
    done = []
    for name, m in model.named_modules():
        # an FP8 primary weight is gathered as its codes already (lowprec.distributed.fp8_weight_shards)
        if isinstance(m, Linear) and _eligible(m).ok and not isinstance(m.weight, (FP8ShardedWeight, FP8Weight)):
            w = m.weight
            m.weight = nn.Parameter(FP8ShardedWeight(w.data, ScaleBox()), requires_grad=w.requires_grad)
            m.register_state_dict_post_hook(_plain_state)
            done.append(name)
    return done


def _plain(t: torch.Tensor) -> torch.Tensor:
    """``t`` with the wrapper taken off (inside a DTensor too): checkpoints hold plain tensors."""
    if isinstance(t, FP8ShardedWeight):
        return t._data
    inner = getattr(t, "_local_tensor", None)
    if isinstance(inner, FP8ShardedWeight):
        return like(t, inner._data)
    return t


def _plain_state(module, state_dict, prefix, local_metadata) -> None:
    key = prefix + "weight"
    if key in state_dict:
        state_dict[key] = _plain(state_dict[key])


def sharded_weights(model: nn.Module) -> list[FP8ShardedWeight]:
    """The :class:`FP8ShardedWeight` shards of ``model`` (inside FSDP2's DTensors), in module order."""
    out = []
    for p in model.parameters():
        t = p._local_tensor if hasattr(p, "_local_tensor") else p.data
        if isinstance(t, FP8ShardedWeight):
            out.append(t)
    return out


@torch.no_grad()
def _set_scales(weights: list[FP8ShardedWeight], group: dist.ProcessGroup | None) -> None:
    if not weights:
        return
    amax = amaxes_of([w._data for w in weights]).float()  # (n,), one multi-tensor pass
    if dist.is_available() and dist.is_initialized():
        dist.all_reduce(amax, op=dist.ReduceOp.MAX, group=group)
    for w, a in zip(weights, amax):
        w._box.amax = a.clone()
        w._box.scale = amax_scale(a, E4M3).reshape(1, 1)
        w._box.version = w._box.writes


def precompute_fp8_scales(model: nn.Module, group: dist.ProcessGroup | None = None) -> int:
    """Every FP8-all-gathered weight's scale from its amax over all shards, in one all-reduce (MAX) for
    all of them; call after each optimizer step (the train loop does). Returns how many weights."""
    weights = sharded_weights(model)
    _set_scales(weights, group)
    return len(weights)
