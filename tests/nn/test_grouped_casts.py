"""Batched per-expert casts (see [Note: batched per-expert casts] in ``lowprec.nn.grouped_casts``): every
expert's codes and scales equal its own cast bit for bit, per tensor and per row, and a ``GroupedLinear``
under such a recipe takes them, with the same outputs and gradients as the expert-by-expert loop."""
from __future__ import annotations

import dataclasses
import itertools
import math

import pytest
import torch

from lowprec import recipes as R
from lowprec.nn import GroupedLinear, grouped
from lowprec.nn import grouped_casts as GC
from lowprec.quant import blockwise, mx, nvfp4, quantize, rowwise, tensorwise
from tests.nn.common import bits, randn
from tests.nn.test_grouped import COUNTS, grouped_step, make

GRANULARITY = {"fp8-current": tensorwise(), "fp8-rowwise": rowwise(), "mxfp8": mx(32, "ceil"), "mxfp4": mx(32, "ceil"),
               "fp8-blockwise": blockwise(1, 128), "nvfp4": nvfp4(16)}
"""Each batched recipe's token sides; the weights' (:data:`WEIGHTS`) where they differ."""
WEIGHTS = {**GRANULARITY, "fp8-blockwise": blockwise(128, 128), "nvfp4": nvfp4(16, two_d=True)}


def _plan(recipe: str):
    return GroupedLinear(len(COUNTS), 128, 256, recipe=recipe).plan()


def test_every_preset_that_quantizes_is_batched():
    batched = [n for n in R.names() if _plan(n) is not None and _plan(n).scaled and GC.batches(_plan(n))]
    assert batched == ["fp8-delayed", "fp8-current", "fp8-rowwise", "fp8-blockwise", "mxfp8", "mxfp4", "nvfp4"]


def _rows(counts, poison: float | None = None) -> torch.Tensor:
    """Rows grouped by expert, each expert's rows at their own magnitude (2^-8 .. 2^4), so that one
    scale for all would differ from each expert's; ``poison`` put in expert 2's first row."""
    x = torch.cat([randn(n, 128, seed=10 + e) * 2.0 ** (4 * e - 8) for e, n in enumerate(counts)])
    if poison is not None:
        x[sum(counts[:2]), 3] = poison
    return x


def _alone(x: torch.Tensor, fmt: str, recipe: str, weight: bool = False):
    return quantize(x, fmt, (WEIGHTS if weight else GRANULARITY)[recipe])


def _same(got, want):
    assert torch.equal(bits(got.data), bits(want.data))
    assert torch.equal(bits(got.scale), bits(want.scale))
    assert (got.shape, got.dtype) == (want.shape, want.dtype)
    assert (got.global_scale is None) == (want.global_scale is None)
    if want.global_scale is not None:  # NVFP4: the expert's own global scale
        assert torch.equal(bits(got.global_scale.reshape(())), bits(want.global_scale))


FORMATS = [("e4m3", "e4m3"), ("e4m3", "e5m2")]


@pytest.mark.parametrize("recipe, fmts", [(r, f) for r in GRANULARITY if r != "nvfp4" for f in FORMATS]
                         + [("mxfp4", ("e2m1", "e4m3")), ("nvfp4", ("e2m1", "e2m1"))])
@pytest.mark.parametrize("poison", [None, math.inf, math.nan])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rows_cast_as_each_expert_alone(recipe, fmts, poison, dtype):
    """Each expert's rows along K and, transposed, along its tokens, against the expert's own casts (MX: each
    expert's tokens padded to whole blocks of its own, as its cast pads them)."""
    x = _rows(COUNTS, poison).to(dtype)
    op = _plan(recipe).input
    op = dataclasses.replace(op, cast_k=R.Cast(format=fmts[0], granularity=GRANULARITY[recipe]),
                             cast_t=R.Cast(format=fmts[1], granularity=GRANULARITY[recipe]))
    k, t = GC.cast_rows(x, GC.groups(COUNTS), op, True, True)
    start = 0
    for e, n in enumerate(COUNTS):
        rows = slice(start, start + n)
        start += n
        if n:
            _same(k.expert(e, rows), _alone(x[rows], fmts[0], recipe))
            _same(t.expert(e, rows), _alone(x[rows].t(), fmts[1], recipe))
    if poison is not None and recipe == "fp8-current":  # expert 2 alone has a NaN scale, as its own cast
        assert k.scales.isnan().tolist() == [False, False, True, False]


@pytest.mark.parametrize("recipe", list(GRANULARITY))
def test_weights_cast_as_each_expert_alone(recipe):
    w = torch.stack([randn(256, 128, seed=20 + e) * 2.0 ** (3 * e - 5) for e in range(4)])
    plan = _plan(recipe)
    k, t = GC.cast_weights(w, plan.weight, True, True)
    for e in range(4):
        _same(k.expert(e), _alone(w[e], plan.weight.cast_k.format, recipe, True))
        _same(t.expert(e), _alone(w[e].t(), plan.weight.cast_t.format, recipe, True))
        if recipe.startswith("mx") or recipe in ("fp8-blockwise", "nvfp4"):
            continue
        # what a grouped GEMM reads: every expert's codes and the scale of each of their rows
        assert torch.equal(bits(k.weight_codes()[e]), bits(k.expert(e).data))
        assert torch.equal(bits(t.weight_codes()[e]), bits(t.expert(e).data))
        assert torch.equal(t.weight_scales()[e], t.expert(e).scale.expand(-1, 1).reshape(-1).expand(
            t.weight_scales().shape[1]))


@pytest.mark.parametrize("recipe", list(GRANULARITY))
@pytest.mark.parametrize("counts", [COUNTS, (0, 0, 64, 0), (16, 16, 16, 16)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_grouped_linear_batched_equals_the_loop(monkeypatch, recipe, counts, dtype):
    """The batched path is taken (the loop's autograd function is not called), and its output and every
    gradient equal the loop's bit for bit."""
    g, _, x, dy = make(recipe, counts, dtype=dtype)
    calls = []
    real = grouped.BatchedFunction.apply
    monkeypatch.setattr(grouped.BatchedFunction, "apply", lambda *a: calls.append(1) or real(*a))
    batched = grouped_step(g, x, dy, counts)
    assert calls == [1]
    g.weight.grad = g.bias.grad = None
    monkeypatch.setattr(GC, "batches", lambda plan: False)
    looped = grouped_step(g, x, dy, counts)
    assert calls == [1]
    for a, b in zip(batched, looped):
        assert torch.equal(bits(a), bits(b))


def test_inference_takes_the_batched_casts_too(monkeypatch):
    g, _, x, _ = make("fp8-current")
    offsets = torch.tensor(COUNTS).cumsum(0)
    with torch.no_grad():
        batched = g(x, offsets)
        monkeypatch.setattr(GC, "batches", lambda plan: False)
        looped = g(x, offsets)
    assert torch.equal(bits(batched), bits(looped))


@pytest.fixture
def folded_cpu(monkeypatch):
    """The CPU taken as a device with FP8 tensor cores whose MX GEMMs run folded to row scales."""
    import sys

    from lowprec.nn.plan import layer_plan

    C = sys.modules["lowprec.kernels.capability"]
    monkeypatch.setitem(C._KNOWN, torch.device("cpu"), C.Capability("cpu", "cpu", None, True, False, False, False))
    monkeypatch.setattr(grouped, "folded_runs", lambda device: True)
    layer_plan.cache_clear()
    yield
    layer_plan.cache_clear()


@pytest.mark.parametrize("recipe", ["mxfp8", "mxfp4"])
def test_mx_experts_take_one_grouped_gemm_of_rows_folded_to_row_scales(monkeypatch, recipe, folded_cpu):
    """Where MX GEMMs run folded and the device runs grouped FP8 GEMMs (told so here: the CPU, with a
    grouped GEMM from exact products standing in), the experts' forward and input gradient are one grouped
    GEMM each on every row folded at once, and equal the expert-by-expert folded GEMMs."""
    from lowprec.kernels import grouped_gemm as GG

    calls = []

    def by_rows(a, a_scales, b, b_scales, offsets, out_dtype, fast_accum):
        calls.append((a.dtype, tuple(b.shape)))
        counts = torch.diff(offsets.long(), prepend=offsets.new_zeros(1).long()).tolist()
        return GG._reference(GG.ROWS, a, a_scales, b, b_scales, counts).to(out_dtype)

    monkeypatch.setattr(GG, "runs_grouped", lambda kind, device, a_fmt, b_fmt, *dims, **kw: kind == GG.ROWS)
    monkeypatch.setattr(GG, "grouped_by_rows", by_rows)
    g, _, x, dy = make(recipe, COUNTS)
    assert g.plan().fprop.path.value == "folded"
    batched = grouped_step(g, x, dy, COUNTS)
    assert calls == [(torch.float8_e4m3fn, (4, 256, 128)), (torch.float8_e4m3fn, (4, 128, 256))]
    g.weight.grad = g.bias.grad = None
    monkeypatch.setattr(GC, "batches", lambda plan: False)
    looped = grouped_step(g, x, dy, COUNTS)
    for name, a, b in zip(("y", "dx", "dweight", "dbias"), batched, looped):
        assert ((a - b).abs().max() <= 1e-5 * b.abs().max()).item(), name


@pytest.mark.parametrize("recipe", ["fp8-rowwise", "fp8-current"])
def test_the_weight_gradient_takes_one_grouped_gemm_of_the_laid_out_tokens(monkeypatch, recipe):
    """Where the device runs grouped FP8 GEMMs (told so here: the CPU, with a grouped GEMM from exact
    products standing in), every expert's weight gradient is one grouped GEMM: fp8-rowwise's token sides
    already features-major and padded per expert (read as cast), fp8-current's padded there. Both equal
    the expert-by-expert weight gradients."""
    from lowprec.kernels import grouped_gemm as GG

    calls = []

    def exact(a_t, sa, b_t, sb, ends):  # (E, M, N) from features-major (M, P) and (N, P)
        m, n = a_t.shape[0], b_t.shape[0]
        out, start = [], 0
        for e, end in enumerate(ends.tolist()):
            out.append((a_t[:, start:end].float() @ b_t[:, start:end].float().t()) * sa[e * m:(e + 1) * m, None]
                       * sb[e * n:(e + 1) * n])
            start = end
        return torch.stack(out)

    def laid_out(a_t, sa, b_t, sb, ends, out_dtype, fast_accum):
        calls.append(("laid out", tuple(a_t.shape), tuple(b_t.shape)))
        return exact(a_t, sa, b_t, sb, ends).to(out_dtype)

    def by_features(a, sa, b, sb, padding, out_dtype, fast_accum):
        calls.append(("rows", tuple(a.shape), tuple(b.shape)))
        return exact(GG.features_padded(a, padding), sa, GG.features_padded(b, padding), sb,
                     padding.ends).to(out_dtype)

    monkeypatch.setattr(GG, "runs_grouped", lambda kind, device, a_fmt, b_fmt, *dims, **kw: kind == GG.FEATURES)
    monkeypatch.setattr(grouped, "_row_scaled", lambda gp, a, b: True)
    monkeypatch.setattr(GG, "grouped_by_features_laid_out", laid_out)
    monkeypatch.setattr(GG, "grouped_by_features", by_features)
    g, _, x, dy = make(recipe, COUNTS)
    batched = grouped_step(g, x, dy, COUNTS)
    padded = sum(-(-n // 16) * 16 for n in COUNTS)  # 16 + 0 + 48 + 32
    want = ("laid out", (256, padded), (128, padded)) if recipe == "fp8-rowwise" else ("rows", (64, 256), (64, 128))
    assert calls == [want]
    g.weight.grad = g.bias.grad = None
    monkeypatch.setattr(GC, "batches", lambda plan: False)
    looped = grouped_step(g, x, dy, COUNTS)
    for name, a, b in zip(("y", "dx", "dweight", "dbias"), batched, looped):
        assert ((a - b).abs().max() <= 1e-5 * b.abs().max()).item(), name


@pytest.mark.parametrize("recipe", list(GRANULARITY))
def test_a_backward_for_the_bias_alone_casts_nothing(recipe):
    """A frozen weight and an input without gradient: backward needs neither GEMM, so no operand is cast,
    and the bias gradient is each expert's sum of its rows' output gradients."""
    g, _, x, dy = make(recipe, COUNTS)
    g.weight.requires_grad_(False)
    y = g(x, torch.tensor(COUNTS).cumsum(0))
    y.backward(dy)
    want = torch.stack([part.sum(0) for part in dy.split(COUNTS)])
    assert torch.allclose(g.bias.grad, want, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("recipe", ["mxfp8", "mxfp4"])
def test_mx_weight_gradients_take_one_grouped_gemm_of_the_tokens_folded_per_expert(monkeypatch, recipe, folded_cpu):
    """Where MX GEMMs run folded and the device runs grouped FP8 GEMMs of the features kind (told so here: the
    CPU, with a grouped GEMM from exact products standing in), every expert's weight gradient is one grouped
    GEMM of the token sides folded with a scale per (feature, expert), and equals the expert-by-expert folded
    GEMMs (an expert without tokens: zeros)."""
    from lowprec.kernels import grouped_gemm as GG

    calls = []

    def laid_out(a_t, sa, b_t, sb, ends, out_dtype, fast_accum):
        calls.append((a_t.dtype, tuple(a_t.shape), tuple(b_t.shape), tuple(ends.tolist())))
        m, n = a_t.shape[0], b_t.shape[0]
        out, start = [], 0
        for e, end in enumerate(ends.tolist()):
            out.append((a_t[:, start:end].float() @ b_t[:, start:end].float().t()) * sa[e * m:(e + 1) * m, None]
                       * sb[e * n:(e + 1) * n])
            start = end
        return torch.stack(out).to(out_dtype)

    monkeypatch.setattr(GG, "runs_grouped", lambda kind, device, a_fmt, b_fmt, *dims, **kw: kind == GG.FEATURES)
    monkeypatch.setattr(GG, "grouped_by_features_laid_out", laid_out)
    g, _, x, dy = make(recipe, COUNTS)
    assert g.plan().wgrad.path.value == "folded"
    batched = grouped_step(g, x, dy, COUNTS)
    ends = tuple(itertools.accumulate(-(-n // 32) * 32 for n in COUNTS))  # whole MX blocks per expert
    assert calls == [(torch.float8_e4m3fn, (256, ends[-1]), (128, ends[-1]), ends)]
    g.weight.grad = g.bias.grad = None
    monkeypatch.setattr(GC, "batches", lambda plan: False)
    looped = grouped_step(g, x, dy, COUNTS)
    assert COUNTS.count(0) and torch.equal(batched[2][COUNTS.index(0)], torch.zeros_like(batched[2][0]))
    for name, a, b in zip(("y", "dx", "dweight", "dbias"), batched, looped):
        assert ((a - b).abs().max() <= 1e-5 * b.abs().max()).item(), name
