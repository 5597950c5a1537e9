"""What lowprec runs natively on a device, asked of the kernels' own decision.

[Note: one source for "native"]
A low-precision GEMM is native where ``lowprec.kernels.gemm.gemm_path`` sends it to a tensor-core
GEMM (``cublas``) and emulated where it sends it to ``emulated`` (the exact quantized values through
a high-precision GEMM of :func:`lowprec.kernels.gemm.emulation_dtype`). A converted layer, the
conversion report, ``lowprec info``, the planner and the docs' tables all read that one function,
through :func:`is_native` for a pair of casts or :func:`native_gemms` for a device, so a native path
added to ``gemm_path`` appears in all of them at once. A native path that checks itself on first use
(Blackwell's block-scaled GEMMs, [Note: GEMM paths that check themselves]) is native here; ``lowprec info``
adds each device's check outcome. MX operands folded to row scales on FP8 tensor cores are not native
(``GemmPath.FOLDED``: the tensor cores multiply FP8, not MX).
"""
from __future__ import annotations

from dataclasses import dataclass

from lowprec.kernels.capability import Capability
from lowprec.kernels.gemm import GemmPath, gemm_path
from lowprec.quant import Granularity, blockwise, mx, nvfp4, rowwise, tensorwise

NATIVE = GemmPath.CUBLAS
"""The ``gemm_path`` of a native GEMM."""


def is_native(lhs_fmt, lhs_gran: Granularity, rhs_fmt, rhs_gran: Granularity, cap: Capability) -> bool:
    """Whether ``cap``'s device runs the GEMM of these two casts natively (``gemm_path``'s word)."""
    return gemm_path(lhs_fmt, lhs_gran, rhs_fmt, rhs_gran, cap) is NATIVE


@dataclass(frozen=True, slots=True)
class GemmKind:
    """A kind of low-precision GEMM, named by one pair of casts that stands for it."""

    name: str
    lhs: tuple[str, Granularity]
    rhs: tuple[str, Granularity]


GEMM_KINDS: tuple[GemmKind, ...] = (
    GemmKind("fp8 per tensor", ("e4m3", tensorwise()), ("e4m3", tensorwise())),
    GemmKind("fp8 per row", ("e4m3", rowwise()), ("e4m3", rowwise())),
    GemmKind("fp8 1x128 blocks", ("e4m3", blockwise(1, 128)), ("e4m3", blockwise(128, 128))),
    GemmKind("mxfp8", ("e4m3", mx(32)), ("e4m3", mx(32))),
    GemmKind("mxfp6", ("e3m2", mx(32)), ("e3m2", mx(32))),
    GemmKind("mxfp4", ("e2m1", mx(32)), ("e2m1", mx(32))),
    GemmKind("nvfp4", ("e2m1", nvfp4(16)), ("e2m1", nvfp4(16, two_d=True))),
)
"""The kinds of low-precision GEMM the presets and the OCP/NVIDIA formats make, for naming what a
device runs natively (``lowprec info``); a recipe's own GEMMs are asked of :func:`is_native`."""


def native_gemms(cap: Capability) -> tuple[str, ...]:
    """The kinds of :data:`GEMM_KINDS` that ``cap``'s device runs natively."""
    return tuple(k.name for k in GEMM_KINDS if is_native(*k.lhs, *k.rhs, cap))

