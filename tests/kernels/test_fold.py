"""MX operands folded to row scales (``kernels.fold``, [Note: folding MX blocks into rows]) and the GEMM that
multiplies them on FP8 tensor cores (``GemmPath.FOLDED``).

The independent reference for a folded element is arithmetic on exact values: ``v * 2^d`` kept where it is at
least the target's smallest normal, else rounded half to even onto the subnormal step with ``torch.round``;
never torch's float8 conversion, which the folding itself uses.
"""
from __future__ import annotations

import importlib.util
import math

import pytest
import torch

from lowprec import formats as F
from lowprec import recipes as R
from lowprec.kernels import fold as FD
from lowprec.kernels.gemm import GemmPath, scaled_mm
from lowprec.quant import GranularityKind, QuantizedTensor, mx, nvfp4, quantize, rowwise
from tests.kernels.folded_layers import fp8_cpu, train_once

MX_ELEMENTS = ("e4m3", "e5m2", "e3m2", "e2m3", "e2m1")
TARGET = {"e5m2": (2.0 ** -14, 2.0 ** -16)}  # (smallest normal, subnormal step) of the target
E4M3_GRID = (2.0 ** -6, 2.0 ** -9)


def _every_code(fmt: F.Format) -> torch.Tensor:
    """Every code of ``fmt`` (NaN and inf codes left out), one per element."""
    codes = torch.arange(1 << fmt.bits, dtype=torch.int32).to(torch.uint8)
    v = F.decode_unchecked(codes.view(fmt.storage_dtype) if fmt.torch_dtype is not None else codes, fmt)
    return codes[v.isfinite()]


def _row_of_every_code(fmt: F.Format) -> torch.Tensor:
    """Every code of ``fmt``, repeated to fill at least two blocks of 32."""
    codes = _every_code(fmt)
    k = 32 * max(2, math.ceil(codes.numel() / 32))
    return codes.repeat(math.ceil(k / codes.numel()))[:k]


def _mx_tensor(fmt: F.Format, codes: torch.Tensor, exponents: torch.Tensor, block: int = 32) -> QuantizedTensor:
    """An MX tensor of ``codes`` (M, K) with block exponents ``exponents`` (M, K / block) (NaN where 1000)."""
    scale = torch.ldexp(torch.ones(exponents.shape), exponents.clamp(max=127))
    scale = torch.where(exponents == 1000, torch.nan, scale)
    data = codes.view(fmt.torch_dtype) if fmt.torch_dtype is not None else codes
    return QuantizedTensor(data, scale, fmt, mx(block), codes.shape, torch.float32)


def _expected(q: QuantizedTensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(folded values, row scales) by the rule on exact values."""
    fmt = q.fmt
    h = {"e4m3": 0, "e5m2": 0, "e3m2": 4, "e2m3": 5, "e2m1": 6}[fmt.name]
    normal, step = TARGET.get(fmt.name, E4M3_GRID)
    e = torch.log2(q.scale)  # NaN for NaN blocks
    top = torch.where(e.isnan(), -math.inf, e).amax(1)
    r = torch.where(top == -math.inf, 0.0, top - h)
    shift = (e - r[:, None]).clamp(min=-40)
    v = q.values().view(*q.scale.shape, -1).double() * torch.pow(2.0, shift.double())[:, :, None]
    v = v.view(q.data.shape)
    tiny = v.abs() < normal
    folded = torch.where(tiny, torch.round(v / step) * step, v)
    return folded, torch.pow(2.0, r.double())


def _assert_folded(q: QuantizedTensor, got: QuantizedTensor) -> None:
    folded, r = _expected(q)
    assert got.granularity == rowwise() and got.fmt is FD.target(q.fmt)
    assert got.data.dtype == FD.target(q.fmt).torch_dtype and got.scale.shape == (q.data.shape[0], 1)
    assert torch.equal(got.scale.double().view(-1), r)
    v = got.values().double()
    nan = folded.isnan()
    assert torch.equal(v.isnan(), nan)
    assert torch.equal(v[~nan], folded[~nan])


@pytest.mark.parametrize("name", MX_ELEMENTS)
def test_every_code_of_every_mx_format_folds_by_the_rule(name):
    """Every code, in blocks from the row's top down to 20 binades below it (elements exact, then rounded
    onto the subnormal step, then zero), and rows whose blocks span E8M0's extremes."""
    fmt = F.get(name)
    row = _row_of_every_code(fmt)
    k = row.numel()
    shifts = torch.arange(0, -21, -1)
    data = row.repeat(len(shifts), 1)  # (21, K): row i's second block i binades below its first
    exps = torch.zeros(len(shifts), k // 32, dtype=torch.int32)
    exps[:, 1:] = shifts[:, None]
    extreme = torch.tensor([[127, -127] + [0] * (k // 32 - 2), [-127] * (k // 32)], dtype=torch.int32)
    q = _mx_tensor(fmt, torch.cat([data, row.repeat(2, 1)]), torch.cat([exps, extreme]))
    _assert_folded(q, FD.fold_reference(q))


@pytest.mark.parametrize("name", MX_ELEMENTS)
def test_a_folded_element_is_exact_or_within_half_the_subnormal_step_of_its_row_scale(name):
    fmt = F.get(name)
    x = torch.randn(64, 256, generator=torch.Generator().manual_seed(1)) * torch.logspace(-8, 8, 256, base=2)
    q = quantize(x, fmt, mx(32, "ceil"))
    got = FD.fold_reference(q)
    orig, folded = q.dequantize(torch.float64), got.dequantize(torch.float64)
    normal, step = TARGET.get(name, E4M3_GRID)
    r = got.scale.double()
    exact = orig.abs() >= normal * r
    assert torch.equal(folded[exact], orig[exact])
    assert ((folded - orig).abs() <= step / 2 * r).all()
    # the bound the docs state: each element within 2^-17 of its row's largest (2^-16 for E2M3)
    rel = (folded - orig).abs() / orig.abs().amax(1, keepdim=True)
    assert rel.max() <= (2.0 ** -16 if name == "e2m3" else 2.0 ** -17)


def test_nan_blocks_and_elements_and_infinities_stay_so():
    e4m3, e5m2 = F.get("e4m3"), F.get("e5m2")
    codes = torch.full((2, 64), 0x38, dtype=torch.uint8)  # 1.0
    codes[0, 3] = 0x7F  # an E4M3 NaN element
    q = _mx_tensor(e4m3, codes, torch.tensor([[1000, 2], [1000, 1000]], dtype=torch.int32))
    got = FD.fold_reference(q).values()
    assert got[0, :32].isnan().all() and torch.equal(got[0, 32:], torch.ones(32))
    assert got[1].isnan().all() and FD.fold_reference(q).scale[1].item() == 1.0  # a row of NaN blocks only
    codes5 = torch.full((1, 32), 0x3C, dtype=torch.uint8)  # 1.0 in E5M2
    codes5[0, 0], codes5[0, 1] = 0x7C, 0xFC  # +inf, -inf
    got5 = FD.fold_reference(_mx_tensor(e5m2, codes5, torch.tensor([[5]], dtype=torch.int32))).values()
    assert got5[0, 0] == math.inf and got5[0, 1] == -math.inf and got5[0, 2] == 1.0


def test_only_mx_operands_fold():
    x = torch.randn(16, 64)
    assert FD.foldable("e4m3", mx(32)) and FD.foldable("e2m1", mx(32)) and not FD.foldable("e2m1", nvfp4(16))
    for q in (quantize(x, "e2m1", nvfp4(16)), quantize(x, "e4m3", rowwise()), "codes"):
        with pytest.raises(ValueError, match=r"^q: expected an MX operand"):
            FD.fold(q)


# --- the Triton kernel, through the interpreter ---------------------------------------------------------

def _bits(q: QuantizedTensor) -> torch.Tensor:
    b = q.data.view(torch.uint8).clone()
    nan = q.values().isnan()
    b[nan] = 0xFF  # a NaN's sign is not part of the contract
    return b


@pytest.mark.parametrize("name", MX_ELEMENTS)
@pytest.mark.parametrize("shape", [(5, 32), (37, 200), (16, 640)], ids=str)
def test_the_triton_fold_is_the_reference_bit_for_bit(name, shape):
    pytest.importorskip("triton")
    g = torch.Generator().manual_seed(sum(shape))
    x = torch.randn(*shape, generator=g) * torch.logspace(-10, 10, shape[1], base=2)
    x[1, 3] = math.nan  # a NaN block
    q = quantize(x, name, mx(32, "ceil"))
    want, got = FD.fold_reference(q), FD.fold(q, backend="triton")
    assert got.fmt is want.fmt and got.granularity == want.granularity and got.data.dtype == want.data.dtype
    assert torch.equal(got.scale, want.scale)
    assert torch.equal(_bits(got), _bits(want))


def test_the_triton_fold_takes_every_code_and_extreme_scales():
    pytest.importorskip("triton")
    for name in MX_ELEMENTS:
        fmt = F.get(name)
        row = _row_of_every_code(fmt)
        k = row.numel()
        exps = torch.randint(-127, 128, (6, k // 32), generator=torch.Generator().manual_seed(3), dtype=torch.int32)
        exps[0] = -127
        exps[1, 0] = 1000
        q = _mx_tensor(fmt, row.repeat(6, 1), exps)
        assert torch.equal(_bits(FD.fold(q, backend="triton")), _bits(FD.fold_reference(q))), name


@pytest.mark.parametrize("name", MX_ELEMENTS)
def test_zeros_fold_to_plus_zero_whatever_their_sign(name):
    """The code of a folded zero is +0 in the reference and the kernel, and for an element rounded to zero:
    compiled code negates as ``0 - x`` and would keep no sign, so neither path keeps one."""
    fmt = F.get(name)
    neg_zero = 1 << (fmt.bits - 1)  # the sign bit alone: -0
    codes = torch.tensor([[0, neg_zero] * 16, [neg_zero] * 31 + [1]], dtype=torch.uint8)
    q = _mx_tensor(fmt, codes, torch.tensor([[3], [-30]], dtype=torch.int32))  # row 2: its 1 far above its zeros
    want = FD.fold_reference(q)
    zeros = want.values() == 0
    assert zeros[0].all() and zeros[1, :31].all()
    assert (_bits(want)[zeros] == 0).all()
    if importlib.util.find_spec("triton") is not None:
        assert torch.equal(_bits(FD.fold(q, backend="triton")), _bits(want))


# --- the GEMM -------------------------------------------------------------------------------------------

def _integers(m, k, seed, spread=2):
    """Small integers times a power of two per block of 32: every folding exact, every sum representable."""
    g = torch.Generator().manual_seed(seed)
    ints = torch.randint(-3, 4, (m, k), generator=g).float()
    blocks = 2.0 ** torch.randint(-spread, spread + 1, (m, k // 32), generator=g).float()
    return (ints.view(m, k // 32, 32) * blocks[:, :, None]).view(m, k)


@pytest.mark.parametrize("gemm", R.GEMMS)
@pytest.mark.parametrize("recipe", ["mxfp8", "mxfp4"])
def test_a_folded_gemm_equals_the_emulation_where_both_are_exact(recipe, gemm):
    g: R.Gemm = getattr(R.get(recipe), gemm)
    a = quantize(_integers(40, 160, 1), g.lhs.fmt, g.lhs.granularity)
    b = quantize(_integers(24, 160, 2), g.rhs.fmt, g.rhs.granularity)
    want = scaled_mm(a, b, torch.float32, backend=GemmPath.EMULATED)
    got = scaled_mm(a, b, torch.float32, backend=GemmPath.FOLDED)
    assert torch.equal(got, want)
    assert torch.equal(scaled_mm(a, b, torch.bfloat16, backend="folded"), want.to(torch.bfloat16))


@pytest.mark.parametrize("pair", [("e4m3", "e4m3"), ("e2m1", "e2m1"), ("e5m2", "e4m3"), ("e3m2", "e2m3")])
def test_a_folded_gemm_is_within_the_stated_bound_of_the_emulation(pair):
    g = torch.Generator().manual_seed(7)
    spread = torch.logspace(-9, 9, 192, base=2)
    a = quantize(torch.randn(33, 192, generator=g) * spread, pair[0], mx(32, "ceil"))
    b = quantize(torch.randn(20, 192, generator=g) * spread.flip(0), pair[1], mx(32, "ceil"))
    want = scaled_mm(a, b, torch.float32, backend=GemmPath.EMULATED).double()
    got = scaled_mm(a, b, torch.float32, backend=GemmPath.FOLDED).double()
    va, vb = a.dequantize(torch.float64), b.dequantize(torch.float64)
    # each element within 2^-16 of its row's largest; then two FP32 sums of K products
    ea, eb = 2.0 ** -16 * va.abs().amax(1, keepdim=True), 2.0 ** -16 * vb.abs().amax(1, keepdim=True)
    bound = ea * vb.abs().sum(1)[None, :] + va.abs().sum(1)[:, None] * eb.t() + ea * eb.t() * 192
    bound = bound + 2 * 193 * 2.0 ** -24 * (va.abs() @ vb.abs().t())
    assert ((got - want).abs() <= bound).all()
    assert (got != want).any() or pair == ("e2m1", "e2m1")  # the bound is not met by equality alone


def test_the_first_use_check_runs_eagerly_while_torch_compile_traces(monkeypatch):
    """Met first inside a compiled step, the check runs at trace time and its outcome is a constant of the
    graph: no graph break (its ``.item()`` would make one), and the outcome is remembered for the device."""
    import torch._dynamo.testing

    from lowprec.kernels import gemm as G

    cpu = torch.device("cpu")
    monkeypatch.setattr(FD.CHECK, "_done", {})
    torch._dynamo.reset()

    def step(x):
        return x * 2 if G._folded_checked(cpu) else x

    counter = torch._dynamo.testing.CompileCounter()
    assert torch.equal(torch.compile(step, backend=counter, fullgraph=True)(torch.ones(3)), torch.full((3,), 2.0))
    assert counter.frame_count == 1 and FD.CHECK.state(cpu) is True
    torch._dynamo.reset()


def test_the_first_use_check_passes_here_and_refuses_a_wrong_gemm():
    from lowprec.kernels.first_use import relative_error
    from lowprec.kernels.gemm import _emulated, _folded

    cpu = torch.device("cpu")
    for name, a, b in FD.CHECK.problems(cpu):
        assert relative_error(a, b, _folded, _emulated) == 0.0, name
    assert FD.CHECK.run(cpu, _folded, _emulated) is True
    with pytest.warns(UserWarning, match=r"differ from the emulation on cpu \(e4m3: by .* of \|A\|\|B\|\^T"):
        assert FD.CHECK.run(cpu, lambda a, b: _folded(a, b) * 1.01, _emulated) is False

    def broken(a, b):
        raise RuntimeError("no kernel\nmore")

    with pytest.warns(UserWarning, match=r"fail on cpu \(no kernel\); MX GEMMs stay emulated there"):
        assert FD.CHECK.run(cpu, broken, _emulated) is False
    assert FD.CHECK.state(cpu) is None  # run() decides nothing for the process; checked() remembers


def test_a_linear_trains_folded_within_the_bound_of_the_emulated_one(monkeypatch):
    """A device with FP8 tensor cores (the CPU, told so; torch._scaled_mm runs on it) takes the folded path
    for every GEMM of mxfp8 and mxfp4; forward and backward stay within 2^-12 of the emulated layer."""
    from lowprec.nn.plan import layer_plan

    for recipe in ("mxfp8", "mxfp4"):
        outs = {}
        for fp8 in (False, True):
            fp8_cpu(monkeypatch, fp8)
            layer_plan.cache_clear()
            plan, outs[fp8] = train_once(recipe)
            assert {plan.fprop.path, plan.dgrad.path, plan.wgrad.path} == {GemmPath.FOLDED if fp8 else
                                                                             GemmPath.EMULATED}
        layer_plan.cache_clear()
        for got, want in zip(outs[True], outs[False]):
            assert ((got - want).abs().max() / want.abs().max()).item() <= 2.0 ** -12, recipe


def test_the_granularity_kind_of_mx_is_what_foldable_reads():
    assert mx(32).kind is GranularityKind.MX and F.get("e2m1") in FD.ELEMENTS


def test_a_one_row_operand_and_an_expert_slice_of_the_tokens_side_fold_and_multiply():
    """A single token (its row scale kept per row while its data is padded to 16 rows), and an expert's
    columns of the batched tokens' side (a strided view, made contiguous for the Triton kernel)."""
    pytest.importorskip("triton")
    from lowprec.nn import grouped_casts as GC
    from lowprec.nn.plan import layer_plan

    one = quantize(torch.randn(1, 64), "e4m3", mx(32))
    w = quantize(torch.randn(24, 64), "e4m3", mx(32))
    assert torch.equal(scaled_mm(one, w, backend="folded"), scaled_mm(one, w, backend="emulated"))
    op = layer_plan(R.get("mxfp8"), torch.device("cpu"), 64, 128, None, None).input
    x = torch.randn(70, 64)
    _, t = GC.cast_rows(x, GC.groups((30, 40)), op, False, True)
    part = t.expert(1, slice(30, 70))
    assert part.data.is_contiguous() and part.scale.is_contiguous()
    assert torch.equal(_bits(FD.fold(part, backend="triton")), _bits(FD.fold_reference(part)))


def test_blocks_of_other_sizes_fold_by_the_reference():
    q = quantize(torch.randn(8, 96), "e4m3", mx(48))
    assert torch.equal(_bits(FD.fold(q, backend="triton")), _bits(FD.fold_reference(q)))


def _columns(q: QuantizedTensor, blocks: slice) -> QuantizedTensor:
    """The MX tensor of ``q``'s block columns ``blocks`` alone (what one expert's own cast would hold)."""
    bc = q.granularity.block_cols
    codes = q.data[:, blocks.start * bc:blocks.stop * bc].contiguous()
    return QuantizedTensor(codes, q.scale[:, blocks].contiguous(), q.fmt, q.granularity, codes.shape, q.dtype)


@pytest.mark.parametrize("name", MX_ELEMENTS)
def test_folding_by_segments_equals_folding_each_segments_columns_alone(name):
    """Each segment of block columns (an expert's tokens) folds to a scale of its own per row, bit for bit
    the fold of its columns alone, by the rule on exact values: segments of one and of several blocks, one
    without blocks (scale 1), blocks 20 binades apart, NaN blocks (a segment of NaN blocks only: scale 1)."""
    fmt = F.get(name)
    g = torch.Generator().manual_seed(4)
    row = _row_of_every_code(fmt)
    kb = 7
    data = row.repeat(1, -(-32 * kb // row.numel()))[:, :32 * kb].repeat(5, 1)  # (5, 224)
    data = data[:, torch.randperm(32 * kb, generator=g)]
    exps = torch.randint(-20, 21, (5, kb), generator=g, dtype=torch.int32)
    exps[0, 1:3] = 1000  # the whole of segment 1 NaN in row 0
    exps[1, 4] = 1000  # one NaN block among others
    q = _mx_tensor(fmt, data, exps)
    segments = [slice(0, 1), slice(1, 3), slice(3, 3), slice(3, 7)]  # the third: no tokens
    segment = torch.tensor([0, 1, 1, 3, 3, 3, 3])
    codes, scales = FD.fold_segments(q, segment, 4)
    assert codes.dtype == FD.target(fmt).torch_dtype and scales.shape == (5, 4)
    for s, blocks in enumerate(segments):
        bc = 32
        if blocks.start == blocks.stop:
            assert torch.equal(scales[:, s], torch.ones(5))
            continue
        alone = _columns(q, blocks)
        want = FD.fold_reference(alone)
        _assert_folded(alone, want)  # the rule, on exact values
        got = codes[:, blocks.start * bc:blocks.stop * bc]
        assert torch.equal(got.view(torch.uint8), want.data.view(torch.uint8)), s
        assert torch.equal(scales[:, s:s + 1], want.scale), s
    assert scales[0, 1] == 1.0  # NaN blocks only


def test_folding_by_segments_names_a_segment_map_of_the_wrong_shape():
    q = quantize(torch.randn(2, 64), F.get("e4m3"), mx(32))
    with pytest.raises(ValueError, match=r"segment.*\(2,\).*\(3,\)"):
        FD.fold_segments(q, torch.zeros(3, dtype=torch.int64), 2)
