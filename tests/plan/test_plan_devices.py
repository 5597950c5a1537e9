"""This machine's devices and what each runs natively, for ``lowprec info``."""
from __future__ import annotations

import pytest

from lowprec.plan.devices import library_versions, local_devices

HP = ("fp16", "bf16", "tf32")
FP8 = ("fp8 per tensor", "fp8 per row")


def test_cpu_first_and_runs_nothing_natively():
    cpu = local_devices()[0]
    assert (cpu.device, cpu.native) == ("cpu", ())


def test_cuda_devices_are_described_by_what_the_kernels_run_there(fake_cuda):
    fake_cuda(("NVIDIA A100-SXM4-80GB", (8, 0), 85.1), ("NVIDIA H100 80GB HBM3", (9, 0), 85.0),
              ("NVIDIA B200", (10, 0), 191.5))
    cpu, a100, h100, b200 = local_devices()
    assert (cpu.device, a100.device, h100.device, b200.device) == ("cpu", "cuda:0", "cuda:1", "cuda:2")
    assert [d.capability for d in (a100, h100, b200)] == ["sm80", "sm90", "sm100"]
    assert (h100.name, h100.memory_gb) == ("NVIDIA H100 80GB HBM3", pytest.approx(85.0))
    assert a100.native == HP
    assert h100.native == HP + FP8 + ("fp8 1x128 blocks",)
    # Blackwell: MXFP8, MXFP4 and NVFP4 on its block-scaled tensor cores (checked on first use); no FP8 blocks
    assert b200.native == HP + FP8 + ("mxfp8", "mxfp4", "nvfp4")


def test_library_versions_name_the_stack():
    import torch

    versions = dict(library_versions())
    assert versions["torch"] == torch.__version__
    assert {"python", "triton", "numpy", "lowprec"} <= set(versions)
    assert "CUDA" in versions or "ROCm" in versions
