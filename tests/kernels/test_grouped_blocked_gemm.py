"""lowprec's grouped FP8 GEMMs with block scales (``fp8-blockwise``'s experts: 1 x 128 token blocks, 128 x 128
weight blocks) through Triton's interpreter, against every expert's GEMM from the exact values: bit for bit
where every partial sum is representable (small integers times powers of two), within the first-use check's
tolerance on random values; and a ``GroupedLinear`` under fp8-blockwise takes them for all three GEMMs where
the device runs them, with the expert-by-expert values, counts read or left on the device."""
from __future__ import annotations

import sys

import pytest
import torch

from lowprec.kernels import grouped_gemm as GG
from lowprec.kernels import triton_grouped_gemm as TG
from lowprec.nn import GroupedLinear, grouped
from lowprec.nn import grouped_casts as GC
from lowprec.nn.plan import layer_plan
from tests.kernels.test_grouped_triton_gemm import COUNTS, _ends, _ints
from tests.nn.common import randn
from tests.nn.test_experts_on_device import _step, compiled_once_for_every_routing

E4M3 = torch.float8_e4m3fn


def _pow2(*shape: int, seed: int) -> torch.Tensor:
    """Block scales 2^-2 .. 2^2: with codes up to 6, every partial sum of 128-wide chunks stays exact in FP32."""
    g = torch.Generator().manual_seed(seed)
    return 2.0 ** torch.randint(-2, 3, shape, generator=g).float()


@pytest.mark.parametrize("counts", COUNTS)
@pytest.mark.parametrize("k", [128, 384])  # one block of K, and several
@pytest.mark.parametrize("weight_rows", [128, 1])  # 128 x 128 weight blocks, and 1 x 128
def test_rows_equal_each_experts_gemm_bit_for_bit_where_sums_are_exact(counts, k, weight_rows):
    t, e, n = sum(counts), len(counts), 256  # two tiles of N
    a, sa = _ints(t, k, seed=1, dtype=E4M3), _pow2(t, k // 128, seed=2)
    b, sb = _ints(e, n, k, seed=3, dtype=E4M3), _pow2(e, n // weight_rows, k // 128, seed=4)
    want = GG.reference_blocked(GG.ROWS, a, sa, b, sb, _ends(counts)).float()
    got = TG.grouped_rows_blocked(a, sa, b, sb, _ends(counts), torch.float32)
    assert got.shape == (t, n) and torch.equal(got, want)
    assert torch.equal(TG.grouped_rows_blocked(a, sa, b, sb, _ends(counts), torch.bfloat16), want.to(torch.bfloat16))


@pytest.mark.parametrize("counts", COUNTS)
def test_features_equal_each_experts_gemm_bit_for_bit_where_sums_are_exact(counts):
    """The weight gradient's kind on token sides laid out features-major, each expert's tokens whole blocks
    of 128 (zeros after its last token); an expert without tokens gives zeros."""
    t, e, m, n = sum(counts), len(counts), 256, 128
    padding = GG.token_padding(counts, torch.tensor(counts), GG.BLOCK)
    a_t = GG.features_padded(_ints(t, m, seed=5, dtype=E4M3), padding)
    b_t = GG.features_padded(_ints(t, n, seed=6, dtype=E4M3), padding)
    sa, sb = _pow2(m, padding.total // 128, seed=7), _pow2(n, padding.total // 128, seed=8)
    got = TG.grouped_features_blocked(a_t, sa, b_t, sb, padding.ends, torch.float32)
    want = GG.reference_blocked(GG.FEATURES, a_t, sa, b_t, sb, padding.ends).float()
    assert got.shape == (e, m, n) and torch.equal(got, want)
    for x, c in enumerate(counts):
        if c == 0:
            assert not got[x].any()


def test_each_block_scale_multiplies_its_own_chunk_only():
    """One token row, one expert: a scale of 2 on the second block of K doubles that block's products alone."""
    a = torch.ones(1, 256).to(E4M3)
    b = torch.ones(1, 128, 256).to(E4M3)
    sa = torch.tensor([[1.0, 2.0]])
    sb = torch.tensor([[[1.0, 4.0]]])
    got = TG.grouped_rows_blocked(a, sa, b, sb, _ends((1,)), torch.float32)
    assert torch.equal(got, torch.full((1, 128), 128.0 + 128 * 8))


def test_the_first_use_check_passes_the_kernels_and_fails_a_wrong_or_failing_one(monkeypatch):
    cpu = torch.device("cpu")
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert GG._self_check_blocked(GG.ROWS, cpu) and GG._self_check_blocked(GG.FEATURES, cpu)
    real = TG.grouped_rows_blocked
    monkeypatch.setattr(TG, "grouped_rows_blocked", lambda *a: real(*a) * 1.01)
    with pytest.warns(UserWarning, match="block scales .* differs"):
        assert not GG._self_check_blocked(GG.ROWS, cpu)

    def broken(*a):
        raise RuntimeError("no such kernel")

    monkeypatch.setattr(TG, "grouped_features_blocked", broken)
    with pytest.warns(UserWarning, match="block scales .* fails"):
        assert not GG._self_check_blocked(GG.FEATURES, cpu)


def test_only_e4m3_pairs_with_dimensions_of_whole_blocks_run_blocked(monkeypatch):
    """The blocked kinds take E4M3 pairs (fp8-blockwise's), dimensions multiples of 128, Triton, sm90: never
    on a CPU."""
    from lowprec import formats as F

    e4m3 = F.get("e4m3")
    assert not GG.runs_grouped(GG.ROWS, "cpu", e4m3, e4m3, 256, 256, blocked=True)
    monkeypatch.setattr(GG, "_CHECKED", {})
    monkeypatch.setattr(GG, "_triton_runs", lambda device: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(GG, "_self_check_blocked", lambda kind, device: True)
    cuda = torch.device("cuda", 0)
    assert GG._runs(GG.ROWS, cuda, E4M3, E4M3, (256, 128), True, True)
    assert not GG._runs(GG.ROWS, cuda, E4M3, E4M3, (256, 144), True, True)  # 144: not whole blocks
    assert not GG._runs(GG.ROWS, cuda, torch.float8_e5m2, E4M3, (256, 128), True, True)
    assert (cuda, "rows blocked") in GG._CHECKED


@pytest.fixture
def blocked_here(monkeypatch):
    """The CPU taken as a device with cuBLAS's block-scaled FP8 GEMMs (fp8-blockwise's plans' GEMMs
    cuBLAS's), whose experts' blocked GEMMs run grouped on lowprec's Triton kernels (the interpreter)."""
    C = sys.modules["lowprec.kernels.capability"]
    monkeypatch.setitem(C._KNOWN, torch.device("cpu"), C.Capability("cpu", "cpu", None, True, True, False, False))
    monkeypatch.setattr(GG, "runs_grouped", lambda kind, device, a_fmt, b_fmt, *dims, **kw: kw.get("blocked", False))
    layer_plan.cache_clear()
    yield
    layer_plan.cache_clear()


@pytest.fixture
def blocked_calls(blocked_here, monkeypatch):
    """As ``blocked_here``, each blocked kernel's call recorded (eager code only: a compiled graph keeps no
    such side effect)."""
    calls = []
    for name in ("grouped_rows_blocked", "grouped_features_blocked"):
        real = getattr(TG, name)
        monkeypatch.setattr(TG, name, lambda *a, real=real, name=name: calls.append(name) or real(*a))
    return calls


def _layer(bias: bool = True) -> GroupedLinear:
    torch.manual_seed(0)
    g = GroupedLinear(4, 256, 128, bias=bias, recipe="fp8-blockwise")
    with torch.no_grad():
        g.weight.copy_(randn(4, 128, 256, seed=1, scale=256 ** -0.5))
    return g


LAYER_COUNTS = (70, 0, 200, 3)


def test_fp8_blockwise_experts_take_the_blocked_grouped_gemms_with_the_loops_values(monkeypatch, blocked_calls):
    """Forward, input gradient and weight gradient, one blocked grouped GEMM each, against the expert-by-expert
    loop on the CPU as it is (emulated block-scaled GEMMs): equal within FP32 summation order."""
    layer = _layer()
    x, dy = randn(sum(LAYER_COUNTS), 256, seed=2), randn(sum(LAYER_COUNTS), 128, seed=3, scale=1e-2)
    off = torch.tensor(LAYER_COUNTS).cumsum(0)
    assert layer.plan().fprop.path.value == "cublas"
    grouped_out = _step(layer, x, dy, lambda m, a: m(a, off))
    assert blocked_calls == ["grouped_rows_blocked", "grouped_rows_blocked", "grouped_features_blocked"]
    monkeypatch.undo()
    layer_plan.cache_clear()
    layer.set_recipe("fp8-blockwise")
    monkeypatch.setattr(GC, "batches", lambda plan: False)
    looped = _step(layer, x, dy, lambda m, a: m(a, off))
    for name, a, b in zip(("y", "dx", "dweight"), grouped_out, looped, strict=True):
        assert ((a - b).abs().max() <= 1e-5 * b.abs().max()).item(), name
    assert not grouped_out[2][1].any()  # the expert without tokens


def test_fp8_blockwise_experts_run_on_the_device_counts_in_a_compiled_graph(blocked_here):
    """Where every GEMM runs blocked and grouped, the experts take the counts as the device holds them: the
    same bits as the counted layer, and a compiled graph holds them for every routing, compiled once."""
    layer = _layer(bias=False)
    x = randn(24, 256, seed=4)
    dy = randn(24, 128, seed=5, scale=1e-2)
    assert layer.takes_offsets(x)
    assert not _layer(bias=True).takes_offsets(x)  # a bias: its sum per expert reads the counts
    way = layer._on_device(x)
    off = torch.tensor([6, 6, 20, 24])
    counted = _step(layer, x, dy, lambda m, a: m(a, off))
    on_device = _step(layer, x, dy, lambda m, a: m._on_offsets(a, off, way))
    for a, b in zip(on_device, counted, strict=True):
        assert torch.equal(a, b)
    compiled_once_for_every_routing(layer, x, dy)


def test_weights_whose_rows_are_not_whole_blocks_run_expert_by_expert(blocked_here):
    """An expert's 128 x 128 blocks never span two experts: 96 rows are cast expert by expert, each padded as
    its own cast pads it, and such GEMMs stay per expert (here: no blocked grouped call for them)."""
    from lowprec.quant import blockwise, quantize

    w = randn(3, 96, 256, seed=6)
    plan = _layer().plan()  # fp8-blockwise's casts (a 96-row layer alone is kept in high precision as small)
    k, t = GC.cast_weights(w, plan.weight, True, True)
    for e in range(3):
        for got, want in ((k.expert(e), quantize(w[e], "e4m3", blockwise(128, 128))),
                          (t.expert(e), quantize(w[e].t(), "e4m3", blockwise(128, 128)))):
            assert torch.equal(got.data.view(torch.uint8), want.data.view(torch.uint8))
            assert torch.equal(got.scale, want.scale) and got.shape == want.shape
    assert not grouped._fp32_blocks(plan.fprop, k, k)
