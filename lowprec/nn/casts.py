"""Operand casts as a layer's plan says, with the state they read and keep.

:func:`cast_operand` casts one operand along the routes of its :class:`~lowprec.nn.plan.OperandPlan`,
taking delayed scales from the layer's amax history and recording its amax. The state a layer keeps
between calls is a :class:`CastState`: the delayed-scaling history, the weight casts held inside
:func:`lowprec.nn.cached_weight_casts` (a :class:`WeightCasts`), and the :class:`InputShare` of the
layers that read the same input (``convert`` makes the groups: q/k/v, gate/up).
"""
from __future__ import annotations

import weakref
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol

from lowprec import kernels as K
from lowprec import recipes as R
from lowprec.nn.delayed import DelayedState
from lowprec.nn.plan import OperandPlan, codes_serve
from lowprec.nn.recomputation import recomputing
from lowprec.nn.stored_codes import stored_operand
from lowprec.quant import Granularity, QuantizedTensor
from lowprec.quant.scales import amax_scale

Operand = QuantizedTensor | torch.Tensor
"""A GEMM operand: quantized, or a plain high-precision tensor."""


def _hp_side(x2: torch.Tensor, c: R.Cast) -> torch.Tensor:
    """A side the recipe does not quantize: kept, or cast to its 16-bit format (bf16, fp16)."""
    return x2 if c.format is None else x2.to(c.fmt.torch_dtype)


def _scale(spec: K.CastSpec | None, role: R.Role, state: DelayedState | None, current: torch.Tensor | None):
    if spec is None or not spec.delayed or state is None:
        return None
    return state.scale(role, spec.fmt, current)


def agreed_scale(x2: torch.Tensor, spec: K.CastSpec, group: dist.ProcessGroup | None) -> torch.Tensor | None:
    """The per-tensor current scale of the whole tensor ``x2`` is a part of, under tensor parallelism: its
    amax is the max over ``group`` of every part's (one small all-reduce), so every rank casts its part
    as one process casts the whole (see [Note: amaxes under tensor parallelism] in
    ``lowprec.distributed.tensor_parallel``). None (the cast computes its own scale) without a group or
    for any other scaling: blocks and MX blocks lie inside one rank's part, and a row split by the group
    takes a scale per part. A NaN anywhere makes every part's scale NaN, as it would the whole's."""
    if group is None or spec.delayed or not spec.granularity.per_tensor:
        return None
    amax = x2.detach().abs().amax().float()
    amax = torch.where(torch.isnan(amax), torch.inf, amax)  # a MAX reduction may drop a NaN; inf stays
    return amax_scale(funcol.all_reduce(amax, "max", group), spec.fmt)  # a non-finite amax: a NaN scale


def record_weight_amax(delayed: DelayedState | None, op: OperandPlan, amax: torch.Tensor | None,
                       record: bool = True) -> None:
    """The weight's amax into its delayed-scaling history, where ``op`` (the weight's plan) scales by
    delay and the forward records (``record``: training, not evaluation). ``amax`` None: the amax it
    recorded last again (a cast reused from the cache: every forward records the weight, cached or not,
    and compiled code, which holds no cache, does the same, so the history spans the same steps either
    way). Every record of a weight's amax goes through here: casts, FP8 weights, lazy initialisation. None
    in a recomputed forward (see [Note: recomputed forwards] in ``lowprec.nn.recomputation``)."""
    if record and op.delayed and delayed is not None and not recomputing():
        delayed.record(op.role, amax if amax is not None else delayed.last(op.role))


def cast_operand(x2: torch.Tensor, op: OperandPlan, need_k: bool, need_t: bool, state: DelayedState | None,
                 record: bool, group: dist.ProcessGroup | None = None) -> tuple[Operand | None, Operand | None]:
    """``(x2 cast along K or None, x2.T cast or None)``, the sides asked for, as ``op`` says. Delayed
    scales come from ``state`` before this tensor's amax is recorded (once, and only with ``record``:
    evaluation must not move the training scales). ``group``: the tensor-parallel group ``x2`` is a part
    of, whose per-tensor current scales are agreed (see :func:`agreed_scale`)."""
    route = op.both if need_k and need_t else op.along_k if need_k else op.transposed
    k = t = None
    if route is not None:
        a, b = route.along_k, route.transposed
        recording = record and op.delayed and state is not None
        # Compiled code cannot branch on whether the role has a history, so it takes x2's amax either way
        # (see DelayedState.scale); that one amax is also what it records, so the compiler reduces x2 once,
        # inside the kernel that produced it, and the cast kernel records nothing. Eager code records the
        # amax the cast kernel takes on its way (the same value: a maximum is exact).
        current = (x2.detach().abs().amax().float()
                   if op.delayed and state is not None and torch.compiler.is_compiling() else None)
        scale_k = _scale(a, op.role, state, current) if a is None or a.delayed else agreed_scale(x2, a, group)
        # one scale tensor where the sides are scaled alike, so a fused pass can serve both with it
        scale_t = (scale_k if a is not None and a.scaled_like(b) else
                   _scale(b, op.role, state, current) if b is None or b.delayed else agreed_scale(x2, b, group))
        k, t, amax = K.cast(x2, route, scale_k=scale_k, scale_t=scale_t,
                            record_amax=recording and current is None)
        if recording:
            state.record(op.role, amax if current is None else current)
    if need_k and k is None:
        k = _hp_side(x2, op.cast_k)
    if need_t and t is None:
        t = _hp_side(x2.t(), op.cast_t)
    return k, t


class QuantizedWeight(torch.Tensor):
    """A weight parameter that arrives quantized (FSDP2's FP8 all-gather:
    ``lowprec.distributed.fp8_weights``): the layer takes its operands as they are instead of casting."""

    _data: torch.Tensor
    """The E4M3 codes, of the weight's shape (or padded to whole blocks)."""
    _scale: torch.Tensor
    """Their FP32 scales: (1, 1) per tensor, one per block otherwise."""

    def quantized(self, transposed: bool = False) -> QuantizedTensor:
        """The weight's cast (or weight.T's, for dgrad): :func:`weight_operand`."""
        return weight_operand(self, transposed)

    @property
    def amax(self) -> torch.Tensor:
        """The high-precision weight's amax, for the delayed-scaling history."""
        raise NotImplementedError

    @property
    def granularity(self) -> Granularity:
        """How the codes are scaled (see :func:`serves`)."""
        raise NotImplementedError

    def dequantize(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        """The decoded weight, a plain tensor."""
        return self.quantized().dequantize(dtype or self.dtype)

    @property
    def resident(self) -> bool:
        """The parameter itself (FP8 primary weights), alive from forward to backward: backward takes
        weight.T from it rather than keep a transposed copy (an all-gathered weight is freed between)."""
        return False


@dataclass(frozen=True, slots=True)
class WeightCasts:
    """A weight's casts kept inside :func:`lowprec.nn.cached_weight_casts`, for the version of the
    weight they were made from."""

    key: tuple
    """(the weight's version counter, its storage address, the plan): a change to any recasts."""
    fprop: Operand
    dgrad: Operand | None
    """weight.T's cast; None when the forward that made the entry did not need it."""
    recorded: bool
    """The weight's amax went into the delayed-scaling history when these were made."""


class InputShare:
    """The casts of the last input one layer of a group cast, for the other layers of the group that
    read the same tensor next (attention's q, k and v projections; the FFN's gate and up): they reuse
    its casts rather than cast it again, which spares the reads and keeps one saved copy where there
    were three. ``lowprec.convert`` makes a group's share and gives it to each of its layers.

    The entry holds the input weakly and is read and replaced as one tuple, so threads (``nn.DataParallel``
    replicas) never take each other's casts. A write the version counter does not see (through
    ``x.data``) between two layers reading ``x`` is not noticed, as for the weight cache."""

    __slots__ = ("_entry", "names", "__weakref__")

    def __init__(self, names: tuple[str, ...] = ()) -> None:
        self._entry: tuple | None = None  # (weakref to the input, key, casts)
        self.names = names
        """The layers of the group, for reports."""

    def get(self, x: torch.Tensor, key: tuple) -> tuple | None:
        entry = self._entry
        if entry is not None and entry[1] == key and entry[0]() is x:
            return entry[2]
        return None

    def put(self, x: torch.Tensor, key: tuple, casts: tuple) -> None:
        self._entry = (weakref.ref(x, self._forget), key, casts)

    def _forget(self, ref: weakref.ref) -> None:
        entry = self._entry
        if entry is not None and entry[0] is ref:
            self._entry = None

    @property
    def holding(self) -> bool:
        return self._entry is not None


class CastState:
    """What a converted layer keeps between calls for its casts (the plan itself is frozen)."""

    __slots__ = ("delayed", "weight_cache", "cache_depth", "share", "group")

    def __init__(self) -> None:
        self.delayed: DelayedState | None = None
        self.weight_cache: WeightCasts | None = None
        self.cache_depth = 0
        """How many :func:`lowprec.nn.cached_weight_casts` regions hold the layer (0: cast at every forward)."""
        self.share: InputShare | None = None
        self.group: dist.ProcessGroup | None = None
        """The tensor-parallel group the layer's operands are parts of, whose per-tensor current scales
        are agreed (see :func:`agreed_scale`); None outside tensor parallelism."""

    @property
    def caching(self) -> bool:
        """Inside :func:`lowprec.nn.cached_weight_casts`, in eager code (a compiled graph holds no cache)."""
        return self.cache_depth > 0 and not torch.compiler.is_compiling()


def shared_casts(x: torch.Tensor, op: OperandPlan, share: InputShare | None, how: tuple, make):
    """``make()``, the casts of a layer's input ``x``, or those its group's share holds when another layer
    cast the same unchanged tensor the same way (``op`` and ``how``: what else decides them; see
    :class:`InputShare`). Under ``torch.compile`` the compiler removes repeated casts itself; inference
    tensors have no version counter to key on."""
    if share is None or not op.shareable or torch.compiler.is_compiling() or x.is_inference():
        return make()
    key = (x._version, x.shape, x.stride(), x.dtype, x.device, op, *how)
    casts = share.get(x, key)
    if casts is None:
        casts = make()
        share.put(x, key, casts)
    return casts


def input_casts(x: torch.Tensor, x2: torch.Tensor, op: OperandPlan, need_t: bool, state: CastState,
                record: bool) -> tuple[Operand, Operand | None]:
    """:func:`cast_operand` of a layer's input ``x`` (``x2``: its 2-D view), shared as :func:`shared_casts`
    says."""
    return shared_casts(x, op, state.share, (need_t,),
                        lambda: cast_operand(x2, op, True, need_t, state.delayed, record, state.group))


def weight_operand(weight: QuantizedWeight, transposed: bool = False) -> QuantizedTensor:
    """The weight's codes and scales as the fprop operand, or transposed as dgrad's (``weight.T``), built
    from its inner tensors: compiled code reads a subclass's inner tensors, but a method of the subclass
    returning no tensor ends the graph (and runs the layer eagerly)."""
    return stored_operand(weight._data, weight._scale, weight.granularity, weight.shape, weight.dtype, transposed)


def serves(weight: QuantizedWeight, op: OperandPlan | None) -> bool:
    """The weight's codes are exactly ``op``'s weight casts (else the layer decodes and casts them). A
    function of the weight's ``granularity``, not a method of the weight: compiled code cannot pass the
    plan into a method of a tensor subclass."""
    return codes_serve(weight.granularity, op)


def weight_casts(weight: torch.Tensor, op: OperandPlan, state: CastState, need_t: bool,
                 record: bool, stored: QuantizedTensor | None = None) -> tuple[Operand, Operand | None]:
    """(weight cast for fprop, weight.T cast for dgrad or None): cast now, or inside
    :func:`lowprec.nn.cached_weight_casts` taken from the cache until the weight changes. ``record``:
    add the weight's amax to the delayed-scaling history (training forwards, not evaluation).
    ``stored``: an FP8 primary weight's codes in another format than the recipe's, decoded and cast."""
    caching = state.caching
    if stored is None and isinstance(weight, QuantizedWeight):
        if serves(weight, op):
            if op.delayed:  # a weight gathered for a recipe without delayed scaling holds no amax
                record_weight_amax(state.delayed, op, weight.amax, record)
            return weight_operand(weight), weight_operand(weight, transposed=True) if need_t else None
        stored = weight_operand(weight)
    if stored is not None:
        # FP8 weights stored in another format than the recipe's: decoded, then cast as it says
        key = (weight._version, stored.data.data_ptr(), op) if caching else None
        weight = stored.dequantize(weight.dtype)
    else:
        key = (weight._version, weight.data_ptr(), op) if caching else None
    cached = state.weight_cache
    if (caching and cached is not None and cached.key == key and (cached.dgrad is not None or not need_t)
            and (cached.recorded or not record)):  # a training forward needs a cast whose amax was recorded
        record_weight_amax(state.delayed, op, None, record)
        return cached.fprop, cached.dgrad
    qw, qw_t = cast_operand(weight.detach(), op, True, need_t, state.delayed, record, state.group)
    if caching:
        state.weight_cache = WeightCasts(key, qw, qw_t, record)
    return qw, qw_t
