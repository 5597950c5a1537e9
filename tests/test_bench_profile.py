"""benchmarks/bench_profile.py: the kinds it sorts kernels into, its FP8 ceiling, and its dry run."""
from __future__ import annotations

import ast
import json
from pathlib import Path

import pytest
import torch
from torch import nn

import lowprec
from lowprec.train.model import ModelConfig, Transformer
from lowprec.train.moe_model import MoEConfig
from lowprec.train.recompute import Recompute, recompute_mode
from tests.helpers import load_benchmark


@pytest.fixture(name="prof", scope="module")
def prof_fixture():
    with pytest.MonkeyPatch.context() as mp:
        load_benchmark("bench_model", mp)  # bench_profile imports it by plain name
        yield load_benchmark("bench_profile", mp)


@pytest.mark.parametrize("name, kind", [
    ("nvjet_tst_256x128_64x4_2x1_v_bz_coopB_TNT", "gemm"),
    ("sm90_xmma_gemm_e4m3e4m3_e4m3f32_f32_tn_n_tilesize128x128x128", "gemm"),
    ("aten::_scaled_mm", "gemm"),
    ("pytorch_flash::flash_bwd_dq_dk_dv_loop_seqk_parallel_kernel", "attention"),
    ("cast_kernel", "lowprec casts"),
    ("amax_kernel", "lowprec casts"),
    ("triton_red_fused__to_copy_add_mean_mul_pow_rsqrt_0", "inductor fused"),
    ("void at::native::(anonymous namespace)::multi_tensor_apply_kernel<FusedAdamMathFunctor>", "optimizer"),
    ("Memcpy DtoD (Device -> Device)", "copies"),
    ("adamw_kernel", "optimizer"),
    ("void at::native::vectorized_elementwise_kernel<4, at::native::AbsFunctor<float>>", "other torch kernels"),
    ("void at_cuda_detail::cub::DeviceRadixSortOnesweepKernel<Policy900, false, long, int>", "gather/scatter/sort"),
    ("void at::native::index_elementwise_kernel<128, 4, gpu_index_kernel>", "gather/scatter/sort"),
    ("void at::native::indexSelectLargeIndex<c10::BFloat16, long, unsigned int, 2, 2, -2, true>",
     "gather/scatter/sort"),
    ("void at::native::_scatter_gather_elementwise_kernel<128, 8>", "gather/scatter/sort"),
    ("triton_poi_fused_index_put_new_zeros_3", "inductor fused"),
    ("ncclDevKernel_AllGather_RING_LL(ncclDevKernelArgsStorage<4096ul>)", "other torch kernels"),
])
def test_kernels_sorted_by_kind(prof, name, kind):
    assert prof.kind_of(name) == kind


def _launched_kernels() -> set[str]:
    """The Triton kernels lowprec launches: its top-level ``@triton.jit`` functions named ``*_kernel``
    (the profiler names a Triton kernel after its function)."""
    root = Path(lowprec.__file__).parent
    names = set()
    for path in root.rglob("*.py"):
        for node in ast.parse(path.read_text()).body:
            if (isinstance(node, ast.FunctionDef) and node.name.endswith("_kernel")
                    and any("triton" in ast.unparse(d) for d in node.decorator_list)):
                names.add(node.name)
    return names


def test_every_lowprec_kernel_has_its_kind(prof):
    # run 93's profile counted the experts' grouped GEMMs and casts as "other torch kernels", so the
    # GEMMs' and casts' rows said half of what they were: no kernel of lowprec's may fall to that kind
    launched = _launched_kernels()
    assert {"rows_kernel", "cast_kernel", "group_amax_kernel", "adamw_kernel"} <= launched  # the scan finds them
    listed = set(prof.LOWPREC_GEMMS) | set(prof.LOWPREC_CASTS) | set(prof.LOWPREC_OPTIMIZER)
    assert launched == listed
    for name in prof.LOWPREC_GEMMS:
        assert prof.kind_of(name) == "gemm", name
    for name in prof.LOWPREC_CASTS:
        assert prof.kind_of(name) == "lowprec casts", name
    for name in prof.LOWPREC_OPTIMIZER:
        assert prof.kind_of(name) == "optimizer", name
    # a name that merely contains one of them is not one of them
    assert prof.kind_of("triton_poi_fused_rows_kernel_0") == "inductor fused"


def test_ceiling_counts_the_converted_linears_only(prof):
    size = prof.SIZES["1b"]
    with torch.device("meta"):
        model = Transformer(size.config)
    linears = [m for m in model.modules() if isinstance(m, nn.Linear)]
    head = size.config.vocab_size * size.config.dim
    body = sum(m.weight.numel() for m in linears) - head  # every linear but the LM head
    share = body / (body + head)
    c = prof.ceiling(size, 100.0, 60.0, 2.0)
    assert c["converted_gemm_share"] == pytest.approx(share)
    # the converted GEMMs take half their time; nothing else moves
    assert c["step_ms"] == pytest.approx(100.0 - 60.0 * share / 2)
    assert c["speedup"] == pytest.approx(100.0 / c["step_ms"])
    assert prof.ceiling(size, 100.0, 60.0, 1.0)["speedup"] == pytest.approx(1.0)


def test_cast_traffic_counts_each_operand_once_per_pass(prof):
    # one layer of dim 128, ffn 256, 2 query heads sharing 1 key/value head, 8 tokens: the sums by hand
    cfg = ModelConfig(dim=128, n_layers=1, n_heads=2, n_kv_heads=1, ffn_dim=256, vocab_size=64)
    size = type(prof.SIZES["1b"])(config=cfg, batch=1, seq_len=8)
    shapes = [(128, 256), (128, 128), (128, 512), (256, 128)]  # qkv (GQA 2/1), wo, gate+up (one input), down
    with torch.device("meta"):
        model = Transformer(cfg)
    weights = [m.weight.numel() for m in model.modules() if isinstance(m, nn.Linear)][:-1]  # not the LM head
    assert sum(weights) == sum(k * n for k, n in shapes)  # the shapes are the model's linears
    acts = sum(k + n for k, n in shapes)
    got = prof.cast_traffic(size, weight_bytes=4)
    assert got["amax_bytes"] == 2 * 8 * acts
    assert got["weight_bytes"] == sum(10 * k * n for k, n in shapes)  # FP32 read + FP8 write, twice
    assert got["bytes"] == 3 * 2 * 8 * acts + got["weight_bytes"]
    assert prof.cast_traffic(size, weight_bytes=2)["weight_bytes"] == sum(6 * k * n for k, n in shapes)


def test_a_mixture_of_experts_counts_the_experts_a_token_meets(prof):
    # one layer of dim 128, 2 query heads sharing 1 key/value head (q/k/v 128 -> 256), 4 routed experts of
    # width 64 (top 2) and one shared expert of width 64, vocabulary 64, 8 tokens: the sums by hand
    cfg = ModelConfig(dim=128, n_layers=1, n_heads=2, n_kv_heads=1, ffn_dim=64, vocab_size=64,
                      moe=MoEConfig(n_experts=4, top_k=2, n_shared=1))
    size = type(prof.SIZES["1b"])(config=cfg, batch=1, seq_len=8)
    # weights a token meets: q/k/v 128 x 256, wo 128 x 128, 2 routed and 1 shared expert of 3 x 128 x 64 each,
    # the router 128 x 4 and the LM head 128 x 64
    active = 128 * 256 + 128 * 128 + 3 * (3 * 128 * 64) + 128 * 4 + 128 * 64
    assert size.active_linear_params() == active
    c = prof.ceiling(size, 100.0, 60.0, 2.0)
    assert c["converted_gemm_share"] == pytest.approx((active - 128 * 64) / active)
    # casts: (rows per token, K, N, weights): qkv, wo, routed gate/up and down (2 rows a token, 4 experts'
    # weights), shared gate/up and down; the router is not cast
    shapes = [(1, 128, 256, 1), (1, 128, 128, 1), (2, 128, 128, 4), (2, 64, 128, 4), (1, 128, 128, 1),
              (1, 64, 128, 1)]
    amax = sum(2 * 8 * r * (k + n) for r, k, n, _ in shapes)
    got = prof.cast_traffic(size, weight_bytes=2)
    assert got["amax_bytes"] == amax == 2 * 8 * (384 + 256 + 512 + 384 + 256 + 192)
    assert got["weight_bytes"] == sum(2 * w * 3 * k * n for _, k, n, w in shapes)
    assert got["bytes"] == 3 * amax + got["weight_bytes"]


def test_dry_run_profiles_each_variant(prof, tmp_path):
    with torch.random.fork_rng():
        results = prof.main(["--size", "tiny", "--mode", "eager", "--params", "bf16-master", "--steps", "1",
                             "--variants", "bf16,lowprec:fp8-current+int8states", "--out", str(tmp_path)])
    for name in ("bf16", "lowprec:fp8-current+int8states"):
        r = results[name]
        assert r["step_ms"] > 0 and r["kernel_ms"] > 0
        assert sum(r["kinds_ms"].values()) == pytest.approx(r["kernel_ms"])
        assert r["top_kernels"] and all(ms >= 0 for _, ms in r["top_kernels"])
        assert 0 < r["optimizer_wall_ms"] < r["cpu_issue_ms"]  # the update alone, within the step
    assert "int8" not in results["bf16"]["conversion"]
    # the planner's parts beside the profile's: a step of the same model planned for the H200
    planned = results["bf16"]["planned_ms"]
    assert set(planned) == {g for g, _ in prof.PLANNED_KINDS} and planned["GEMMs"] > 0 < planned["optimizer step"]
    assert prof.planned_rows(results)[0][0] == "bf16"
    assert 0 < results["ceiling"]["speedup"] < 1.9
    saved = json.loads((tmp_path / "bench_profile_tiny_eager_bf16-master.json").read_text())
    assert set(saved["results"]) == {"bf16", "lowprec:fp8-current+int8states", "ceiling", "cast_traffic"}


def test_dry_run_profiles_a_recompute_mode(prof, tmp_path, monkeypatch):
    checkpointed = []
    real = prof.place

    def place(*args):
        model, what, setup_s = real(*args)
        checkpointed.append([recompute_mode(b) for b in model.layers])
        return model, what, setup_s

    monkeypatch.setattr(prof, "place", place)
    with torch.random.fork_rng():
        results = prof.main(["--size", "tiny", "--mode", "eager", "--params", "bf16-master", "--steps", "1",
                             "--variants", "bf16", "--recompute", "selective", "--out", str(tmp_path)])
    assert checkpointed == [[Recompute.SELECTIVE] * prof.SIZES["tiny"].config.n_layers]  # every block
    assert results["bf16"]["step_ms"] > 0
    saved = json.loads((tmp_path / "bench_profile_tiny_eager_bf16-master_recompute-selective.json").read_text())
    assert saved["args"]["recompute"] == "selective"


def test_cudagraphs_mode_compiles_with_graphs_and_reads_no_memory(prof, tmp_path, monkeypatch):
    seen = []

    def make_step(model, params, compiled, tokens, states=None, graphs=False):
        seen.append((compiled, graphs))
        raise RuntimeError("stop here")

    monkeypatch.setattr(prof, "make_step", make_step)
    results = prof.main(["--size", "tiny", "--mode", "cudagraphs", "--params", "bf16-master", "--steps", "1",
                         "--variants", "bf16", "--out", str(tmp_path)])
    assert seen == [(True, True)] and "stop here" in results["bf16"]["error"]
