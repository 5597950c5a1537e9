"""Every preset recipe trains under DDP and FSDP2 on two ranks, and the ranks stay one model."""
from __future__ import annotations

import math

import pytest
import torch

from lowprec import recipes
from tests.distributed import common as C
from tests.distributed import session
from tests.distributed.harness import result

dist_results = session.dist_results


@pytest.mark.parametrize("parallel", ["ddp", "fsdp2"])
@pytest.mark.parametrize("recipe", recipes.names())
def test_every_recipe_trains_and_the_ranks_agree(dist_results, recipe, parallel):
    a, b = (r[recipe, parallel] for r in result(dist_results, "every_recipe"))
    assert a["converted"] == 2  # both linears take the recipe (bf16/fp16 as unscaled casts)
    assert all(math.isfinite(v) for v in a["losses"]) and a["losses"] == b["losses"]
    assert torch.equal(C.bits(a["weights"]), C.bits(b["weights"]))
