"""The one place where every Triton-or-reference choice is made: a cast's backend, from what to cast to how
it runs, and the choices that are not casts (see [Note: routes]).

[Note: routes]
A linear layer casts each high-precision operand along K for one GEMM and, transposed, for another
(see [Note: the three GEMMs] in ``lowprec.recipes``). A :class:`CastSpec` says what one side is (format,
granularity, rounding, the random Hadamard transform, a delayed scale); :func:`route` decides, once,
how a pair of sides runs on a device and returns a :class:`CastRoute`:

=============  =====================================================================  ===========
pairing        how                                                                    reads of x
=============  =====================================================================  ===========
FUSED          one Triton pass writes both sides (and the amax delayed scaling        one (two with
               records)                                                               a tensor amax)
TRANSPOSED     one per-tensor cast; the other side is its data transposed, same scale  one
SEPARATE       each side cast on its own backend                                      one per side
=============  =====================================================================  ===========

Either side may be absent (inference needs no transposed side; backward recasts only weight.T).
A backend is ``triton`` where the device runs Triton and the kernels cover the side
(:func:`lowprec.kernels.triton_plan.covers`), else ``torch`` (the reference); both give the same bits.
Every cast follows a route: ``kernels.cast`` runs the one it is given, and ``kernels.quantize`` and
``kernels.requantize_many`` take :func:`quantize_backend` and :func:`requantize_backend`.

The Triton-or-reference choices that are not casts are made here too, each by a function named for
what it decides and called where the work runs, from what that place knows:

=================================  ==========================================================================
:func:`emulated_operand_backend`   an emulated GEMM's block-scaled operand decoded into BF16 in one Triton
                                   pass (``kernels.gemm``), by its device and the GEMM's dtype
:func:`saved_cast_backend`         an activation saved for backward cast on its route, or by the
                                   reference's ops that compiled code traces (``nn.saved``)
:func:`saved_dequantize_backend`   a saved activation dequantized by one Triton pass in an eager backward
                                   (``nn.saved``), by device, dtype and granularity
:func:`fused_adamw_step`           whether AdamWLP's step takes the fused Triton kernel (``optim.adamw_lp``)
:func:`grouped_rows_backend`       the batched per-expert casts of a ``GroupedLinear`` (``nn.grouped_casts``):
                                   Triton kernels given each expert's amaxes, or the reference
=================================  ==========================================================================

A converted layer asks :func:`route` when its plan is made; the others are asked at each call, from
the device's cached capability. Which CUDA parameters the fused AdamW step covers, and which tensors
``requantize_many``'s one launch takes, are those kernels' own limits, checked where they run.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass, replace

import torch

from lowprec import formats as F
from lowprec._checks import check_choice, fail
from lowprec.kernels.capability import Capability, capability, triton_available
from lowprec.quant import Granularity, GranularityKind, tensorwise


class Backend(enum.Enum):
    TORCH = "torch"
    """The pure-torch reference in ``lowprec.quant`` (any device)."""
    TRITON = "triton"
    """The Triton kernels (CUDA; the CPU only through Triton's interpreter, in tests)."""


BACKENDS = tuple(b.value for b in Backend)


class Pairing(enum.Enum):
    FUSED = "fused"
    TRANSPOSED = "transposed"
    SEPARATE = "separate"


@dataclass(frozen=True, slots=True)
class CastSpec:
    """One side of a cast, resolved: typed format and rounding (see [Note: routes])."""

    fmt: F.Format
    granularity: Granularity
    rounding: F.Rounding = F.Rounding.NEAREST
    hadamard_seed: int | None = None
    """Seed of the 16-point random Hadamard transform applied along the side's reduction dimension
    first (zero-padded to a multiple of 16), or None."""
    delayed: bool = False
    """The scale is given (delayed scaling, per tensor) rather than computed from the data."""
    folded: bool = False
    """An MX cast whose codes are then folded onto one power-of-two scale per row (``lowprec.kernels.fold``):
    the result is the row-wise FP8 operand a folded GEMM multiplies, made in the cast's own passes."""

    @staticmethod
    def of(fmt: str | F.Format, granularity: Granularity, rounding: str | F.Rounding = F.Rounding.NEAREST,
           hadamard_seed: int | None = None, delayed: bool = False, folded: bool = False) -> CastSpec:
        return CastSpec(F.get(fmt), granularity, F.as_rounding(rounding), hadamard_seed, delayed, folded)

    @property
    def stochastic(self) -> bool:
        return self.rounding is F.Rounding.STOCHASTIC

    def scaled_like(self, other: CastSpec | None) -> bool:
        """``other`` takes the same per-tensor scale as this side: one format, one kind of scaling (a
        delayed scale is a format's, from one role's history; a current one, the tensor's)."""
        return other is not None and other.fmt is self.fmt and other.delayed == self.delayed


@dataclass(frozen=True, slots=True)
class CastRoute:
    """How a pair of sides runs (see [Note: routes]); a side that is None is not made."""

    along_k: CastSpec | None
    """x (M, K) cast along K."""
    transposed: CastSpec | None
    """x.T (K, M) cast along M."""
    backend_k: Backend
    backend_t: Backend
    pairing: Pairing
    device_type: str
    templates: tuple | None = None
    """A fused route's launch templates, without and with a given scale (Triton's; see
    ``lowprec.kernels.triton_plan.Template``): made here, eagerly, so that compiled code does not
    trace the planning."""
    unfolded: CastRoute | None = None
    """A fused route with folded sides: the same casts unfolded, which compiled code takes, folding after
    them by ops the compiler fuses (see [Note: folded casts in compiled code] in ``lowprec.kernels.cast``)."""

    @property
    def fused(self) -> bool:
        return self.pairing is Pairing.FUSED


def _covered(spec: CastSpec, cap: Capability) -> bool:
    if not cap.triton:
        return False
    from lowprec.kernels.triton_plan import covers  # imports Triton: only where the device runs it

    return covers(spec)


def backend_for(spec: CastSpec, device: torch.device | str, backend: str | Backend | None = None) -> Backend:
    """The backend of one side on ``device``; ``backend`` forces one (``triton`` must cover the side)."""
    if backend is None:
        return Backend.TRITON if _covered(spec, capability(device)) else Backend.TORCH
    chosen = Backend(check_choice("backend", backend.value if isinstance(backend, Backend) else backend, BACKENDS))
    if chosen is Backend.TRITON:
        from lowprec.kernels.triton_plan import covers

        if not covers(spec):
            fail("backend", f"'torch' for {spec.fmt.name}/{spec.granularity} ({spec.rounding.value}); the "
                 "Triton kernels do not cover this cast", "'triton'")
    return chosen


def _same_cast(a: CastSpec, b: CastSpec) -> bool:
    """One per-tensor deterministic cast serves both sides: the transposed data is the cast's."""
    return (a.granularity.per_tensor and b.granularity == a.granularity and a.fmt is b.fmt
            and not a.stochastic and not b.stochastic and b.hadamard_seed is None and a.hadamard_seed is None
            and a.delayed == b.delayed)


def _fusable(a: CastSpec, b: CastSpec) -> bool:
    """Both sides from one Triton pass: a given scale serves both sides, so it needs one format; the
    Hadamard transform is the transposed side's alone."""
    return a.hadamard_seed is None and a.delayed == b.delayed and (not a.delayed or a.fmt is b.fmt)


def route(along_k: CastSpec | None, transposed: CastSpec | None, device: torch.device | str,
          backend: str | Backend | None = None) -> CastRoute:
    """How ``along_k`` and ``transposed`` (either may be None) run on ``device``. ``backend`` forces
    one for both sides (tests; benchmarks)."""
    if along_k is None and transposed is None:
        fail("along_k/transposed", "at least one side to cast", "None for both")
    device = torch.device(device)
    bk = backend_for(along_k, device, backend) if along_k is not None else None
    bt = backend_for(transposed, device, backend) if transposed is not None else None
    if along_k is None or transposed is None:
        pairing = Pairing.FUSED if (bk or bt) is Backend.TRITON else Pairing.SEPARATE
    elif bk is bt is Backend.TRITON and _fusable(along_k, transposed):
        pairing = Pairing.FUSED  # the kernel shares one cast itself where _same_cast holds
    elif bk is Backend.TORCH and _same_cast(along_k, transposed):
        pairing = Pairing.TRANSPOSED
    else:
        pairing = Pairing.SEPARATE
    templates = None
    if pairing is Pairing.FUSED:
        from lowprec.kernels.triton_plan import template

        delayed = any(s is not None and s.delayed for s in (along_k, transposed))
        templates = (template(along_k, transposed, False), template(along_k, transposed, True) if delayed else None)
    unfolded = None
    if pairing is Pairing.FUSED and any(s is not None and s.folded for s in (along_k, transposed)):
        plain = [None if s is None else replace(s, folded=False) for s in (along_k, transposed)]
        unfolded = route(*plain, device, backend)
    return CastRoute(along_k, transposed, bk or bt, bt or bk, pairing, device.type, templates, unfolded)


def quantize_backend(spec: CastSpec, device: torch.device | str, *, saturate: bool = True,
                     backend: str | Backend | None = None) -> Backend:
    """The backend of a direct quantize (``kernels.quantize``): :func:`backend_for`'s, but the reference
    for a cast that does not saturate (the Triton kernels always do)."""
    chosen = backend_for(spec, device, backend)
    return chosen if saturate else Backend.TORCH


_REQUANTIZE = CastSpec(F.get("e4m3"), tensorwise(), delayed=True)
"""FP8 weights cast again after an optimizer step: E4M3 per tensor, with given scales."""


def requantize_backend(device: torch.device | str, dtype: torch.dtype,
                       backend: str | Backend | None = None) -> Backend:
    """Whether ``kernels.requantize_many`` takes its one Triton launch for many weights (float32 masters
    onto BF16 parameters) or casts them one by one, each on its own backend."""
    chosen = backend_for(_REQUANTIZE, device, backend)
    return chosen if dtype == torch.bfloat16 else Backend.TORCH


def _triton_runs(device: torch.device | str) -> bool:
    device = torch.device(device)
    return device.type == "cuda" and capability(device).triton


def emulated_operand_backend(device: torch.device | str, dtype: torch.dtype) -> Backend:
    """How an emulated GEMM decodes a block-scaled operand into ``dtype`` (``kernels.gemm``): one fused
    Triton pass (decode times block scale) for a BF16 GEMM on a CUDA device that runs Triton, else the
    reference's ops. The same values: only BF16 GEMMs take block values that are exact in BF16."""
    return Backend.TRITON if dtype == torch.bfloat16 and _triton_runs(device) else Backend.TORCH


def fold_backend(device: torch.device | str, *, compiling: bool, backend: str | Backend | None = None) -> Backend:
    """How an MX operand is folded to row scales (``kernels.fold``): Triton eagerly on a CUDA device that
    runs it; the reference's elementwise ops elsewhere and in compiled code (the compiler fuses them).
    ``backend`` forces one (tests)."""
    if backend is not None:
        return Backend(backend)
    return Backend.TRITON if not compiling and _triton_runs(device) else Backend.TORCH


def saved_cast_backend(fmt: str | F.Format, granularity: Granularity, device: torch.device | str, *,
                       compiling: bool, backend: str | Backend | None = None) -> Backend:
    """How an activation saved for backward is cast (``nn.saved``): in compiled code (``compiling``) by
    the reference's few elementwise ops and reductions, which the compiler fuses itself (tracing a
    route's planning would only add compile time); eagerly on the route the device takes for it.
    ``backend`` forces one (tests)."""
    if compiling and backend is None:
        return Backend.TORCH
    return backend_for(CastSpec.of(fmt, granularity), device, backend)


def saved_dequantize_backend(device: torch.device | str, dtype: torch.dtype, granularity: Granularity, *,
                             compiling: bool, backend: str | Backend | None = None) -> Backend:
    """How a saved activation is dequantized in backward (``nn.saved``): one Triton pass
    (``kernels.triton_dequant``) for BF16 saved in ``1 x B`` blocks (B a power of two up to 128, as the
    kernel tiles them) in eager code on a CUDA device that runs Triton; else the reference, whose ops
    compiled code fuses. The same bits. ``backend`` forces one (tests, through Triton's interpreter)."""
    if backend is not None:
        return Backend(check_choice("backend", backend.value if isinstance(backend, Backend) else backend, BACKENDS))
    g, b = granularity, granularity.block_cols
    tiled = g.kind is GranularityKind.BLOCK and g.block_rows == 1 and b <= 128 and b & (b - 1) == 0
    fused = dtype == torch.bfloat16 and tiled and not compiling and _triton_runs(device)
    return Backend.TRITON if fused else Backend.TORCH


def grouped_rows_backend(spec: CastSpec, device: torch.device | str) -> Backend:
    """Whether the batched per-expert casts of ``lowprec.nn.grouped_casts`` run on Triton (the row-wise
    cast's kernel with each row given its expert's amax, ``triton_quant.rows_by_amax``; the tokens'
    per-(expert, feature) cast, ``triton_grouped.columns_by_group``) or on the reference's ops given the
    scales: ``spec`` is the row-wise cast of the experts' format, and Triton runs where it covers it."""
    return backend_for(spec, device)


def padding_backend(device: torch.device | str) -> Backend:
    """Whether experts' token rows move into the weight gradient's padded features-major layout
    (``kernels.grouped_gemm.features_padded``), and experts' weight codes into their transposed copy
    (``kernels.grouped_gemm.transposed``), in one Triton pass each (a CUDA device that runs Triton) or by the
    reference's scatter and copy; the same bits either way."""
    return Backend.TRITON if _triton_runs(device) else Backend.TORCH


def fused_adamw_step(requested: bool | None) -> bool:
    """Whether AdamWLP steps the parameters its fused Triton kernel covers by that kernel
    (``lowprec.optim.fused``): as ``requested``, or by default where a CUDA device runs Triton. True
    where Triton is not installed is refused."""
    if requested is None:
        return torch.cuda.is_available() and capability(torch.device("cuda")).triton
    if requested and not triton_available():
        fail("fused", "False where Triton is not installed", "True")
    return requested
