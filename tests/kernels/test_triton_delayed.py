"""The Triton delayed scale equals ``lowprec.kernels.delayed_scale``'s reference bit for bit: the bank's
scale where the role is ready, whatever the operand holds, else the operand's current scale (NaN, inf,
zeros, subnormals, strided views); and where ready it reads nothing of the operand."""
from __future__ import annotations

import math

import pytest
import torch

pytest.importorskip("triton")

from lowprec import formats as F
from lowprec.kernels import delayed_scale as D
from lowprec.kernels import triton_delayed as TD
from lowprec.quant.scales import amax_scale


def _bank(n: int = 6) -> tuple[torch.Tensor, torch.Tensor]:
    scales = torch.tensor([0.5, 3.0e-3, 7.25, 1.0, math.nan, 2.0**-126])[:n]
    ready = torch.tensor([True, False, True, False, True, False])[:n]
    return scales, ready


def _operands() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(70, 300, generator=g) * torch.logspace(-3, 3, 300)  # ragged against the 32 x 256 tile
    nan, inf, zeros = x.clone(), x.clone(), torch.zeros(40, 33)
    nan[69, 299], inf[3, 7] = math.nan, -math.inf
    sub = torch.full((5, 17), 1e-40)  # FP32 subnormals: the scale clamps to FP32's smallest normal
    return [x, x.bfloat16(), x.half().t(), nan, inf, zeros, sub, x[::3, 5:260]]


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int32)


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
@pytest.mark.parametrize("i", range(8))
def test_the_triton_delayed_scale_equals_the_reference(fmt, i):
    x2, f = _operands()[i], F.get(fmt)
    scales, ready = _bank()
    for r, k in [(0, 2), (1, 1), (2, 4), (3, 0), (4, 5), (5, 3)]:  # ready and not, scales of every kind
        got = TD.delayed_scale(x2, scales, ready, k, r, f)
        want = D.reference(x2, scales, ready, k, r, f)
        assert got.shape == (1, 1) and got.dtype == torch.float32
        assert torch.equal(_bits(got), _bits(want)), (r, k, got, want)
        if not ready[r]:  # the operand's own scale, as a current cast computes it
            assert torch.equal(_bits(got), _bits(amax_scale(x2.abs().amax().float(), f).reshape(1, 1)))


def test_a_ready_scale_reads_nothing_of_the_operand():
    # NaN everywhere: had any program reduced the operand, the scale would be NaN
    x2 = torch.full((64, 512), math.nan)
    scales, ready = _bank()
    assert TD.delayed_scale(x2, scales, ready, 2, 0, F.get("e4m3")).item() == 7.25
    assert math.isnan(TD.delayed_scale(x2, scales, ready, 2, 1, F.get("e4m3")).item())


def test_the_operator_returns_the_reference_on_the_cpu():
    x2 = _operands()[0]
    scales, ready = _bank()
    for r in range(6):
        got = D.delayed_scale(x2, scales, ready, r, r, "e4m3")
        assert torch.equal(_bits(got), _bits(D.reference(x2, scales, ready, r, r, F.get("e4m3"))))
