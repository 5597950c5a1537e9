"""This machine's devices and native formats, for ``lowprec info``."""
from __future__ import annotations

import pytest

from lowprec.plan.devices import library_versions, local_devices, native_formats_for_arch

FP8 = {"e4m3", "e5m2"}
BLOCK_SCALED = {"mxfp8", "mxfp6", "mxfp4", "nvfp4"}


def test_formats_by_amd_architecture():
    assert FP8 <= set(native_formats_for_arch("gfx942:sramecc+:xnack-"))
    assert "mxfp4" not in native_formats_for_arch("gfx942")
    mi355 = set(native_formats_for_arch("gfx950"))
    assert {"mxfp8", "mxfp6", "mxfp4"} <= mi355 and "nvfp4" not in mi355
    assert native_formats_for_arch("gfx1100") is None


def test_cpu_first_and_runs_nothing_natively():
    cpu = local_devices()[0]
    assert (cpu.device, cpu.native) == ("cpu", ())


def test_cuda_devices_are_described_by_their_compute_capability(fake_cuda):
    fake_cuda(("NVIDIA A100-SXM4-80GB", (8, 0), 85.1), ("NVIDIA H100 80GB HBM3", (9, 0), 85.0),
              ("NVIDIA B200", (10, 0), 191.5))
    cpu, a100, h100, b200 = local_devices()
    assert (cpu.device, a100.device, h100.device, b200.device) == ("cpu", "cuda:0", "cuda:1", "cuda:2")
    assert [d.capability for d in (a100, h100, b200)] == ["sm80", "sm90", "sm100"]
    assert (h100.name, h100.memory_gb) == ("NVIDIA H100 80GB HBM3", pytest.approx(85.0))
    assert set(a100.native) == {"fp16", "bf16", "tf32"}
    assert set(h100.native) == {"fp16", "bf16", "tf32"} | FP8
    assert set(b200.native) == {"fp16", "bf16", "tf32"} | FP8 | BLOCK_SCALED


def test_library_versions_name_the_stack():
    import torch

    versions = dict(library_versions())
    assert versions["torch"] == torch.__version__
    assert {"python", "triton", "numpy", "lowprec"} <= set(versions)
    assert "CUDA" in versions or "ROCm" in versions
