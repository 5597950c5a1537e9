"""FP8 primary weights: a converted layer's weight held as E4M3 codes and FP32 scales, with no
high-precision copy in the model.

[Note: FP8 primary weights]
``lowprec.convert(model, recipe, fp8_weights=True)`` replaces the weight of every layer that runs the
recipe by an :class:`FP8Weight`: a parameter that autograd, ``nn.Module`` and the optimizer see as a
tensor of the model's dtype (BF16 or FP16) and shape, but that stores only the E4M3 codes (1 byte per
element), their FP32 scales (one per tensor, or one per 128x128 block) and the amax of the weight they
were made from. Its gradient is a plain tensor of the model's dtype, accumulated in FP32 as any.

*How it computes.* Where the recipe's two weight casts (fprop's ``weight``, dgrad's ``weight.T``) are
exactly the stored format -- E4M3 per tensor (``fp8-current``, ``fp8-delayed``) or E4M3 in 128x128
blocks (``fp8-blockwise``) -- the GEMMs take the codes as they are: the forward GEMM reads them, and
backward reads them transposed (a per-tensor scale serves both; a 128x128 block of W.T is the transpose
of a block of W, with the same amax), made again from the parameter rather than saved from forward.
Nothing is cast. Other recipes (row-wise, MX, NVFP4) store 128x128 blocks, the finest FP8 storage with
FP32 scales, and decode the weight at every forward and cast it as the recipe says: two roundings, and
the conversion warns.

*Where the scale comes from.* Codes are always scaled by the current amax of the weight (never by a
delayed history: a weight's amax is known exactly when it changes, in the optimizer step). Under
``fp8-delayed`` the forward then records the stored amax into the weight's history as before, so the
history spans the same steps; only the weight's scale differs from a BF16-weight layer's (current where
that one would take the delayed scale), as under FSDP2's FP8 all-gather.

*How it trains.* The FP32 master of each FP8 weight lives only in ``lowprec.optim.Optimizer`` (see
[Note: master weights] there); after every step the optimizer writes the master into the parameter
with :meth:`FP8Weight.requantize_` (``lowprec.nn.fp8_requantize.requantize_all``, for all of them at
once). The master is first rounded to the parameter's dtype and then quantized, which is exactly the
cast a layer with BF16 weights and FP32 masters makes of its weight at each forward: the model computes
bit for bit as that one, under ``fp8-current`` and ``fp8-blockwise``, while it stores 1 byte per weight
instead of 2. Until an optimizer takes it, an :class:`FP8Weight` keeps the high-precision value it was
made from (:meth:`FP8Weight.take_initial`), so that the master starts from the model's weights, not
from their FP8 rounding; the optimizer then drops it.

*Everything else.* Any other op on the parameter (a high-precision layer, ``torch.norm``, a
``state_dict`` copy) sees the decoded weight, in the parameter's dtype. ``copy_`` into it quantizes
(``load_state_dict``, DDP's first broadcast), through any alias (``.detach()``), and drops the initial
value for all of them unless it changed no code; other in-place writes are refused, since the codes
cannot take an update. Under DDP, ``lowprec.distributed.launch.wrap`` gives every rank rank 0's initial
value first (``share_fp8_initials``). Its
``state_dict`` entry is the decoded weight, so a plain model loads it; a checkpoint's masters are in
the optimizer's state.

*Where each piece is.* This file holds the parameter; ``lowprec.nn.fp8_convert`` the choice of
storage (:func:`~lowprec.nn.fp8_convert.storage_for`) and the swap into converted layers;
``lowprec.nn.fp8_requantize`` the optimizer's write of its masters; ``lowprec.nn.fp8_state_dict`` the
decoded ``state_dict`` entry; ``lowprec.nn.stored_codes`` the codes as GEMM operands from plain tensors,
which is how a compiled forward reads them (see [Note: FP8 primary weights under torch.compile] there).
"""
from __future__ import annotations

import torch
from torch.utils import _pytree as pytree

from lowprec import kernels as K
from lowprec._checks import fail
from lowprec.nn.casts import QuantizedWeight
from lowprec.nn.stored_codes import E4M3, StoredCodes
from lowprec.quant import Granularity, QuantizedTensor
from lowprec.quant.scales import amax_scale

aten = torch.ops.aten


def _quantize(hp: torch.Tensor, granularity: Granularity, amax: bool) -> tuple[QuantizedTensor, torch.Tensor | None]:
    # the weight's own current scale, on the backend the device takes (same bits on every backend)
    q = K.quantize(hp, E4M3, granularity)
    return q, hp.detach().abs().amax().float() if amax else None


class _Held:
    """The high-precision value an :class:`FP8Weight` was made from, one holder for the parameter and every
    alias of it (``nn.Parameter``, ``.detach()``): codes written through one alias (DDP's first broadcast
    copies into a detached alias) drop it for all, so no alias hands a stale value to the optimizer."""

    __slots__ = ("value",)

    def __init__(self, value: torch.Tensor | None) -> None:
        self.value = value


class FP8Weight(QuantizedWeight):
    """A weight stored as E4M3 codes with FP32 scales, seen as a tensor of ``dtype`` (see [Note: FP8
    primary weights]). Make one with :meth:`of`."""

    @staticmethod
    def __new__(cls, data, scale, amax, granularity, shape, dtype, initial=None):
        return torch.Tensor._make_wrapper_subclass(cls, shape, dtype=dtype, device=data.device)

    def __init__(self, data: torch.Tensor, scale: torch.Tensor, amax: torch.Tensor | None, granularity: Granularity,
                 shape: torch.Size, dtype: torch.dtype, initial: torch.Tensor | _Held | None = None) -> None:
        self._data = data  # (N_pad, K_pad) float8_e4m3fn
        self._scale = scale  # (1, 1) or (N_pad / 128, K_pad / 128) float32
        self._amax = amax  # () float32, for a delayed recipe's history only (None otherwise)
        self._granularity = granularity
        self._held = initial if isinstance(initial, _Held) else _Held(initial)

    @property
    def _initial(self) -> torch.Tensor | None:
        return self._held.value

    @property
    def initial(self) -> torch.Tensor | None:
        """The high-precision value this was made from, until the optimizer takes it (None after)."""
        return self._held.value

    @_initial.setter
    def _initial(self, value: torch.Tensor | None) -> None:
        self._held.value = value

    @classmethod
    def of(cls, weight: torch.Tensor, granularity: Granularity, amax: bool = False) -> FP8Weight:
        """``weight`` (2-D, bfloat16 or float16) quantized; it is kept until :meth:`take_initial`.
        ``amax``: also keep the weight's amax (for a recipe that records it in a delayed history)."""
        hp = weight.detach()
        q, amax = _quantize(hp, granularity, amax)
        return cls(q.data, q.scale, amax, granularity, hp.shape, hp.dtype, hp)

    __torch_function__ = torch._C._disabled_torch_function_impl

    def __repr__(self) -> str:
        return f"FP8Weight(shape={tuple(self.shape)}, dtype={self.dtype}, granularity={self._granularity})"

    # ---- what the layer and the optimizer use ----------------------------------------------------

    @property
    def granularity(self) -> Granularity:
        return self._granularity

    @property
    def resident(self) -> bool:
        return True

    @property
    def amax(self) -> torch.Tensor:
        if self._amax is None:
            fail("weight", "an FP8 weight made for a delayed recipe to record its amax (convert with that recipe)",
                 "one made for a recipe without delayed weight scaling")
        return self._amax

    def dequantize(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        """The decoded weight, a plain tensor of ``dtype`` (default: the parameter's)."""
        return self.quantized().dequantize(dtype or self.dtype)

    def take_initial(self) -> torch.Tensor:
        """The high-precision weight this was made from, handed over once (to become the FP32 master);
        without it (taken already, or loaded), the decoded weight."""
        hp, self._initial = self._initial, None
        return hp if hp is not None else self.dequantize()

    agreement = None
    """How the ranks holding the other rows of this weight agree on its amax (a callable taking a float32
    tensor of amaxes and setting each, in place, to its maximum over those ranks), or None: this tensor is
    the whole weight. Set on FSDP2's shards (``lowprec.distributed.fp8_weight_shards``): a per-tensor scale
    is the whole weight's."""

    def _quantize_src(self, src: torch.Tensor) -> tuple[QuantizedTensor, torch.Tensor | None]:
        """``src`` rounded to the parameter's dtype and quantized as this weight stores it, with the
        whole weight's scale where this is a shard; and its amax where the recipe records one."""
        hp = (src.dequantize() if isinstance(src, FP8Weight) else src).detach().to(self.dtype)
        if self.agreement is None or not self._granularity.per_tensor:  # blocks lie within a rank's rows
            return _quantize(hp, self._granularity, self._amax is not None)
        amax = hp.abs().amax().float().reshape(1) if hp.numel() else hp.new_zeros(1, dtype=torch.float32)
        self.agreement(amax)
        scale = amax_scale(amax[0], E4M3)
        if hp.numel():
            q = K.quantize(hp, E4M3, self._granularity, scale=scale)
        else:  # a rank holding no rows keeps the agreed scale all the same (its all-gather sends it)
            q = QuantizedTensor(self._data.new_empty(hp.shape), scale.reshape(1, 1), E4M3, self._granularity,
                                hp.shape, self.dtype)
        return q, amax[0] if self._amax is not None else None

    @torch.no_grad()
    def requantize_(self, src: torch.Tensor) -> None:
        """Store ``src`` (an FP32 master, or any tensor of this shape), rounded to the parameter's dtype
        and quantized; counts as a write for autograd's version checks."""
        self._store(*self._quantize_src(src))

    @torch.no_grad()
    def copy_from_(self, src: torch.Tensor) -> None:
        """``copy_``: ``src`` quantized and stored, unless it gives the codes already held (a copy of the
        weight's own value: DDP's first broadcast on every rank once ranks hold the same weights), which
        keeps the initial value for the optimizer to take."""
        q, amax = self._quantize_src(src)
        same = torch.equal(q.data.view(torch.uint8), self._data.view(torch.uint8)) and torch.equal(q.scale, self._scale)
        if not same or (amax is not None and not torch.equal(amax, self._amax)):
            self._store(q, amax)

    @torch.no_grad()
    def share_initial_(self, initial: torch.Tensor) -> None:
        """Hold ``initial`` (the high-precision weight, as another rank made it) instead of this one's own:
        stored as codes and kept for the optimizer to take."""
        self._store(*self._quantize_src(initial))
        self._initial = initial

    def _store(self, q: QuantizedTensor, amax: torch.Tensor | None) -> None:
        # in place: a compiled graph holds these tensors as its inputs
        self._data.copy_(q.data)
        self._scale.copy_(q.scale)
        if amax is not None:
            self._amax.copy_(amax)
        self._stored()

    def _stored(self) -> None:
        """After new codes were written: the initial value is gone, and autograd sees a new version."""
        self._initial = None
        torch.autograd.graph.increment_version(self)

    @property
    def nbytes_held(self) -> int:
        """Bytes of the tensors this parameter holds (codes, scales, amax; the initial value until taken)."""
        held = [self._data, self._scale, self._amax, self._initial]
        return sum(t.numel() * t.element_size() for t in held if t is not None)

    # ---- torch ---------------------------------------------------------------------------------

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _ALIASING:  # nn.Parameter and .detach(): the same storage, still FP8
            t = args[0]
            return cls(t._data, t._scale, t._amax, t._granularity, t.shape, t.dtype, t._held)  # one holder
        if func is aten.copy_.default and isinstance(args[0], cls):
            args[0].copy_from_(args[1])
            return args[0]
        if func is aten._to_copy.default and isinstance(args[0], cls) and _moves_only(args[0], kwargs):
            t, device = args[0], kwargs.get("device", args[0].device)
            initial = t._initial.to(device) if t._initial is not None else None
            amax = t._amax.to(device) if t._amax is not None else None
            return cls(t._data.to(device), t._scale.to(device), amax, t._granularity, t.shape, t.dtype, initial)
        schema = func._schema
        if any(a.alias_info is not None and a.alias_info.is_write for a in schema.arguments):
            fail("weight", "no in-place write into an FP8 weight but copy_ (lowprec.optim.Optimizer updates its "
                 "FP32 master and requantizes it)", func.name())

        def hp(t):
            return t.dequantize() if isinstance(t, cls) else t

        return func(*pytree.tree_map(hp, args), **pytree.tree_map(hp, kwargs))

    def __tensor_flatten__(self):
        names = ["_data", "_scale"] + (["_amax"] if self._amax is not None else [])
        return names, (self._granularity, self.dtype)

    @staticmethod
    def __tensor_unflatten__(inner, meta, outer_size, outer_stride):
        granularity, dtype = meta
        return FP8Weight(inner["_data"], inner["_scale"], inner.get("_amax"), granularity, outer_size, dtype)


_ALIASING = {aten.detach.default, aten.alias.default}


def _moves_only(t: FP8Weight, kwargs: dict) -> bool:
    """A ``.to()`` that changes at most the device (``module.to(device)``)."""
    return set(kwargs) <= {"device", "dtype", "layout", "non_blocking", "copy"} and \
        kwargs.get("dtype", t.dtype) == t.dtype and kwargs.get("layout", torch.strided) == torch.strided


def stored_codes(weight: torch.Tensor) -> StoredCodes | None:
    """``weight``'s codes, scales and amax as plain tensors (the same tensors, which the optimizer's
    requantization writes in place), or None for any weight but an :class:`FP8Weight`."""
    if not isinstance(weight, FP8Weight):
        return None
    return StoredCodes(weight._granularity, weight._data, weight._scale, weight._amax)
