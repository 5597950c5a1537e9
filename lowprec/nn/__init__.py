"""Low-precision modules: ``Linear`` and its autograd."""
from lowprec.nn.linear import Linear, cached_weight_casts, fallback_reason

__all__ = ["Linear", "cached_weight_casts", "fallback_reason"]
