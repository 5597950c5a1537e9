"""``lowprec plan``: memory per GPU, GPUs needed, and time and cost to train a model with a recipe."""
from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable

import click

from lowprec.cli.app import main
from lowprec.nn.saved import fp8_activations as saved_activations
from lowprec.optim.states import StateFormat
from lowprec.plan.gpus import GPUS
from lowprec.plan.memory import Training
from lowprec.plan.planner import PlanConfig, plan
from lowprec.plan.recipes import GRAD_BYTES, OPTIMIZERS, RECIPES
from lowprec.plan.report import format_comparison, format_plan, gpu_table, model_table, plan_to_dict


def _show(table: Callable[[], str]) -> Callable:
    """An eager flag's callback: print ``table()`` and exit before the required options are checked."""
    def callback(ctx: click.Context, _param: click.Parameter, value: bool) -> None:
        if value and not ctx.resilient_parsing:
            click.echo(table())
            ctx.exit()
    return callback


@main.command("plan")
@click.option("--model", required=True, help="A preset (see --list-models) or a Hugging Face config.json / its folder.")
@click.option("--recipe", default="bf16", show_default=True,
              help="One of " + ", ".join(RECIPES) + "; several, comma-separated, plan each beside the first.")
@click.option("--gpu", default="h100", show_default=True, help="One of " + ", ".join(GPUS) + ".")
@click.option("--gpus", type=int, default=None, help="GPUs to plan for [default: the fewest that fit].")
@click.option("--zero", type=int, default=0, show_default=True, help="ZeRO stage 0-3.")
@click.option("--tp", type=int, default=1, show_default=True, help="Tensor-parallel degree.")
@click.option("--pp", type=int, default=1, show_default=True, help="Pipeline stages.")
@click.option("--ep", type=int, default=1, show_default=True, help="Expert-parallel degree (MoE).")
@click.option("--seq", type=int, default=4096, show_default=True, help="Sequence length.")
@click.option("--micro-batch", type=int, default=1, show_default=True, help="Sequences per micro-batch.")
@click.option("--grad-accum", type=int, default=1, show_default=True,
              help="Micro-batches per optimizer step; above 1 every layer keeps its weight casts for the step.")
@click.option("--recompute", default="none", show_default=True, help="none, selective or full.")
@click.option("--optimizer", default="adamw", show_default=True, help="One of " + ", ".join(OPTIMIZERS) + ".")
@click.option("--optim-states", type=click.Choice([f.value for f in StateFormat]), default="fp32",
              show_default=True, help="How AdamW stores its moments (as lowprec train --optim-states).")
@click.option("--master-weights/--no-master-weights", default=True, show_default=True,
              help="FP32 master weights; without, BF16 weights rounded stochastically.")
@click.option("--fp8-activations", is_flag=False, flag_value="1x128", default=None, metavar="[1xB|tensor]",
              help="Norms and SwiGLU keep their inputs for backward in E4M3 with FP32 scales per 1xB block "
                   "(alone: 1x128) or per tensor. Default: BF16.")
@click.option("--grad-dtype", default="bf16", show_default=True, help="One of " + ", ".join(GRAD_BYTES) + ".")
@click.option("--fp8-weights", is_flag=True,
              help="Quantized linears' weights stored in FP8 (no BF16 copy), as lowprec train --fp8-weights.")
@click.option("--tokens", type=float, default=None, help="Tokens to train on (e.g. 15e12), for days and cost.")
@click.option("--mfu", type=float, default=None,
              help="Fraction of each GEMM format's dense peak the whole step achieves. Default: the step's parts "
                   "(GEMMs, experts, casts, attention, other kernels, optimizer) at the fractions measured on an "
                   "H200 (docs/plan.md).")
@click.option("--price-per-gpu-hour", type=float, default=None, help="US dollars per GPU-hour, for the cost.")
@click.option("--json", "as_json", is_flag=True, help="Print JSON instead of tables.")
@click.option("--list-gpus", is_flag=True, expose_value=False, is_eager=True, callback=_show(gpu_table),
              help="Print the accelerator table and exit.")
@click.option("--list-models", is_flag=True, expose_value=False, is_eager=True, callback=_show(model_table),
              help="Print the model presets and exit.")
def plan_cmd(model: str, recipe: str, gpu: str, gpus: int | None, zero: int, tp: int, pp: int, ep: int,
             seq: int, micro_batch: int, grad_accum: int, recompute: str, optimizer: str, optim_states: str,
             master_weights: bool, grad_dtype: str, fp8_weights: bool, fp8_activations: str | None,
             tokens: float | None, mfu: float | None, price_per_gpu_hour: float | None, as_json: bool) -> None:
    """Memory per GPU by component, whether it fits, the fewest GPUs that fit, and time and cost."""
    training = Training(seq=seq, micro_batch=micro_batch, grad_accum=grad_accum, recompute=recompute,
                        optimizer=optimizer, optim_states=optim_states, master_weights=master_weights,
                        grad_dtype=grad_dtype, fp8_weights=fp8_weights,
                        saved_activations=saved_activations(fp8_activations) if fp8_activations else None)
    config = PlanConfig(model=model, recipe=recipe, gpu=gpu, gpus=gpus, tp=tp, pp=pp, ep=ep, zero=zero,
                        training=training, tokens=tokens, mfu=mfu, price_per_gpu_hour=price_per_gpu_hour)
    names = [r.strip() for r in recipe.split(",")]
    if len(names) > 1:
        first = plan(dataclasses.replace(config, recipe=names[0]))  # the others on as many GPUs as the first
        plans = [first] + [plan(dataclasses.replace(config, recipe=r, gpus=first.parallel.gpus)) for r in names[1:]]
        click.echo(json.dumps([plan_to_dict(p) for p in plans], indent=2) if as_json else format_comparison(plans))
        return
    result = plan(config)
    click.echo(json.dumps(plan_to_dict(result), indent=2) if as_json else format_plan(result))
