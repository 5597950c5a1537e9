"""``scaled_mm`` on both backends against GEMMs of the dequantized operands, and the backend choice
from a device's capability."""
from __future__ import annotations

import pytest
import torch

from lowprec.kernels import Capability, gemm_backend, gemm_path, quantize, scaled_mm
from lowprec.kernels.gemm import blockwise_operands
from lowprec.quant import blockwise, mx, nvfp4, rowwise, tensorwise
from tests.helpers import sqnr

H100 = Capability("cuda", "H100", (9, 0), fp8_gemm=True, blockwise_fp8_gemm=True, mx_gemm=False, triton=True)
L40 = Capability("cuda", "L40", (8, 9), fp8_gemm=True, blockwise_fp8_gemm=False, mx_gemm=False, triton=True)
B200 = Capability("cuda", "B200", (10, 0), fp8_gemm=True, blockwise_fp8_gemm=False, mx_gemm=True, triton=True)
A100 = Capability("cuda", "A100", (8, 0), fp8_gemm=False, blockwise_fp8_gemm=False, mx_gemm=False, triton=True)
CPU = Capability("cpu", "cpu", None, False, False, False, False)


@pytest.mark.parametrize("lhs,rhs,cap,expected", [
    (("e4m3", tensorwise()), ("e4m3", tensorwise()), H100, "cublas"),
    (("e5m2", tensorwise()), ("e4m3", tensorwise()), L40, "cublas"),
    (("e5m2", tensorwise()), ("e5m2", tensorwise()), H100, "emulated"),  # at most one E5M2 operand
    (("e4m3", rowwise()), ("e4m3", rowwise()), H100, "cublas"),
    (("e4m3", rowwise()), ("e4m3", tensorwise()), H100, "emulated"),  # mixed scalings: no cuBLAS kernel
    (("e4m3", blockwise(1, 128)), ("e4m3", blockwise(128, 128)), H100, "cublas"),
    (("e4m3", blockwise(1, 128)), ("e4m3", blockwise(128, 128)), L40, "emulated"),  # sm90 only
    (("e4m3", blockwise(1, 128)), ("e4m3", blockwise(1, 128)), H100, "cublas"),  # the weight gradient
    (("e4m3", blockwise(128, 128)), ("e4m3", blockwise(1, 128)), H100, "emulated"),
    (("e4m3", mx(32, "ceil")), ("e4m3", mx(32, "ceil")), H100, "folded"),  # row scales on FP8 tensor cores
    (("e2m1", mx(32)), ("e4m3", mx(32)), L40, "folded"),
    (("e5m2", mx(32)), ("e5m2", mx(32)), H100, "emulated"),  # at most one E5M2 operand
    (("e4m3", mx(32)), ("e4m3", mx(32)), A100, "emulated"),
    (("e4m3", mx(32)), ("e4m3", mx(32)), CPU, "emulated"),
    (("e2m1", nvfp4(16)), ("e2m1", nvfp4(16, two_d=True)), H100, "emulated"),
    (("e4m3", tensorwise()), ("e4m3", tensorwise()), A100, "emulated"),
    (("e4m3", tensorwise()), ("e4m3", tensorwise()), CPU, "emulated"),
], ids=str)
def test_gemm_path_from_capability(lhs, rhs, cap, expected):
    assert gemm_path(lhs[0], lhs[1], rhs[0], rhs[1], cap) == expected
    a, b = quantize(torch.randn(32, 128), *lhs), quantize(torch.randn(16, 128), *rhs)
    assert gemm_backend(a, b, cap) == expected


def _dequantized_gemm(a, b) -> torch.Tensor:
    """The independent reference: float64 product of the dequantized operands."""
    return a.dequantize(torch.float64) @ b.dequantize(torch.float64).t()


@pytest.mark.parametrize("lhs,rhs", [
    (("e4m3", tensorwise()), ("e4m3", tensorwise())), (("e5m2", tensorwise()), ("e4m3", tensorwise())),
    (("e4m3", rowwise()), ("e4m3", rowwise())),
], ids=str)
def test_cublas_backend_on_cpu_matches_the_dequantized_gemm(lhs, rhs):
    g = torch.Generator().manual_seed(0)
    a = quantize(torch.randn(64, 128, generator=g), *lhs)
    b = quantize(torch.randn(48, 128, generator=g) * 10, *rhs)
    out = scaled_mm(a, b, torch.float32, backend="cublas")
    assert out.shape == (64, 48) and out.dtype == torch.float32
    assert sqnr(_dequantized_gemm(a, b), out) > 100  # FP32 accumulation of exact products


@pytest.mark.parametrize("lhs,rhs", [
    (("e4m3", tensorwise()), ("e4m3", tensorwise())), (("e5m2", tensorwise()), ("e5m2", tensorwise())),
    (("e4m3", rowwise()), ("e4m3", rowwise())), (("e4m3", blockwise(1, 128)), ("e4m3", blockwise(128, 128))),
    (("e4m3", mx(32, "ceil")), ("e4m3", mx(32, "ceil"))), (("e2m1", mx(32, "ceil")), ("e2m1", mx(32, "ceil"))),
    (("e3m2", mx(32, "floor")), ("e2m3", mx(32, "floor"))), (("e2m1", nvfp4(16)), ("e2m1", nvfp4(16, two_d=True))),
], ids=str)
def test_emulated_backend_matches_the_dequantized_gemm_on_ragged_shapes(lhs, rhs):
    g = torch.Generator().manual_seed(1)
    a = quantize(torch.randn(50, 256, generator=g), *lhs)  # 50 rows: padded by 128 x 128 blocks
    b = quantize(torch.randn(40, 256, generator=g) * 0.1, *rhs)
    out = scaled_mm(a, b, torch.float32, backend="emulated")
    assert out.shape == (50, 40)
    assert sqnr(_dequantized_gemm(a, b), out) > 100


def test_emulated_bf16_output_and_a_hand_computed_product():
    # amax 1.75 and 0.875 give the scales 2^-8 and 2^-9 (448 = 1.75 * 2^8), and every element is an
    # E4M3 value times its scale, so the product is exact: [.25*.875 + .5*.5, 1*.875 + 1.75*.5].
    a = quantize(torch.tensor([[0.25, 0.5], [1.0, 1.75]]), "e4m3", tensorwise())
    b = quantize(torch.tensor([[0.875, 0.5]]), "e4m3", tensorwise())
    assert a.scale.item() == 2.0**-8 and b.scale.item() == 2.0**-9
    out = scaled_mm(a, b, torch.bfloat16, backend="emulated")
    assert out.dtype == torch.bfloat16
    assert out.float().flatten().tolist() == [0.46875, 1.75]


def test_bad_arguments_name_themselves():
    a = quantize(torch.randn(8, 64), "e4m3", tensorwise())
    b = quantize(torch.randn(8, 32), "e4m3", tensorwise())
    with pytest.raises(ValueError, match="a/b: expected operands with the same reduction dimension"):
        scaled_mm(a, b)
    with pytest.raises(ValueError, match="backend: expected 'cublas', 'folded' or 'emulated'"):
        scaled_mm(a, a, backend="magic")


def test_capability_lookup_compiles_without_a_graph_break(monkeypatch):
    # On CUDA the first lookup asks the driver (Python values a compiled graph cannot hold); later
    # lookups, in compiled code too, read the table of known devices.
    import sys

    table = sys.modules["lowprec.kernels.capability"]._KNOWN
    monkeypatch.setitem(table, torch.device("cuda", 0), H100)
    from lowprec.kernels import capability

    @torch.compile(backend="eager", fullgraph=True)
    def path(x):
        cap = capability(torch.device("cuda", 0))
        return x * 2 if cap.blockwise_fp8_gemm else x

    assert torch.equal(path(torch.ones(3)), torch.full((3,), 2.0))


def _read_as_cublas(scale: torch.Tensor, rows: int, cols: int, ld: int) -> torch.Tensor:
    """The (rows, cols) matrix cuBLAS reads from ``scale``'s storage: column-major with leading dimension ``ld``
    (element (i, j) at offset i + j * ld)."""
    flat = scale.t().contiguous().view(-1) if scale.stride(0) != 1 else scale.as_strided((scale.numel(),), (1,))
    return flat.as_strided((rows, cols), (1, ld))


def _product_as_cublas_reads(a_data, sa, b_data, sb, rhs_rows: int) -> torch.Tensor:
    """a @ b.T computed from the laid-out operands as cuBLAS reads them (float64): each 128-wide K block of
    a row times its 1x128 scale; b's blocks times their 128x128 (or 1x128) scale."""
    m, k = a_data.shape
    kb = k // 128
    a_s = _read_as_cublas(sa, m, kb, m)  # (M, K/128)
    av = a_data.double().view(m, kb, 128) * a_s.double()[:, :, None]
    n = b_data.shape[0]
    if rhs_rows == 128:
        b_s = _read_as_cublas(sb, kb, sb.shape[1], sb.stride(1)).t()  # (N/128, K/128)
        b_s = b_s.double().repeat_interleave(128, dim=0)[:n]
    else:
        b_s = sb.t().double()  # (N, K/128)
    bv = b_data.double().view(n, kb, 128) * b_s[:, :, None]
    return av.reshape(m, k) @ bv.reshape(n, k).t()


@pytest.mark.parametrize("m,k,n", [(50, 768, 256), (64, 640, 384), (4096, 1024, 1536), (3, 128, 130)], ids=str)
def test_block_scales_are_laid_out_as_cublas_reads_them(m, k, n):
    """[Note: block scales for cuBLAS]: leading dimensions are multiples of 4 (K padded to a multiple of 512
    for 128x128 weights), and the product read that way is the product of the dequantized operands."""
    g = torch.Generator().manual_seed(2)
    a = quantize(torch.randn(m, k, generator=g) * torch.logspace(-2, 2, k), "e4m3", blockwise(1, 128))
    for rhs in (blockwise(128, 128), blockwise(1, 128)):
        b = quantize(torch.randn(n, k, generator=g), "e4m3", rhs)
        a_data, sa, b_data, sb = blockwise_operands(a, b)
        m4, kp = a_data.shape
        assert m4 % 4 == 0 and m4 - m < 4 and sa.stride(0) == 1
        assert b_data.shape[1] == kp and kp % 128 == 0
        if rhs.block_rows == 128:
            assert (kp // 128) % 4 == 0 and sb.shape == (kp // 128, b.scale.shape[0]) and sb.stride() == (1, kp // 128)
        else:
            assert kp == k and b_data.shape[0] % 4 == 0 and sb.is_contiguous()
        got = _product_as_cublas_reads(a_data, sa, b_data, sb, rhs.block_rows)[:m, :n]
        want = _dequantized_gemm(a, b)
        # dequantize() rounds value x scale to float32 first: differences at that level, never a misread scale
        assert (got - want).abs().max() <= 1e-6 * want.abs().max()
