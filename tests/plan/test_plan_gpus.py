"""The accelerator table: dense peaks, sources, and the capability the kernels would see on each row."""
from __future__ import annotations

import pytest

from lowprec.plan.gpus import GPU, GPUS, get_gpu, sm_of_arch

# The vendors' headline figures are quoted with 2:4 sparsity; the table keeps dense peaks, half of these.
SPARSE_TFLOPS = {
    "h100": {"bf16": 1979, "fp8": 3958}, "h200": {"bf16": 1979, "fp8": 3958},
    "b200": {"bf16": 4500, "fp8": 9000, "nvfp4": 18000}, "gb200": {"bf16": 5000, "fp8": 10000, "nvfp4": 20000},
    "mi300x": {"bf16": 2614.9, "fp8": 5229.8}, "mi325x": {"bf16": 2614.9, "fp8": 5229.8},
}


@pytest.mark.parametrize("key", SPARSE_TFLOPS)
def test_dense_peaks_are_half_the_sparse_headlines(key):
    g = GPUS[key]
    for fmt, sparse in SPARSE_TFLOPS[key].items():
        assert g.peak(fmt) == (pytest.approx(sparse / 2, rel=1e-3), True)


def test_every_row_names_its_source_and_has_sane_figures():
    assert set(GPUS) == {"a100", "h100", "h200", "b200", "gb200", "b300", "mi300x", "mi325x", "mi355x", "gaudi3"}
    for g in GPUS.values():
        assert g.source and g.memory_gb >= 80 and g.hbm_tb_s >= 2 and g.link_gb_s >= 600
        peaks = dict(g.peaks)
        # lower precision is never slower than higher precision on one chip
        assert peaks["bf16"] <= peaks.get("fp8", peaks["bf16"]) <= peaks.get("mxfp4", peaks.get("fp8", peaks["bf16"]))


# What lowprec's kernels would see on each row: the compute capability of an NVIDIA row, the one ROCm
# reports for an AMD architecture (gfx942 -> 9.4), and no tensor-core GEMMs of lowprec's on Gaudi.
CAPABILITIES = {"a100": (8, 0), "h100": (9, 0), "h200": (9, 0), "b200": (10, 0), "gb200": (10, 0), "b300": (10, 3),
                "mi300x": (9, 4), "mi325x": (9, 4), "mi355x": (9, 5), "gaudi3": None}


def test_each_row_is_seen_as_the_kernels_would_see_the_device():
    assert set(CAPABILITIES) == set(GPUS)
    for key, sm in CAPABILITIES.items():
        cap = GPUS[key].capability
        assert (cap.sm, cap.device_type) == (sm, "cuda" if sm else "hpu"), key


def _row(arch: str, **peaks) -> GPU:
    return GPU(key="x", name="x", vendor="NVIDIA", arch=arch, memory_gb=80, hbm_tb_s=3, link_gb_s=900, link="l",
               peaks=tuple(peaks.items()), source="s")


def test_a_row_lists_hardware_peaks_and_needs_a_bf16_one():
    # the hardware's block-scaled peaks are listed whatever lowprec runs natively (the planner asks the kernels)
    assert _row("sm100", bf16=1, fp8=2, nvfp4=4).peak("nvfp4") == (4, True)
    with pytest.raises(ValueError, match=r"x.peaks: expected a bf16 peak \(high-precision GEMMs run at it\)"):
        _row("sm90", fp16=1, fp8=2)
    with pytest.raises(ValueError, match="x.peaks: expected one of 'bf16', .*, got 'fp12'"):
        _row("sm90", bf16=1, fp12=2)


@pytest.mark.parametrize("arch, sm", [("sm80", (8, 0)), ("sm89", (8, 9)), ("sm100", (10, 0)), ("sm103", (10, 3)),
                                      ("gfx942", None), ("gaudi3", None), ("sm", None), ("smx0", None)])
def test_arch_names_read_as_compute_capabilities(arch, sm):
    assert sm_of_arch(arch) == sm


def test_formats_without_a_listed_peak_fall_back_to_bf16():
    assert GPUS["a100"].peak("fp8") == (312, False)
    assert GPUS["h200"].peak("mxfp8") == (989, False)
    assert GPUS["mi355x"].peak("nvfp4") == (2516.6, False)


def test_lookup_is_case_insensitive_and_errors_name_the_choices():
    assert get_gpu("H200") is GPUS["h200"]
    with pytest.raises(ValueError, match="gpu: expected one of a100, h100, h200, .*gaudi3, got 'H300'"):
        get_gpu("H300")
    with pytest.raises(ValueError, match="gemm format: expected one of"):
        GPUS["h100"].peak("fp12")
