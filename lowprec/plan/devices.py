"""This machine: its devices, what each runs natively, and library versions.

What a device runs natively is what the kernels decide there: the high-precision formats its tensor
cores multiply (``Capability.hp_formats``) and the kinds of low-precision GEMM ``gemm_path`` runs on
them (``lowprec.kernels.native.native_gemms``; see [Note: one source for "native"] there). A ROCm
device is looked up as the kernels look it up, by the compute capability torch reports for it. A CPU
runs none of them natively: lowprec emulates every low-precision GEMM there.
"""
from __future__ import annotations

import importlib.metadata
import importlib.util
import os
import platform
from dataclasses import dataclass

import torch

from lowprec.kernels.capability import Capability, capability
from lowprec.kernels.native import native_gemms
from lowprec.plan.gpus import arch_of_sm


def native_of(cap: Capability) -> tuple[str, ...]:
    """What ``cap``'s device multiplies natively: high-precision formats, then low-precision GEMM kinds."""
    return cap.hp_formats + native_gemms(cap)


@dataclass(frozen=True, kw_only=True, slots=True)
class Device:
    device: str
    """``cpu`` or ``cuda:<i>``."""
    name: str
    capability: str
    memory_gb: float | None
    native: tuple[str, ...]
    """What it multiplies natively (:func:`native_of`); empty for a CPU."""


def _cpu() -> Device:
    try:
        memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 1e9
    except (ValueError, OSError, AttributeError):  # not POSIX
        memory = None
    name = f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores"
    return Device(device="cpu", name=name, capability="-", memory_gb=memory, native=native_of(capability("cpu")))


def _accelerator(i: int) -> Device:
    props = torch.cuda.get_device_properties(i)
    cap = capability(torch.device("cuda", i))  # ROCm reports its devices through torch.cuda too
    arch = getattr(props, "gcnArchName", "") if torch.version.hip else ""
    return Device(device=f"cuda:{i}", name=props.name, capability=arch.split(":")[0] or arch_of_sm(cap.sm),
                  memory_gb=props.total_memory / 1e9, native=native_of(cap))


def local_devices() -> list[Device]:
    """The CPU, then every CUDA (or ROCm) device torch sees."""
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    return [_cpu()] + [_accelerator(i) for i in range(count)]


def _version(dist: str) -> str:
    if importlib.util.find_spec(dist) is None:
        return "not installed"
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return "importable, version unknown"


def library_versions() -> list[tuple[str, str]]:
    """``(library, version)`` for python, torch, CUDA (or ROCm), triton, numpy and lowprec."""
    import lowprec

    if torch.version.hip:
        runtime = ("ROCm", torch.version.hip)
    else:
        runtime = ("CUDA", torch.version.cuda or "none (CPU-only torch)")
    return [("python", platform.python_version()), ("torch", torch.__version__), runtime,
            ("triton", _version("triton")), ("numpy", _version("numpy")), ("lowprec", lowprec.__version__)]
