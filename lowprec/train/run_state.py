"""The mutable state of one training run, and how a checkpoint saves and restores it.

[Note: what resuming checks]
Before anything is loaded, resuming refuses, each in one line naming the checkpoint: a checkpoint
whose files do not match their sha256 (the JSON included: optimizer settings, history, data
position, schedule); settings that change the numbers and differ from the checkpoint's; other
data or another model; a history that does not end at the checkpoint's step; state that does not
fit the model and optimizer (:mod:`lowprec.train.state_checks`); generator states torch refuses.
After loading, weights, masters and optimizer state must be finite on every rank: a run resumed
from NaN weights would skip every step.
"""
from __future__ import annotations

import platform
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

import lowprec
from lowprec._checks import fail
from lowprec.distributed import named_state  # a module: lowprec.distributed.checkpoint comes here half-way
from lowprec.distributed.agree import local
from lowprec.distributed.launch import Ranks, unwrap
from lowprec.optim import Optimizer
from lowprec.train.checkpoint import (
    CheckpointError,
    is_distributed_checkpoint,
    latest_checkpoint,
    load_checkpoint,
    read_meta,
    save_checkpoint,
)
from lowprec.train.config import TrainConfig, check_resumable
from lowprec.train.data import TokenData
from lowprec.train.models import describe_shapes
from lowprec.train.schedule import Schedule
from lowprec.train.state_checks import (
    check_model_state,
    check_optimizer_shapes,
    check_rng_state,
    first_nonfinite,
    refuse_nonfinite,
    set_cuda_rng_state,
    tensor_shape,
)


@dataclass
class RunState:
    """The mutable state of one run, in one place."""

    model: nn.Module
    """The model as trained: wrapped by DDP, sharded by FSDP2, or itself in one process."""
    opt: Optimizer
    data: TokenData
    cfg: TrainConfig
    device: torch.device
    val: list[tuple[torch.Tensor, torch.Tensor]]
    """This rank's rows of the validation batches."""
    ranks: Ranks = field(default_factory=Ranks)
    history: list[dict[str, Any]] = field(default_factory=list)
    schedule: Schedule | None = None
    """The learning rates; a fresh run's follow ``cfg``, a grown run's continue its checkpoint's."""
    forward: nn.Module | None = None
    """What the steps and validation call: ``model`` compiled (``cfg.compile``), or ``model`` itself. It
    shares ``model``'s parameters; state is always saved and loaded through ``model``."""
    control: Any = None
    """The precision controller (``lowprec.telemetry.control``), or None."""
    data_offset: int = 0
    """Added to the step to draw its batch: moved past the data of rolled-back steps (``on_spike``)."""
    rollbacks: int = 0
    pending_switches: list = field(default_factory=list)
    graph_skips: int = 0
    """Compiled graphs inductor had run without CUDA graphs when the last step ended (``cfg.cuda_graphs``:
    a new one is warned about; see ``lowprec.train.graphs``)."""

    def __post_init__(self) -> None:
        if self.forward is None:
            self.forward = self.model
        if self.schedule is None:
            c = self.cfg
            self.schedule = Schedule.of(lr=c.lr, warmup_steps=c.warmup_steps, total_steps=c.steps,
                                        min_lr_ratio=c.min_lr_ratio)


def _param_shapes(model: nn.Module) -> dict[str, list[int]]:
    return {n: list(p.shape) for n, p in model.named_parameters()}


def _rng_state(device: torch.device) -> dict[str, Any]:
    return {"cpu": torch.get_rng_state(),
            "cuda": torch.cuda.get_rng_state_all() if device.type == "cuda" else None}


def _set_rng_state(state: Any, device: torch.device, where: str) -> None:
    if not isinstance(state, dict) or "cpu" not in state:
        fail("checkpoint", f"generator states in {where}", "none", CheckpointError)
    torch.set_rng_state(check_rng_state(state["cpu"], "CPU", where))
    if device.type == "cuda" and state.get("cuda") is not None:
        set_cuda_rng_state(lambda: torch.cuda.set_rng_state_all(state["cuda"]), where)


def _run_info(run: RunState) -> dict[str, Any]:
    # the data position is the step: batches are drawn from (seed, step) alone
    return {"train_config": run.cfg.to_dict(), "data": {"source": run.data.source,
                                                        "fingerprint": run.data.fingerprint,
                                                        "position": {"seed": run.cfg.seed,
                                                                     "data_offset": run.data_offset,
                                                                     "next_step": run.history[-1]["step"] + 1}},
            "schedule": run.schedule.to_dict(), "param_shapes": _param_shapes(unwrap(run.model)),
            "lowprec_version": lowprec.__version__, "torch_version": torch.__version__,
            "python_version": platform.python_version()}


def save(run: RunState, directory: Path) -> None:
    """The checkpoint of the history's last step: one process's files, or every rank's through DCP."""
    step = run.history[-1]["step"]
    if run.ranks.distributed:
        from lowprec.distributed import checkpoint as dist_checkpoint  # torch's DCP takes seconds to import
        dist_checkpoint.save(directory, step, run.model, run.opt, run.ranks, keep=run.cfg.keep,
                             state={"history": run.history, "run": _run_info(run), **_control(run)},
                             rng=dist_checkpoint.rank_rng_state(run.device))
        return
    state = {"model": run.model.state_dict(), "optimizer": run.opt.state_dict(), "rng": _rng_state(run.device),
             "history": run.history, "run": _run_info(run), **_control(run)}
    save_checkpoint(directory, step, state, keep=run.cfg.keep)


def _control(run: RunState) -> dict[str, Any]:
    return {"control": run.control.state_dict()} if run.control is not None else {}


def _restore_control(run: RunState, state: Any) -> None:
    """The controller's levels, bound before the model's state loads (a layer's delayed-scaling
    history loads under the recipe it ran), and the data offset."""
    if run.control is not None and isinstance(state, dict) and "control" in state:
        run.control.load_state_dict(state["control"])
    run.data_offset = int(state["run"]["data"]["position"].get("data_offset", 0))


def saved_train_config(directory: str | Path) -> dict[str, Any] | None:
    """The settings of the newest checkpoint in ``directory`` (its JSON verified), or None without one."""
    path = latest_checkpoint(directory)
    if path is None:
        return None
    meta = read_meta(path)
    try:
        return dict(meta["state"]["run"]["train_config"])
    except (KeyError, TypeError, ValueError) as e:
        raise CheckpointError(f"checkpoint: expected a run's settings in {str(path)!r}, got {e!r}") from e


def _check_run(run: RunState, step: int, state: Any, where: str) -> tuple[list[dict[str, Any]], Schedule]:
    """The checkpoint's history and the schedule to go on with, once its run is this one."""
    try:
        info, history = state["run"], list(state["history"])
        saved_cfg, data, shapes = info["train_config"], info["data"], info["param_shapes"]
        schedule, next_step = Schedule.from_dict(info["schedule"]), data["position"]["next_step"]
        steps = [row["step"] for row in history]
    except (KeyError, TypeError, ValueError) as e:
        raise CheckpointError(f"checkpoint: expected a run's history and settings in {where}, got {e!r}") from e
    check_resumable(saved_cfg, run.cfg)
    if data["fingerprint"] != run.data.fingerprint:
        fail("data", f"the data the checkpoint was trained on ({data['source']})", run.data.source)
    if shapes != _param_shapes(unwrap(run.model)):
        fail("model", f"the model the checkpoint was trained on, {describe_shapes(shapes)}",
             describe_shapes(_param_shapes(unwrap(run.model))))
    if steps != list(range(1, step + 1)) or next_step != step + 1:
        fail("checkpoint", f"a history of steps 1 to {step} and step {step + 1} next in {where}",
             f"{len(steps)} rows and step {next_step!r} next", CheckpointError)
    if step > run.cfg.steps:
        fail("steps", f"at least the checkpoint's step {step}", run.cfg.steps)
    return history, schedule.grown(step, run.cfg.steps)


def restore(run: RunState, directory: Path) -> None:
    """Continue ``run`` from the newest checkpoint in ``directory`` (see [Note: what resuming checks])."""
    path = latest_checkpoint(directory)
    if path is None:
        fail("resume", f"a checkpoint in {str(directory)!r}", "none (start without --resume)", FileNotFoundError)
    where = repr(str(path))
    if is_distributed_checkpoint(path):
        from lowprec.distributed import checkpoint as dist_checkpoint  # torch's DCP takes seconds to import
        meta = dist_checkpoint.read(path, run.ranks)
        step, state = meta["step"], meta["state"]
        history, schedule = _check_run(run, step, state, where)
        _restore_control(run, state)
        rng = dist_checkpoint.load(path, meta, run.model, run.opt, run.ranks)
        dist_checkpoint.set_rank_rng_state(rng, run.device, where)
    else:
        step, state = load_checkpoint(path)  # under torchrun, every rank reads it whole
        history, schedule = _check_run(run, step, state, where)
        _restore_control(run, state)
        _load_single(run, state, where)
    _check_finite(run, where)
    run.history, run.schedule = history, schedule


def _load_single(run: RunState, state: dict[str, Any], where: str) -> None:
    """A single-process checkpoint's tensors into the run, in one process or spread over the ranks."""
    try:
        model_state, optim_state, rng = state["model"], state["optimizer"], state["rng"]
        saved_shapes = {k: tuple(v.shape) for k, v in model_state.items() if isinstance(v, torch.Tensor)}
    except (KeyError, TypeError, AttributeError) as e:
        raise CheckpointError(f"checkpoint: expected model, optimizer and generator states in {where}, "
                              f"got {e!r}") from e
    model = unwrap(run.model)
    check_model_state({k: tuple(v.shape) for k, v in model.state_dict().items()}, saved_shapes, where)
    by_name = named_state.optimizer_state_by_name(run.model, run.opt, optim_state, where)
    targets = {n: tuple(t.shape) for n, t in named_state.optimizer_targets(run.model, run.opt).items()}
    check_optimizer_shapes(by_name, targets, tensor_shape, where)
    if run.ranks.distributed:  # a single-process checkpoint, spread over the ranks
        from lowprec.distributed import checkpoint as dist_checkpoint

        cpu_rng = check_rng_state(rng.get("cpu") if isinstance(rng, dict) else None, "CPU", where)
        dist_checkpoint.load_whole(run.model, run.opt, model_state, optim_state)
        torch.set_rng_state(cpu_rng)  # one process's CUDA generators are not this rank's
    else:
        if isinstance(rng, dict):
            check_rng_state(rng.get("cpu"), "CPU", where)  # before anything is loaded
        run.model.load_state_dict(model_state)
        run.opt.load_state_dict(optim_state)
        _set_rng_state(rng, run.device, where)


def _check_finite(run: RunState, where: str) -> None:
    """Refuse non-finite weights, masters or optimizer state (this rank's shards; every rank raises alike)."""
    named: list[tuple[str, torch.Tensor]] = [(f"weight {n!r}", local(p.detach()))
                                            for n, p in unwrap(run.model).named_parameters()]
    for name, target in named_state.optimizer_targets(run.model, run.opt).items():
        named.append((f"the master weight of {name!r}", local(target.detach())))
        named += [(f"optimizer state {k!r} of {name!r}", local(v)) for k, v in run.opt.state.get(target, {}).items()
                  if isinstance(v, torch.Tensor)]
    found = first_nonfinite(named)
    if run.ranks.distributed:
        every: list[Any] = [None] * run.ranks.world_size
        dist.all_gather_object(every, found)
        found = next((f for f in every if f is not None), None)
    refuse_nonfinite(found, where)
