"""This machine's devices and native formats, for ``lowprec info``."""
from __future__ import annotations

import pytest

from lowprec.plan.devices import library_versions, local_devices, native_formats_for_arch, native_formats_for_capability

FP8 = {"e4m3", "e5m2"}
BLOCK_SCALED = {"mxfp8", "mxfp6", "mxfp4", "nvfp4"}


@pytest.mark.parametrize("sm, has, lacks", [
    ((6, 1), set(), {"fp16", "bf16"}),
    ((7, 5), {"fp16"}, {"bf16"} | FP8),
    ((8, 0), {"bf16", "fp16", "tf32"}, FP8 | BLOCK_SCALED),
    ((8, 9), FP8, BLOCK_SCALED),
    ((9, 0), {"bf16", "tf32"} | FP8, BLOCK_SCALED),
    ((10, 0), FP8 | BLOCK_SCALED, set()),
    ((10, 3), FP8 | BLOCK_SCALED, set()),
])
def test_formats_by_compute_capability(sm, has, lacks):
    native = set(native_formats_for_capability(sm))
    assert has <= native and not lacks & native


def test_formats_by_amd_architecture():
    assert FP8 <= set(native_formats_for_arch("gfx942:sramecc+:xnack-"))
    assert "mxfp4" not in native_formats_for_arch("gfx942")
    mi355 = set(native_formats_for_arch("gfx950"))
    assert {"mxfp8", "mxfp6", "mxfp4"} <= mi355 and "nvfp4" not in mi355
    assert native_formats_for_arch("gfx1100") is None


def test_cpu_first_and_runs_nothing_natively():
    cpu = local_devices()[0]
    assert (cpu.device, cpu.native) == ("cpu", ())


def test_library_versions_name_the_stack():
    import torch

    versions = dict(library_versions())
    assert versions["torch"] == torch.__version__
    assert {"python", "triton", "numpy", "lowprec"} <= set(versions)
    assert "CUDA" in versions or "ROCm" in versions
