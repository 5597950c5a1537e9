"""Emulated block-scaled experts as one grouped BF16 GEMM per GEMM (``lowprec.kernels.grouped_emulated``): NVFP4
experts on Hopper. The path runs on CUDA only, where emulated GEMMs run in BF16; here it runs on PyTorch's CPU
grouped GEMM (the device list widened) and is held to the loop of Linears, whose CPU emulation multiplies in
FP32: by an SQNR floor (the grouped GEMM rounds its output to BF16 before the global scales, see [Note: grouped
emulated GEMMs]) and exactly where the loop's value is exact (an expert without tokens: a zero gradient)."""
from __future__ import annotations

import pytest
import torch

from lowprec.kernels import grouped_emulated as GE
from tests.helpers import sqnr
from tests.nn.test_grouped import grouped_step, loop_step, make

SQNR_FLOOR_DB = 50.0
"""BF16's rounding of a GEMM's output alone gives 55.5-55.9 dB on these data."""


def assert_within_a_bf16_rounding(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    """Each value within half a BF16 ulp of the loop's (one rounding), beside the FP32 sums' order."""
    got, want = got.double(), want.double()
    bound = 2.0**-8 * want.abs() + 2.0**-20 * want.abs().max()
    assert ((got - want).abs() <= bound).all(), f"{what}: max excess {((got - want).abs() - bound).max():.3g}"


@pytest.fixture
def grouped_on_cpu(monkeypatch):
    """The grouped emulated GEMMs enabled on the CPU, and a count of their calls by kind."""
    monkeypatch.setattr(GE, "DEVICES", ("cpu",))
    calls = {"rows": 0, "features": 0}

    def spy(kind, fn):
        def wrapped(*args, **kwargs):
            calls[kind] += 1
            return fn(*args, **kwargs)
        return wrapped

    monkeypatch.setattr(GE, "by_rows", spy("rows", GE.by_rows))
    monkeypatch.setattr(GE, "by_features", spy("features", GE.by_features))
    return calls


@pytest.mark.parametrize("recipe", ["nvfp4", "mxfp4", "mxfp8"])
@pytest.mark.parametrize("counts", [(5, 0, 40, 19), (64, 0, 0, 0), (1, 2, 3, 130)])
def test_grouped_emulated_experts_match_the_loop(recipe, counts, grouped_on_cpu):
    g, lins, x, dy = make(recipe, counts, bias=False)  # no bias: the outputs are the GEMMs' own
    got = grouped_step(g, x, dy, counts)
    want = loop_step(lins, x, dy, counts)
    assert grouped_on_cpu == {"rows": 2, "features": 1}, "each GEMM of the layer runs grouped"
    for name, a, b in zip(("y", "dx", "dweight"), got, want):
        assert a.dtype == b.dtype and a.shape == b.shape, name
        assert torch.isfinite(a).all(), name
        assert sqnr(b, a) > SQNR_FLOOR_DB, f"{name}: {sqnr(b, a):.1f} dB"
        assert_within_a_bf16_rounding(a, b, name)
    for e, n in enumerate(counts):
        if n == 0:  # no token: no gradient, exactly
            assert torch.equal(got[2][e], torch.zeros_like(got[2][e]))


def test_bf16_layer_outputs_bf16(grouped_on_cpu):
    counts = (5, 0, 40, 19)
    g, lins, x, dy = make("nvfp4", counts, dtype=torch.bfloat16)
    got, want = grouped_step(g, x, dy, counts), loop_step(lins, x, dy, counts)
    assert grouped_on_cpu["rows"] == 2
    for name, a, b in zip(("y", "dx", "dweight"), got, want):
        assert a.dtype == torch.bfloat16, name
        assert sqnr(b.float(), a.float()) > SQNR_FLOOR_DB - 5, name  # both round to BF16


def test_elsewhere_the_experts_keep_the_per_expert_emulation(monkeypatch):
    """Where the device is not listed (the CPU by default: FP32 emulation) no grouped emulated GEMM runs."""
    called = []
    monkeypatch.setattr(GE, "by_rows", lambda *a, **k: called.append(1))
    monkeypatch.setattr(GE, "by_features", lambda *a, **k: called.append(1))
    counts = (5, 0, 40, 19)
    g, _, x, dy = make("nvfp4", counts)
    grouped_step(g, x, dy, counts)
    assert not called
