"""What the training loop does around each step for precision control and loss spikes: the
controller's schedule before the step, its decision after it, the ``switches.csv`` log, and the
roll-back to the last checkpoint that ``on_spike="rollback"`` asks for.

[Note: rolling back a spike]
With ``on_spike="rollback"`` a step whose loss is a spike is not taken (the optimizer skips it, as
for ``skip``); then the run goes back to its newest checkpoint (model, optimizer, generators,
controller, history) and goes on from the step after it with the data moved past the window that
led to the spike: the batch of step ``s`` is drawn at position ``s + data_offset``, and a roll-back
from step ``s`` to checkpoint ``k`` adds ``s - k`` to the offset. The offset is saved in every
checkpoint, so a resumed run draws the same batches. The schedule still follows the step. At most
:data:`MAX_ROLLBACKS` roll-backs per process, and none without a checkpoint: past that, a spike is
skipped.
"""
from __future__ import annotations

import csv
import os
from dataclasses import asdict
from pathlib import Path
from typing import Any

from lowprec import recipes
from lowprec.distributed.launch import unwrap
from lowprec.telemetry.control import SWITCH_FIELDS, PrecisionController, Switch
from lowprec.train.checkpoint import latest_checkpoint

MAX_ROLLBACKS = 8


def make_controller(run) -> PrecisionController | None:
    """The run's precision controller, or None when its config turns nothing on."""
    cfg = run.cfg
    if not cfg.control.enabled:
        return None
    return PrecisionController(unwrap(run.model), recipes.get(cfg.recipe), cfg.control, cfg.steps, run.opt.group)


def before_step(run, step: int) -> list[Switch]:
    return run.control.before_step(step) if run.control is not None else []


def after_step(run, step: int, row: dict[str, Any], switches: list[Switch], records=None) -> None:
    """The controller's decision on the step's figures and loss; the switches counted in ``row``."""
    if run.control is not None:
        switches = switches + run.control.observe(step, records, row["spike"])
        row["precision_switches"] = len(switches)
    run.pending_switches = switches


def write_switches(out: Path | None, switches: list[Switch]) -> None:
    """Append ``switches`` to ``out/switches.csv`` (its header written once)."""
    if out is None or not switches:
        return
    path = out / "switches.csv"
    new = not path.exists()
    with path.open("a", newline="") as f:
        w = csv.DictWriter(f, fieldnames=SWITCH_FIELDS)
        if new:
            w.writeheader()
        w.writerows(asdict(s) for s in switches)


def rewrite_switches(out: Path, control: PrecisionController | None) -> None:
    """After a roll-back: ``out/switches.csv`` is the restored controller's switches (those of the undone
    steps dropped), the file replaced whole."""
    if control is None or not (out / "switches.csv").exists():
        return
    tmp = out / "switches.csv.tmp"
    with tmp.open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=SWITCH_FIELDS)
        w.writeheader()
        w.writerows(asdict(s) for s in control.switches)
    os.replace(tmp, out / "switches.csv")


def should_roll_back(run, row: dict[str, Any], ckpt_dir: Path | None) -> bool:
    return (run.cfg.on_spike == "rollback" and row["spike"] and ckpt_dir is not None
            and run.rollbacks < MAX_ROLLBACKS and latest_checkpoint(ckpt_dir) is not None)


def roll_back(run, step: int, ckpt_dir: Path) -> None:
    """Back to the newest checkpoint, the data moved past steps ``k+1..step`` (see [Note: rolling back a spike])."""
    from lowprec.train.run_state import restore  # run_state imports this module's users

    restore(run, ckpt_dir)
    run.data_offset += step - run.history[-1]["step"]
    run.rollbacks += 1
