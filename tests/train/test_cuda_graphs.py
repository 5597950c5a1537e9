"""``TrainConfig.cuda_graphs``: what it needs, the compile mode it asks for, and the warning where inductor
records no CUDA graph (on a CPU it never does, which is what these tests lean on)."""
from __future__ import annotations

import warnings
from dataclasses import replace
from unittest import mock

import pytest
import torch
from click.testing import CliRunner

from lowprec.cli import main
from lowprec.train import graphs
from lowprec.train.config import RESUME_MUST_MATCH, TrainConfig

GRAPHS = TrainConfig(steps=2, compile="inductor", cuda_graphs=True, device="cuda:0")


def test_config_takes_what_cuda_graphs_need():
    assert GRAPHS.cuda_graphs  # a CUDA device named, not opened: no GPU needed to check the config
    assert "cuda_graphs" not in RESUME_MUST_MATCH  # replays change no number: a resume may turn them on or off


@pytest.mark.parametrize("field, value, named", [
    ("compile", None, "compile: expected 'inductor' with cuda_graphs"),
    ("compile", "aot_eager", "got 'aot_eager'"),
    ("device", "cpu", "device: expected a CUDA device with cuda_graphs"),
    ("parallel", "ddp", "parallel: expected 'none' with cuda_graphs"),
    ("grad_accum", 2, "grad_accum: expected 1 with cuda_graphs"),
])
def test_config_refuses_what_cuda_graphs_cannot_replay(field, value, named):
    with pytest.raises(ValueError, match=named):
        replace(GRAPHS, **{field: value})


def test_config_refuses_a_non_bool():
    with pytest.raises(TypeError, match="cuda_graphs: expected a bool, got 'yes'"):
        replace(GRAPHS, cuda_graphs="yes")


def test_cli_names_the_missing_compile(tmp_path):
    result = CliRunner().invoke(main, ["train", "--model", "tiny", "--steps", "1", "--cuda-graphs",
                                       "--out", str(tmp_path / "run")])
    assert result.exit_code != 0
    assert "compile: expected 'inductor' with cuda_graphs" in result.output
    assert not (tmp_path / "run").exists() or not any((tmp_path / "run").iterdir())  # refused before any step


def test_compiled_asks_inductor_for_reduce_overhead():
    model = torch.nn.Linear(4, 4)
    with mock.patch.object(torch, "compile", side_effect=lambda m, **kw: kw) as compile_:
        assert graphs.compiled(model, "inductor", True) == {"backend": "inductor", "mode": "reduce-overhead"}
        assert graphs.compiled(model, "inductor", False) == {"backend": "inductor"}
        assert graphs.compiled(model, None, False) is model
    assert compile_.call_count == 2


def test_begin_step_starts_a_generation_only_with_cuda_graphs():
    with mock.patch.object(torch.compiler, "cudagraph_mark_step_begin") as begin:
        graphs.begin_step(False)
        assert begin.call_count == 0
        graphs.begin_step(True)
        assert begin.call_count == 1


def test_a_graph_run_without_cuda_graphs_is_warned_about():
    torch._dynamo.reset()
    seen = graphs.skipped()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert graphs.warn_unrecorded(seen) == seen  # nothing new: silent
    # on a CPU inductor compiles the graph and records no CUDA graph of it: the case the warning is for
    fn = graphs.compiled(torch.nn.Linear(8, 8), "inductor", True)
    out = fn(torch.randn(2, 8))
    assert out.shape == (2, 8)
    assert graphs.skipped() > seen
    with pytest.warns(UserWarning, match=r"cuda_graphs: \d+ compiled graph\(s\) run without CUDA graphs"):
        now = graphs.warn_unrecorded(seen)
    assert now == graphs.skipped()
    torch._dynamo.reset()


def _moe(recipe):
    from lowprec.nn import GroupedLinear

    model = torch.nn.Sequential(torch.nn.Linear(16, 16))
    model.add_module("experts", GroupedLinear(4, 128, 128, recipe=recipe))
    return model


@pytest.mark.parametrize("recipe, args, warned", [
    ("fp8-current", ("inductor", False, "cuda", True), True),
    ("mxfp4", ("inductor", False, "cuda", True), True),
    ("fp8-current", ("inductor", True, "cuda", True), False),  # graphs asked for
    ("fp8-current", (None, False, "cuda", True), False),  # eager
    ("fp8-current", ("inductor", False, "cpu", True), False),  # no CUDA graphs on a CPU
    ("fp8-current", ("inductor", False, "cuda", False), False),  # DDP or accumulation: graphs refused
    (None, ("inductor", False, "cuda", True), False),  # high-precision experts: one grouped GEMM each
    ("bf16", ("inductor", False, "cuda", True), False),
])
def test_low_precision_experts_compiled_without_graphs_are_told_of_them(recipe, args, warned):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        graphs.suggest(_moe(recipe), *args)
    said = [str(w.message) for w in caught if "cuda-graphs" in str(w.message)]
    assert bool(said) is warned
    if warned:
        assert "1 low-precision expert layer(s) (experts, ...)" in said[0]
