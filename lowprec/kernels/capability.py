"""What a device's matrix units can do: the one table of these facts.

:func:`cuda_capability` maps a CUDA compute capability to its hardware, with no CUDA query, so the
planner and ``lowprec info`` can ask about any sm, present or not; :func:`capability` looks up a
present device at first use (never at import) and caches it per device. Which low-precision GEMMs
lowprec runs natively on that hardware is not this table's to say: ``lowprec.kernels.gemm.gemm_path``
decides it from a capability, and ``lowprec.kernels.native`` asks it for everyone else.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from lowprec._checks import describe, fail
from lowprec.kernels.first_use import device_key

_TENSOR_CORE_FORMATS: tuple[tuple[tuple[int, int], tuple[str, ...]], ...] = (
    ((7, 0), ("fp16",)),  # Volta
    ((8, 0), ("bf16", "tf32")),  # Ampere
)
"""High-precision formats a compute capability's tensor cores gain (each row includes those above)."""

FP8_SM = (8, 9)
"""FP8 tensor cores: Ada (sm89), Hopper (sm90) and later."""
BLOCKWISE_FP8_MAJOR = 9
"""``torch._scaled_mm`` runs DeepSeek-style 1x128 / 128x128 block-scaled FP8 on Hopper only."""
MX_MAJOR = 10
"""Block-scaled MX and NVFP4 tensor cores: Blackwell (sm100) and later."""


@dataclass(frozen=True, slots=True)
class Capability:
    device_type: str
    name: str
    sm: tuple[int, int] | None
    """CUDA compute capability, None elsewhere."""
    fp8_gemm: bool
    """FP8 tensor-core GEMMs through ``torch._scaled_mm`` (sm89, sm90 and newer)."""
    blockwise_fp8_gemm: bool
    """DeepSeek-style 1x128 x 128x128 and 1x128 x 1x128 FP8 GEMMs through ``torch._scaled_mm`` (sm90)."""
    mx_gemm: bool
    """The hardware has MXFP8/MXFP4 and NVFP4 block-scaled tensor cores (sm100 and newer, Blackwell), which
    ``gemm_path`` sends those recipes' GEMMs to (``kernels.blackwell``, checked on a device's first use)."""
    triton: bool
    """Triton kernels can run on this device."""

    @property
    def hp_formats(self) -> tuple[str, ...]:
        """High-precision formats the device's tensor cores multiply (FP32, which every device runs,
        is not listed): FP16 from sm70, BF16 and TF32 from sm80; none on a CPU. The low-precision
        GEMMs lowprec runs natively are ``lowprec.kernels.native.native_gemms``'s."""
        return tuple(f for need, formats in _TENSOR_CORE_FORMATS if self.sm and self.sm >= need for f in formats)


def cuda_capability(sm: tuple[int, int], *, name: str = "", triton: bool = False) -> Capability:
    """What a CUDA device of compute capability ``sm`` (``(9, 0)`` for sm90) runs, from ``sm`` alone:
    no CUDA query, so any sm can be asked about, present or not. ``triton``: whether Triton can run
    here (a property of the installation, not of the sm)."""
    ok = (isinstance(sm, tuple) and len(sm) == 2
          and all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in sm))
    if not ok:
        fail("sm", "a compute capability (major, minor) of non-negative ints", describe(sm))
    return Capability(
        "cuda", name or f"sm{sm[0]}{sm[1]}", sm,
        fp8_gemm=sm >= FP8_SM,
        blockwise_fp8_gemm=sm[0] == BLOCKWISE_FP8_MAJOR,
        mx_gemm=sm[0] >= MX_MAJOR,
        triton=triton,
    )


def triton_available() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def host_capability(device_type: str, name: str = "") -> Capability:
    """A device with no tensor-core GEMMs lowprec uses (a CPU, an Intel Gaudi): every low-precision
    GEMM is emulated there."""
    return Capability(device_type, name or device_type, None, False, False, False, False)


@functools.cache
def _capability(device: torch.device) -> Capability:
    if device.type != "cuda":
        return host_capability(device.type)
    return cuda_capability(torch.cuda.get_device_capability(device), name=torch.cuda.get_device_name(device),
                           triton=triton_available())


_KNOWN: dict[torch.device, Capability] = {}
"""Capabilities looked up so far. A compiled graph reads this plain dict (dynamo guards on it); the
lookup itself calls CUDA queries that return Python values, which would break the graph."""


def capability(device: torch.device | str | None = None) -> Capability:
    """The capability of ``device`` (default: the current CUDA device if there is one, else CPU)."""
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    device = device_key(device)
    cap = _KNOWN.get(device)
    if cap is None:
        cap = _KNOWN[device] = _capability(device)
    return cap
