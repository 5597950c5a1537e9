"""OperandStats against hand-built tensors whose answers are worked out by hand."""
from __future__ import annotations

import math

import pytest
import torch

from lowprec.quant import mx, nvfp4, quantize, tensorwise
from lowprec.telemetry import OperandStats, operand_stats
from tests.helpers import sqnr


def _stats(hp, q):
    return operand_stats(hp, q, layer="l", gemm="fprop", operand="input", step=3)


def _sqnr_db(x: list[float], deq: list[float]) -> float:
    signal = math.fsum(v * v for v in x)
    noise = math.fsum((a - b) ** 2 for a, b in zip(x, deq))
    return 10 * math.log10(signal / noise)


def test_per_tensor_e4m3_with_a_given_scale():
    # E4M3: max 448, grid step 32 at the top (overflow threshold 464), smallest subnormal 2^-9
    x = [1000.0, -600.0, 460.0, 448.0, 1e-4, 9e-4, 0.0, 1.0]
    deq = [448.0, -448.0, 448.0, 448.0, 0.0, 0.0, 0.0, 1.0]  # 460 rounds to 448: not clipped
    hp = torch.tensor(x)
    s = _stats(hp, quantize(hp, "e4m3", tensorwise(), scale=torch.tensor(1.0)))
    assert torch.equal(quantize(hp, "e4m3", tensorwise(), scale=torch.tensor(1.0)).dequantize(), torch.tensor(deq))
    assert (s.amax, s.scale, s.underflow, s.saturation) == (1000.0, 1.0, 2 / 8, 2 / 8)
    assert s.sqnr_db == pytest.approx(_sqnr_db(x, deq), rel=1e-12)
    assert (s.layer, s.gemm, s.operand, s.step) == ("l", "fprop", "input", 3)


def test_current_scaling_never_counts_the_amax_as_clipped():
    torch.manual_seed(0)
    for _ in range(20):
        hp = torch.randn(8, 64) * torch.rand(()) * 1e3
        s = _stats(hp, quantize(hp, "e4m3", tensorwise()))
        assert s.saturation == 0.0
        assert s.scale == pytest.approx(hp.abs().max().item() / 448, rel=1e-6)


def test_exact_cast_reads_inf_and_nothing_lost():
    hp = torch.tensor([[0.5, -2.0, 0.0, 6.0], [1.5, 3.0, -4.0, 0.0]])
    s = _stats(hp, quantize(hp, "e2m1", tensorwise(), scale=torch.tensor(1.0)))
    assert (s.underflow, s.saturation, s.sqnr_db) == (0.0, 0.0, math.inf)


def test_mx_blocks_clip_and_report_their_largest_scale():
    # e2m1: max 6, step 2 at the top, threshold 7. FLOOR: block amax 7.5 -> scale 2^(2-2) = 1;
    # block amax 0.75 -> 2^(-1-2) = 1/8, where 0.75 = 6 * 1/8 is exact
    a = [7.5, 6.5, 1.0, 0.0] + [0.0] * 28
    b = [0.75, 0.25, 0.0625, 0.01] + [0.0] * 28  # 1/8 * e2m1 smallest 0.5 = 1/16: 0.01 underflows
    hp = torch.tensor([a + b])
    q = quantize(hp, "e2m1", mx(32))
    assert q.scale.flatten().tolist() == [1.0, 0.125]
    s = _stats(hp, q)
    deq = q.dequantize().flatten().tolist()
    assert deq[:3] == [6.0, 6.0, 1.0] and deq[32:36] == [0.75, 0.25, 0.0625, 0.0]
    assert (s.amax, s.scale, s.underflow, s.saturation) == (7.5, 1.0, 1 / 64, 1 / 64)
    assert s.sqnr_db == pytest.approx(_sqnr_db(a + b, deq), rel=1e-12)


def test_all_zero_operand():
    hp = torch.zeros(4, 32)
    s = _stats(hp, quantize(hp, "e4m3", tensorwise()))
    assert (s.amax, s.scale, s.underflow, s.saturation, s.sqnr_db) == (0.0, 1.0, 0.0, 0.0, math.inf)


def test_a_block_holding_inf_is_left_out_of_scale_and_sqnr():
    hp = torch.ones(2, 32)
    hp[0, 3] = math.inf
    q = quantize(hp, "e4m3", mx(32))
    s = _stats(hp, q)
    assert s.amax == math.inf and s.scale == 2.0**-8  # E4M3 emax 8, amax 1: the finite block's scale
    assert (s.underflow, s.saturation, s.sqnr_db) == (0.0, 0.0, math.inf)


def test_nvfp4_block_whose_scale_underflows_is_underflow_not_saturation():
    # global encode 2688 / 100; the small block's E4M3 scale 1e-7 * 26.88 / 6 is below 2^-9: zero
    hp = torch.cat([torch.full((1, 16), 100.0), torch.full((1, 16), 1e-7)], dim=1)
    q = nvfp4(16)
    s = _stats(hp, quantize(hp, "e2m1", q))
    assert (s.underflow, s.saturation) == (16 / 32, 0.0)


def test_a_side_kept_in_bf16():
    hp = torch.tensor([1.0, 3.40e38, 1e-45, 3.0e38])  # bf16 overflows past 3.3961e38 and flushes 1e-45
    s = _stats(hp, hp.bfloat16())
    assert (s.amax, s.scale, s.underflow, s.saturation) == (pytest.approx(3.40e38), 1.0, 1 / 4, 1 / 4)
    kept = torch.tensor([1.0, 1e-45, 3.0e38])
    assert _stats(kept, kept).sqnr_db == math.inf


@pytest.mark.parametrize("fmt, gran", [("e4m3", tensorwise()), ("e5m2", tensorwise()), ("e2m1", mx(32)),
                                       ("e2m1", nvfp4(16))])
def test_sqnr_agrees_with_the_test_suites_own(fmt, gran):
    torch.manual_seed(1)
    hp = torch.randn(48, 80)
    q = quantize(hp, fmt, gran)
    assert _stats(hp, q).sqnr_db == pytest.approx(sqnr(hp, q.dequantize()), abs=1e-9)


def test_bad_arguments_name_themselves():
    with pytest.raises(ValueError, match="^gemm: expected one of"):
        OperandStats("l", "forward", "input", 1.0, 1.0, 0.0, 0.0, 30.0, 0)
    with pytest.raises(ValueError, match="^underflow: expected a fraction"):
        OperandStats("l", "fprop", "input", 1.0, 1.0, 1.5, 0.0, 30.0, 0)
    hp = torch.randn(4, 32)
    with pytest.raises(ValueError, match="^q: expected"):
        _stats(hp, quantize(torch.randn(4, 16), "e4m3", tensorwise()))
