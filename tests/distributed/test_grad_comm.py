"""Gradient communication in FP32, BF16 and FP8: the FP8 error against an FP32 all-reduce bounded from the
quantization's own error bound, bytes on the wire counted, DDP and FSDP2 hooks."""
from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as nnf

from lowprec.distributed import (
    FSDPReduceScatter,
    GradComm,
    GradCommState,
    fsdp_reduce_dtype,
    register_ddp,
    register_fsdp,
)
from lowprec.quant import blockwise, error_bound, quantize
from tests.distributed import common as C
from tests.distributed import session
from tests.distributed.checks import STEPS, _comm_input
from tests.distributed.common import tolerance
from tests.distributed.harness import WORLD, result

dist_results = session.dist_results

N = 1000  # the bucket of grad_comm_direct: not a multiple of 128 * WORLD
BLOCK = 128
F32_EPS = 2.0**-24  # float32's unit roundoff


def _blocks(x: torch.Tensor, length: int) -> torch.Tensor:
    """``x`` zero-padded to ``length`` and viewed as 1x128 blocks, as the wire quantizes it."""
    return nnf.pad(x.float(), (0, length - x.numel())).reshape(-1, BLOCK)


def _quantized(x: torch.Tensor):
    """(dequantized values, error bound), both flat, of ``x`` quantized in 1x128 E4M3 blocks."""
    q = quantize(x, "e4m3", blockwise(1, BLOCK))
    return q.dequantize().reshape(-1), error_bound(q).reshape(-1)


def fp8_mean_bound(inputs: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """(exact float64 mean, bound on |FP8 all-reduce - that mean|) for the ranks' ``inputs``.

    [Note: the FP8 all-reduce's error]
    Rank r's bucket x_r is quantized once: |deq(q_r) - x_r| <= e_r (``error_bound``). Its owner sums
    the W dequantized chunks in float32 (W-1 roundings, each at most 2^-24 of the partial sums, so
    at most (W-1) 2^-24 sum_r |deq(q_r)|), divides by W (exact for W a power of two), and quantizes
    the mean m once more for the all-gather: |deq(q_m) - m| <= e_m. So
    |result - mean(x)| <= sum_r e_r / W + (W-1) 2^-24 sum_r |deq(q_r)| / W + e_m.
    e_m is taken from the quantization of m as the owner computes it; the rest from the inputs."""
    w = len(inputs)
    shard = -(-inputs[0].numel() // w)
    length = -(-shard // BLOCK) * BLOCK * w
    deq, bounds = zip(*(_quantized(_blocks(x, length)) for x in inputs))
    summed = deq[0].clone()
    for d in deq[1:]:
        summed += d  # float32, rank order, as each owner sums
    m_deq, m_bound = _quantized((summed / w).reshape(-1, BLOCK))
    n = inputs[0].numel()
    bound = (sum(bounds) / w + (w - 1) * F32_EPS * sum(d.abs() for d in deq) / w + m_bound)[:n]
    exact = sum(x.double() for x in inputs) / w
    return exact, bound.double()


def test_fp8_all_reduce_error_is_within_the_derived_bound(dist_results):
    ranks = result(dist_results, "grad_comm_direct")
    inputs = [_comm_input(r, N) for r in range(WORLD)]
    exact, bound = fp8_mean_bound(inputs)
    fp32 = ranks[0]["fp32"][0].double()
    fp32_err = (F32_EPS * sum(x.abs().double() for x in inputs)).max()  # one rounding in the FP32 sum (W=2)
    assert ((fp32 - exact).abs() <= fp32_err).all()
    for r in ranks:
        fp8 = r["fp8"][0].double()
        assert torch.equal(r["fp8"][0], ranks[0]["fp8"][0])  # every rank dequantizes the same bytes
        err = (fp8 - exact).abs()
        assert (err <= bound).all()
        assert ((fp8 - fp32).abs() <= bound + fp32_err).all()  # against an FP32 all-reduce
        assert err.max() > 0 and (err / bound).max() > 0.1  # a real error, and a bound that is not loose
    # a BF16 bucket (DDP on BF16 parameters): the same, then one BF16 rounding (2^-9 relative)
    exact16, bound16 = fp8_mean_bound([x.bfloat16() for x in inputs])
    fp8_16 = ranks[0]["fp8-bf16"].double()
    assert ranks[0]["fp8-bf16"].dtype == torch.bfloat16
    assert ((fp8_16 - exact16).abs() <= bound16 * (1 + 2.0**-8) + exact16.abs() * 2.0**-9).all()


def test_fp8_sends_about_half_the_bytes_of_bf16(dist_results):
    r = result(dist_results, "grad_comm_direct")[0]
    shard = math.ceil(math.ceil(N / WORLD) / BLOCK) * BLOCK  # each rank's shard, in whole blocks
    row = BLOCK + 4  # 128 codes and a float32 scale
    # all-to-all: (W-1)/W of the W shards; all-gather: the own shard to W-1 ranks
    fp8 = (WORLD - 1) * (shard // BLOCK) * row * 2
    assert r["fp8"][1] == fp8
    assert r["bf16"][1] == 2 * (WORLD - 1) * N * 2 // WORLD  # a ring all-reduce of N bf16 values
    assert r["fp32"][1] == 2 * (WORLD - 1) * N * 4 // WORLD
    assert fp8 / r["bf16"][1] <= 0.55  # 33/64 with no padding; this bucket pads 1000 values to 1024
    per_step = [x["bytes"] for x in result(dist_results, "ddp_grad_comm")[0].values()]
    fp32_step, bf16_step, fp8_step = (b[0] for b in per_step)
    assert all(len(set(b)) == 1 for b in per_step)  # the same buckets every step
    assert bf16_step * 2 == fp32_step and fp8_step / bf16_step <= 0.55


def test_fsdp_fp8_reduce_scatter_sums_each_ranks_shard(dist_results):
    ranks = result(dist_results, "grad_comm_direct")
    inputs = [_comm_input(r, N) for r in range(WORLD)]
    for rank, r in enumerate(ranks):
        shard, sent = r["fsdp-fp8"]
        chunks = [x[rank * (N // WORLD):(rank + 1) * (N // WORLD)] for x in inputs]
        deq, bounds = zip(*(_quantized(_blocks(c, 512)) for c in chunks))
        exact = sum(c.double() for c in chunks) / WORLD
        bound = ((sum(bounds) + F32_EPS * sum(d.abs() for d in deq)) / WORLD)[:N // WORLD].double()
        assert ((shard.double() - exact).abs() <= bound).all()
        assert sent == (WORLD - 1) * 512 // BLOCK * (BLOCK + 4)  # (W-1)/W of both padded chunks


def test_a_non_finite_gradient_block_arrives_as_nan_everywhere(dist_results):
    for r in result(dist_results, "grad_comm_direct"):
        out = r["nonfinite"]
        bad = torch.zeros(N, dtype=torch.bool)
        bad[256:384] = True  # rank 1's inf at 300 poisons its 128-value block (rank 0's shard), never hidden
        assert out[bad].isnan().all() and out[~bad].isfinite().all()


def test_ddp_fp8_hook_keeps_ranks_identical_and_trains(dist_results):
    ranks = result(dist_results, "ddp_grad_comm")
    for mode in ("fp32", "bf16", "fp8"):
        assert torch.equal(C.bits(ranks[0][mode]["weights"]), C.bits(ranks[1][mode]["weights"]))
    # FP8 on the wire moves training no further from the FP32 wire than FP8 GEMMs move it from BF16 ones
    # (see [Note: how close a data-parallel run must be] in tests.distributed.common)
    tol, _ = tolerance("fp8-current", torch.bfloat16, master_weights=True)
    assert 0 < (ranks[0]["fp8"]["weights"] - ranks[0]["fp32"]["weights"]).norm().item() <= tol
    assert STEPS == len(ranks[0]["fp8"]["bytes"])


def test_modes_parse_and_refuse_unknown_names():
    assert GradComm.parse("fp8") is GradComm.FP8 and GradComm.parse(GradComm.BF16) is GradComm.BF16
    assert [fsdp_reduce_dtype(m) for m in ("fp32", "bf16", "fp8")] == [torch.float32, torch.bfloat16, None]
    with pytest.raises(ValueError, match="^mode: expected one of 'fp32', 'bf16', 'fp8', got 'fp4'"):
        GradComm.parse("fp4")
    state = GradCommState(GradComm.FP8)
    state.bytes_sent, state.calls = 10, 2
    assert state.take() == 10 and state.bytes_sent == 0 and state.calls == 0


def test_hooks_refuse_what_they_cannot_serve():
    premul = dist._make_nccl_premul_sum(0.5)  # FSDP2's op for a custom gradient divide factor
    with pytest.raises(ValueError, match="^op: expected ReduceOp.AVG or ReduceOp.SUM"):
        FSDPReduceScatter(GradCommState(GradComm.FP8))(torch.empty(4), torch.empty(8), None, premul)
    with pytest.raises(TypeError, match="^ddp_model: expected a torch.nn.parallel.DistributedDataParallel"):
        register_ddp(C.mlp(None), "fp8")
    with pytest.raises(ValueError, match="^model: expected a model with fully_shard applied"):
        register_fsdp(C.mlp(None), "fp8")
