"""The Triton quantization kernels equal ``lowprec.quant.quantize`` bit for bit (codes, scales, global
scale, metadata), on ragged shapes and on tensors holding NaN, inf, zero blocks, FP32 subnormals and
values that saturate; the fused pair equals two reference casts; stochastic rounding equals the
reference given the same uniforms, and is unbiased with its own Philox numbers."""
from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as nnf

pytest.importorskip("triton")

import lowprec.kernels as K
from lowprec.kernels import triton_quant as TQ
from lowprec.kernels.route import CastSpec
from lowprec.kernels.triton_plan import covers
from lowprec.quant import blockwise, columnwise, hadamard, mx, nvfp4, quantize, rowwise, tensorwise

SEED = 0x5EED


def assert_same(q, r):
    """Same codes (every byte), scales (every bit, NaN included) and metadata."""
    assert (q.shape, q.dtype, q.fmt, q.granularity) == (r.shape, r.dtype, r.fmt, r.granularity)
    assert torch.equal(q.data.view(torch.uint8), r.data.view(torch.uint8))
    assert torch.equal(q.scale.contiguous().view(torch.int32), r.scale.contiguous().view(torch.int32))
    assert (q.global_scale is None) == (r.global_scale is None)
    if r.global_scale is not None:
        assert torch.equal(q.global_scale.view(torch.int32), r.global_scale.view(torch.int32))


def special(m: int, k: int, dtype=torch.bfloat16, seed: int = 0) -> torch.Tensor:
    """Outliers across the columns, plus a NaN, infs, a zero block, negative zeros, subnormals and huge values."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g) * torch.logspace(-4, 4, k)
    x[1, 2], x[m // 2, k // 3], x[m - 1, 0] = math.nan, math.inf, -math.inf
    x[m // 4: m // 4 + 3, :] = 0
    x[3, :] = 1e-40  # FP32 subnormals (bf16 keeps some)
    x[m // 3, k // 2: k // 2 + 5] = 3e38
    x[5, 1::7] = -0.0  # negative zeros among other values: their code keeps the sign
    x[m // 4 + 1, ::2] = -0.0  # and in a zero block
    return x.to(dtype)


CASTS = [
    ("e4m3", tensorwise()), ("e5m2", tensorwise()), ("e4m3", rowwise()), ("e4m3", blockwise(1, 128)),
    ("e4m3", blockwise(128, 128)), ("e4m3", mx(32, "floor")), ("e5m2", mx(32, "ceil")), ("e3m2", mx(32, "ceil")),
    ("e2m3", mx(32, "floor")), ("e2m1", mx(32, "ceil")), ("e2m1", nvfp4(16)), ("e2m1", nvfp4(16, two_d=True)),
]


@pytest.mark.parametrize("fmt,g", CASTS, ids=lambda v: str(v))
def test_single_cast_is_bit_exact_on_special_ragged_tensors(fmt, g):
    x = special(150, 200)  # neither dimension a multiple of any block
    assert_same(TQ.quantize(x, fmt, g), quantize(x, fmt, g))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("fmt,g", [("e4m3", tensorwise()), ("e2m1", nvfp4(16))], ids=str)
def test_other_input_dtypes_and_3d_inputs(dtype, fmt, g):
    x = special(48, 96, dtype=torch.float32, seed=1).to(dtype).reshape(2, 24, 96)
    assert_same(TQ.quantize(x, fmt, g), quantize(x, fmt, g))


PAIRS = [
    ("e4m3", tensorwise(), "e4m3", tensorwise()), ("e5m2", rowwise(), "e4m3", rowwise()),
    ("e4m3", blockwise(1, 128), "e4m3", blockwise(1, 128)), ("e4m3", blockwise(128, 128), "e4m3", blockwise(128, 128)),
    ("e4m3", mx(32, "ceil"), "e2m1", mx(32, "floor")), ("e2m1", nvfp4(16), "e2m1", nvfp4(16, two_d=True)),
]


@pytest.mark.parametrize("fmt,g,fmt_t,g_t", PAIRS, ids=str)
def test_pair_from_one_read_equals_two_reference_casts(fmt, g, fmt_t, g_t):
    x = special(130, 160, seed=2)
    q, qt, amax = TQ.quantize_pair(x, fmt, g, fmt_t, g_t)
    assert amax is None
    assert_same(q, quantize(x, fmt, g))
    assert_same(qt, quantize(x.t(), fmt_t, g_t))


@pytest.mark.parametrize("saturate", [True, False])
@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
def test_delayed_scale_pair_records_amax_and_matches_the_reference(fmt, saturate):
    x = special(70, 90, seed=3)
    x[1, 2] = 5.0  # a finite tensor, so its amax is a number to compare
    scale = torch.tensor(1e-3)  # many values saturate (or overflow without saturation)
    q, qt, amax = TQ.quantize_pair(x, fmt, tensorwise(), fmt, tensorwise(), scale=scale, saturate=saturate,
                                   record_amax=True)
    assert_same(q, quantize(x, fmt, tensorwise(), scale=scale, saturate=saturate))
    assert_same(qt, quantize(x.t(), fmt, tensorwise(), scale=scale, saturate=saturate))
    assert amax.item() == x.float().abs().amax().item() == math.inf
    x[0, 0] = math.nan
    assert math.isnan(TQ.quantize_pair(x, fmt, tensorwise(), fmt, tensorwise(), scale=scale, record_amax=True)[2])


def test_stochastic_rounding_with_given_uniforms_is_bit_exact_both_sides():
    g = torch.Generator().manual_seed(4)
    x = torch.randn(40, 96, generator=g).bfloat16()
    ra, rb = torch.rand(40, 96, generator=g), torch.rand(96, 40, generator=g)
    q, qt, _ = TQ.quantize_pair(x, "e2m1", nvfp4(16), "e2m1", mx(32, "ceil"), rounding="stochastic",
                                rounding_t="stochastic", rand=ra, rand_t=rb)
    assert_same(q, quantize(x, "e2m1", nvfp4(16), rounding="stochastic", rand=ra))
    assert_same(qt, quantize(x.t(), "e2m1", mx(32, "ceil"), rounding="stochastic", rand=rb))


def test_philox_stochastic_rounding_is_unbiased_and_rounds_to_a_neighbour():
    x = torch.full((64, 512), 0.3)  # between the E2M1 grid points 0.25*s and 0.375*s: never on the grid
    x[:, ::32] = 6.0  # every block's scale is 1, so 0.3 sits between the grid points 0 and 0.5
    gen = torch.Generator().manual_seed(5)
    q = TQ.quantize(x, "e2m1", mx(32, "floor"), rounding="stochastic", generator=gen)
    v = q.dequantize(torch.float32)[x != 6.0]
    lo, hi = v.min().item(), v.max().item()
    assert lo < 0.3 < hi and set(v.unique().tolist()) == {lo, hi}  # only the two neighbours
    p_up = (v == hi).float().mean().item()
    expected = (0.3 - lo) / (hi - lo)
    n = v.numel()
    assert abs(p_up - expected) < 5 * math.sqrt(expected * (1 - expected) / n)  # 5 sigma
    q2 = TQ.quantize(x, "e2m1", mx(32, "floor"), rounding="stochastic", generator=gen)
    assert not torch.equal(q.data, q2.data)  # a fresh seed per call


@pytest.mark.parametrize("transposed", [False, True], ids=["rows", "transposed side"])
def test_philox_neighbours_take_different_numbers_from_one_draw(transposed):
    # one Philox draw serves four neighbours along the side's rows: each must get its own number
    x = torch.full((128, 256), 0.3)
    x[::32, :] = 6.0
    x[:, ::32] = 6.0  # a 6.0 in every 32-block either way: scale 1, 0.3 between 0 and 0.5
    gen = torch.Generator().manual_seed(9)
    if transposed:
        _, q, _ = TQ.quantize_pair(x, "e2m1", mx(32, "floor"), "e2m1", mx(32, "floor"), rounding_t="stochastic",
                                   generator=gen)
        v, ref = q.dequantize(torch.float32), x.t()
    else:
        q = TQ.quantize(x, "e2m1", mx(32, "floor"), rounding="stochastic", generator=gen)
        v, ref = q.dequantize(torch.float32), x
    up = (v == 0.5)[ref != 6.0].view(-1, 4).float()  # groups of four neighbours along the rows
    p = up.mean().item()
    assert abs(p - 0.6) < 0.03  # unbiased: 0.3 rounds up to 0.5 with probability 0.6
    same = ((up.sum(1) == 0) | (up.sum(1) == 4)).float().mean().item()
    assert same < 0.25  # independent lanes: 0.6^4 + 0.4^4 = 0.155; one shared number would give 1


def test_hadamard_side_equals_transform_then_reference_cast():
    g = torch.Generator().manual_seed(6)
    # Eighths of small integers: every partial sum is exact, so any summation order gives one answer.
    x = (torch.randint(-64, 64, (70, 48), generator=g).float() / 8).bfloat16()
    q, qt, _ = TQ.quantize_pair(x, "e2m1", nvfp4(16), "e2m1", nvfp4(16), hadamard_t=SEED)
    ref_in = hadamard(nnf.pad(x.t(), (0, 10)), 16, seed=SEED)  # x.T zero-padded to 80 columns
    assert_same(qt, quantize(ref_in, "e2m1", nvfp4(16)))
    assert qt.shape == (48, 80)
    assert_same(q, quantize(x, "e2m1", nvfp4(16)))


@pytest.mark.parametrize("fmt,g,kw", [
    ("int8", tensorwise(), {}), ("e4m3", columnwise(), {}), ("e4m3", blockwise(1, 48), {}),
    ("e4m3", blockwise(256, 256), {}), ("e2m1", mx(32, "ceil"), {"saturate": False}),
    ("e4m3", rowwise(), {"scale": torch.full((7, 1), 0.5)}),
], ids=str)
def test_casts_the_kernels_do_not_cover_are_refused_by_them_and_routed_to_the_reference(fmt, g, kw):
    x = torch.randn(7, 64)  # ceil scales: nothing overflows, so the reference returns instead of raising
    spec = CastSpec.of(fmt, g, delayed="scale" in kw)
    assert not (covers(spec, kw.get("saturate", True)) and "scale" not in kw)
    with pytest.raises(ValueError, match="a cast the Triton kernels cover|one per-tensor scale"):
        TQ.quantize(x, fmt, g, **kw)
    # lowprec.kernels.quantize follows the route: the reference (forcing Triton is an error)
    assert_same(K.quantize(x, fmt, g, **kw), quantize(x, fmt, g, **kw))
    if kw.get("saturate", True):
        with pytest.raises(ValueError, match="backend: expected 'torch' for"):
            K.quantize(x, fmt, g, backend="triton", **kw)


def test_the_kernels_cover_the_recipe_casts():
    for fmt, g in CASTS:
        assert covers(CastSpec.of(fmt, g)) and covers(CastSpec.of(fmt, g, "stochastic"))
    assert covers(CastSpec.of("e4m3", tensorwise(), delayed=True))
    assert not covers(CastSpec.of("e2m1", tensorwise(), delayed=True))  # FP4 with a given scale
    assert covers(CastSpec.of("e2m1", nvfp4(16), hadamard_seed=SEED))
    assert not covers(CastSpec.of("e4m3", rowwise(), hadamard_seed=SEED))
    with pytest.raises(ValueError, match="rounding: expected one of 'nearest', 'stochastic', got 'truncate'"):
        CastSpec.of("e4m3", tensorwise(), "truncate")


def test_bad_input_is_refused_with_the_reference_message():
    with pytest.raises(TypeError, match="x: expected"):
        TQ.quantize(torch.zeros(4, 4, dtype=torch.int32), "e4m3", tensorwise())
    with pytest.raises(ValueError, match="rand"):
        TQ.quantize_pair(torch.zeros(4, 4), "e4m3", tensorwise(), "e4m3", tensorwise(), rand=torch.zeros(3))


def test_custom_ops_compile_into_one_graph():
    x = special(64, 128, seed=7).float().nan_to_num(0.0, 0.0, 0.0)

    def f(x):
        q = TQ.quantize(x, "e4m3", blockwise(1, 128))
        return q.data.view(torch.uint8), q.scale

    data, scale = torch.compile(f, fullgraph=True, backend="aot_eager")(x)
    r = quantize(x, "e4m3", blockwise(1, 128))
    assert torch.equal(data, r.data.view(torch.uint8)) and torch.equal(scale, r.scale)


@pytest.mark.parametrize("g", [tensorwise(), rowwise()], ids=str)
def test_traceable_amax_equals_the_amax_kernel(g):
    # under torch.compile per-tensor and per-line amaxes come from torch reductions the compiler can
    # fuse into x's producer; they must give the kernel's bits (NaN: any NaN, the scale is NaN either way)
    from lowprec.kernels import triton_ops as ops
    from lowprec.kernels.triton_plan import Plan, side

    def canonical(bits):
        return torch.where(bits > 0x7F800000, 0x7FC00000, bits)

    for x in (special(96, 160, seed=3), special(64, 128, dtype=torch.float32, seed=4).nan_to_num(0.0)):
        m, k = x.shape
        spec = CastSpec.of("e4m3", g)
        a = side(spec, True, transposed=False, rows=m, cols=k)
        b = side(spec, True, transposed=True, rows=k, cols=m)
        plan = Plan(m, k, a, b)
        kernel = ops.amax(x, tuple(plan.to_ints()), None)
        traced = (TQ._traceable_amax(x, a.amax_kind, a.hadamard, False),
                  TQ._traceable_amax(x, b.amax_kind, b.hadamard, True))
        for got, want in zip(traced, kernel):
            assert torch.equal(canonical(got), canonical(want))


@pytest.mark.parametrize("g", [tensorwise(), rowwise()], ids=str)
def test_compiled_pair_with_traceable_amax_equals_the_reference(g):
    x = special(64, 256, seed=8)

    def f(x):
        q, q_t, _ = TQ.quantize_pair(x, "e4m3", g, "e4m3", g)
        return q.data.view(torch.uint8), q.scale, q_t.data.view(torch.uint8), q_t.scale

    got = torch.compile(f, fullgraph=True, backend="aot_eager")(x)
    r, r_t = quantize(x, "e4m3", g), quantize(x.t(), "e4m3", g)
    want = (r.data.view(torch.uint8), r.scale, r_t.data.view(torch.uint8), r_t.scale)
    for a, b in zip(got, want):
        assert torch.equal(a.view(torch.uint8) if a.dtype == torch.uint8 else a.view(torch.int32),
                           b.view(torch.uint8) if b.dtype == torch.uint8 else b.view(torch.int32))


def test_hadamard_pair_compiles_into_one_graph_once_its_matrix_is_built():
    x = special(32, 64, seed=11).float().nan_to_num(0.0, 0.0, 0.0)

    def f(x):
        q, q_t, _ = TQ.quantize_pair(x, "e2m1", nvfp4(16), "e2m1", nvfp4(16), hadamard_t=SEED)
        return q_t.data, q_t.scale

    eager = f(x)  # builds the matrix (outside any graph: its signs come from a CPU generator)
    got = torch.compile(f, fullgraph=True, backend="aot_eager")(x)
    assert all(torch.equal(a, b) for a, b in zip(got, eager))


def test_a_plan_refuses_a_tile_that_is_not_a_power_of_two():
    from lowprec.kernels.triton_plan import Plan

    with pytest.raises(ValueError, match="tile_rows"):
        Plan(64, 64, None, None, tile_rows=48)


def test_fp4_with_a_given_scale_follows_the_reference_on_non_finite_input():
    # E2M1 has no inf/NaN: under a given scale the reference zeroes such a tensor (NaN scale)
    x = torch.tensor([[0.3, math.nan, 7.0, -0.2] * 8] * 4)
    s = torch.tensor([[1.0]])
    assert not covers(CastSpec.of("e2m1", tensorwise(), delayed=True))
    assert_same(K.quantize(x, "e2m1", tensorwise(), scale=s), quantize(x, "e2m1", tensorwise(), scale=s))
