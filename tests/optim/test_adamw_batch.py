"""AdamWLP's batched step (``lowprec.optim.adamw_batch``) equals the per-parameter step bit for bit: every
state format, parameters of sizes no group divides, different step counts and dtypes in one group,
buckets split by size."""
from __future__ import annotations

import pytest
import torch

from lowprec.optim import AdamWLP
from lowprec.optim import adamw_batch as batch
from lowprec.optim.adamw_lp import update_one
from tests.optim.common import bits

SHAPES = [(3, 5), (130,), (64, 40), (2049,), (1,), (7, 300)]


def _params(dtype=torch.float32) -> list[torch.nn.Parameter]:
    g = torch.Generator().manual_seed(0)
    return [torch.nn.Parameter(torch.randn(*s, generator=g).to(dtype if i % 2 else torch.float32))
            for i, s in enumerate(SHAPES)]


def _run(params, states: str, per_parameter: bool, monkeypatch, limit: int) -> AdamWLP:
    opt = AdamWLP(params, lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1, states=states)
    if per_parameter:
        def each(ps, sts, fmt, group, step):
            for p, st in zip(ps, sts):
                update_one(p, st, fmt, group)
        monkeypatch.setattr(batch, "update", each)
    monkeypatch.setattr(batch, "BUCKET", limit)
    monkeypatch.setattr(batch.buckets, "__defaults__", (limit,))
    g = torch.Generator().manual_seed(1)
    for s in range(4):
        for i, p in enumerate(params):  # a parameter without a gradient at a step falls a count behind
            grad = (torch.randn(p.shape, generator=g) * 10.0**(i - 3)).to(p.dtype)
            p.grad = None if (s == 1 and i % 3 == 0) else grad
        opt.step()
    monkeypatch.undo()
    return opt


@pytest.mark.parametrize("states", ["fp32", "bf16", "fp8", "int8"])
@pytest.mark.parametrize("limit", [1 << 22, 3000])
def test_the_batched_step_equals_the_per_parameter_step(states, limit, monkeypatch):
    a, b = _params(torch.bfloat16), _params(torch.bfloat16)
    ref = _run(a, states, True, monkeypatch, limit)
    got = _run(b, states, False, monkeypatch, limit)
    for p, q in zip(a, b):
        assert torch.equal(bits(p), bits(q))
        sa, sb = ref.state[p], got.state[q]
        assert sa.keys() == sb.keys() and sa["step"].item() == sb["step"].item()
        for k in sa:
            assert sa[k].dtype == sb[k].dtype and torch.equal(bits(sa[k]), bits(sb[k])), k
    assert ref.state_dict()["state"].keys() == got.state_dict()["state"].keys()


def test_buckets_hold_one_device_dtype_and_step_within_the_limit():
    ps = [torch.zeros(n, dtype=d) for n, d in [(10, torch.float32), (10, torch.bfloat16), (15, torch.float32),
                                             (40, torch.float32), (5, torch.float32)]]
    for p in ps:
        p.grad = torch.zeros_like(p)
    assert batch.buckets(ps, [1, 1, 1, 1, 2], limit=30) == [[0, 2], [1], [3], [4]]
