"""A granularity's scale format is the table's format, so its bits and codes come from the table."""
from __future__ import annotations

import pytest
import torch

from lowprec import formats as F
from lowprec.quant import blockwise, mx, nvfp4, quantize, rowwise, tensorwise


@pytest.mark.parametrize(("granularity", "name"), [
    (tensorwise(), "fp32"), (rowwise(), "fp32"), (blockwise(1, 128), "fp32"), (mx(32), "e8m0"),
    (mx(32, "ceil"), "e8m0"), (nvfp4(16), "e4m3"), (nvfp4(16, two_d=True), "e4m3"),
])
def test_the_scale_format_is_the_tables(granularity, name):
    assert granularity.scale_format is F.FORMATS[name]


@pytest.mark.parametrize(("fmt", "granularity", "scale_bytes", "global_bytes"), [
    ("e4m3", rowwise(), 4, 0), ("e4m3", mx(32), 1, 0), ("e2m1", nvfp4(16), 1, 4),
])
def test_nbytes_counts_scales_at_their_formats_bits(fmt, granularity, scale_bytes, global_bytes):
    q = quantize(torch.randn(64, 256), fmt, granularity)
    elem = 64 * 256 * F.get(fmt).bits // 8
    assert q.nbytes == elem + q.scale.numel() * scale_bytes + global_bytes
