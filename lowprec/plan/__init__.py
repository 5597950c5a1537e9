"""Capacity planning: memory per GPU, GPUs needed, and time and cost to train a model with a recipe.

Layers, bottom up: ``gpus`` (the accelerator table), ``models`` and ``hf_config`` (model shapes),
``layers`` (the linears of a block and parameter counts), ``recipes`` (what a recipe stores,
derived from ``lowprec.recipes``), ``gemm_paths`` (how each GEMM runs on a device, as the kernels
decide), ``activations``, ``memory``, ``throughput``, ``trainable`` (what ``lowprec train`` cannot
run of a layout), ``planner`` (``plan``) and ``report``; ``devices`` describes this machine for
``lowprec info``. docs/plan.md gives the formulas and their sources.
"""
from lowprec.plan.gpus import GPU, GPUS, get_gpu
from lowprec.plan.hf_config import from_hf_config, load_hf_config
from lowprec.plan.layers import ParamCount, count_params
from lowprec.plan.memory import Parallel, StageMemory, Training, fewest_gpus, memory_per_gpu
from lowprec.plan.models import PRESETS, MLASpec, ModelSpec, MoESpec, all_presets, get_model
from lowprec.plan.planner import Plan, PlanConfig, plan
from lowprec.plan.recipes import OPTIMIZERS, RECIPES, RecipeCost, Storage, cost_of, get_recipe
from lowprec.plan.report import format_plan, plan_to_dict
from lowprec.plan.throughput import FlopTerm, Throughput, flop_terms, throughput

__all__ = [
    "GPU", "GPUS", "get_gpu", "from_hf_config", "load_hf_config", "ParamCount", "count_params",
    "Parallel", "StageMemory", "Training", "fewest_gpus", "memory_per_gpu", "PRESETS", "MLASpec",
    "ModelSpec", "MoESpec", "all_presets", "get_model", "Plan", "PlanConfig", "plan", "OPTIMIZERS",
    "RECIPES", "RecipeCost", "Storage", "cost_of", "get_recipe", "format_plan", "plan_to_dict", "FlopTerm",
    "Throughput", "flop_terms", "throughput",
]
