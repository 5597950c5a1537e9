"""``block_scaled_mm`` (``kernels.triton_block_gemm``) through Triton's interpreter against the emulated GEMM
(``kernels.gemm._emulated``), the reference: for the operands of every GEMM of the MX and NVFP4 recipes,
within the bound of [Note: block-scaled GEMMs on tensor cores] for the interpreter (both sides sum exact
products in FP32, in different orders), and bit for bit where every partial sum is representable.

The interpreter's FP8 dot multiplies in FP32 (exact for FP8 operands); the tensor core's accumulation
inside a 32-wide chunk is measured on the GPU by ``benchmarks/bench_block_gemm.py``.
"""
from __future__ import annotations

import math

import pytest
import torch

triton = pytest.importorskip("triton")
tl = pytest.importorskip("triton.language")

from lowprec import formats as F  # noqa: E402
from lowprec import recipes as R  # noqa: E402
from lowprec.kernels.gemm import _emulated  # noqa: E402
from lowprec.kernels.triton_block_gemm import BlockGemmVariant, block_scaled_mm  # noqa: E402
from lowprec.kernels.triton_block_mx import _e4m3_codes  # noqa: E402
from lowprec.quant import QuantizedTensor, blockwise, mx, nvfp4, quantize  # noqa: E402

TILES = [(64, 64, 64), (32, 64, 128)]  # BLOCK_K 64 and 128: the padded K (96, 48, 64 below) is no multiple of 128
TOKENS, D_IN, D_OUT = 40, 80, 56  # no dimension a multiple of a tile; K = 80, 56, 40 pad to whole blocks
MX_VARIANTS = list(BlockGemmVariant)  # two MX operands: every kernel
NVFP4_VARIANTS = [BlockGemmVariant.DEQUANT]  # blocks of 16: no FP8 MMA step


def _variants(g) -> list[BlockGemmVariant]:
    return NVFP4_VARIANTS if g.kind.name == "NVFP4" else MX_VARIANTS


def _within_bound(got: torch.Tensor, ref: torch.Tensor, a: QuantizedTensor, b: QuantizedTensor) -> None:
    """``|got - ref| <= 2 (K + 1) 2^-24 (|A| |B|^T)`` (two FP32 sums of the same exact products, each within
    ``K 2^-24`` of the exact sum; one more term for rounding the bound's own GEMM), plus FP32's smallest
    subnormal per term for products that underflow on one side only."""
    kp = a.data.shape[1]
    mag = a.dequantize(torch.float32).abs().reshape(-1, a.shape[-1]) @ b.dequantize(torch.float32).abs(
    ).reshape(-1, b.shape[-1]).t()  # (M, N)
    bound = 2 * (kp + 1) * 2.0**-24 * mag + kp * 2.0**-149
    assert torch.equal(torch.isnan(got), torch.isnan(ref))
    ok = ~torch.isnan(ref)
    assert ((got - ref).abs()[ok] <= bound[ok]).all(), float(((got - ref).abs()[ok] / bound[ok]).max())


def _recipe_operands(recipe: R.Recipe, gemm: str, gen: torch.Generator) -> tuple[QuantizedTensor, QuantizedTensor]:
    """``gemm``'s two operands for a linear layer, each cast along its own K as ``recipe`` casts it
    ([Note: the three GEMMs]); values over six decades so that blocks' scales differ."""
    x = torch.randn(TOKENS, D_IN, generator=gen) * torch.logspace(-3, 3, D_IN)
    w = torch.randn(D_OUT, D_IN, generator=gen) * torch.logspace(2, -2, D_IN)
    dy = torch.randn(TOKENS, D_OUT, generator=gen) * torch.logspace(-2, 2, D_OUT)
    lhs, rhs = {"fprop": (x, w), "dgrad": (dy, w.t()), "wgrad": (dy.t(), x.t())}[gemm]
    spec = getattr(recipe, gemm)

    def cast(t, c: R.Cast) -> QuantizedTensor:
        return quantize(t.contiguous(), c.format, c.granularity, rounding=c.rounding, generator=gen)

    return cast(lhs, spec.lhs), cast(rhs, spec.rhs)


@pytest.mark.parametrize("tile", TILES, ids=str)
@pytest.mark.parametrize("gemm", R.GEMMS)
@pytest.mark.parametrize("recipe,variant", [(r, v) for r in ("mxfp8", "mxfp4") for v in MX_VARIANTS]
                         + [("nvfp4", v) for v in NVFP4_VARIANTS], ids=str)
def test_recipe_gemms_equal_the_emulation_within_the_bound(recipe, variant, gemm, tile):
    a, b = _recipe_operands(R.get(recipe), gemm, torch.Generator().manual_seed(len(recipe) + len(gemm)))
    ref = _emulated(a, b, torch.float32)[: a.shape[0], : b.shape[0]]
    got = block_scaled_mm(a, b, torch.float32, tile=tile, variant=variant)
    assert got.shape == ref.shape
    _within_bound(got, ref, a, b)
    # BF16 output: the FP32 result rounded to nearest even, as torch rounds it
    assert torch.equal(block_scaled_mm(a, b, torch.bfloat16, tile=tile, variant=variant), got.to(torch.bfloat16))


def _exact_mx(fmt: str, rows: int, k: int, gen: torch.Generator) -> torch.Tensor:
    """Values whose MX cast is exact and whose products' partial sums are all representable in FP32:
    small integers (FP8: at most 4 significant bits, E5M2 3) or E2M1 values, times 2^-2..2^2 per block."""
    if fmt == "e2m1":
        grid = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])
        v = grid[torch.randint(0, 8, (rows, k), generator=gen)]
        v = v * (torch.randint(0, 2, (rows, k), generator=gen) * 2 - 1)
    else:
        top = 7 if fmt == "e5m2" else 15
        v = torch.randint(-top, top + 1, (rows, k), generator=gen).float()
    e = torch.randint(-2, 3, (rows, math.ceil(k / 32)), generator=gen).float()
    return v * torch.exp2(e).repeat_interleave(32, dim=1)[:, :k]


@pytest.mark.parametrize("fa,fb", [("e4m3", "e4m3"), ("e2m1", "e2m1"), ("e2m1", "e4m3"), ("e4m3", "e5m2"),
                                   ("e5m2", "e5m2")])
def test_mx_gemms_are_bit_exact_where_every_partial_sum_is_representable(fa, fb):
    gen = torch.Generator().manual_seed(1)
    x, w = _exact_mx(fa, TOKENS, D_IN, gen), _exact_mx(fb, D_OUT, D_IN, gen)
    a, b = quantize(x, fa, mx(32, "ceil")), quantize(w, fb, mx(32, "ceil"))
    assert torch.equal(a.dequantize(), x) and torch.equal(b.dequantize(), w)  # the inputs are the operands
    for tile in TILES:
        for variant in MX_VARIANTS:
            got = block_scaled_mm(a, b, tile=tile, variant=variant)
            assert torch.equal(got, _emulated(a, b, torch.float32)[:TOKENS, :D_OUT])
            assert torch.equal(got, x @ w.t())  # exact


def _nvfp4_operand(rows: int, k: int, two_d: bool, global_scale: float, gen: torch.Generator) -> QuantizedTensor:
    """An NVFP4 operand built from E2M1 codes and E4M3 block scales in {1/2, 3/4, 1, 3/2, 2, 3}, so that
    products are multiples of 2^-6 below 324 and their sums over K exact in FP32."""
    br = 16 if two_d else 1
    rp, kp = -(-rows // br) * br, -(-k // 16) * 16
    codes = torch.zeros(rp, kp, dtype=torch.uint8)
    codes[:rows, :k] = torch.randint(0, 16, (rows, k), generator=gen, dtype=torch.uint8)
    choices = torch.tensor([0.5, 0.75, 1.0, 1.5, 2.0, 3.0])
    scale = choices[torch.randint(0, 6, (rp // br, kp // 16), generator=gen)]
    return QuantizedTensor(codes, scale, F.get("e2m1"), nvfp4(16, two_d=two_d), torch.Size((rows, k)),
                           torch.float32, torch.tensor(global_scale))


def test_nvfp4_gemm_is_bit_exact_where_every_partial_sum_is_representable():
    gen = torch.Generator().manual_seed(2)
    a = _nvfp4_operand(TOKENS, D_IN, False, 2.0**-3, gen)
    b = _nvfp4_operand(D_OUT, D_IN, True, 2.0**2, gen)
    exact = a.dequantize() @ b.dequantize().t()  # FP32: exact, by construction
    for tile in TILES:
        got = block_scaled_mm(a, b, tile=tile)
        assert torch.equal(got, _emulated(a, b, torch.float32)[:TOKENS, :D_OUT])
        assert torch.equal(got, exact)


def _extreme_blocks(rows: int, k: int, gen: torch.Generator) -> torch.Tensor:
    """Blocks of 32 along K, by row: zero, tiny (1e-30: subnormal-range E8M0 scales and FP32 products
    near underflow), with elements on the format's subnormals (one large element beside tiny ones),
    maximal (every element +-2^k times the format's largest), ordinary; and one NaN."""
    x = torch.randn(rows, k, generator=gen)
    x[0::5] = 0.0
    x[1::5] *= 1e-30
    x[2::5, 1::2] *= 2.0**-16
    x[3::5] = torch.where(x[3::5] < 0, -448.0, 448.0) * 2.0**60
    x[4, 5] = math.nan
    return x


@pytest.mark.parametrize("fmt,g", [("e4m3", mx(32, "ceil")), ("e2m1", mx(32, "ceil")), ("e5m2", mx(32, "floor")),
                                   ("e2m1", nvfp4(16))], ids=str)
def test_zero_subnormal_maximal_and_nan_blocks(fmt, g):
    gen = torch.Generator().manual_seed(3)
    x = _extreme_blocks(TOKENS, D_IN, gen)
    w = torch.randn(D_OUT, D_IN, generator=gen) * 2.0**-60
    a, b = quantize(x, fmt, g), quantize(w, fmt, g)
    ref = _emulated(a, b, torch.float32)[:TOKENS, :D_OUT]
    for variant in _variants(g):
        got = block_scaled_mm(a, b, tile=TILES[0], variant=variant)
        _within_bound(got, ref, a, b)
        assert (got[0::5] == 0).all() and torch.isnan(got[4]).all()


@pytest.mark.parametrize("fmt", ["e2m1", "e3m2", "e2m3"])
def test_narrow_codes_become_e4m3_codes_of_the_same_values(fmt):
    f = F.get(fmt)
    codes = torch.arange(2**f.bits, dtype=torch.int32)
    out = torch.empty_like(codes)
    _e4m3_probe[(1,)](codes, out, f.exp_bits, f.man_bits, codes.numel())
    got = out.to(torch.uint8).view(torch.float8_e4m3fn).float()
    want = F.decode(codes.to(torch.uint8), f)
    assert torch.equal(got, want) and torch.equal(torch.signbit(got), torch.signbit(want))  # -0 stays -0


@triton.jit
def _e4m3_probe(c_ptr, out_ptr, EXP: tl.constexpr, MAN: tl.constexpr, N: tl.constexpr):
    offs = tl.arange(0, N)
    tl.store(out_ptr + offs, _e4m3_codes(tl.load(c_ptr + offs), EXP, MAN))


def test_operands_the_kernels_do_not_cover_are_refused():
    x = torch.randn(32, 64)
    with pytest.raises(ValueError, match=r"^a/b: expected MX or NVFP4 block scales"):
        block_scaled_mm(quantize(x, "e4m3", blockwise(1, 128)), quantize(x, "e4m3", mx(32)))
    with pytest.raises(ValueError, match=r"^a/b: expected MX or NVFP4 block scales with one block size"):
        block_scaled_mm(quantize(x, "e2m1", mx(32)), quantize(x, "e2m1", nvfp4(16)))
    with pytest.raises(ValueError, match=r"^variant: expected dequant for operands other than two MX ones"):
        block_scaled_mm(quantize(x, "e2m1", nvfp4(16)), quantize(x, "e2m1", nvfp4(16)), variant="chunk")
    with pytest.raises(ValueError, match=r"^variant: expected dequant for operands other than two MX ones"):
        block_scaled_mm(quantize(x, "e2m1", mx(16)), quantize(x, "e2m1", mx(16)), variant="chunk-inline")
    with pytest.raises(ValueError, match=r"^variant: expected one of chunk, chunk-inline, dequant"):
        block_scaled_mm(quantize(x, "e4m3", mx(32)), quantize(x, "e4m3", mx(32)), variant="fastest")
    with pytest.raises(ValueError, match=r"^a/b: expected operands with the same reduction dimension K"):
        block_scaled_mm(quantize(x, "e4m3", mx(32)), quantize(torch.randn(32, 96), "e4m3", mx(32)))
