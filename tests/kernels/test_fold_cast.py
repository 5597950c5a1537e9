"""MX casts folded as they are cast (``CastSpec.folded``): the cast kernel writes the row-wise FP8 operand a
folded GEMM multiplies, in the cast's own passes, bit for bit what ``kernels.fold`` makes of the MX cast
(whose rule ``tests/kernels/test_fold.py`` checks against arithmetic on exact values).
"""
from __future__ import annotations

import math

import pytest
import torch

from lowprec import recipes as R
from lowprec.kernels import fold as FD
from lowprec.kernels.cast import cast
from lowprec.kernels.gemm import GemmPath
from lowprec.kernels.route import Backend, CastSpec, route
from lowprec.quant import QuantizedTensor, mx, quantize, rowwise
from tests.kernels.folded_layers import fp8_cpu, train_once

MX_ELEMENTS = ("e4m3", "e5m2", "e3m2", "e2m3", "e2m1")


def _bits(q: QuantizedTensor) -> torch.Tensor:
    b = q.data.view(torch.uint8).clone()
    b[q.values().isnan()] = 0xFF  # a NaN's sign is not part of the contract
    return b


def _awkward(m: int, k: int, seed: int, dtype=torch.bfloat16) -> torch.Tensor:
    """Values over 38 binades with a NaN, an infinity, a zero row, a zero tail and (rows permitting) a row
    of NaN only: NaN blocks, lines without a finite block, blocks of zeros."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g) * torch.logspace(-30, 8, k, base=2)
    x[1, 3] = math.nan
    x[5, :] = 0
    x[7, k // 2:] = 0
    x[9, 7] = math.inf
    if m > 20:
        x[20, :] = math.nan
    return x.to(dtype)


def _assert_same(got: QuantizedTensor, want: QuantizedTensor) -> None:
    assert got.fmt is want.fmt and got.granularity == want.granularity == rowwise()
    assert got.data.dtype == want.data.dtype and got.data.shape == want.data.shape
    assert got.shape == want.shape and torch.equal(got.scale, want.scale)
    assert torch.equal(_bits(got), _bits(want))


@pytest.mark.parametrize("name", MX_ELEMENTS)
@pytest.mark.parametrize("rule", ["floor", "ceil"])
@pytest.mark.parametrize("shape", [(64, 128), (40, 100), (33, 64)], ids=str)
def test_the_triton_cast_folds_both_sides_as_the_reference_folds_the_mx_cast(name, rule, shape):
    pytest.importorskip("triton")
    x = _awkward(*shape, seed=sum(shape))
    spec = CastSpec.of(name, mx(32, rule), folded=True)
    got = cast(x, route(spec, spec, "cpu", "triton"))
    for q, xv in ((got.along_k, x), (got.transposed, x.t())):
        want = FD.fold_reference(quantize(xv, name, mx(32, rule)))
        _assert_same(q, want)
        assert q.fmt is FD.target(spec.fmt) and q.scale.shape == (q.data.shape[0], 1)


@pytest.mark.parametrize("name", ["e4m3", "e2m1"])
def test_a_folded_side_alone_and_beside_an_unfolded_one(name):
    """Either side alone; a folded side beside an MX side that keeps its blocks; float32 input."""
    pytest.importorskip("triton")
    x = _awkward(48, 96, seed=3, dtype=torch.float32)
    folded, plain = CastSpec.of(name, mx(32), folded=True), CastSpec.of(name, mx(32))
    want_k = FD.fold_reference(quantize(x, name, mx(32)))
    want_t = FD.fold_reference(quantize(x.t(), name, mx(32)))
    _assert_same(cast(x, route(folded, None, "cpu", "triton")).along_k, want_k)
    _assert_same(cast(x, route(None, folded, "cpu", "triton")).transposed, want_t)
    both = cast(x, route(folded, plain, "cpu", "triton"))
    _assert_same(both.along_k, want_k)
    mxq = quantize(x.t(), name, mx(32))
    assert both.transposed.granularity == mx(32)
    torch.testing.assert_close(both.transposed.scale, mxq.scale, rtol=0, atol=0, equal_nan=True)
    assert torch.equal(_bits(both.transposed), _bits(mxq))


def test_a_hadamard_side_folds_what_it_transformed():
    """mxfp4's wgrad operands are transformed along their K first: the fold follows the transform."""
    pytest.importorskip("triton")
    x = _awkward(64, 96, seed=5)
    x = torch.where(x.isfinite(), x, 0.0)  # a NaN would spread over its transform's 16 outputs alike
    spec = CastSpec.of("e2m1", mx(32), hadamard_seed=11, folded=True)
    got = cast(x, route(None, spec, "cpu", "triton")).transposed
    want = cast(x, route(None, spec, "cpu", "torch")).transposed
    _assert_same(got, want)
    assert got.data.shape == (96, 64)


def test_the_reference_route_folds_the_cast_it_made():
    x = _awkward(40, 64, seed=9)
    spec = CastSpec.of("e2m3", mx(32), folded=True)
    got = cast(x, route(spec, spec, "cpu", "torch"))
    _assert_same(got.along_k, FD.fold_reference(quantize(x, "e2m3", mx(32))))
    _assert_same(got.transposed, FD.fold_reference(quantize(x.t(), "e2m3", mx(32))))


def test_only_mx_casts_fold():
    from lowprec.kernels.triton_plan import covers
    from lowprec.quant import blockwise, nvfp4

    assert covers(CastSpec.of("e4m3", mx(32), folded=True))
    for fmt, g in (("e4m3", rowwise()), ("e4m3", blockwise(1, 128)), ("e2m1", nvfp4())):
        assert not covers(CastSpec.of(fmt, g, folded=True))
    with pytest.raises(ValueError, match="backend"):
        route(CastSpec.of("e4m3", rowwise(), folded=True), None, "cpu", "triton")


@pytest.mark.parametrize("shape", [(64, 128), (33, 96)], ids=str)
def test_compiled_code_reduces_a_folded_sides_line_amax_as_the_amax_kernel_does(shape):
    """Under torch.compile a direct folded cast's line amaxes are torch reductions the compiler fuses into x's
    producer (whole blocks only: 33 rows are no whole blocks of the transposed side, which takes the kernel);
    a route's cast in compiled code takes its unfolded casts and folds after them: the same bits."""
    pytest.importorskip("triton")
    from lowprec.kernels import triton_ops as ops
    from lowprec.kernels import triton_quant as TQ
    from lowprec.kernels import triton_tiles as T
    from lowprec.kernels.triton_plan import launch

    x = _awkward(*shape, seed=4)
    spec = CastSpec.of("e4m3", mx(32), folded=True)
    lau = launch(spec, spec, *shape, True, False, False, False, False)
    assert lau.amax_kinds == (T.AMAX_FOLD, T.AMAX_FOLD) and lau.fold_blocks == (32, 32)
    kernel = ops.amax(x, lau.ints, None)
    for i, transposed in enumerate((False, True)):
        traced = TQ._traceable_amax(x, T.AMAX_FOLD, False, transposed, 32)
        if transposed and shape[0] % 32:
            assert traced is None
            continue
        assert traced.dtype == torch.int32 and torch.equal(traced, kernel[i])
    assert TQ._traceable_amax(x, T.AMAX_FOLD, True, False, 32) is None  # a Hadamard side: the kernel's

    r = route(spec, spec, "cpu", "triton")
    assert r.unfolded is not None and not r.unfolded.along_k.folded and not r.unfolded.transposed.folded
    assert route(spec, spec, "cpu", "torch").unfolded is None  # the reference's ops: the compiler sees them

    def f(x):
        c = cast(x, r)
        k, t = c.along_k, c.transposed
        return k.data.view(torch.uint8), k.scale, t.data.view(torch.uint8), t.scale

    got = torch.compile(f, fullgraph=True, backend="aot_eager")(x)
    want = cast(x, route(spec, spec, "cpu", "torch"))
    direct = TQ.cast(x, spec, spec)  # the folded cast itself, compiled: its amaxes traced
    got_direct = torch.compile(lambda x: [t for q in TQ.cast(x, spec, spec)[:2] for t in (q.data, q.scale)],
                               fullgraph=True, backend="aot_eager")(x)
    for g, w in zip(got_direct, [t for q in direct[:2] for t in (q.data, q.scale)], strict=True):
        torch.testing.assert_close(g.view(torch.uint8) if g.element_size() == 1 else g,
                                   w.view(torch.uint8) if w.element_size() == 1 else w, rtol=0, atol=0, equal_nan=True)
    nan_k, nan_t = want.along_k.values().isnan(), want.transposed.values().isnan()
    assert torch.equal(got[0][~nan_k], want.along_k.data.view(torch.uint8)[~nan_k])
    assert torch.equal(got[2][~nan_t], want.transposed.data.view(torch.uint8)[~nan_t])
    assert torch.equal(got[1], want.along_k.scale) and torch.equal(got[3], want.transposed.scale)


# --- layers --------------------------------------------------------------------------------------------

@pytest.mark.parametrize("recipe", ["mxfp8", "mxfp4"])
def test_a_layer_folds_at_its_casts_with_the_bits_of_folding_at_its_gemms(monkeypatch, recipe):
    from lowprec.nn import plan as P

    fp8_cpu(monkeypatch)
    outs = {}
    for at_cast in (True, False):
        monkeypatch.setattr(P, "folds_at_cast", lambda device, v=at_cast: v)
        P.layer_plan.cache_clear()
        P.operand_plan.cache_clear()
        plan, outs[at_cast] = train_once(recipe)
        assert {plan.fprop.path, plan.dgrad.path, plan.wgrad.path} == {GemmPath.FOLDED}
        sides = [s for op in (plan.input, plan.weight, plan.grad_output)
                 for s in (op.both.along_k, op.both.transposed)]
        assert all(s.folded is at_cast for s in sides)
    P.layer_plan.cache_clear()
    P.operand_plan.cache_clear()
    for got, want in zip(outs[True], outs[False], strict=True):
        assert torch.equal(got, want), recipe


def test_only_sides_read_by_a_folded_gemm_fold(monkeypatch):
    from lowprec.kernels import gemm as G
    from lowprec.nn.plan import folded_sides

    monkeypatch.setattr(G, "FOLD_AT_CAST", True)
    cpu = torch.device("cpu")
    paths = {"fprop": GemmPath.FOLDED, "dgrad": GemmPath.CUBLAS, "wgrad": GemmPath.EMULATED}
    assert folded_sides(R.Role.INPUT, paths, cpu) == (True, False)
    assert folded_sides(R.Role.WEIGHT, paths, cpu) == (True, False)
    assert folded_sides(R.Role.GRAD_OUTPUT, paths, cpu) == (False, False)
    paths = {"fprop": GemmPath.EMULATED, "dgrad": GemmPath.FOLDED, "wgrad": GemmPath.FOLDED}
    assert folded_sides(R.Role.GRAD_OUTPUT, paths, cpu) == (True, True)
    assert folded_sides(R.Role.WEIGHT, paths, cpu) == (False, True)


def test_a_cuda_device_whose_check_failed_folds_at_the_gemm(monkeypatch):
    from lowprec.kernels import gemm as G

    monkeypatch.setattr(G, "FOLD_AT_CAST", True)
    monkeypatch.setattr(G, "_folded_checked", lambda device: False)
    assert not G.folds_at_cast("cuda:0") and G.folds_at_cast("cpu")
    monkeypatch.setattr(G, "_folded_checked", lambda device: True)
    assert G.folds_at_cast("cuda:0")
    monkeypatch.setattr(G, "FOLD_AT_CAST", False)  # LOWPREC_FOLD_AT_CAST=0: fold at the GEMMs, to compare
    assert not G.folds_at_cast("cuda:0") and not G.folds_at_cast("cpu")


def test_telemetry_reports_the_mx_cast_a_folded_side_made():
    """Saturation read from folded codes would be judged against E4M3's range: the figures are the MX cast's."""
    from lowprec.telemetry.collect import Collector
    from lowprec.telemetry.stats import stats_tensor

    x = torch.randn(32, 64, generator=torch.Generator().manual_seed(2)) * 100
    spec = CastSpec.of("e2m1", mx(32), folded=True)
    q = cast(x, route(spec, None, "cpu", Backend.TORCH)).along_k
    state = object()
    c = Collector({id(state): "layer"}, step=1)
    c.side(state, 0, False, x, q, spec)
    (_, _, _, fmt, figures), = c._pending
    want = stats_tensor(x, quantize(x, "e2m1", mx(32)))
    assert torch.equal(figures, want) and fmt.name == "e2m1"
    assert want[3] > 0  # E2M1 saturates here, which the folded codes' own view would not show
    assert stats_tensor(x, q)[3] != want[3]
