"""The granularity x element-format cases the quant tests run, each paired with its hand-written
reference block shape and rule (tests/quant/_reference.py), so the block layout is not read back
from the code under test."""
from __future__ import annotations

from lowprec.quant import blockwise, columnwise, mx, nvfp4, rowwise, tensorwise
from tests.quant._reference import Spec

FP32_SCALED = [
    (tensorwise(), Spec("tensorwise", None, None, "amax")),
    (rowwise(), Spec("rowwise", 1, None, "amax")),
    (columnwise(), Spec("columnwise", None, 1, "amax")),
    (blockwise(1, 128), Spec("block1x128", 1, 128, "amax")),
    (blockwise(128, 128), Spec("block128x128", 128, 128, "amax")),
]
MX = [
    (mx(32, "floor"), Spec("mx32-floor", 1, 32, "floor")),
    (mx(32, "ceil"), Spec("mx32-ceil", 1, 32, "ceil")),
]
NVFP4 = [
    (nvfp4(16), Spec("nvfp4-16", 1, 16, "nvfp4")),
    (nvfp4(16, two_d=True), Spec("nvfp4-16x16", 16, 16, "nvfp4")),
]
FP8 = ("e4m3", "e5m2")
MX_FORMATS = ("e4m3", "e5m2", "e3m2", "e2m3", "e2m1")

CASES = (
    [(g, s, f) for g, s in FP32_SCALED for f in FP8]
    + [(g, s, f) for g, s in MX for f in MX_FORMATS]
    + [(g, s, "e2m1") for g, s in NVFP4]
)
"""Every (granularity, reference spec, element format) the task covers."""
CASE_IDS = [f"{s.name}-{f}" for _, s, f in CASES]
BLOCK_CASES = [c for c in CASES if c[1].bc is not None and c[1].bc > 1]
BLOCK_IDS = [f"{s.name}-{f}" for _, s, f in BLOCK_CASES]
