"""DDP on two gloo ranks: every recipe trains as one process does; lowprec.optim's masters, FP32
accumulation and step guard act on the reduced gradients, and every rank takes the same decisions."""
from __future__ import annotations

import math
import warnings

import pytest
import torch

from lowprec.optim import NONFINITE_GRADS, NONFINITE_LOSS, grad_norm
from tests.distributed import common as C
from tests.distributed import session
from tests.distributed.checks import RECIPES, STEPS
from tests.distributed.common import one_process, tolerance
from tests.distributed.harness import WORLD, result

dist_results = session.dist_results

warnings.filterwarnings("ignore", message="lowprec:")  # emulated GEMMs on CPU


@pytest.mark.parametrize("recipe", RECIPES)
def test_ddp_training_matches_one_process(dist_results, recipe):
    ranks = [r[recipe] for r in result(dist_results, "ddp_recipes")]
    assert torch.equal(C.bits(ranks[0]["weights"]), C.bits(ranks[1]["weights"]))
    assert not any(ranks[0]["skipped"])
    reference = one_process(recipe)
    miss = (ranks[0]["weights"] - reference).norm().item()
    tol, update = tolerance(recipe)
    assert tol < update / 4  # the tolerance can tell a wrong average from a right one
    if recipe == "mxfp8":
        # half a batch is a whole number of 32-row MX blocks: the same quantization, only sums reordered
        assert miss <= 1e-5 * update
    else:
        assert miss <= tol


def _reduced_first_gradient() -> list[torch.Tensor]:
    """Step 0's gradient as DDP must hand it to the optimizer: on each rank the two micro-batches'
    BF16 gradients summed in float32 and rounded once to BF16; then DDP's reduction of BF16
    buckets, each rank's share multiplied by 1/W and the shares added in BF16."""
    shares = []
    for rank in range(WORLD):
        model = C.mlp("fp8-current", torch.bfloat16)
        total = None
        for micro in range(2):
            model.zero_grad(set_to_none=True)
            x, y = C.batch(micro, rank, WORLD, torch.bfloat16)
            (C.mse(model, x, y) / 2).backward()
            g = [p.grad.float() for p in model.parameters()]
            total = g if total is None else [t + gi for t, gi in zip(total, g)]
        shares.append([(t.to(torch.bfloat16) * (1 / WORLD)) for t in total])
    return [(a + b).float() for a, b in zip(*shares)]


@pytest.mark.parametrize("variant", ["copy", "bucket-view"])
def test_bf16_weights_stay_identical_across_ranks(dist_results, variant):
    ranks = [r[variant] for r in result(dist_results, "ddp_bf16_masters")]
    for a, b in zip(ranks[0]["params"], ranks[1]["params"]):
        assert a.dtype == torch.bfloat16 and torch.equal(C.bits(a), C.bits(b))
    assert len(ranks[0]["masters"]) == 4
    for a, b in zip(ranks[0]["masters"], ranks[1]["masters"]):
        assert a.dtype == torch.float32 and torch.equal(C.bits(a), C.bits(b))
    # the optimizer saw the reduced float32-accumulated gradient: its norm, bit for bit
    assert ranks[0]["norms"][0] == ranks[1]["norms"][0] == grad_norm(_reduced_first_gradient()).item()
    assert ranks[0]["collectives"] == [1] * STEPS  # the step's decision took one all-reduce


def test_stochastic_rounding_is_refused_under_data_parallelism(dist_results):
    for r in result(dist_results, "ddp_bf16_masters"):
        assert r["refused"].startswith("stochastic_rounding: expected False under data parallelism")


def test_nan_on_one_rank_skips_the_step_on_all(dist_results):
    ranks = result(dist_results, "ddp_nan")
    for r in ranks:
        (skip_loss, why_loss, loss), (skip_grad, why_grad, _), (skip_next, _, _) = r["results"]
        assert skip_loss and why_loss == NONFINITE_LOSS and math.isnan(loss)  # rank 1's NaN loss, everywhere
        assert skip_grad and why_grad == NONFINITE_GRADS
        assert not skip_next and r["skipped_steps"] == 2
        before, after_loss, after_grad = r["snaps"]
        for snap in (after_loss, after_grad):
            for key in ("params", "masters"):
                assert all(torch.equal(C.bits(a), C.bits(b)) for a, b in zip(before[key], snap[key]))
            assert _same_state(before["inner"], snap["inner"])
        assert after_loss["scale"] == before["scale"]  # a bad loss is not the scale's fault
        assert after_grad["scale"] == before["scale"] / 2  # overflowing gradients back it off, on both ranks
    assert [r[:2] for r in ranks[0]["results"]] == [r[:2] for r in ranks[1]["results"]]


def _same_state(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(C.bits(a), C.bits(b))
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same_state(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_same_state(x, y) for x, y in zip(a, b))
    return a == b
