"""The experts' NVFP4 casts in one Triton pass (``triton_quant.nvfp4_by_lines``: each block row of x under the
global scale of the amax it is given, its expert's) through Triton's interpreter: equal to
``lowprec.quant.quantize`` given those global amaxes, bit for bit, on every side the experts' casts make, with
non-finite values and experts without a finite value; the layer's casts take it where the route says Triton
and equal the loop of Linears; a kernel that fails its first-use check leaves the reference's casts, said."""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from lowprec import formats as F
from lowprec.kernels import triton_quant
from lowprec.kernels.route import Backend, CastSpec
from lowprec.nn import grouped_casts as GC
from lowprec.quant import hadamard_padded, nvfp4, quantize
from tests.kernels.test_triton_quant import assert_same, special

pytestmark = pytest.mark.filterwarnings("ignore:overflow encountered")


def _amax(n: int, seed: int, zero: int | None = None) -> torch.Tensor:
    a = torch.rand(n, generator=torch.Generator().manual_seed(seed)) * 60 + 0.01
    if zero is not None:
        a[zero] = 0.0  # an expert without a finite value: global scale 1
    return a


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("two_d", [False, True], ids=["1x16", "16x16"])
def test_rows_along_k_each_under_its_block_rows_global_amax(dtype, two_d):
    x = special(64, 160, dtype, seed=3)
    g = nvfp4(16, two_d=two_d)
    amax = _amax(64 // (16 if two_d else 1), seed=4, zero=1)
    got = triton_quant.nvfp4_by_lines(x, CastSpec.of(F.get("e2m1"), g, "nearest"), amax)
    assert_same(got, quantize(x, "e2m1", g, global_amax=amax[:, None]))
    assert got.global_scale.shape == (amax.numel(), 1)


@pytest.mark.parametrize("rounding", ["nearest", "stochastic"])
@pytest.mark.parametrize("hadamard", [None, 11])
def test_the_transposed_side_each_block_of_rows_under_its_global_amax(rounding, hadamard):
    """x.T cast along x's rows (the tokens' side of the weight gradient, x the padded tokens): each 16 rows of x
    one expert's, with its global amax; with the Hadamard transform and given uniform numbers as the layer gives
    them."""
    x = special(96, 48, torch.bfloat16, seed=5)
    g = nvfp4(16)
    amax = _amax(6, seed=6, zero=4)
    rand = torch.rand(48, 96, generator=torch.Generator().manual_seed(7)) if rounding == "stochastic" else None
    spec = CastSpec.of(F.get("e2m1"), g, rounding, hadamard)
    got = triton_quant.nvfp4_by_lines(x, spec, amax, transposed=True, rand=rand)
    xt = x.t() if hadamard is None else hadamard_padded(x.t(), 16, hadamard)
    assert_same(got, quantize(xt, "e2m1", g, rounding=rounding, rand=rand, global_amax=amax[None, :]))
    assert got.global_scale.shape == (1, 6)


def test_a_strided_view_reads_as_its_values():
    """The layer hands the features-major padded layout transposed (a view): read through its strides."""
    xt = special(40, 64, torch.float32, seed=8)  # (K, P)
    amax = _amax(4, seed=9)
    got = triton_quant.nvfp4_by_lines(xt.t(), CastSpec.of(F.get("e2m1"), nvfp4(16), "nearest"), amax,
                                      transposed=True)
    assert_same(got, quantize(xt, "e2m1", nvfp4(16), global_amax=amax[None, :]))


@pytest.mark.parametrize("counts", [(5, 0, 40, 19), (0, 0, 0, 33), (16, 16)])
def test_the_layer_on_the_kernel_equals_a_loop_of_linears(monkeypatch, counts):
    """Every NVFP4 cast of a GroupedLinear (rows, weights, the tokens' rotated side, stochastic rounding) on the
    kernel: the layer equals the loop of Linears bit for bit, outputs and gradients."""
    from tests.nn.test_grouped import assert_like_loop

    calls = []
    real = triton_quant.nvfp4_by_lines

    def spy(*args, **kwargs):
        calls.append(kwargs.get("transposed", False))
        return real(*args, **kwargs)

    monkeypatch.setattr(GC, "nvfp4_lines_backend", lambda spec, device: Backend.TRITON)
    monkeypatch.setattr(triton_quant, "nvfp4_by_lines", spy)
    assert_like_loop("nvfp4", counts, bias=False)
    assert True in calls and False in calls  # both kinds of side ran on the kernel


def test_a_kernel_that_fails_its_first_use_check_leaves_the_reference(monkeypatch):
    def broken(*args, **kwargs):
        raise RuntimeError("out of resources")

    monkeypatch.setattr(triton_quant, "nvfp4_by_lines", broken)
    with pytest.warns(UserWarning, match="NVFP4 cast with a global scale per expert fails on cpu .out of resources.; "
                                          "the experts' NVFP4 casts run on the reference"):
        assert triton_quant._check_lines(torch.device("cpu")) is False


def test_a_kernel_that_differs_fails_its_first_use_check(monkeypatch):
    real = triton_quant.nvfp4_by_lines

    def off_by_one(*args, **kwargs):
        q = real(*args, **kwargs)
        q.data.view(torch.uint8)[0, 0] ^= 1
        return q

    monkeypatch.setattr(triton_quant, "nvfp4_by_lines", off_by_one)
    with pytest.warns(UserWarning, match="differs from the reference on cpu .rows."):
        assert triton_quant._check_lines(torch.device("cpu")) is False


def test_the_first_use_check_passes_on_the_interpreter():
    assert triton_quant._check_lines(torch.device("cpu")) is True
