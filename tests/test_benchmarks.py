"""benchmarks/bench_model.py, run as its dry run (the tiny model, eager, on the CPU): what it measures and writes."""
from __future__ import annotations

import importlib
import json
import math
import statistics

import pytest
import torch
import torch._inductor.config
from torch import nn

from lowprec.train.model import PRESETS, Transformer, build_model
from tests.helpers import load_benchmark

ROW_FIELDS = {"convert_on", "conversion", "checkpointed_blocks", "setup_s", "model_gib", "tokens_per_s", "step_ms",
              "peak_gib", "first_step_s", "warmup_s", "graph_breaks", "graphs", "cudagraph_skips", "loss_first",
              "loss_last", "skipped_steps", "planned_gib"}


@pytest.fixture(name="bench", scope="module")
def bench_fixture():
    """The script as a module."""
    with pytest.MonkeyPatch.context() as mp:
        # main() disables inductor's caches for the process; the tests after these keep theirs
        mp.setattr(torch._inductor.config, "force_disable_caches", torch._inductor.config.force_disable_caches)
        yield load_benchmark("bench_model", mp)


@pytest.fixture(name="models", scope="module")
def models_fixture(bench):
    """``benchmarks/_models.py``, the sizes the script imports."""
    return importlib.import_module("_models")


@pytest.fixture(name="dry_run", scope="module")
def dry_run_fixture(bench, tmp_path_factory):
    out = tmp_path_factory.mktemp("bench_model")
    with torch.random.fork_rng():  # main() seeds the global generators
        bench.main(["--sizes", "tiny", "--modes", "eager", "--params", "fp32-autocast,bf16-master", "--steps", "2",
                    "--warmup", "1", "--variants", "bf16,lowprec:fp8-current,torchao:tensorwise", "--out", str(out)])
    files = list(out.glob("*.json"))
    assert len(files) == 1
    return json.loads(files[0].read_text())


@pytest.mark.parametrize("params", ["fp32-autocast", "bf16-master"])
@pytest.mark.parametrize("variant", ["bf16", "lowprec:fp8-current"])
def test_dry_run_measures_whole_training_steps(bench, dry_run, params, variant):
    row = dry_run["results"][f"tiny / eager / {params}"][variant]
    assert set(row) == ROW_FIELDS | ({"mfu"} if torch.cuda.is_available() else set())
    size = bench.SIZES["tiny"]
    assert len(row["step_ms"]) == 2 and all(ms > 0 for ms in row["step_ms"])
    assert row["tokens_per_s"] == pytest.approx(size.tokens / statistics.median(row["step_ms"]) * 1e3, rel=1e-12)
    assert row["first_step_s"] > 0 and row["graph_breaks"] == 0 and row["skipped_steps"] == 0
    assert row["peak_gib"] is None and row["model_gib"] is None  # no CUDA allocator to ask on a CPU
    # the planner models BF16 parameters with FP32 masters, not FP32 parameters under autocast
    assert (row["planned_gib"] is None) == (params == "fp32-autocast")
    # initial weights of std 0.02 give nearly uniform logits: the first loss is close to ln(vocab) ...
    assert abs(row["loss_first"] - math.log(size.config.vocab_size)) < 0.2
    # ... and four optimizer steps on the same batch lower it: backward and step really ran
    assert row["loss_last"] < row["loss_first"] - 0.1


def test_dry_run_converts_all_but_the_head(bench, dry_run):
    cfg = bench.SIZES["tiny"].config
    n_linears = 7 * cfg.n_layers + 1  # wq, wk, wv, wo, w1, w2, w3 per block, then the LM head
    for params in ("fp32-autocast", "bf16-master"):
        rows = dry_run["results"][f"tiny / eager / {params}"]
        assert f"{n_linears - 1} of {n_linears} linears converted" in rows["lowprec:fp8-current"]["conversion"]
        assert rows["bf16"]["conversion"] == "plain nn.Linear"
        torchao = rows["torchao:tensorwise"]
        if bench.torchao_float8() is None:
            assert torchao == {"skipped": "skipped: torchao not importable"}
        else:
            assert ROW_FIELDS <= set(torchao)


def test_dry_run_json_records_the_setup(bench, dry_run):
    assert dry_run["args"]["variants"] == ["bf16", "lowprec:fp8-current", "torchao:tensorwise"]
    assert {"device", "torch", "torchao"} <= set(dry_run["env"])
    tiny = dry_run["sizes"]["tiny"]
    model = build_model(bench.SIZES["tiny"].config)
    assert tiny["n_params"] == sum(p.numel() for p in model.parameters())
    assert tiny["tokens_per_step"] == 2 * 64


def test_flops_per_token_counts_linears_and_attention(bench):
    for name in ("tiny", "1b", "3b"):
        size, cfg = bench.SIZES[name], bench.SIZES[name].config
        with torch.device("meta"):  # shapes only
            model = Transformer(cfg)
        linear = sum(m.weight.numel() for m in model.modules() if isinstance(m, nn.Linear))
        # per layer and token: Q K^T and A V, 2 x seq x head_dim FLOPs per head each, forward then twice backward
        attention = 3 * 2 * (2 * size.seq_len * cfg.head_dim) * cfg.n_heads * cfg.n_layers
        assert size.flops_per_token() == 6 * linear + attention


def test_ffn_rule_reproduces_the_presets(models):
    for cfg in PRESETS.values():
        if cfg.moe is None:  # an expert's width follows no dense rule
            assert models.llama_ffn(cfg.dim) == cfg.ffn_dim


def test_reference_shapes(bench):
    shapes = {name: (s.config.dim, s.config.n_layers, s.config.n_heads, s.config.n_kv_heads, s.seq_len, s.batch,
                     s.config.vocab_size) for name, s in bench.SIZES.items() if name != "tiny"}
    assert shapes == {"125m": (768, 12, 12, 4, 2048, 16, 32000), "1b": (2048, 16, 16, 8, 2048, 8, 32000),
                      "3b": (3072, 26, 24, 8, 4096, 4, 32000), "moe-1b": (1024, 16, 16, 8, 2048, 8, 32000),
                      "8b": (4096, 32, 32, 8, 4096, 2, 128256)}
    assert bench.SIZES["8b"].config.num_params() == pytest.approx(8.03e9, rel=0.001)  # Llama 3 8B
    assert bench.SIZES["3b"].config.num_params() == pytest.approx(2.8e9, rel=0.02)
    moe = bench.SIZES["moe-1b"].config.moe
    assert (moe.n_experts, moe.top_k, moe.n_shared, bench.SIZES["moe-1b"].config.ffn_dim) == (32, 4, 1, 512)
    assert bench.SIZES["moe-1b"].config.num_params() == pytest.approx(0.95e9, rel=0.01)


@pytest.mark.parametrize("argv", [["--variants", "lowprec:fp9"], ["--variants", "torchao:mxfp8"],
                                  ["--sizes", "7b"], ["--modes", "jit"], ["--params", "fp16"],
                                  ["--convert-on", "gpu"], ["--steps", "0"], ["--recompute", "some"]])
def test_bad_flags_are_refused(bench, argv, capsys):
    with pytest.raises(SystemExit) as e:
        bench.parse_args(argv)
    assert e.value.code == 2
    assert "expected" in capsys.readouterr().err


def test_recompute_runs_a_group_per_mode_with_the_planner_beside(bench, tmp_path):
    """``--recompute``: one group per mode, every block checkpointed (the same first loss: the same model),
    the planner's peak falling from none to full as it does for the 1B model on the H200."""
    with torch.random.fork_rng():
        results = bench.main(["--sizes", "tiny", "--modes", "eager", "--params", "bf16-master", "--steps", "1",
                              "--warmup", "0", "--variants", "bf16,lowprec:fp8-current+fp8act",
                              "--recompute", "none,selective,full", "--out", str(tmp_path)])
    groups = {mode: results[f"tiny / eager / bf16-master / recompute {mode}"] for mode in ("none", "selective", "full")}
    for variant in ("bf16", "lowprec:fp8-current+fp8act"):
        rows = [groups[mode][variant] for mode in groups]
        assert all("error" not in r for r in rows), rows
        assert len({r["loss_first"] for r in rows}) == 1  # recomputation changes no number
        n = bench.SIZES["tiny"].config.n_layers
        assert [r["checkpointed_blocks"] for r in rows] == [0, n, n]
    bf16 = [groups[mode]["bf16"]["planned_gib"] for mode in groups]
    assert bf16[0] > bf16[1] > bf16[2]
    size = bench.SIZES["1b"]
    planned = [bench.planned_gib(size, "bf16", "bf16-master", mode, "h200") for mode in groups]
    assert planned[0] > planned[1] > planned[2]
    assert bench.planned_gib(size, "torchao:tensorwise", "bf16-master", "none", "h200") is None


@pytest.mark.parametrize("params", ["fp32-autocast", "bf16-master"])
def test_cudagraphs_mode_compiles_for_replay_and_starts_each_step(bench, params, monkeypatch):
    """``--modes cudagraphs``: the model compiled with ``mode="reduce-overhead"`` and every step a new CUDA-graph
    generation, before it touches the gradients (a replay writes over the last step's outputs)."""
    calls = []
    model = build_model(PRESETS["tiny"], seed=0).to(torch.float32 if params == "fp32-autocast" else torch.bfloat16)
    monkeypatch.setattr(torch, "compile", lambda m, **kw: calls.append(("compile", kw)) or m)
    monkeypatch.setattr(torch.compiler, "cudagraph_mark_step_begin", lambda: calls.append(("begin",)))
    tokens = torch.randint(PRESETS["tiny"].vocab_size, (2, 9))
    step, _ = bench.make_step(model, params, True, tokens, graphs=True)
    assert calls == [("compile", {"mode": "reduce-overhead"})]
    for _ in range(2):
        assert torch.isfinite(step())
    assert calls[1:] == [("begin",), ("begin",)]
    calls.clear()
    bench.make_step(model, params, True, tokens)[0]()
    assert calls == [("compile", {})]  # compiled without graphs: no generation to start
