"""What each rank does in the checkpoint tests (run by :func:`tests.distributed.launch_helpers.forked`).

Results the test checks are written under ``out`` (JSON, or ``torch.save`` files of whole tensors).
"""
from __future__ import annotations

import json
import os
import signal
from dataclasses import replace
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint.filesystem as dcp_fs

import lowprec
from lowprec.distributed import checkpoint as dist_checkpoint
from lowprec.distributed.launch import Ranks, wrap
from lowprec.optim import Optimizer
from lowprec.train.config import TrainConfig
from lowprec.train.data import load_data
from lowprec.train.loop import train
from lowprec.train.model import build_model
from tests.distributed.launch_helpers import MICRO, MICRO_CFG

RESUME_RECIPE = "nvfp4"
"""Its gradients are rounded stochastically: an exact resume needs each rank's generators restored."""
RESUME_STEPS = 4
KILL_AT_STEP = 4


class Stop(Exception):
    pass


def stop_after(step: int):
    def hook(row):
        if row["step"] == step:
            raise Stop

    return hook


def curve(result) -> list:
    return [(r["step"], r["loss"], r["grad_norm"], r["val_loss"], r["lr"]) for r in result.history]


def resume(out: Path, parallel: str) -> None:
    """A whole run, one stopped after step 3 (saved at 2), and its resumption: curves to ``curves_<rank>.json``."""
    data = load_data()
    cfg = replace(MICRO_CFG, recipe=RESUME_RECIPE, steps=RESUME_STEPS, eval_every=2, save_every=2, parallel=parallel)
    whole = train(build_model(MICRO, seed=0), data, cfg, out_dir=out / "whole")
    try:
        train(build_model(MICRO, seed=0), data, cfg, out_dir=out / "cut", on_step=stop_after(3))
    except Stop:
        pass
    resumed = train(build_model(MICRO, seed=0), data, cfg, out_dir=out / "cut", resume=True)
    rank = dist.get_rank()
    (out / f"curves_{rank}.json").write_text(json.dumps({"whole": curve(whole), "resumed": curve(resumed)}))


def _die() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def kill(out: Path, where: str) -> None:
    """Train with a checkpoint every 2 steps; the save of step 4 is killed: ``where`` is ``shards`` (rank 1
    dies while writing its shards), ``publish`` (rank 0 dies after renaming the shards into place,
    before the JSON) or ``none`` (nothing is killed)."""
    rank = dist.get_rank()
    stem = f"step_{KILL_AT_STEP:08d}"
    if where == "shards" and rank == 1:
        write_data = dcp_fs.FileSystemWriter.write_data

        def dying_write_data(self, plan, planner):
            if stem in str(self.path):
                _die()
            return write_data(self, plan, planner)

        dcp_fs.FileSystemWriter.write_data = dying_write_data
    if where == "publish" and rank == 0:
        write_atomically = dist_checkpoint.write_atomically

        def dying_write(path, data):
            if path.name == f"{stem}.json":
                _die()
            write_atomically(path, data)

        dist_checkpoint.write_atomically = dying_write
    cfg = replace(MICRO_CFG, save_every=2, parallel="ddp")
    train(build_model(MICRO, seed=0), load_data(), cfg, out_dir=out)


def resume_on_ranks(out: Path, cfg: TrainConfig) -> None:
    """Resume the run in ``out`` with ``cfg`` (its ``parallel`` set) on these ranks."""
    train(build_model(MICRO, seed=0), load_data(), cfg, out_dir=out, resume=True)


def resume_expecting_error(out: Path) -> None:
    """Resume the run in ``out``; the error each rank gets goes to ``error_<rank>.txt``."""
    cfg = replace(MICRO_CFG, save_every=2, parallel="ddp")
    try:
        train(build_model(MICRO, seed=0), load_data(), cfg, out_dir=out, resume=True)
    except ValueError as e:
        (out / f"error_{dist.get_rank()}.txt").write_text(str(e))


def _fsdp2_model_and_optimizer(dtype: torch.dtype, record_amaxes: bool) -> tuple[torch.nn.Module, Optimizer]:
    model = build_model(MICRO, seed=0).to(dtype)
    lowprec.convert(model, lowprec.recipes.get("fp8-delayed"))
    if record_amaxes:
        # delayed-scaling histories; the same on every rank, as amaxes reduced across the ranks make them (a
        # tensor the ranks hold alike is saved once)
        x = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(0))
        model(x).float().sum().backward()
        model.zero_grad()
    model = wrap(model, "fsdp2")
    return model, Optimizer(model.parameters(), torch.optim.AdamW, lr=1e-2, master_weights=True)


def targets(opt: Optimizer) -> list[torch.Tensor]:
    """What the inner optimizer updates: each parameter's FP32 master, or the FP32 parameter itself."""
    return [p if m is None else m for p, m in zip(opt.params, opt.master_weights)]


def fsdp2_state(out: Path, dtype: torch.dtype) -> None:
    """A model of ``dtype`` parameters (bfloat16 ones get FP32 masters) under FSDP2, after one AdamW step
    of what its optimizer updates, on given gradients, saved through DCP; rank 0 writes the whole
    tensors (gathered from the shards) to ``reference.pt``. Then a fresh FSDP2 model loads it on the
    same two ranks: ``reload_<rank>.json`` says whether each local shard came back bit for bit."""
    model, opt = _fsdp2_model_and_optimizer(dtype, record_amaxes=True)
    gen = torch.Generator().manual_seed(1)
    for t in targets(opt):
        # the inner optimizer steps alone (the guard's global norm under FSDP2 is not tested here)
        t.grad = torch.zeros_like(t)
        t.grad.to_local().copy_(torch.randn(t.to_local().shape, generator=gen))
    opt.optimizer.step()
    ranks = Ranks.of("fsdp2")
    dist_checkpoint.save(out / "checkpoints", 1, model, opt, ranks, state={"note": "fsdp2"},
                         rng=dist_checkpoint.rank_rng_state(torch.device("cpu")))
    names = [n for n, _ in model.named_parameters()]
    full = {
        "targets": {n: t.full_tensor() for n, t in zip(names, targets(opt))},
        "exp_avg_sq": {n: opt.state[t]["exp_avg_sq"].full_tensor() for n, t in zip(names, targets(opt))},
        "extra": {k: v for k, v in model.state_dict().items() if k.endswith("_extra_state")},
    }
    if ranks.is_main:
        torch.save(full, out / "reference.pt")
    fresh, fresh_opt = _fsdp2_model_and_optimizer(dtype, record_amaxes=False)
    json_path = out / "checkpoints" / "step_00000001.json"
    dist_checkpoint.load(json_path, dist_checkpoint.read(json_path, ranks), fresh, fresh_opt, ranks)
    same = {
        "targets": all(torch.equal(a.to_local(), b.to_local()) for a, b in zip(targets(opt), targets(fresh_opt))),
        "params": all(torch.equal(t.to_local().to(p.dtype), p.to_local())
                      for t, p in zip(targets(opt), fresh.parameters())),
        "moments": all(torch.equal(opt.state[a][k].to_local(), fresh_opt.state[b][k].to_local())
                       for a, b in zip(targets(opt), targets(fresh_opt)) for k in ("exp_avg", "exp_avg_sq")),
        "sharded": all(p.to_local().numel() < p.numel() for p in fresh.parameters() if p.numel() > 1),
    }
    (out / f"reload_{ranks.rank}.json").write_text(json.dumps(same))
