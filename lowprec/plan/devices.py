"""This machine: its devices, the element formats each runs natively, and library versions.

Native formats of a CUDA device are ``lowprec.kernels.capability``'s, the facts the kernels choose
their backends by (and the accelerator table's NVIDIA rows are held to); an AMD or Intel device is
looked up by architecture in that table. A CPU runs none of them natively: lowprec emulates every
low-precision format there.
"""
from __future__ import annotations

import importlib.metadata
import importlib.util
import os
import platform
from dataclasses import dataclass

import torch

from lowprec.kernels.capability import capability
from lowprec.plan.gpus import GPUS, arch_of_sm


def native_formats_for_arch(arch: str) -> tuple[str, ...] | None:
    """Native element formats of a non-CUDA architecture in the accelerator table (``gfx942``...)."""
    for g in GPUS.values():
        if arch.split(":")[0] == g.arch:
            return g.native_elements
    return None


@dataclass(frozen=True, kw_only=True, slots=True)
class Device:
    device: str
    """``cpu`` or ``cuda:<i>``."""
    name: str
    capability: str
    memory_gb: float | None
    native: tuple[str, ...] | None
    """Native element formats; empty for a CPU, None when unknown."""


def _cpu() -> Device:
    try:
        memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 1e9
    except (ValueError, OSError, AttributeError):  # not POSIX
        memory = None
    name = f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores"
    return Device(device="cpu", name=name, capability="-", memory_gb=memory,
                  native=capability("cpu").native_formats)


def _accelerator(i: int) -> Device:
    props = torch.cuda.get_device_properties(i)
    arch = getattr(props, "gcnArchName", "") if torch.version.hip else ""
    if arch:  # ROCm reports AMD devices through torch.cuda
        arch, native = arch.split(":")[0], native_formats_for_arch(arch)
    else:
        cap = capability(torch.device("cuda", i))
        arch, native = arch_of_sm(cap.sm), cap.native_formats
    return Device(device=f"cuda:{i}", name=props.name, capability=arch,
                  memory_gb=props.total_memory / 1e9, native=native)


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
