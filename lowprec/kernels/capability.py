"""What a device runs natively, looked up at first use (never at import) and cached per device."""
from __future__ import annotations

import functools
from dataclasses import dataclass

import torch


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
    """MXFP8/MXFP4 and NVFP4 block-scaled GEMMs (sm100 and newer, Blackwell)."""
    triton: bool
    """Triton kernels can run on this device."""

    @property
    def native_formats(self) -> tuple[str, ...]:
        out = ["fp32", "tf32", "bf16", "fp16"] if self.sm else ["fp32", "bf16", "fp16"]
        if self.fp8_gemm:
            out += ["e4m3", "e5m2"]
        if self.mx_gemm:
            out += ["mxfp8", "mxfp6", "mxfp4", "nvfp4"]
        return tuple(out)


def _triton_available() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


@functools.cache
def _capability(device: torch.device) -> Capability:
    if device.type != "cuda":
        return Capability(device.type, device.type, None, False, False, False, False)
    sm = torch.cuda.get_device_capability(device)
    name = torch.cuda.get_device_name(device)
    return Capability(
        "cuda", name, sm,
        fp8_gemm=sm >= (8, 9),
        blockwise_fp8_gemm=sm[0] == 9,
        mx_gemm=sm[0] >= 10,
        triton=_triton_available(),
    )


_KNOWN: dict[torch.device, Capability] = {}
"""Capabilities looked up so far. A compiled graph reads this plain dict (dynamo guards on it); the
lookup itself calls CUDA queries that return Python values, which would break the graph."""


def capability(device: torch.device | str | None = None) -> Capability:
    """The capability of ``device`` (default: the current CUDA device if there is one, else CPU)."""
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    cap = _KNOWN.get(device)
    if cap is None:
        cap = _KNOWN[device] = _capability(device)
    return cap
