"""The planner's optimizer states equal what lowprec.optim holds after a step of the reference tiny model."""
from __future__ import annotations

import pytest
import torch

from lowprec.optim import AdamWLP, Optimizer
from lowprec.optim.states import StateFormat
from lowprec.plan.memory import Parallel, Training, memory_per_gpu
from lowprec.plan.models import get_model
from lowprec.plan.recipes import get_recipe
from lowprec.train.model import build_model, preset


def _planned(**train) -> dict[str, float]:
    mem = memory_per_gpu(get_model("ref-tiny"), get_recipe("bf16"), Parallel(gpus=1), Training(**train))
    return {c.name.split(" (")[0]: c.bytes for c in mem.components}


def _held(states: str, masters: bool) -> tuple[int, int, int]:
    """Bytes of the moments and of the masters the optimizer holds after one step, and the tensors it steps."""
    model = build_model(preset("tiny"), seed=0).to(torch.bfloat16)
    cls, kw = (torch.optim.AdamW, {}) if states == "fp32" else (AdamWLP, {"states": states})
    opt = Optimizer(model.parameters(), cls, master_weights=masters, stochastic_rounding=not masters, **kw)
    opt.backward(model(torch.zeros(1, 8, dtype=torch.long)).float().mean())
    opt.step()
    moments = sum(v.numel() * v.element_size() for s in opt.state.values() for k, v in s.items() if k != "step")
    master = sum(m.numel() * m.element_size() for m in opt.master_weights if m is not None)
    return moments, master, len(opt.state)


@pytest.mark.parametrize("states", [f.value for f in StateFormat])
@pytest.mark.parametrize("masters", [True, False])
def test_planned_moments_and_masters_are_what_the_optimizer_holds(states, masters):
    planned = _planned(optim_states=states, master_weights=masters)
    moments, master, tensors = _held(states, masters)
    if StateFormat(states).group is None:
        assert planned["optimizer moments"] == moments
    else:
        # the planner spreads the scales over whole groups; a tensor's partial last group holds one more set
        per_group = 2 * 4 * len(StateFormat(states).group_keys)
        assert 0 <= moments - planned["optimizer moments"] <= tensors * per_group
        assert planned["optimizer moments"] == pytest.approx(moments, rel=1e-3)
    assert planned.get("master weights", 0) == master
    assert (master > 0) == masters


@pytest.mark.parametrize("states", ["fp8", "int8"])
def test_fp8_and_8bit_moments_take_at_most_half_of_fp32_adamws(states):
    assert _planned(optim_states=states)["optimizer moments"] <= 0.5 * _planned()["optimizer moments"]


def test_bad_settings():
    with pytest.raises(ValueError, match="optim_states: expected one of 'fp32', 'bf16', 'fp8', 'int8', got 'fp4'"):
        Training(optim_states="fp4")
