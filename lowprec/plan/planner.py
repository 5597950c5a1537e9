"""``plan``: memory per GPU, whether it fits, the fewest GPUs that fit, and time and cost to train."""
from __future__ import annotations

import math
from dataclasses import dataclass

from lowprec._checks import check_positive_int, describe, fail
from lowprec.plan.gpus import GPU, get_gpu
from lowprec.plan.layers import ParamCount, check_parallel_fits, count_params
from lowprec.plan.memory import Parallel, StageMemory, Training, fewest_gpus, memory_per_gpu
from lowprec.plan.models import ModelSpec, get_model
from lowprec.plan.recipes import RecipeCost, get_recipe, on_gpu
from lowprec.plan.step_time import StepTime, step_time
from lowprec.plan.throughput import FlopTerm, Throughput, flop_terms, throughput
from lowprec.plan.trainable import trainer_refusals
from lowprec.plan.units import GB
from lowprec.recipes import Recipe


def _check_number(name: str, value: float | None, *, positive: bool) -> None:
    if value is None:
        return
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    if not ok or value < 0 or (positive and value == 0):
        fail(name, "a positive finite number" if positive else "a non-negative finite number", describe(value))


@dataclass(frozen=True, kw_only=True, slots=True)
class PlanConfig:
    model: str | ModelSpec
    """A preset name, a path to a Hugging Face config.json, or a ModelSpec."""
    recipe: str | Recipe = "bf16"
    """A preset name or a user-defined ``lowprec.recipes.Recipe``."""
    gpu: str = "h100"
    gpus: int | None = None
    """GPUs to plan for; None: the fewest that fit (tp x pp x ep if none does)."""
    tp: int = 1
    pp: int = 1
    ep: int = 1
    zero: int = 0
    training: Training = Training()
    tokens: float | None = None
    """Tokens to train on, for days and cost."""
    mfu: float | None = None
    """Fraction of each GEMM format's dense peak the whole step achieves; None: the step's parts at the
    fractions measured for them (``lowprec.plan.step_time``)."""
    price_per_gpu_hour: float | None = None

    def __post_init__(self) -> None:
        if self.gpus is not None:
            check_positive_int("gpus", self.gpus)
        for name in ("tp", "pp", "ep"):
            check_positive_int(name, getattr(self, name))
        _check_number("tokens", self.tokens, positive=True)
        _check_number("price_per_gpu_hour", self.price_per_gpu_hour, positive=False)
        _check_number("mfu", self.mfu, positive=True)
        if self.mfu is not None and self.mfu > 1:
            fail("mfu", "a fraction in (0, 1]", self.mfu)
        if not isinstance(self.training, Training):
            fail("training", "a lowprec.plan.Training", describe(self.training), TypeError)


@dataclass(frozen=True, kw_only=True, slots=True)
class Plan:
    config: PlanConfig
    model: ModelSpec
    params: ParamCount
    recipe: RecipeCost
    gpu: GPU
    parallel: Parallel
    memory: StageMemory
    """The fullest pipeline stage."""
    fewest_gpus: int | None
    """Fewest GPUs that fit with this tp, pp, ep and ZeRO stage; None if no count does."""
    flops: tuple[FlopTerm, ...]
    throughput: Throughput
    step: StepTime | None
    """The step's parts where no ``mfu`` was given."""
    trainer_refusals: tuple[str, ...] = ()
    """One line per option ``lowprec train`` cannot run in this layout (``lowprec.plan.trainable``)."""

    @property
    def capacity_bytes(self) -> float:
        return self.gpu.memory_gb * GB

    @property
    def fits(self) -> bool:
        return self.memory.total <= self.capacity_bytes


def plan(config: PlanConfig) -> Plan:
    """Plan training ``config.model`` with ``config.recipe`` on ``config.gpu`` accelerators."""
    m, gpu, train = get_model(config.model), get_gpu(config.gpu), config.training
    recipe = on_gpu(get_recipe(config.recipe), gpu.capability)
    check_parallel_fits(m, config.tp, config.ep)
    layout = dict(tp=config.tp, pp=config.pp, ep=config.ep, zero=config.zero)
    fewest = fewest_gpus(m, recipe, gpu.memory_gb, train, **layout)
    gpus = config.gpus or fewest or config.tp * config.pp * config.ep
    par = Parallel(gpus=gpus, **layout)
    mem = memory_per_gpu(m, recipe, par, train)
    terms = flop_terms(m, recipe, gpu, train.seq, train.recompute, train.tokens)
    # one optimizer step runs grad_accum micro-batches per data-parallel rank, and at least the pp
    # that fill a 1F1B pipeline
    tokens_per_step = train.tokens * par.dp * max(train.grad_accum, par.pp)
    step = None if config.mfu is not None else step_time(m, recipe, gpu, train, par, tokens_per_step)
    tp_out = throughput(terms, gpus=gpus, mfu=config.mfu, step_s=step.step_s if step else None,
                        tokens_per_step=tokens_per_step, tokens=config.tokens,
                        price_per_gpu_hour=config.price_per_gpu_hour)
    params = count_params(m, recipe.hp_blocks(m.n_layers), recipe.min_features)
    return Plan(config=config, model=m, params=params, recipe=recipe, gpu=gpu, parallel=par, memory=mem,
                fewest_gpus=fewest, flops=tuple(terms), throughput=tp_out, step=step,
                trainer_refusals=trainer_refusals(par, train))
