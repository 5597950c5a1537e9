"""The small-layer rule as it applies where the recipe runs natively, simulated on the CPU."""
from __future__ import annotations

import pytest

from lowprec.kernels.capability import cuda_capability
from lowprec.nn import plan

H100 = cuda_capability((9, 0))
"""FP8 GEMMs on cuBLAS: where the default policy keeps linears under 1024 features in BF16."""


@pytest.fixture
def native_small_rule(monkeypatch):
    """``small_reason`` sees an H100's capability, so the default policy keeps small layers in BF16 as it
    does on a GPU, while the GEMMs themselves are still planned (and run) emulated on the CPU."""
    original = plan.small_reason

    def small_reason(*args):
        with monkeypatch.context() as m:
            m.setattr(plan, "capability", lambda device=None: H100)
            return original(*args)

    monkeypatch.setattr(plan, "small_reason", small_reason)
    plan.layer_plan.cache_clear()  # plans made before, or under the simulation, are not the CPU's
    yield
    plan.layer_plan.cache_clear()
