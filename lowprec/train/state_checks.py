"""Whether a checkpoint fits this run: the names of ``lowprec.state.checks``, which holds them below
``distributed`` so that the distributed checkpoint may use them without importing the trainer."""
from __future__ import annotations

from lowprec.state.checks import (
    EXTRA_STATE,
    Shape,
    check_model_state,
    check_optimizer_shapes,
    check_rng_state,
    first_nonfinite,
    refuse_nonfinite,
    set_cuda_rng_state,
    tensor_shape,
)

__all__ = ["EXTRA_STATE", "Shape", "check_model_state", "check_optimizer_shapes", "check_rng_state", "first_nonfinite",
           "refuse_nonfinite", "set_cuda_rng_state", "tensor_shape"]
