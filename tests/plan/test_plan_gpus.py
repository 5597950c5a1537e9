"""The accelerator table: dense peaks, sources, NVIDIA rows' native formats from the compute capability."""
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


# What each NVIDIA row runs natively, by hand: Ampere BF16/FP16, Hopper adds FP8, Blackwell (sm100,
# sm103) adds the block-scaled MX formats and NVFP4.
HOPPER = {"bf16", "fp16", "fp8"}
BLACKWELL = HOPPER | {"mxfp8", "mxfp6", "mxfp4", "nvfp4"}
NVIDIA_NATIVE = {"a100": {"bf16", "fp16"}, "h100": HOPPER, "h200": HOPPER, "b200": BLACKWELL, "gb200": BLACKWELL,
                 "b300": BLACKWELL}


def test_nvidia_rows_run_what_their_compute_capability_runs():
    assert {k for k, g in GPUS.items() if g.vendor == "NVIDIA"} == set(NVIDIA_NATIVE)
    for key, native in NVIDIA_NATIVE.items():
        assert set(GPUS[key].native_gemms) == native, key
        assert all(GPUS[key].peak(fmt)[1] == (fmt in native) for fmt in BLACKWELL), key


def _row(arch: str, **peaks) -> GPU:
    return GPU(key="x", name="x", vendor="NVIDIA", arch=arch, memory_gb=80, hbm_tb_s=3, link_gb_s=900, link="l",
               peaks=tuple(peaks.items()), source="s")


def test_an_nvidia_row_whose_peaks_disagree_with_its_compute_capability_is_refused():
    assert _row("sm90", bf16=1, fp16=1, fp8=2).native_gemms == ("bf16", "fp16", "fp8")
    with pytest.raises(ValueError, match="x.peaks: expected peaks for the GEMM formats sm90 runs natively, "
                                         "bf16, fp16, fp8, got bf16, fp16"):
        _row("sm90", bf16=1, fp16=1)  # an FP8 peak missing: planned as emulated though sm90 runs it
    with pytest.raises(ValueError, match="runs natively, bf16, fp16, got bf16, fp16, fp8"):
        _row("sm80", bf16=1, fp16=1, fp8=2)  # FP8 claimed native on Ampere


@pytest.mark.parametrize("arch, sm", [("sm80", (8, 0)), ("sm89", (8, 9)), ("sm100", (10, 0)), ("sm103", (10, 3)),
                                      ("gfx942", None), ("gaudi3", None), ("sm", None), ("smx0", None)])
def test_arch_names_read_as_compute_capabilities(arch, sm):
    assert sm_of_arch(arch) == sm


def test_emulated_formats_fall_back_to_bf16():
    assert GPUS["a100"].peak("fp8") == (312, False)
    assert GPUS["h200"].peak("mxfp8") == (989, False)
    assert GPUS["mi355x"].peak("nvfp4") == (2516.6, False)


def test_lookup_is_case_insensitive_and_errors_name_the_choices():
    assert get_gpu("H200") is GPUS["h200"]
    with pytest.raises(ValueError, match="gpu: expected one of a100, h100, h200, .*gaudi3, got 'H300'"):
        get_gpu("H300")
    with pytest.raises(ValueError, match="gemm format: expected one of"):
        GPUS["h100"].peak("fp12")
