"""``Training(fp8_weights=True)``: the planner's weight bytes are the bytes the converted model holds."""
from __future__ import annotations

import warnings

import pytest
import torch

import lowprec
from lowprec.nn.fp8_weight import FP8Weight
from lowprec.optim import Optimizer
from lowprec.plan.memory import Parallel, Training, memory_per_gpu
from lowprec.plan.models import ModelSpec
from lowprec.plan.recipes import get_recipe
from lowprec.train.model import ModelConfig, build_model

# every linear a multiple of 128, so that fp8-blockwise converts them all as the planner assumes
MICRO = ModelConfig(dim=128, n_layers=2, n_heads=2, n_kv_heads=2, ffn_dim=256, max_seq_len=64)
SPEC = ModelSpec(name="micro", vocab=MICRO.vocab_size, d_model=MICRO.dim, n_layers=MICRO.n_layers,
                 n_heads=MICRO.n_heads, n_kv_heads=MICRO.n_kv_heads, head_dim=MICRO.dim // MICRO.n_heads,
                 ffn=MICRO.ffn_dim)


def _parts(recipe: str, fp8_weights: bool) -> dict[str, float]:
    train = Training(fp8_weights=fp8_weights, overhead_gb=0.0, fragmentation=0.0)
    mem = memory_per_gpu(SPEC, get_recipe(recipe), Parallel(gpus=1), train)
    return {c.name: c.bytes for c in mem.components}


def _held(t: torch.Tensor) -> int:
    return t.nbytes_held if isinstance(t, FP8Weight) else t.numel() * t.element_size()


@pytest.mark.parametrize("recipe", ["fp8-current", "fp8-blockwise"])
def test_the_planned_weights_and_masters_are_the_bytes_the_model_holds(recipe):
    model = build_model(MICRO, seed=0).to(torch.bfloat16)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        lowprec.convert(model, recipe, fp8_weights=True)
    opt = Optimizer(model.parameters(), torch.optim.AdamW)  # takes each FP8 weight's initial value
    params = list(model.parameters())
    fp8 = sum(_held(p) for p in params if isinstance(p, FP8Weight))
    bf16 = sum(_held(p) for p in params if not isinstance(p, FP8Weight))
    masters = sum(_held(m) for m in opt.master_weights)
    plan = _parts(recipe, True)
    assert plan["weights (fp8)"] == fp8 and plan["weights (bf16)"] == bf16
    assert plan["master weights (fp32)"] == masters
    assert "low-precision weight copy (fp8-current)" not in plan
    # below the BF16 weights with FP32 masters that the same recipe holds without the option
    without = _parts(recipe, False)
    assert fp8 + bf16 + masters < without["weights (bf16)"] + without["master weights (fp32)"]
    assert plan["weights (fp8)"] + plan["weights (bf16)"] == pytest.approx(
        without["weights (bf16)"] - sum(p.numel() for p in params if isinstance(p, FP8Weight)), abs=1e3)


def test_a_recipe_that_casts_weights_otherwise_keeps_its_casts():
    plan = _parts("mxfp8", True)
    assert "weights (fp8)" in plan and "weight casts (mxfp8), one layer at a time" in plan
    assert _parts("bf16", True) == _parts("bf16", False)  # nothing to store in FP8
