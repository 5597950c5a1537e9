"""The records a sampled region collects equal the figures of the operands each GEMM was given,
computed independently; nothing is computed outside a region."""
from __future__ import annotations

import math

import pytest
import torch
import torch.nn as nn

from lowprec import telemetry as T
from lowprec.quant import quantize, tensorwise
from lowprec.quant.hadamard import RHT_BLOCK, RHT_SEED, hadamard_padded
from lowprec.telemetry import collect
from tests.nn.common import make_linear, randn


def _run(lin, x, dy):
    x = x.clone().requires_grad_()
    lin(x).backward(dy)


def _by_key(records):
    return {(r.layer, r.gemm, r.operand): r for r in records}


def test_fp8_current_records_equal_the_operands_own_figures():
    lin = make_linear("fp8-current", 64, 32)
    model = nn.Sequential(lin)
    x, dy = randn(16, 64, seed=1, scale=3.0), randn(16, 32, seed=2, scale=1e-3)
    with T.sample(model, step=7) as t:
        _run(model, x, dy)
    got = _by_key(t.records)
    # fp8-current: E4M3 per-tensor forward operands, E5M2 per-tensor grad_output (both GEMMs)
    w = lin.weight.detach()
    want = {("fprop", "input"): (x, "e4m3"), ("wgrad", "input"): (x.t(), "e4m3"),
            ("fprop", "weight"): (w, "e4m3"), ("dgrad", "weight"): (w.t(), "e4m3"),
            ("dgrad", "grad_output"): (dy, "e5m2"), ("wgrad", "grad_output"): (dy.t(), "e5m2")}
    assert set(got) == {("0", g, o) for g, o in want}
    for (gemm, operand), (hp, fmt) in want.items():
        ref = T.operand_stats(hp, quantize(hp, fmt, tensorwise()), layer="0", gemm=gemm, operand=operand, step=7)
        assert got[("0", gemm, operand)] == ref


def test_a_scaled_input_saturates_under_delayed_scaling_and_telemetry_names_it():
    lin = make_linear("fp8-delayed", 64, 32)
    model = nn.Sequential(lin)
    x, dy = randn(16, 64, seed=1), randn(16, 32, seed=2)
    _run(model, x, dy)  # the history holds x's amax
    with T.sample(model, step=2) as t:
        _run(model, x * 1e4, dy)  # the injected fault: scaled by the stale scale, clipped
    r = _by_key(t.records)[("0", "fprop", "input")]
    amax = x.abs().max().item()
    assert r.amax == pytest.approx(amax * 1e4, rel=1e-6)
    assert r.scale == pytest.approx(amax / 448, rel=1e-6)
    # every element whose |x| * 1e4 passes 464 * amax / 448 is clipped
    clipped = ((x.abs() * 1e4) / torch.tensor(r.scale) >= 464).float().mean().item()
    assert r.saturation == pytest.approx(clipped) and r.saturation > 0.9
    assert _by_key(t.records)[("0", "fprop", "weight")].saturation == 0.0


def test_micro_batches_merge_into_the_worst_figures():
    lin = make_linear("fp8-current", 64, 32)
    model = nn.Sequential(lin)
    x1, x2, dy = randn(16, 64, seed=1), randn(16, 64, seed=3, scale=1e-6), randn(16, 32, seed=2)
    singles = []
    for x in (x1, x2):
        with T.sample(model) as t:
            _run(model, x, dy)
        singles.append(_by_key(t.records)[("0", "fprop", "input")])
    with T.sample(model) as t:
        _run(model, x1, dy)
        _run(model, x2, dy)
    merged = _by_key(t.records)[("0", "fprop", "input")]
    a, b = singles
    assert merged.amax == max(a.amax, b.amax) and merged.underflow == max(a.underflow, b.underflow)
    assert merged.sqnr_db == min(a.sqnr_db, b.sqnr_db)
    assert len(t.records) == 6


def test_nothing_is_computed_outside_a_region_or_for_layers_of_another_model(monkeypatch):
    def boom(*args):
        raise AssertionError("computed")

    monkeypatch.setattr(collect, "stats_tensor", boom)
    lin, other = make_linear("mxfp8", 64, 32), make_linear("mxfp8", 64, 32)
    _run(lin, randn(16, 64, seed=1), randn(16, 32, seed=2))
    with T.sample(nn.Sequential(other)) as t:
        _run(lin, randn(16, 64, seed=1), randn(16, 32, seed=2))
    assert t.records == []


def test_telemetry_says_which_steps_are_due():
    tel = T.Telemetry(every=3)
    assert [s for s in range(1, 10) if tel.due(s)] == [3, 6, 9]
    assert not any(T.Telemetry(every=0).due(s) for s in range(10))
    with tel.region(nn.Linear(2, 2), 4) as t:
        assert t is None
    with pytest.raises(ValueError, match="^every: expected a non-negative int"):
        T.Telemetry(every=-1)
    with pytest.raises(ValueError, match="^step: expected"):
        with T.sample(nn.Linear(2, 2), step=-2):
            pass


def test_an_nvfp4_wgrad_operand_is_compared_after_its_hadamard_transform():
    lin = make_linear("nvfp4", 64, 32)
    x, dy = randn(16, 64, seed=1), randn(16, 32, seed=2)
    with T.sample(nn.Sequential(lin)) as t:
        _run(lin, x, dy)
    r = _by_key(t.records)[("0", "wgrad", "input")]
    transformed = hadamard_padded(x.t(), RHT_BLOCK, RHT_SEED)  # (K, M): what the wgrad cast quantized
    assert r.amax == transformed.abs().max().item() != x.abs().max().item()
    assert math.isfinite(r.sqnr_db) and r.sqnr_db > 12
