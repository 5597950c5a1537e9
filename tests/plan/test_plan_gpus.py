"""The accelerator table: dense peaks, sources, native formats agree with the compute-capability rule."""
from __future__ import annotations

import pytest

from lowprec.plan.devices import native_formats_for_capability
from lowprec.plan.gpus import GPUS, get_gpu

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


@pytest.mark.parametrize("key", [k for k, g in GPUS.items() if g.vendor == "NVIDIA"])
def test_nvidia_rows_agree_with_the_compute_capability_rule(key):
    g = GPUS[key]
    sm = (int(g.arch[2:-1]), int(g.arch[-1]))
    assert set(g.native_elements) == set(native_formats_for_capability(sm)) - {"tf32"}


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
