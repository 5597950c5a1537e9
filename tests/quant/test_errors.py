"""Bad input: every error names the argument, what was expected and what was received."""
from __future__ import annotations

import pytest
import torch

from lowprec.quant import Granularity, ScaleRule, blockwise, mx, nvfp4, quantize, rowwise, tensorwise

X = torch.randn(4, 64)


@pytest.mark.parametrize(("x", "got"), [
    (torch.arange(8), "torch.int64 tensor"),
    (torch.zeros(8, dtype=torch.int8), "torch.int8 tensor"),
    (torch.zeros(8, dtype=torch.complex64), "torch.complex64 tensor"),
    (torch.zeros(8, dtype=torch.float8_e4m3fn), "torch.float8_e4m3fn tensor"),
    ([1.0, 2.0], "[1.0, 2.0] (list)"),
])
def test_x_must_be_a_real_floating_tensor(x, got):
    expected = r"^x: expected (a float32, float16 or bfloat16 tensor|a torch.Tensor), got "
    with pytest.raises(TypeError, match=expected) as e:
        quantize(x, "e4m3", tensorwise())
    assert got in str(e.value)


@pytest.mark.parametrize(("fmt", "exc", "pattern"), [
    ("e9m9", ValueError, r"^fmt: expected one of fp32, .*e2m1.*, got 'e9m9'$"),
    (8, TypeError, r"^fmt: expected a format name or lowprec.formats.Format, got 8 \(int\)$"),
    ("e8m0", ValueError, r"^fmt: expected an element format \(e8m0 is a scale format\), got e8m0$"),
])
def test_bad_format(fmt, exc, pattern):
    with pytest.raises(exc, match=pattern):
        quantize(X, fmt, tensorwise())


@pytest.mark.parametrize(("fmt", "g", "name"), [("int8", mx(32), "mx32-floor"), ("int4", mx(32, "ceil"), "mx32-ceil"),
                                                ("int8", nvfp4(16), "nvfp4-16")])
def test_block_scaled_granularities_need_a_float_element_format(fmt, g, name):
    expected = rf"^fmt: expected a floating-point element format for {name} scales, got {fmt}$"
    with pytest.raises(ValueError, match=expected):
        quantize(X, fmt, g)


def test_bad_granularity_and_rounding():
    expected = r"^granularity: expected a lowprec.quant.Granularity .*, got 'rowwise' \(str\)$"
    with pytest.raises(TypeError, match=expected):
        quantize(X, "e4m3", "rowwise")
    with pytest.raises(ValueError, match=r"^rounding: expected one of 'nearest', 'stochastic', got 'up'$"):
        quantize(X, "e4m3", rowwise(), rounding="up")


def test_bad_scale():
    with pytest.raises(ValueError, match=r"^scale: expected None for mx32-floor \(its scales are always computed"):
        quantize(X, "e4m3", mx(32), scale=torch.tensor(1.0))
    with pytest.raises(ValueError, match=r"^scale: expected None for nvfp4-16 "):
        quantize(X, "e2m1", nvfp4(16), scale=torch.tensor(1.0))
    with pytest.raises(TypeError, match=r"^scale: expected a float32, float16 or bfloat16 tensor, got .*int64"):
        quantize(X, "e4m3", tensorwise(), scale=torch.tensor(1))
    with pytest.raises(ValueError, match=r"^scale: expected a tensor broadcastable to the block grid \(4, 1\), "
                                         r"got a torch.float32 tensor of shape \(3,\)"):
        quantize(X, "e4m3", rowwise(), scale=torch.ones(3))


def test_bad_rand():
    with pytest.raises(ValueError, match=r"^rand: expected a float32 tensor of x's shape \(4, 64\), "
                                         r"got a torch.float32 tensor of shape \(4, 32\)"):
        quantize(X, "e2m1", mx(32), rounding="stochastic", rand=torch.rand(4, 32))
    with pytest.raises(ValueError, match=r"^rand: expected a float32 tensor of x's shape \(4, 64\), got 0.5 \(float\)"):
        quantize(X, "e2m1", mx(32), rounding="stochastic", rand=0.5)


def test_tensors_on_different_devices():
    # 'meta' stands in for a second device: the check must come before any arithmetic
    with pytest.raises(ValueError, match=r"^x/scale: expected tensors on one device, got x on cpu, scale on meta$"):
        quantize(X, "e4m3", tensorwise(), scale=torch.ones((), device="meta"))
    with pytest.raises(ValueError, match=r"^x/rand: expected tensors on one device, got x on cpu, rand on meta$"):
        quantize(X, "e4m3", mx(32), rounding="stochastic", rand=torch.rand(4, 64, device="meta"))


@pytest.mark.parametrize("bad", [0, -1, True, 3.5, "32", None])
def test_invalid_block_sizes_name_the_argument(bad):
    got = repr(bad)
    with pytest.raises(ValueError, match=r"^block: expected a positive int, got ") as e:
        mx(bad)
    assert got in str(e.value)
    with pytest.raises(ValueError, match=r"^block: expected a positive int, got "):
        nvfp4(bad)
    if bad is not None:  # None is blockwise's "the whole dimension"
        with pytest.raises(ValueError, match=r"^rows: expected a positive int, got "):
            blockwise(bad, 128)
        with pytest.raises(ValueError, match=r"^cols: expected a positive int, got "):
            blockwise(1, bad)
        with pytest.raises(ValueError, match=r"^block_cols: expected a positive int or None, got "):
            Granularity(block_rows=1, block_cols=bad)


def test_bad_rules_and_flags():
    with pytest.raises(ValueError, match=r"^rule: expected 'floor' or 'ceil' .* for MX scales, got 'round' \(str\)$"):
        mx(32, "round")
    with pytest.raises(ValueError, match=r"^rule: expected 'floor' or 'ceil' .*, got <ScaleRule.AMAX: 'amax'>"):
        mx(32, ScaleRule.AMAX)
    with pytest.raises(TypeError, match=r"^two_d: expected a bool, got 'yes' \(str\)$"):
        nvfp4(16, two_d="yes")
    with pytest.raises(TypeError, match=r"^rule: expected a lowprec.quant.ScaleRule, got 'floor' \(str\)$"):
        Granularity(block_rows=1, block_cols=32, rule="floor")
    with pytest.raises(ValueError, match=r"^block_rows: expected 1 for MX scales"):
        Granularity(block_rows=2, block_cols=32, rule=ScaleRule.FLOOR)
    with pytest.raises(ValueError, match=r"^block_cols: expected a block size for nvfp4 scales, got None$"):
        Granularity(block_rows=1, block_cols=None, rule=ScaleRule.NVFP4)
