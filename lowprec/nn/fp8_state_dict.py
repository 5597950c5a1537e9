"""What a layer with an FP8 primary weight writes into its ``state_dict``: the decoded weight."""
from __future__ import annotations

from lowprec.nn.fp8_weight import FP8Weight
from lowprec.ranks import is_dtensor, like


def decoded_state(module, state_dict, prefix, local_metadata) -> None:
    """A ``state_dict`` post-hook: the layer's FP8 weight as the decoded weight, in the parameter's dtype,
    so that checkpoints and plain models take it (the masters are in the optimizer's state)."""
    key = prefix + "weight"
    value = state_dict.get(key)
    if isinstance(value, FP8Weight):
        state_dict[key] = value.dequantize()
    elif is_dtensor(value) and isinstance(value._local_tensor, FP8Weight):  # FSDP2's shard: its rows decoded
        state_dict[key] = like(value, value._local_tensor.dequantize())
