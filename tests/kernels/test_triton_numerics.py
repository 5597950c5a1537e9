"""The kernels' exact-arithmetic helpers, over many values at once, against torch and the reference.

Each helper runs in a one-program probe kernel over a long vector (Triton's interpreter evaluates a
program's tensors with numpy, so 10^5 values cost about as much as 10). The references are
``lowprec.formats`` / ``lowprec.quant.scales`` (themselves tested against ml_dtypes), torch's own
casts and IEEE float64 arithmetic.
"""
from __future__ import annotations

import math

import pytest
import torch

triton = pytest.importorskip("triton")
tl = pytest.importorskip("triton.language")

from lowprec import formats as F  # noqa: E402
from lowprec.kernels import triton_numerics as N  # noqa: E402
from lowprec.kernels import triton_tiles as T  # noqa: E402
from lowprec.quant import scales as S  # noqa: E402
from lowprec.quant.granularity import ScaleRule  # noqa: E402

SMALL_FLOATS = ("e4m3", "e5m2", "e3m2", "e2m3", "e2m1")
SPECIAL = {F.Special.NONE: N.SPECIAL_NONE, F.Special.FN: N.SPECIAL_FN, F.Special.IEEE: N.SPECIAL_IEEE}


@triton.jit
def _codes_probe(v_ptr, r_ptr, out_ptr, n, EXP: tl.constexpr, MAN: tl.constexpr, SPECIAL: tl.constexpr,
                 SAT: tl.constexpr, STOCH: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    m = offs < n
    v = tl.load(v_ptr + offs, mask=m, other=0.0)
    r = tl.load(r_ptr + offs, mask=m, other=0.0)
    sign = (v.to(tl.int32, bitcast=True) >> 31) & 1
    tl.store(out_ptr + offs, N.to_codes(v, sign, r, EXP, MAN, SPECIAL, SAT, STOCH), mask=m)


@triton.jit
def _e2m1_probe(v_ptr, r_ptr, out_ptr, n, STOCH: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    m = offs < n
    v = tl.load(v_ptr + offs, mask=m, other=0.0)
    r = tl.load(r_ptr + offs, mask=m, other=0.0)
    tl.store(out_ptr + offs, N.e2m1_codes(v, r, STOCH), mask=m)


@triton.jit
def _scale_probe(a_ptr, out_ptr, g, n, RULE: tl.constexpr, FMAX: tl.constexpr, EMAX: tl.constexpr,
                 BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    m = offs < n
    bits = N.abs_bits(tl.load(a_ptr + offs, mask=m, other=0.0))
    tl.store(out_ptr + offs, N.scale_from_amax(bits, g, RULE, FMAX, EMAX), mask=m)


@triton.jit
def _misc_probe(e_ptr, v_ptr, d_ptr, exp_out, bf_out, hf_out, div_out, n, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    m = offs < n
    tl.store(exp_out + offs, N.exp2i(tl.load(e_ptr + offs, mask=m, other=0)), mask=m)
    v = tl.load(v_ptr + offs, mask=m, other=0.0)
    tl.store(bf_out + offs, N.round_to_dtype(v, tl.bfloat16), mask=m)
    tl.store(hf_out + offs, N.round_to_dtype(v, tl.float16), mask=m)
    d = tl.load(d_ptr + offs, mask=m, other=1.0)
    dd, r, dead, ok = T.divisor_of(d)
    tl.store(div_out + offs, T.divide(v, dd, r, ok, 1), mask=m)


def _block(n: int) -> int:
    return triton.next_power_of_2(n)


def _probe_codes(v: torch.Tensor, fmt: str, sat: bool = True, rand: torch.Tensor | None = None) -> torch.Tensor:
    f = F.get(fmt)
    out = torch.empty(v.numel(), dtype=torch.int32)
    r = rand if rand is not None else torch.zeros_like(v)
    _codes_probe[(1,)](v, r, out, v.numel(), EXP=f.exp_bits, MAN=f.man_bits, SPECIAL=SPECIAL[f.special],
                       SAT=sat, STOCH=rand is not None, BLOCK=_block(v.numel()))
    return out


def _grid_neighbourhood(fmt: str) -> torch.Tensor:
    """Every value of the format, the midpoints between neighbours (ties), one FP32 ulp either side
    of each, values beyond the largest, and both signs."""
    vals = F.decode_table(fmt)
    vals = vals[torch.isfinite(vals)].unique().sort().values
    pos = vals[vals >= 0]
    mids = (pos[1:] + pos[:-1]) / 2  # exact in FP32: few significant bits
    pts = torch.cat([pos, mids, pos * 1.5, torch.tensor([F.get(fmt).max * 2, 1e30, 3e-39, 1e-45])])
    pts = torch.cat([pts, torch.nextafter(pts, torch.tensor(math.inf)), torch.nextafter(pts, torch.tensor(0.0))])
    return torch.cat([pts, -pts]).float()


@pytest.mark.parametrize("fmt", SMALL_FLOATS)
def test_nearest_codes_match_encode_at_every_tie_and_neighbour(fmt):
    v = _grid_neighbourhood(fmt)
    assert torch.equal(_probe_codes(v, fmt).to(torch.uint8), F.encode(v, fmt))


@pytest.mark.parametrize("fmt", ("e4m3", "e5m2"))
def test_special_values_and_overflow_without_saturation(fmt):
    v = torch.tensor([math.inf, -math.inf, math.nan, -math.nan, 1e9, -1e9, 0.0, -0.0, 1e-30])
    got = _probe_codes(v, fmt, sat=False).to(torch.uint8)
    assert torch.equal(got, F.encode(v, fmt, saturate=False))  # NaN keeps its sign, as on the CPU
    assert torch.equal(_probe_codes(v, fmt, sat=True).to(torch.uint8), F.encode(v, fmt, saturate=True))


@pytest.mark.parametrize("fmt", ("e4m3", "e2m1"))
def test_stochastic_codes_equal_round_to_given_the_same_uniforms(fmt):
    g = torch.Generator().manual_seed(1)
    v = (torch.randn(20000, generator=g) * 3).float()
    rand = torch.rand(v.shape, generator=g)
    ref = F.codes_of(F.round_to(v, fmt, rounding="stochastic", rand=rand), fmt)
    assert torch.equal(_probe_codes(v, fmt, rand=rand).to(torch.uint8), ref)


def _probe_e2m1(v: torch.Tensor, rand: torch.Tensor | None = None) -> torch.Tensor:
    out = torch.empty(v.numel(), dtype=torch.int32)
    r = rand if rand is not None else torch.zeros_like(v)
    _e2m1_probe[(1,)](v, r, out, v.numel(), STOCH=rand is not None, BLOCK=_block(v.numel()))
    return out.to(torch.uint8)


def test_e2m1_by_comparisons_equals_encode_at_every_tie_and_neighbour():
    v = _grid_neighbourhood("e2m1")
    v = torch.cat([v, torch.tensor([7.0, 8.0, 1e38, -3.4e38, 0.0, -0.0])])
    assert torch.equal(_probe_e2m1(v), F.encode(v, "e2m1"))
    assert torch.equal(_probe_e2m1(v), _probe_codes(v, "e2m1").to(torch.uint8))  # the general path


def test_e2m1_stochastic_by_comparisons_equals_round_to_given_the_same_uniforms():
    g = torch.Generator().manual_seed(2)
    v = torch.cat([(torch.randn(20000, generator=g) * 3), _grid_neighbourhood("e2m1")]).float()
    rand = torch.rand(v.shape, generator=g)
    # uniforms on the decision boundary: equal to the fraction (stays down), zero, just below one
    v[:6] = torch.tensor([0.3, 1.3, 2.5, 5.0, 0.5, 6.5])
    rand[:6] = torch.tensor([0.6, 0.6, 0.5, 0.5, 0.0, 0.99999994])
    ref = F.codes_of(F.round_to(v, "e2m1", rounding="stochastic", rand=rand), "e2m1")
    assert torch.equal(_probe_e2m1(v, rand), ref)


AMAXES = torch.tensor([0.0, 1e-45, 3e-43, 1e-40, 1.17e-38, 1e-30, 0.5, 1.0, 1.5, 448.0, 449.0, 6.0, 7.0,
                       1e30, 3.4e38, math.inf, math.nan])


@pytest.mark.parametrize("rule", [ScaleRule.AMAX, ScaleRule.FLOOR, ScaleRule.CEIL])
@pytest.mark.parametrize("fmt", ("e4m3", "e2m1"))
def test_scale_rules_match_the_reference(rule, fmt):
    f = F.get(fmt)
    g = torch.Generator().manual_seed(2)
    amax = torch.cat([AMAXES, torch.exp(torch.empty(4000).uniform_(-100, 88, generator=g))]).float()
    out = torch.empty_like(amax)
    code = {ScaleRule.AMAX: N.RULE_AMAX, ScaleRule.FLOOR: N.RULE_FLOOR, ScaleRule.CEIL: N.RULE_CEIL}[rule]
    _scale_probe[(1,)](amax, out, 1.0, amax.numel(), RULE=code, FMAX=f.max, EMAX=f.emax, BLOCK=_block(amax.numel()))
    ref = S.block_scales(amax, f, rule)
    assert torch.equal(out.view(torch.int32), ref.view(torch.int32))


def test_nvfp4_block_scale_matches_the_reference():
    f = F.get("e2m1")
    g = torch.Generator().manual_seed(3)
    amax = torch.cat([AMAXES, torch.exp(torch.empty(4000).uniform_(-30, 30, generator=g))]).float()
    for gamax in (torch.tensor(1e-37), torch.tensor(5.0), torch.tensor(1e20)):
        big, _ = S.nvfp4_global_scales(gamax, f)
        out = torch.empty_like(amax)
        _scale_probe[(1,)](amax, out, float(big), amax.numel(), RULE=N.RULE_NVFP4, FMAX=f.max, EMAX=f.emax,
                           BLOCK=_block(amax.numel()))
        ref = S.nvfp4_block_scale(amax, f, big)
        assert torch.equal(out.view(torch.int32), ref.view(torch.int32))


@triton.jit
def _nvfp4_probe(a_ptr, s_ptr, big_out, g_out, enc_out, n, FMAX: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    m = offs < n
    big = N.nvfp4_global_encode(N.abs_bits(tl.load(a_ptr + offs, mask=m, other=0.0)), FMAX)
    g = tl.math.div_rn(1.0, big)
    tl.store(big_out + offs, big, mask=m)
    tl.store(g_out + offs, g, mask=m)
    tl.store(enc_out + offs, N.nvfp4_encode(tl.load(s_ptr + offs, mask=m, other=0.0), g), mask=m)


@pytest.mark.filterwarnings("ignore:overflow encountered")  # 2688 / 1e-45 and 1 / (s * g) overflow, as meant
def test_nvfp4_global_and_encode_scales_match_the_reference():
    # tensor amaxes from FP32's smallest subnormal (2688 / amax overflows) to its largest; block
    # scales every E4M3 value, NaN (a dead block) and 0 (an underflowed block: encode is FP32's max)
    f = F.get("e2m1")
    g = torch.Generator().manual_seed(6)
    e4m3 = F.decode_table("e4m3").abs()
    amax = torch.cat([AMAXES[:-2], torch.exp(torch.empty(6000).uniform_(-103, 88, generator=g))]).float()
    s = e4m3[torch.randint(0, e4m3.numel(), amax.shape, generator=g)]
    outs = [torch.empty_like(amax) for _ in range(3)]
    _nvfp4_probe[(1,)](amax, s, *outs, amax.numel(), FMAX=f.max, BLOCK=_block(amax.numel()))
    big, gs = S.nvfp4_global_scales(amax, f)
    for out, ref in zip(outs, (big, gs, S.nvfp4_encode_scale(s, gs))):
        keep = ~torch.isnan(ref)  # the kernel gives a dead block FP32's max; its codes are zeroed anyway
        assert torch.equal(out[keep].view(torch.int32), ref[keep].view(torch.int32))
    assert (outs[0] == torch.finfo(torch.float32).max).any() and (s == 0).any() and torch.isnan(s).any()


def test_exp2i_rounding_to_16_bit_dtypes_and_division():
    g = torch.Generator().manual_seed(4)
    n = 30000
    e = torch.randint(-149, 128, (n,), generator=g, dtype=torch.int32)
    e[:277] = torch.arange(-149, 128, dtype=torch.int32)
    v = torch.randn(n, generator=g) * torch.exp(torch.empty(n).uniform_(-60, 60, generator=g))
    v[:4] = torch.tensor([math.inf, -math.inf, math.nan, 70000.0])
    v[4:1004] = (torch.arange(1000) * 2.0**-16 + 1).float() + 2.0**-17  # bf16 ties
    d = torch.exp(torch.empty(n).uniform_(-80, 80, generator=g)).float()
    outs = [torch.empty(n) for _ in range(4)]
    _misc_probe[(1,)](e, v, d, *outs, n, BLOCK=_block(n))
    assert torch.equal(outs[0], torch.ldexp(torch.ones(n), e.float()))  # exact powers, subnormals too
    for out, dtype in ((outs[1], torch.bfloat16), (outs[2], torch.float16)):
        ref = v.to(dtype).float()
        num = ~torch.isnan(ref)  # torch's CPU cast gives NaN a sign of its own; which one is no matter
        assert torch.equal(torch.isnan(out), ~num)
        assert torch.equal(out[num].view(torch.int32), ref[num].view(torch.int32))
    finite = torch.isfinite(v)
    assert torch.equal(outs[3][finite], (v / d)[finite])  # Markstein's correction: correctly rounded
