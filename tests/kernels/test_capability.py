"""Device capability: what a CUDA compute capability's matrix units have, from the sm alone and through
the lookup of a present device; what lowprec runs natively there, as ``gemm_path`` decides."""
from __future__ import annotations

import pytest
import torch

from lowprec.kernels.capability import capability, cuda_capability
from lowprec.kernels.native import native_gemms

FP8 = {"fp8 per tensor", "fp8 per row"}
BLOCKWISE = {"fp8 1x128 blocks"}
BLOCK_SCALED = {"mxfp8", "mxfp4", "nvfp4"}
AMPERE = {"fp16", "bf16", "tf32"}


# What each architecture's tensor cores take, from NVIDIA's architecture whitepapers: FP16 from
# Volta, BF16/TF32 from Ampere, FP8 from Ada/Hopper, MX and NVFP4 block scaling from Blackwell;
# cuBLAS's 1x128/128x128 block-scaled FP8 through torch._scaled_mm on Hopper only. lowprec runs FP8
# natively where the hardware has it, and MXFP8, MXFP4 and NVFP4 on Blackwell's block-scaled tensor cores
# (checked on first use; MXFP6 has no torch._scaled_mm path).
@pytest.mark.parametrize("sm, hp, native, blockwise, mx", [
    ((6, 1), set(), set(), False, False),
    ((7, 0), {"fp16"}, set(), False, False),
    ((7, 5), {"fp16"}, set(), False, False),
    ((8, 0), AMPERE, set(), False, False),
    ((8, 6), AMPERE, set(), False, False),
    ((8, 9), AMPERE, FP8, False, False),
    ((9, 0), AMPERE, FP8 | BLOCKWISE, True, False),
    ((10, 0), AMPERE, FP8 | BLOCK_SCALED, False, True),
    ((10, 3), AMPERE, FP8 | BLOCK_SCALED, False, True),
    ((12, 0), AMPERE, FP8 | BLOCK_SCALED, False, True),
])
def test_formats_by_compute_capability(sm, hp, native, blockwise, mx):
    cap = cuda_capability(sm)
    assert (cap.device_type, cap.sm, cap.name) == ("cuda", sm, f"sm{sm[0]}{sm[1]}")
    assert set(cap.hp_formats) == hp and len(cap.hp_formats) == len(hp)
    assert set(native_gemms(cap)) == native
    assert (cap.fp8_gemm, cap.blockwise_fp8_gemm, cap.mx_gemm) == (bool(native), blockwise, mx)


def test_a_cpu_runs_no_format_natively():
    cap = capability("cpu")
    assert (cap.sm, cap.hp_formats, native_gemms(cap), cap.fp8_gemm, cap.mx_gemm) == (None, (), (), False, False)


def test_a_present_device_is_looked_up_by_the_same_rule(fake_cuda):
    fake_cuda(("NVIDIA H100 80GB HBM3", (9, 0), 85.0), ("NVIDIA B200", (10, 0), 190.0))
    h100, b200 = capability(torch.device("cuda", 0)), capability("cuda:1")
    assert h100.name == "NVIDIA H100 80GB HBM3" and h100.sm == (9, 0)
    assert set(native_gemms(h100)) == FP8 | BLOCKWISE and h100.blockwise_fp8_gemm
    assert set(native_gemms(b200)) == FP8 | BLOCK_SCALED and b200.mx_gemm and not b200.blockwise_fp8_gemm
    assert capability() is h100  # the current device


@pytest.mark.parametrize("sm", ["sm90", (9,), (9, 0.5), (9, -1), [9, 0], (True, 0)])
def test_a_bad_compute_capability_is_refused(sm):
    with pytest.raises(ValueError, match=r"sm: expected a compute capability \(major, minor\) of non-negative ints"):
        cuda_capability(sm)
