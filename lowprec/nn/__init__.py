"""Low-precision modules: ``Linear``, its autograd, and the operand-cast plan it follows."""
from lowprec.nn.casts import CastState, InputShare
from lowprec.nn.linear import Linear, cached_weight_casts
from lowprec.nn.plan import LayerPlan, OperandPlan, fallback_reason, layer_plan

__all__ = ["CastState", "InputShare", "LayerPlan", "Linear", "OperandPlan", "cached_weight_casts",
           "fallback_reason", "layer_plan"]
