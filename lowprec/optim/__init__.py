"""Optimizer layer: FP32 master weights, loss scaling, FP32 gradient accumulation, the step guard,
stochastic rounding of BF16/FP16 weights, AdamW with BF16/FP8/8-bit moments (``AdamWLP``), and
:class:`Optimizer`, which composes them around any torch optimizer. See ``docs/optim.md``.
"""
from lowprec.optim.accumulate import GradAccumulator
from lowprec.optim.adamw_lp import AdamWLP
from lowprec.optim.guard import LOSS_SPIKE, NONFINITE_GRADS, NONFINITE_LOSS, StepGuard, Verdict, grad_norm
from lowprec.optim.loss_scale import LossScaleConfig, LossScaler
from lowprec.optim.master import MasterWeights
from lowprec.optim.optimizer import Optimizer, StepResult
from lowprec.optim.spike import SpikeDetector
from lowprec.optim.states import StateFormat
from lowprec.optim.stochastic import StochasticRounding, stochastic_round

__all__ = [
    "Optimizer", "StepResult", "LossScaleConfig", "LossScaler", "StepGuard", "Verdict", "SpikeDetector",
    "GradAccumulator", "MasterWeights", "StochasticRounding", "stochastic_round", "grad_norm",
    "NONFINITE_LOSS", "NONFINITE_GRADS", "LOSS_SPIKE", "AdamWLP", "StateFormat",
]
