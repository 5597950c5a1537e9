"""lowprec's grouped FP8 GEMMs in Triton ([Note: grouped FP8 GEMMs in Triton]) through Triton's interpreter,
against every expert's GEMM from the exact values: bit for bit where every partial sum is representable
(small integers times powers of two), within FP32 summation order otherwise; and a ``GroupedLinear`` under
fp8-current takes them for its E5M2 gradient GEMMs where the device runs them, with the loop's values."""
from __future__ import annotations

import pytest
import torch

from lowprec.kernels import grouped_gemm as GG
from lowprec.kernels import triton_grouped_gemm as TG

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
COUNTS = [(40, 0, 24, 71), (0, 0, 300, 1), (129,), (0, 16, 0), (0,) * 9 + (3,) + (0,) * 10 + (130, 1)]
"""Unbalanced experts, empty ones (first, last, in between), tiles that end short of BLOCK_M, and more
experts than the tile lookup's smallest vector (22: it reads the offsets 32 at a time)."""


def _ints(*shape, seed: int, dtype, lo: int = -6, hi: int = 7) -> torch.Tensor:
    """Small integers (exact in every FP8 format here), so that every FP32 partial sum is exact."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(lo, hi, shape, generator=g).float().to(dtype)


def _pow2(n: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return 2.0 ** torch.randint(-6, 7, (n,), generator=g).float()


def _ends(counts) -> torch.Tensor:
    """The cumulative offsets, int32, as the kernel reads them on the device."""
    return torch.tensor(counts, dtype=torch.int64).cumsum(0).to(torch.int32)


def _rows_problem(counts, k: int, n: int, a_dtype):
    t, e = sum(counts), len(counts)
    return (_ints(t, k, seed=1, dtype=a_dtype), _pow2(t, 2), _ints(e, n, k, seed=3, dtype=E4M3),
            _pow2(e * n, 4).view(e, n))


@pytest.mark.parametrize("counts", COUNTS)
@pytest.mark.parametrize("k", [128, 160])  # K a multiple of the tile, and not
@pytest.mark.parametrize("a_dtype", [E5M2, E4M3])
@pytest.mark.parametrize("fast", [False, True])  # the tensor core's accumulation: exact sums either way
def test_rows_equal_each_experts_gemm_bit_for_bit_where_sums_are_exact(counts, k, a_dtype, fast):
    a, sa, b, sb = _rows_problem(counts, k, 144, a_dtype)  # N not a multiple of the tile either
    want = GG._reference(GG.ROWS, a, sa, b, sb, counts)
    got = TG.grouped_rows(a, sa, b, sb, _ends(counts), torch.float32, fast)
    assert got.shape == (sum(counts), 144) and torch.equal(got, want)
    assert torch.equal(TG.grouped_rows(a, sa, b, sb, _ends(counts), torch.bfloat16), want.to(torch.bfloat16))


@pytest.mark.parametrize("a_dtype", [E5M2, E4M3])
@pytest.mark.parametrize("counts", COUNTS)
def test_features_equal_each_experts_gemm_bit_for_bit_where_sums_are_exact(counts, a_dtype):
    """The weight gradient's kind from the features-major, padded layout (E5M2 gradients, and E4M3 ones
    without fast accumulation); an expert without tokens gives zeros."""
    t, e, m, n = sum(counts), len(counts), 80, 144
    a, b = _ints(t, m, seed=5, dtype=a_dtype), _ints(t, n, seed=6, dtype=E4M3)
    sa, sb = _pow2(e * m, 7), _pow2(e * n, 8)
    padding = GG.token_padding(counts, torch.tensor(counts))
    got = TG.grouped_features(GG.features_padded(a, padding), sa, GG.features_padded(b, padding), sb, padding.ends,
                              torch.float32)
    want = GG._reference(GG.FEATURES, a, sa, b, sb, counts)
    assert got.shape == (e, m, n) and torch.equal(got, want)
    for x, c in enumerate(counts):
        if c == 0:
            assert not got[x].any()


def test_random_values_agree_within_fp32_summation():
    counts = (40, 0, 24, 71)
    g = torch.Generator().manual_seed(9)
    a = (torch.randn(135, 256, generator=g) * 8).to(E5M2)
    b = (torch.randn(4, 64, 256, generator=g) * 8).to(E4M3)
    sa, sb = torch.rand(135, generator=g) + 0.5, torch.rand(4, 64, generator=g) + 0.5
    want = GG._reference(GG.ROWS, a, sa, b, sb, counts)
    got = TG.grouped_rows(a, sa, b, sb, _ends(counts), torch.float32)
    bound = 256 * 2.0 ** -23 * (a.float().abs() @ b.float().abs().transpose(1, 2).reshape(-1, 256).t()).max()
    assert (got - want).abs().max() <= bound * sa.max() * sb.max()


def test_the_self_check_problem_passes_through_the_dispatch():
    """The first-use check's own problem (E5M2 rows, as fp8-current's gradients) through ``_by_rows`` and
    ``_by_features``, which send a pair with E5M2 to the Triton kernels."""
    for kind in (GG.ROWS, GG.FEATURES):
        a, sa, b, sb, counts = GG._problem(kind, torch.device("cpu"), E5M2)
        if kind == GG.ROWS:
            got = GG._by_rows(a, sa, b, sb, GG._offsets(counts, "cpu"), torch.float32, False)
        else:
            got = GG._by_features(a, sa, b, sb, GG.token_padding(counts, torch.tensor(counts)), torch.float32,
                                    False)
        want = GG._reference(kind, a, sa, b, sb, counts)
        assert ((got - want).abs().max() / want.abs().max()).item() <= 1e-6, kind


def test_fp8_current_takes_the_triton_gemms_for_its_gradients(monkeypatch):
    """Told that the device runs grouped GEMMs for E5M2 pairs only (the CPU cannot run PyTorch's), a
    ``GroupedLinear`` under fp8-current computes its input and weight gradients through the Triton kernels,
    equal to the expert-by-expert loop within FP32 summation order."""
    from lowprec.nn import grouped
    from lowprec.nn import grouped_casts as GC
    from tests.nn.test_grouped import COUNTS as LAYER_COUNTS
    from tests.nn.test_grouped import grouped_step, make

    calls = []
    real_rows, real_features = TG.grouped_rows, TG.grouped_features
    monkeypatch.setattr(TG, "grouped_rows", lambda *a: calls.append("rows") or real_rows(*a))
    monkeypatch.setattr(TG, "grouped_features", lambda *a: calls.append("features") or real_features(*a))
    monkeypatch.setattr(GG, "runs_grouped", lambda kind, device, a_fmt, b_fmt, *dims, **kw: a_fmt.name == "e5m2")
    monkeypatch.setattr(grouped, "_row_scaled", lambda gp, a, b: True)
    g, _, x, dy = make("fp8-current", LAYER_COUNTS)
    fast = grouped_step(g, x, dy, LAYER_COUNTS)
    assert calls == ["rows", "features"]
    g.weight.grad = g.bias.grad = None
    monkeypatch.setattr(GC, "batches", lambda plan: False)
    looped = grouped_step(g, x, dy, LAYER_COUNTS)
    for name, a, b in zip(("y", "dx", "dweight", "dbias"), fast, looped):
        assert ((a - b).abs().max() <= 1e-5 * b.abs().max()).item(), name


def test_e4m3_pairs_without_fast_accumulation_take_the_triton_kernels_where_triton_runs(monkeypatch):
    """PyTorch's kernel keeps the E4M3 pairs with fast accumulation (the forward); a pair without it (an input
    or weight gradient) takes lowprec's Triton kernels where Triton runs (told so here: the interpreter),
    with the per-expert values; the first-use check covers that pair for both kinds."""
    counts = (20, 0, 45)
    t, e, m, n = sum(counts), len(counts), 48, 32
    a, b = _ints(t, m, seed=11, dtype=E4M3), _ints(t, n, seed=12, dtype=E4M3)
    sa, sb = _pow2(e * m, 13), _pow2(e * n, 14)
    padding = GG.token_padding(counts, torch.tensor(counts))
    at, bt = GG.features_padded(a, padding), GG.features_padded(b, padding)
    assert GG._on_torch(at, bt, False)  # the CPU runs no Triton of its own
    monkeypatch.setattr(GG, "_triton_runs", lambda device: True)
    assert GG._on_torch(at, bt, True) and not GG._on_torch(at, bt, False)
    assert not GG._on_torch(at.view(E5M2), bt, True)
    got = GG.grouped_by_features(a, sa, b, sb, padding, torch.float32, False)
    assert torch.equal(got, GG._reference(GG.FEATURES, a, sa, b, sb, counts))
    ra, rsa, rb, rsb = _rows_problem(counts, 160, 48, E4M3)
    rows = []
    real_rows = TG.grouped_rows
    monkeypatch.setattr(TG, "grouped_rows", lambda *args: rows.append(args[0].dtype) or real_rows(*args))
    got = GG.grouped_by_rows(ra, rsa, rb, rsb, _ends(counts), torch.float32, False)
    assert rows == [E4M3] and torch.equal(got, GG._reference(GG.ROWS, ra, rsa, rb, rsb, counts))
    rows.clear()
    assert GG._self_check(GG.ROWS, torch.device("cpu"), False)
    assert rows == [E5M2, E4M3]  # both pairs it takes
    seen, real = [], TG.grouped_features
    monkeypatch.setattr(TG, "grouped_features", lambda *args: seen.append(args[0].dtype) or real(*args))
    assert GG._self_check(GG.FEATURES, torch.device("cpu"), False)
    assert seen == [E5M2, E5M2, E4M3, E4M3]  # both pairs it takes, each padded both ways
    monkeypatch.setattr(TG, "grouped_features", lambda *args: seen.append(args[0].dtype) or real(*args) * 1.01)
    seen.clear()
    with pytest.warns(UserWarning, match="differs from the per-expert"):
        assert not GG._self_check(GG.FEATURES, torch.device("cpu"), False)
    assert seen == [E5M2]  # stopped at the first pair that failed


@pytest.mark.parametrize("kind", [GG.ROWS, GG.FEATURES])
def test_the_first_use_check_passes_the_triton_kernels_and_fails_a_wrong_or_failing_one(monkeypatch, kind):
    """``_self_check`` on its own problem (several tiles of rows, N and K): the Triton kernels pass; a kernel
    whose output is off by one scale step, or that raises (a compile error of Triton's own kind included),
    fails with a warning naming the kernel, so the experts' GEMMs of that kind stay per expert."""
    import warnings

    from triton.runtime.errors import OutOfResources

    cpu = torch.device("cpu")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert GG._self_check(kind, cpu, False)
    name = "grouped_rows" if kind == GG.ROWS else "grouped_features"
    real = getattr(TG, name)
    monkeypatch.setattr(TG, name, lambda *a, **k: real(*a, **k) * 1.01)
    with pytest.warns(UserWarning, match="lowprec's grouped Triton GEMM .* differs"):
        assert not GG._self_check(kind, cpu, False)

    def broken(*a, **k):
        raise OutOfResources(232448, 101376, "shared memory")

    monkeypatch.setattr(TG, name, broken)
    with pytest.warns(UserWarning, match="lowprec's grouped Triton GEMM .* fails"):
        assert not GG._self_check(kind, cpu, False)


def test_rowwise_features_major_casts_through_the_triton_features_kernel(monkeypatch):
    """fp8-rowwise's weight gradient from its real features-major casts (``columns_by_group``'s layout) into
    the Triton features kernel (made to take the E4M3 pair), against the expert-by-expert loop."""
    from lowprec.kernels.route import Backend
    from lowprec.nn import grouped
    from lowprec.nn import grouped_casts as GC
    from tests.nn.test_grouped import COUNTS as LAYER_COUNTS
    from tests.nn.test_grouped import grouped_step, make

    calls = []
    real = TG.grouped_features
    monkeypatch.setattr(TG, "grouped_features", lambda *a: calls.append(a[0].shape) or real(*a))
    monkeypatch.setattr(GG, "_on_torch", lambda a, b, fast_accum: False)
    monkeypatch.setattr(GG, "runs_grouped", lambda kind, device, a_fmt, b_fmt, *dims, **kw: kind == GG.FEATURES)
    monkeypatch.setattr(grouped, "_row_scaled", lambda gp, a, b: True)
    monkeypatch.setattr(GC, "grouped_rows_backend", lambda spec, device: Backend.TRITON)  # the Triton casts
    g, _, x, dy = make("fp8-rowwise", LAYER_COUNTS)
    fast = grouped_step(g, x, dy, LAYER_COUNTS)
    padded = sum(-(-n // 16) * 16 for n in LAYER_COUNTS)
    assert calls == [(g.out_features, padded)]
    g.weight.grad = g.bias.grad = None
    monkeypatch.setattr(GC, "batches", lambda plan: False)
    looped = grouped_step(g, x, dy, LAYER_COUNTS)
    for name, a, b in zip(("y", "dx", "dweight", "dbias"), fast, looped):
        assert ((a - b).abs().max() <= 1e-5 * b.abs().max()).item(), name


def test_operands_the_descriptors_cannot_read_are_named_or_copied_aligned():
    """Rows of codes must be a multiple of 16 bytes (a descriptor's stride); a view starting off a 16-byte
    boundary is copied to an aligned one, with the same codes."""
    with pytest.raises(ValueError, match=r"a must have rows of a multiple of 16 codes.*got 24"):
        TG._operand(torch.zeros(4, 24, dtype=E4M3), "a", 24)
    base = _ints(5 * 32 + 1, seed=9, dtype=E4M3)
    view = base[1:].view(5, 32)  # one byte past an aligned start
    got = TG._operand(view, "a", 32)
    assert got.data_ptr() % 16 == 0 and torch.equal(got.view(torch.uint8), view.view(torch.uint8))


def test_a_launch_has_fewer_programs_than_tiles_so_each_walks_several():
    """The persistent kernels' strided walk is what the interpreter runs too: three programs, never more
    than the tiles."""
    cpu = torch.device("cpu")
    assert TG._programs(cpu, 1, 100) == TG.INTERPRETED_PROGRAMS == 3
    assert TG._programs(cpu, 3, 2) == 2 and TG._programs(cpu, 3, 0) == 1
