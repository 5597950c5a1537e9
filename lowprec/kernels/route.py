"""The one place where a cast's backend is chosen: from what to cast to how it runs.

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
Every cast follows a route: ``kernels.cast`` runs the one it is given and ``kernels.quantize`` asks
:func:`backend_for`. Three Triton-or-reference choices that are not casts are still made where they
run, from the device: the fused BF16 dequantize of an emulated block-scaled GEMM's operands
(``kernels.gemm._operand``, on any CUDA tensor), the fused dequantize of activations saved for backward
(``nn.saved._fused_dequantize``) and AdamWLP's fused step (``optim.adamw_lp``).
"""
from __future__ import annotations

import enum
from dataclasses import dataclass

import torch

from lowprec import formats as F
from lowprec._checks import check_choice, fail
from lowprec.kernels.capability import Capability, capability
from lowprec.quant import Granularity


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

    @staticmethod
    def of(fmt: str | F.Format, granularity: Granularity, rounding: str | F.Rounding = F.Rounding.NEAREST,
           hadamard_seed: int | None = None, delayed: bool = False) -> CastSpec:
        return CastSpec(F.get(fmt), granularity, F.as_rounding(rounding), hadamard_seed, delayed)

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
    return CastRoute(along_k, transposed, bk or bt, bt or bk, pairing, device.type, templates)
