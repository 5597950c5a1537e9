"""The grouped FP8 GEMM's host-side parts (see [Note: one grouped GEMM for the experts] in
``lowprec.kernels.grouped_gemm``), which run anywhere: the token padding of the weight gradient's groups,
the self-check's reference, and the refusal off CUDA. The GEMM itself runs on the GPU only
(``benchmarks/bench_moe.py`` checks it against the per-expert loop)."""
from __future__ import annotations

import pytest
import torch

from lowprec import formats as F
from lowprec.kernels import grouped_gemm as GG


def _pad(t, counts):
    padding = GG.token_padding(counts, torch.tensor(counts))
    return padding.dest, GG.features_padded(t, padding), padding.ends.tolist()


def test_each_experts_tokens_are_padded_to_16_with_zero_codes_features_major():
    t = (torch.arange(10 * 3, dtype=torch.float32).view(10, 3) + 1).to(torch.float8_e4m3fn)
    _, padded, offsets = _pad(t, (3, 0, 7))
    assert offsets == [16, 16, 32] and GG.padded_starts((3, 0, 7)) == (0, 16, 16)
    assert padded.dtype == t.dtype and padded.shape == (3, 32)
    v = padded.float().t()
    assert torch.equal(v[:3], t[:3].float()) and not v[3:16].any()
    assert torch.equal(v[16:23], t[3:].float()) and not v[23:].any()


def test_aligned_tokens_are_only_transposed():
    t = torch.randn(32, 4).to(torch.float8_e4m3fn)
    dest, padded, offsets = _pad(t, (16, 0, 16))
    assert dest is None and offsets == [16, 16, 32]
    assert torch.equal(padded.view(torch.uint8), t.view(torch.uint8).t())


@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("counts", [(3, 0, 70, 1, 29), (16, 0, 64), ()])
def test_triton_move_into_the_padded_layout_equals_the_scatter_bit_for_bit(dtype, counts):
    """``triton_grouped.features_padded`` (through Triton's interpreter): each padded column gathers its
    row, across several output tiles and a K that is not a multiple of the tile, bits as they are (NaN
    payloads, negative zeros, FP8 codes); equal to the reference's scatter."""
    from lowprec.kernels import triton_grouped

    rows = sum(counts)
    raw = torch.randint(-2 ** 15, 2 ** 15, (rows, 70), generator=torch.Generator().manual_seed(rows))
    t = {1: raw.to(torch.uint8), 2: raw.to(torch.int16), 4: raw.to(torch.int32) * 65599}[dtype.itemsize].view(dtype)
    padding = GG.token_padding(counts, torch.tensor(counts, dtype=torch.int64))
    assert (padding.sources is None) == (padding.dest is None)
    got = triton_grouped.features_padded(t, padding.sources, padding.total)
    want = GG.features_padded(t, padding)  # the scatter on the CPU
    assert got.dtype == dtype and got.shape == (70, padding.total)
    assert torch.equal(got.view(-1).view(torch.uint8), want.reshape(-1).view(torch.uint8))
    if padding.sources is not None:  # every padded row is the row it names
        live = padding.sources >= 0
        assert torch.equal(padding.sources[padding.dest], torch.arange(rows, dtype=torch.int32))
        assert int(live.sum()) == rows


@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.float8_e5m2, torch.bfloat16])
@pytest.mark.parametrize("shape", [(3, 70, 130), (1, 64, 64), (2, 1, 200), (0, 16, 16)])
def test_triton_transpose_of_each_experts_codes_equals_torchs_bit_for_bit(dtype, shape):
    """``triton_grouped.transposed`` (through Triton's interpreter): every expert's (R, K) as (K, R), across
    several tiles, edges that are not multiples of the tile, one row, no expert; the bits as they are (NaN
    codes, negative zeros); ``grouped_gemm.transposed`` on the CPU is torch's copy."""
    from lowprec.kernels import triton_grouped

    raw = torch.randint(0, 2 ** 16, shape, generator=torch.Generator().manual_seed(sum(shape)))
    t = (raw.to(torch.uint8) if dtype.itemsize == 1 else raw.to(torch.int16)).view(dtype)
    got = triton_grouped.transposed(t)
    want = t.transpose(1, 2).contiguous()
    assert got.dtype == dtype and got.shape == (shape[0], shape[2], shape[1]) and got.is_contiguous()
    bits = {1: torch.uint8, 2: torch.int16}[dtype.itemsize]
    assert torch.equal(got.view(bits), want.view(bits))
    assert torch.equal(GG.transposed(t).view(bits), want.view(bits))


def test_the_move_is_routed_to_triton_only_where_triton_runs():
    from lowprec.kernels.route import Backend, padding_backend

    assert padding_backend("cpu") is Backend.TORCH


def test_the_self_checks_reference_is_each_experts_product():
    a, sa, b, sb, counts = GG._problem(GG.FEATURES, torch.device("cpu"))
    ref = GG._reference(GG.FEATURES, a, sa, b, sb, counts)
    start = 0
    for e, n in enumerate(counts):
        m_a, n_b = a.shape[1], b.shape[1]
        want = (a[start:start + n].float().t() @ b[start:start + n].float()) * sa[e * m_a:(e + 1) * m_a, None] \
            * sb[e * n_b:(e + 1) * n_b]
        assert torch.equal(ref[e], want)
        start += n
    assert not ref[1].any()  # the expert without tokens


def test_no_grouped_gemm_off_cuda():
    e4m3 = F.get("e4m3")
    assert not GG.runs_grouped(GG.ROWS, torch.device("cpu"), e4m3, e4m3, 128, 128)
    assert GG.grouped_status() == {}
