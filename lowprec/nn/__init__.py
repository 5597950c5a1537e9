"""Low-precision modules: ``Linear`` and its autograd."""
from lowprec.nn.linear import Linear, fallback_reason

__all__ = ["Linear", "fallback_reason"]
