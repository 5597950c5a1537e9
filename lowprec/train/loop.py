"""The training loop: convert, then AdamW with the step guard, schedule, validation, logs, checkpoints.

[Note: why a run is deterministic and resumes exactly]
Everything random in a step is a function of saved state: the batch of step ``s`` is drawn from
``(seed, s)`` alone (:meth:`TokenData.train_batch`), the learning rate is a function of ``s`` and
of the schedule the checkpoint records (:class:`lowprec.train.schedule.Schedule`), and the draws of
stochastic rounding come from torch's global generators, which :func:`train` seeds at the start
and a checkpoint saves and restores. With the model (delayed scaling state included), the
optimizer (masters, moments, loss scale, spike window) and the history saved after step ``k``, a
run resumed there repeats steps ``k+1..`` bit for bit on a CPU.

[Note: every rank decides alike]
Under ``ddp``/``fsdp2`` each rank trains on its rows of the step's batch (see
:mod:`lowprec.distributed.launch`). What decides the course of the run is the same on every rank:
the loss handed to the optimizer is the mean over the ranks (so the non-finite-loss check and the
spike watch see one value), the gradients it judges are the reduced ones (its norm and skip
decision taken over all ranks' gradients), the validation loss is averaged over the ranks' rows,
and the schedule, evaluation and checkpoint steps depend on the step alone. So a skipped step, the
divergence stop and every checkpoint happen on all ranks at once.
"""
from __future__ import annotations

import contextlib
import dataclasses
import math
import statistics
import sys
import time
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from tqdm import tqdm

import lowprec
from lowprec import recipes
from lowprec._checks import fail
from lowprec.autocast import autocast
from lowprec.distributed.amax import sync_amaxes
from lowprec.distributed.expert_parallel import expert_parallel
from lowprec.distributed.fp8_weights import precompute_fp8_scales
from lowprec.distributed.launch import (
    Ranks,
    apply_grad_comm,
    grad_sync,
    mean_over_ranks,
    unwrap,
    wrap,
)
from lowprec.distributed.tensor_parallel import split_tensor_parallel, sum_partial_grads
from lowprec.nn import cached_weight_casts
from lowprec.nn.delayed import amax_outliers
from lowprec.optim import AdamWLP, Optimizer
from lowprec.telemetry import Telemetry
from lowprec.telemetry.sample import warn_nothing_to_sample
from lowprec.train import graphs, step_control
from lowprec.train.checkpoint import latest_checkpoint
from lowprec.train.config import ADAM_BETAS, TrainConfig
from lowprec.train.data import TokenData
from lowprec.train.lock import run_directory_lock
from lowprec.train.logs import RunLog
from lowprec.train.memory import PeakMemory
from lowprec.train.moe_model import balance_experts, parallelize_experts
from lowprec.train.recompute import recompute_blocks
from lowprec.train.result import RunResult
from lowprec.train.run_state import RunState, restore, save

TELEMETRY_KEY = "telemetry"
"""A sampled step's operand figures travel in its row to the log, which writes them to telemetry.csv."""
SKIP_REASON_KEY = "skip_reason"
"""Why the optimizer did not take a step travels in its row to the console line that says so."""
HP_START_RECIPE = "bf16"
"""What the first ``hp_start_steps`` steps run in (DeepSeek-V3 starts its scales this way). Layers bound
to a delayed recipe record their amaxes in those steps, so its first step scales from a history (see
[Note: lazy scale initialisation] in :mod:`lowprec.nn.record`)."""


def build_optimizer(model: nn.Module, cfg: TrainConfig, recipe: recipes.Recipe) -> Optimizer:
    """AdamW over the model: weight decay on matrices (ndim >= 2), none on norms; fp32 masters for bf16/fp16
    (or stochastic rounding without them); moments stored as ``cfg.optim_states``."""
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [{"params": [p for p in params if p.ndim >= 2], "weight_decay": cfg.weight_decay},
              {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0}]
    low_precision_params = cfg.torch_dtype != torch.float32
    loss_scale = "dynamic" if recipe.loss_scaling or cfg.torch_dtype == torch.float16 else None
    # torch's AdamW for FP32 moments; AdamWLP stores them in fewer bits (lowprec.optim.states)
    adamw, states = (torch.optim.AdamW, {}) if cfg.optim_states == "fp32" else (AdamWLP, {"states": cfg.optim_states})
    masters = low_precision_params and cfg.master_weights
    return Optimizer([g for g in groups if g["params"]], adamw, lr=cfg.lr, betas=ADAM_BETAS,
                     master_weights=masters, stochastic_rounding=low_precision_params and not masters,
                     seed=cfg.seed, loss_scale=loss_scale, max_grad_norm=cfg.max_grad_norm,
                     skip_spikes=cfg.on_spike != "log", **states)


@torch.no_grad()
def evaluate(model: nn.Module, batches: list[tuple[torch.Tensor, torch.Tensor]], device: torch.device) -> float:
    """Mean cross-entropy (nats per token) over fixed validation batches."""
    model.eval()
    total = 0.0
    for x, y in batches:
        logits = model(x.to(device))  # (B, T, vocab)
        total += F.cross_entropy(logits.float().flatten(0, 1), y.to(device).flatten()).item()
    model.train()
    return total / len(batches)


def _recipe_name(cfg: TrainConfig) -> str:
    """The run's recipe by name (a user's ``Recipe`` by its ``name``)."""
    return cfg.recipe.name if isinstance(cfg.recipe, recipes.Recipe) else cfg.recipe


def _step_recipe(cfg: TrainConfig, step: int) -> str:
    """The name of the recipe step ``step`` runs in: BF16 during the high-precision start, then the run's."""
    return HP_START_RECIPE if step <= cfg.hp_start_steps else _recipe_name(cfg)


def _recipe_region(cfg: TrainConfig, step: int) -> contextlib.AbstractContextManager:
    """BF16 during the high-precision start, recording the amaxes of delayed layers (validation, without
    gradients, records none); else the recipe the model was converted to."""
    if step <= cfg.hp_start_steps:
        return autocast(HP_START_RECIPE, record_amax=True)
    return contextlib.nullcontext()


def _train_step(run: RunState, step: int) -> dict[str, Any]:
    cfg = run.cfg
    lr = run.schedule.lr_at(step)
    for group in run.opt.param_groups:
        group["lr"] = lr
    switches = step_control.before_step(run, step)
    inputs, targets = run.data.train_batch(cfg.seed, step + run.data_offset, cfg.grad_accum, cfg.batch_size,
                                           cfg.seq_len, rank=run.ranks.data_rank,
                                           world_size=run.ranks.data_world)  # (M, B/W, T)
    start = time.perf_counter()
    graphs.begin_step(cfg.cuda_graphs)
    loss_sum = torch.zeros((), device=run.device)
    # backward inside the region too: the override must hold while the backward GEMMs pick their casts
    # micro-batches of one step share each weight's casts; a single batch casts at its forward
    cached = cached_weight_casts(run.model) if cfg.grad_accum > 1 else contextlib.nullcontext()
    sampling = Telemetry(cfg.telemetry_every).region(run.model, step)  # nothing, off the sampled steps
    with _recipe_region(cfg, step), cached, sampling as sampled:
        for i, (x, y) in enumerate(zip(inputs, targets)):
            with grad_sync(run.model, enabled=i == cfg.grad_accum - 1):  # ranks reduce the sum, once
                logits = run.forward(x.to(run.device, non_blocking=True))  # (B/W, T, vocab)
                loss = F.cross_entropy(logits.float().flatten(0, 1), y.to(run.device).flatten())
                run.opt.backward(loss / cfg.grad_accum)
            loss_sum += loss.detach()
    if cfg.tp > 1:
        sum_partial_grads(run.model)  # FSDP2's norms: their tensor-parallel halves (hooks did the rest)
    if run.ranks.distributed and recipes.get(cfg.recipe).uses_delayed_scaling:
        # every rank's next scales from the same amaxes (the BF16 start records too): one all-reduce for all layers
        sync_amaxes(run.model)
    # the global batch's loss: logged, and checked and watched for spikes alike on every rank
    loss_mean = mean_over_ranks(loss_sum / cfg.grad_accum, run.ranks)
    result = run.opt.step(loss=loss_mean)  # the loss check shares the step's one host sync
    balance_experts(unwrap(run.model), taken=not result.skipped)  # routing biases, where a MoE layer balances
    if run.ranks.distributed:
        precompute_fp8_scales(run.model)  # FP8-all-gathered weights' next scales: one all-reduce, if any
    loss_value = result.loss
    seconds = time.perf_counter() - start
    row = {"step": step, "lr": lr, "loss": loss_value, "val_loss": None, "grad_norm": result.grad_norm,
           "loss_scale": result.loss_scale, "skipped": result.skipped, "spike": result.spike,
           "recipe": _step_recipe(cfg, step), "tokens_per_s": cfg.tokens_per_step / seconds}
    if recipes.get(cfg.recipe).uses_delayed_scaling:  # capped amax outliers so far (one read of the device)
        row["amax_outliers"] = amax_outliers(unwrap(run.model))
    row[SKIP_REASON_KEY] = result.reason  # taken out of the row before it joins the history, as the figures
    if sampled is not None:
        row[TELEMETRY_KEY] = sampled.records  # taken out of the row before it joins the history
    # the controller judges the recipe's casts: the BF16 start's figures say nothing about them
    judged = sampled.records if sampled is not None and step > cfg.hp_start_steps else None
    step_control.after_step(run, step, row, switches, records=judged)
    if cfg.cuda_graphs:
        run.graph_skips = graphs.warn_unrecorded(run.graph_skips)
    return row


def _validate(run: RunState) -> float:
    """The validation loss over all ranks' rows (each rank evaluates its own)."""
    graphs.begin_step(run.cfg.cuda_graphs)
    local = evaluate(run.forward, run.val, run.device)
    if not run.ranks.distributed:
        return local
    return mean_over_ranks(torch.tensor(local, dtype=torch.float64, device=run.device), run.ranks).item()


def _steps(run: RunState, first: int) -> Iterator[int]:
    interactive = run.cfg.progress and sys.stderr.isatty() and run.ranks.is_main
    bar = tqdm(range(first, run.cfg.steps + 1), initial=first - 1, total=run.cfg.steps, disable=not interactive,
               desc=run.cfg.recipe, unit="step", dynamic_ncols=True, file=sys.stderr)
    with contextlib.closing(bar):
        step = first
        while step <= run.cfg.steps:
            yield step
            row = run.history[-1]
            bar.n = row["step"]  # a roll-back (on_spike) goes back to its checkpoint's step
            bar.set_postfix(loss=f"{row['loss']:.4f}", refresh=False)
            step = row["step"] + 1


def _loop(run: RunState, log: RunLog | None, ckpt_dir: Path | None, on_step: Callable[[dict], None] | None) -> bool:
    """Train from the step after the history's last to ``cfg.steps``; True if the run diverged."""
    cfg = run.cfg
    # a resumed run's clock goes on from its checkpoint's (the time it was stopped is not counted)
    elapsed_before = (run.history[-1].get("elapsed_s") or 0.0) if run.history else 0.0
    started = time.perf_counter() - elapsed_before
    in_a_row = 0
    for step in _steps(run, run.history[-1]["step"] + 1 if run.history else 1):
        row = _train_step(run, step)
        records = row.pop(TELEMETRY_KEY, None)
        skip_reason = row.pop(SKIP_REASON_KEY)
        in_a_row = in_a_row + 1 if row["skipped"] else 0
        diverged = in_a_row >= cfg.max_skips_in_row
        if (step % cfg.eval_every == 0 or step == cfg.steps) and not diverged:
            with _recipe_region(cfg, step):  # validated as it was trained at this step
                row["val_loss"] = _validate(run)
        row["elapsed_s"] = time.perf_counter() - started
        run.history.append(row)
        if log is not None:
            log.write(row)
            if records:
                log.write_telemetry(records)
            step_control.write_switches(log.path.parent, run.pending_switches)
        step_control.say_switches(run, step, run.pending_switches)
        if step_control.should_roll_back(run, row, ckpt_dir):
            step_control.roll_back(run, step, ckpt_dir)  # the loop goes on from the checkpoint's step
            if log is not None:  # the files follow the history: the undone steps' rows go
                log.rewind(run.history)
                step_control.rewrite_switches(log.path.parent, run.control)
            continue
        step_control.say_skip(run, row, skip_reason)
        if ckpt_dir is not None and ((cfg.save_every and step % cfg.save_every == 0) or step == cfg.steps):
            save(run, ckpt_dir)
        if on_step is not None:
            on_step(row)
        if diverged:
            return True
    return False


def _throughput(history: list[dict[str, Any]]) -> float:
    # the median ignores the first steps' one-time costs and a resumed run's restart
    rates = [r["tokens_per_s"] for r in history[1:] or history]
    return statistics.median(rates) if rates else math.nan


def train(model: nn.Module, data: TokenData, cfg: TrainConfig, *, out_dir: str | Path | None = None,
          resume: bool = False, checkpoints: bool = True,
          on_step: Callable[[dict[str, Any]], None] | None = None) -> RunResult:
    """Convert ``model`` (high precision, unconverted) to ``cfg.recipe`` and train it on ``data``.

    Seeds torch's global generators from ``cfg.seed`` (stochastic rounding draws from them).
    With ``out_dir``: ``log.csv``, ``tensorboard/`` and, with ``checkpoints``, ``checkpoints/``;
    ``resume`` continues from the newest checkpoint there (see [Note: what resuming checks] in
    :mod:`lowprec.train.run_state`), with ``cfg.steps`` larger or smaller than its run's (see [Note:
    growing a run] in :mod:`lowprec.train.schedule`). The run holds ``out_dir``'s lock throughout: another
    process writing there raises :class:`lowprec.train.lock.RunDirectoryLocked`. ``on_step`` sees each
    step's log row after it is written and checkpointed (an exception from it stops the run there).

    With ``cfg.parallel`` ``ddp`` or ``fsdp2`` (a process group must be initialized, e.g. by torchrun),
    every rank calls this with the same model and data: the model is converted, then wrapped; each
    rank trains on its rows of every batch; rank 0 alone writes the logs; checkpoints are saved by
    every rank through ``torch.distributed.checkpoint``. The result's history is the same on every
    rank, but for timings.
    """
    ranks = Ranks.of(cfg.parallel, cfg.tp)
    if resume and out_dir is None:
        fail("resume", "an output directory holding checkpoints", "out_dir=None")
    _check_arguments(cfg, out_dir is not None and checkpoints, out_dir is None, ranks)
    out = Path(out_dir) if out_dir is not None else None
    # one writer per directory: held from before the checkpoints are read until the last one is written
    with run_directory_lock(out, ranks) if out is not None else contextlib.nullcontext():
        run, report = _start(model, data, cfg, ranks)
        ckpt_dir = out / "checkpoints" if out is not None and checkpoints else None
        memory = PeakMemory(run.device)
        log = None
        try:
            if resume:
                restore(run, out / "checkpoints")
            elif ckpt_dir is not None and latest_checkpoint(ckpt_dir) is not None:
                # a fresh run among an older run's checkpoints could later resume from the wrong one
                fail("out_dir", "a directory without checkpoints, or resume=True to continue the run in it",
                     f"{str(out)!r} holding {latest_checkpoint(ckpt_dir).name}")
            memory.reset()
            log = RunLog(out, run.history, cfg.tensorboard) if out is not None and ranks.is_main else None
            diverged = _loop(run, log, ckpt_dir, on_step)
        finally:
            if log is not None:
                log.close()
            run.opt.remove_hooks()
    return RunResult(recipe=_recipe_name(cfg), history=tuple(run.history), tokens_per_s=_throughput(run.history),
                     peak_memory_bytes=memory.peak_bytes(), diverged=diverged, conversion=str(report),
                     out_dir=str(out) if out is not None else None, coverage=report.coverage())


def _check_arguments(cfg: TrainConfig, saves: bool, no_out: bool, ranks: Ranks) -> None:
    """Before anything is built: a roll-back needs checkpoints (refused without); a BF16 start as long as the
    run leaves the recipe no step (said once, from rank 0: a run that will grow by resuming may want it)."""
    if cfg.on_spike == "rollback" and not saves:
        fail("on_spike", "'log' or 'skip' when the run saves no checkpoints (a roll-back returns to the newest "
             "one)", "'rollback' with " + ("out_dir=None" if no_out else "checkpoints=False"))
    name = _recipe_name(cfg)
    if cfg.hp_start_steps >= cfg.steps and name != HP_START_RECIPE and ranks.is_main:
        warnings.warn(f"lowprec: hp_start_steps {cfg.hp_start_steps} >= steps {cfg.steps}: every step of the run "
                      f"is in {HP_START_RECIPE}, none in {name}", stacklevel=3)


def _start(model: nn.Module, data: TokenData, cfg: TrainConfig,
           ranks: Ranks) -> tuple[RunState, lowprec.ConversionReport]:
    """The run before its first step: the model cast, converted and wrapped, its optimizer, the generators
    seeded; and the conversion report."""
    recipe = recipes.get(cfg.recipe)
    device = torch.device(cfg.device)
    # cast before converting, so scaling state the converted layers hold stays float32
    model.to(device=device, dtype=cfg.torch_dtype)
    policy = dataclasses.replace(cfg.policy_object() or lowprec.Policy(), saved_activations=cfg.saved_activations)
    conversion = lowprec.convert(model, recipe, policy, fp8_weights=cfg.fp8_weights)
    replicas = None  # the data-parallel mesh over tensor-parallel groups (None: every rank, or one replica)
    if cfg.tp > 1:  # before the blocks are wrapped for recomputation: the split finds their linears by name
        _, replicas = split_tensor_parallel(model, cfg.tp, fsdp2=cfg.parallel == "fsdp2")
        if cfg.parallel == "fsdp2" and cfg.fp8_all_gather and recipe.low_precision and ranks.is_main:
            warnings.warn("lowprec: --fp8-all-gather does not apply to weights split by tensor parallelism: FSDP2 "
                          "all-gathers them in their dtype", stacklevel=2)
    recompute_blocks(model, cfg.recompute)  # in place, before wrapping: FSDP2 shards the checkpointed blocks
    if cfg.ep > 1:  # before wrapping: the wrappers leave the experts' DTensors alone
        parallelize_experts(model, expert_parallel(cfg.ep, fp8=recipe.low_precision))
    # said at the start, not by a missing file
    warn_nothing_to_sample(model, Telemetry(cfg.telemetry_every), recipe.low_precision)
    val = data.val_batches(cfg.val_batches, cfg.batch_size, cfg.seq_len, rank=ranks.data_rank,
                           world_size=ranks.data_world)  # refuses a batch the ranks cannot share
    # after converting: the wrappers hold lowprec's layers
    # tensor parallelism: DDP over the replicas, none for one (see TrainConfig.tp)
    parallel = cfg.parallel if cfg.tp == 1 or replicas is not None else "none"
    model = wrap(model, parallel, cfg.grad_comm, fp8_weights=cfg.fp8_all_gather and cfg.tp == 1, mesh=replicas)
    apply_grad_comm(model, parallel, cfg.grad_comm)
    torch.manual_seed(cfg.seed)
    # compiled after wrapping (DDP's hooks stay outside the graph), sharing the wrapped model's parameters
    forward = graphs.compiled(model, cfg.compile, cfg.cuda_graphs)
    graphs.suggest(model, cfg.compile, cfg.cuda_graphs, device.type, cfg.parallel == "none" and cfg.grad_accum == 1)
    run = RunState(model=model, opt=build_optimizer(model, cfg, recipe), data=data, cfg=cfg, device=device,
                   val=val, ranks=ranks, forward=forward, graph_skips=graphs.skipped())
    run.control = step_control.make_controller(run)
    return run, conversion
