"""The batched per-expert casts' kernels (see [Note: batched per-expert casts] in ``lowprec.nn.grouped_casts``)
through Triton's interpreter: ``triton_quant.rows_by_amax`` (each row cast with the scale of the amax it is
given) and ``triton_grouped.columns_by_group`` (each element with its expert's feature scale) equal the
reference given those scales, bit for bit, and the layer's casts take them where the route says Triton."""
from __future__ import annotations

import math

import pytest
import torch

from lowprec import formats as F
from lowprec.kernels import triton_quant
from lowprec.kernels.route import Backend, CastSpec
from lowprec.nn import GroupedLinear
from lowprec.nn import grouped_casts as GC
from lowprec.quant import quantize, rowwise, tensorwise
from lowprec.quant.scales import amax_scale
from tests.nn.common import bits, randn

COUNTS = (7, 0, 20, 5)


def _rows(dtype, poison: float | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows of 4 experts at their own magnitudes, and each row's expert amax."""
    x = torch.cat([randn(n, 96, seed=30 + e) * 2.0 ** (5 * e - 9) for e, n in enumerate(COUNTS)]).to(dtype)
    if poison is not None:
        x[8, 5] = poison  # expert 2
    expert = GC.groups(COUNTS).expert
    amax = torch.stack([x[expert == e].float().abs().amax() if n else torch.tensor(0.0)
                        for e, n in enumerate(COUNTS)])
    return x, amax[expert]


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("poison", [None, math.inf, math.nan])
def test_each_row_cast_by_its_given_amax(fmt, dtype, poison):
    x, row_amax = _rows(dtype, poison)
    spec = CastSpec.of(F.get(fmt), rowwise(), "nearest")
    got = triton_quant.rows_by_amax(x, spec, row_amax)
    want = quantize(x, fmt, rowwise(), scale=amax_scale(row_amax, F.get(fmt)).unsqueeze(1)).data
    assert torch.equal(bits(got), bits(want))




@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("poison", [None, math.inf, math.nan])
def test_each_element_cast_by_its_experts_feature_amax(fmt, dtype, poison):
    """``triton_grouped.columns_by_group``: the tokens' transposed side of a row-wise recipe, each
    (expert, feature) with its own scale, equals the reference given those scales per element."""
    from lowprec.kernels import grouped_gemm, triton_grouped
    from lowprec.quant import blockwise

    x, _ = _rows(dtype, poison)
    g = GC.groups(COUNTS)
    amax = GC._amax_by(x.abs().float(), g)  # (E, K)
    padding = g.padded()
    got = triton_grouped.columns_by_group(x, g.expert, amax, F.get(fmt), padding.sources, padding.total)
    scales = amax_scale(amax, F.get(fmt))
    want = quantize(x, fmt, blockwise(1, 1), scale=scales[g.expert]).data  # (T, K)
    total = padding.total
    assert got.shape == (96, total) and total == sum(-(-n // 16) * 16 for n in COUNTS)
    assert torch.equal(bits(got), bits(grouped_gemm.features_padded(want, padding)))
    for e, (n, first) in enumerate(zip(COUNTS, grouped_gemm.padded_starts(COUNTS))):  # each expert's columns
        rows = g.expert == e
        assert torch.equal(bits(got[:, first:first + n]), bits(want[rows].t()))
        assert not bits(got[:, first + n:first + -(-n // 16) * 16]).any()  # zero codes between experts
    if poison is None:  # no padding needed: rows stay in place
        even = (16, 0, 32)
        ge = GC.groups(even)
        xe = torch.cat([x[:16], x[:32]])
        ae = GC._amax_by(xe.abs().float(), ge)
        assert ge.padded().sources is None
        got = triton_grouped.columns_by_group(xe, ge.expert, ae, F.get(fmt), None, 48)
        want = quantize(xe, fmt, blockwise(1, 1), scale=amax_scale(ae, F.get(fmt))[ge.expert]).data
        assert torch.equal(bits(got), bits(want.t()))


def _nan_bits(t: torch.Tensor) -> torch.Tensor:
    """``t``'s bits with every NaN as one NaN (the amaxes promise NaN, not its payload)."""
    return bits(torch.where(t.isnan(), torch.nan, t))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize(("counts", "k"), [(COUNTS, 200), ((0, 0, 64, 1), 200), ((130,), 200),
                                          ((0, 3, 0, 0, 61, 0), 200), ((64, 0, 64), 128)])  # the last: whole tiles
@pytest.mark.parametrize("poison", [None, math.inf, -math.inf, math.nan, -math.nan])
def test_each_experts_feature_amax_in_one_pass(dtype, counts, k, poison):
    """``triton_grouped.amax_by_group``: tiles of rows folded by an atomic maximum of the bits, against each
    expert's own rows reduced by torch (exact: any order gives the same maximum), for experts without rows,
    a tile holding several experts, features that are not a multiple of the tile, and non-finite values
    (a NaN of either sign makes its expert's feature NaN, an infinity of either sign infinite)."""
    from lowprec.kernels import triton_grouped

    rows = sum(counts)
    x = torch.cat([randn(max(n, 1), k, seed=40 + e)[:n] * 2.0 ** (9 * e - 20) for e, n in enumerate(counts)])
    x[::7, 3] = 0.0
    if dtype is not torch.float32:
        x[1, 9] = 2.0 ** -130  # subnormal in float32: its bits order it like any other value
    x = x.to(dtype)
    if poison is not None:
        x[rows - 1, 100] = poison
    g = GC.groups(counts)
    got = triton_grouped.amax_by_group(x, g.expert, len(counts))
    want = torch.stack([x[g.expert == e].float().abs().amax(0) if n else torch.zeros(k)
                        for e, n in enumerate(counts)])
    assert got.shape == (len(counts), k) and got.dtype == torch.float32
    assert torch.equal(_nan_bits(got), _nan_bits(want))
    if poison is not None:
        hit = got[g.expert[-1], 100]  # the expert of the last row
        assert hit.isnan() if math.isnan(poison) else hit == math.inf


@pytest.mark.parametrize("per_feature", [True, False])
@pytest.mark.parametrize("poison", [math.nan, math.inf, None])
def test_the_expert_amaxes_and_scales_agree_on_both_backends(monkeypatch, per_feature, poison):
    """``grouped_casts.expert_scales`` through the Triton kernels equals its segmented reduction and
    ``amax_scale`` bit for bit, per feature and per expert, NaN and infinity included."""
    x, _ = _rows(torch.bfloat16, poison)
    g, fmt = GC.groups(COUNTS), F.get("e4m3")
    reference = GC.expert_scales(x, g, fmt, per_feature)
    monkeypatch.setattr(GC, "grouped_rows_backend", lambda spec, device: Backend.TRITON)
    fast = GC.expert_scales(x, g, fmt, per_feature)
    assert fast[0].shape == fast[1].shape == ((len(COUNTS), 96) if per_feature else (len(COUNTS),))
    for got, want in zip(fast, reference):
        assert torch.equal(bits(got), bits(want))
    if poison is not None:
        assert fast[1].isnan().any()  # expert 2's scale


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2", "e2m1", "e3m2"])
def test_scales_from_amaxes_in_one_pass_equal_the_reference_bit_for_bit(fmt):
    """``triton_grouped.amax_scales``: each amax with one NaN (any payload, either sign, becomes torch.nan's),
    and ``amax_scale``'s scale from it: zeros of both signs, FP32 subnormals, values around the format's
    maximum, FP32's largest, infinities, negative amaxes (scaled by 1, as the reference), random magnitudes."""
    from lowprec.kernels import triton_grouped

    f = F.get(fmt)
    special = torch.tensor([0.0, -0.0, 1e-45, 1e-40, 2.0 ** -126, 1e-30, 0.5, 1.0, f.max / 2, f.max, f.max * 1.5,
                            3.0e38, torch.finfo(torch.float32).max, math.inf, -math.inf, math.nan, -1.0, -1e-40])
    payloads = torch.tensor([0x7FC00001, -0x00400000, 0x7F800001], dtype=torch.int32).view(torch.float32)
    g = torch.Generator().manual_seed(7)
    amax = torch.cat([special, payloads, torch.rand(2000, generator=g) * torch.logspace(-44, 38, 2000)])
    got_amax, got_scale = triton_grouped.amax_scales(amax.view(43, 47), f)  # any shape: kept
    assert got_amax.shape == got_scale.shape == (43, 47)
    assert torch.equal(bits(got_amax.reshape(-1)), bits(torch.where(amax.isnan(), torch.nan, amax)))
    assert torch.equal(bits(got_scale.reshape(-1)), bits(amax_scale(amax, f)))


@pytest.mark.parametrize(("recipe", "kernel"), [("fp8-current", "rows_by_amax"), ("fp8-rowwise", "columns_by_group")])
def test_the_layer_casts_take_the_kernel_where_the_route_says(monkeypatch, recipe, kernel):
    """fp8-current's rows (along K) and fp8-rowwise's tokens (transposed) through their kernel, equal to each
    expert's own cast."""
    from lowprec.kernels import triton_grouped

    x, _ = _rows(torch.bfloat16, None)
    op = GroupedLinear(len(COUNTS), 96, 128, recipe=recipe).plan().input
    module = triton_quant if kernel == "rows_by_amax" else triton_grouped
    calls = []
    real = getattr(module, kernel)
    monkeypatch.setattr(module, kernel, lambda *a: calls.append(1) or real(*a))
    monkeypatch.setattr(GC, "grouped_rows_backend", lambda spec, device: Backend.TRITON)
    along_k = recipe == "fp8-current"
    k, t = GC.cast_rows(x, GC.groups(COUNTS), op, along_k, not along_k)
    assert calls == [1]
    start = 0
    for e, n in enumerate(COUNTS):
        if n:
            rows = slice(start, start + n)
            got = (k if along_k else t).expert(e, rows)
            alone = quantize(x[rows] if along_k else x[rows].t(), op.cast_k.fmt,
                             tensorwise() if along_k else rowwise())
            assert torch.equal(bits(got.data), bits(alone.data))
        start += n


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
def test_columns_of_whole_tiles_cast_features_major(fmt):
    """``columns_by_group`` where the rows and features fill its tiles exactly (its unmasked loads) and no
    expert needs padding: each expert's columns are its rows' codes transposed."""
    from lowprec.kernels import triton_grouped
    from lowprec.quant import blockwise

    counts = (64, 0, 64)
    x = torch.cat([randn(64, 128, seed=50) * 3.0, randn(64, 128, seed=51) * 2.0 ** -6])
    g = GC.groups(counts)
    amax = GC._amax_by(x.abs().float(), g)
    padding = g.padded()
    assert padding.sources is None and padding.total == 128
    got = triton_grouped.columns_by_group(x, g.expert, amax, F.get(fmt), None, 128)
    want = quantize(x, fmt, blockwise(1, 1), scale=amax_scale(amax, F.get(fmt))[g.expert]).data
    assert torch.equal(bits(got), bits(want.t()))
