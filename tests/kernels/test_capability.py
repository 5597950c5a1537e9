"""Device capability: what a CUDA compute capability runs natively, from the sm alone and through
the lookup of a present device."""
from __future__ import annotations

import pytest
import torch

from lowprec.kernels.capability import capability, cuda_capability

FP8 = {"e4m3", "e5m2"}
BLOCK_SCALED = {"mxfp8", "mxfp6", "mxfp4", "nvfp4"}
AMPERE = {"fp16", "bf16", "tf32"}


# What each architecture's tensor cores take, from NVIDIA's architecture whitepapers: FP16 from
# Volta, BF16/TF32 from Ampere, FP8 from Ada/Hopper, MX and NVFP4 block scaling from Blackwell;
# cuBLAS's 1x128/128x128 block-scaled FP8 through torch._scaled_mm on Hopper only.
@pytest.mark.parametrize("sm, native, blockwise", [
    ((6, 1), set(), False),
    ((7, 0), {"fp16"}, False),
    ((7, 5), {"fp16"}, False),
    ((8, 0), AMPERE, False),
    ((8, 6), AMPERE, False),
    ((8, 9), AMPERE | FP8, False),
    ((9, 0), AMPERE | FP8, True),
    ((10, 0), AMPERE | FP8 | BLOCK_SCALED, False),
    ((10, 3), AMPERE | FP8 | BLOCK_SCALED, False),
])
def test_formats_by_compute_capability(sm, native, blockwise):
    cap = cuda_capability(sm)
    assert (cap.device_type, cap.sm, cap.name) == ("cuda", sm, f"sm{sm[0]}{sm[1]}")
    assert set(cap.native_formats) == native and len(cap.native_formats) == len(native)
    assert (cap.fp8_gemm, cap.mx_gemm, cap.blockwise_fp8_gemm) == (FP8 <= native, BLOCK_SCALED <= native, blockwise)


def test_a_cpu_runs_no_format_natively():
    cap = capability("cpu")
    assert (cap.sm, cap.native_formats, cap.fp8_gemm, cap.mx_gemm) == (None, (), False, False)


def test_a_present_device_is_looked_up_by_the_same_rule(fake_cuda):
    fake_cuda(("NVIDIA H100 80GB HBM3", (9, 0), 85.0), ("NVIDIA B200", (10, 0), 190.0))
    h100, b200 = capability(torch.device("cuda", 0)), capability("cuda:1")
    assert h100.name == "NVIDIA H100 80GB HBM3" and h100.sm == (9, 0)
    assert set(h100.native_formats) == AMPERE | FP8 and h100.blockwise_fp8_gemm
    assert set(b200.native_formats) == AMPERE | FP8 | BLOCK_SCALED and not b200.blockwise_fp8_gemm
    assert capability() is h100  # the current device


@pytest.mark.parametrize("sm", ["sm90", (9,), (9, 0.5), (9, -1), [9, 0], (True, 0)])
def test_a_bad_compute_capability_is_refused(sm):
    with pytest.raises(ValueError, match=r"sm: expected a compute capability \(major, minor\) of non-negative ints"):
        cuda_capability(sm)
