"""Low-precision modules: ``Linear``, its autograd, and the operand-cast plan it follows; ``RMSNorm`` and
``SwiGLU``, whose backward can keep their inputs in FP8 (``SavedActivations``)."""
from lowprec.nn.casts import CastState, InputShare
from lowprec.nn.grouped import GroupedLinear
from lowprec.nn.linear import Linear, cached_weight_casts
from lowprec.nn.norm import RMSNorm, rms_norm
from lowprec.nn.plan import LayerPlan, OperandPlan, fallback_reason, layer_plan
from lowprec.nn.saved import SavedActivations, fp8_activations
from lowprec.nn.swiglu import SwiGLU, swiglu

__all__ = ["CastState", "GroupedLinear", "InputShare", "LayerPlan", "Linear", "OperandPlan", "RMSNorm",
           "SavedActivations", "SwiGLU", "cached_weight_casts", "fallback_reason", "fp8_activations", "layer_plan",
           "rms_norm", "swiglu"]
