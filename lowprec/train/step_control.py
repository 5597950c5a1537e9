"""What the training loop does around each step for precision control and loss spikes: the
controller's schedule before the step, its decision after it, the ``switches.csv`` log, and the
roll-back to the last checkpoint that ``on_spike="rollback"`` asks for.

[Note: rolling back a spike]
With ``on_spike="rollback"`` a step whose loss is a spike is not taken (the optimizer skips it, as
for ``skip``); then the run goes back to its newest checkpoint (model, optimizer, generators,
controller, history) and goes on from the step after it with the data moved past the spike's batch
for good: the batch of step ``s`` is drawn at position ``s + data_offset``, and a roll-back from
step ``s`` to checkpoint ``k`` sets the offset to the one in force at the spike plus ``s - k``, so
step ``k + 1`` draws the batch after the spike's. The offset only grows, so no position is drawn
twice however many roll-backs return to the same checkpoint (the batches of the undone steps
``k+1..s-1`` are passed over with the spike's). The offset is saved in every checkpoint, so a
resumed run draws the same batches. The schedule still follows the step. A roll-back needs
checkpoints: ``TrainConfig`` refuses ``rollback`` with ``save_every`` 0, and :func:`train` without
an output directory or with ``checkpoints=False``. At most :data:`MAX_ROLLBACKS` roll-backs per
process; the last says so, and later spikes are skipped, as is a spike before the first checkpoint.
Each roll-back, skipped step and precision switch is one line on the console (rank 0).
"""
from __future__ import annotations

import csv
import os
import sys
from dataclasses import asdict
from pathlib import Path
from typing import Any

from tqdm import tqdm

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


def say(run, line: str) -> None:
    """``line`` on the console from rank 0 (above the progress bar, which tqdm redraws under it)."""
    if run.ranks.is_main:
        tqdm.write(line, file=sys.stderr)


def say_switches(run, step: int, switches: list[Switch]) -> None:
    """One line for the precision switches of ``step``, grouped by what changed to what, and why."""
    groups: dict[tuple[str, str, str], list[Switch]] = {}
    for s in switches:
        groups.setdefault((s.from_recipe, s.to_recipe, s.reason), []).append(s)
    parts = []
    for (before, after, reason), same in groups.items():
        if len(same) == 1:
            what = same[0].layer if same[0].gemm == "all" else f"{same[0].layer} {same[0].gemm}"
        else:
            what = f"{len(same)} layers" if all(s.gemm == "all" for s in same) else f"{len(same)} GEMMs"
        parts.append(f"{what} {before} -> {after} ({reason})")
    if parts:
        say(run, f"step {step}: precision switch: " + "; ".join(parts))


def say_skip(run, row: dict[str, Any], reason: str | None) -> None:
    """One line for a step the optimizer did not take; a spike that could not roll back says why."""
    if not row["skipped"]:
        return
    why = reason or "skipped"
    if row["spike"] and run.cfg.on_spike == "rollback" and run.rollbacks < MAX_ROLLBACKS:
        why += ", no checkpoint yet to roll back to"
    say(run, f"step {row['step']}: skipped ({why})")


def should_roll_back(run, row: dict[str, Any], ckpt_dir: Path | None) -> bool:
    return (run.cfg.on_spike == "rollback" and row["spike"] and ckpt_dir is not None
            and run.rollbacks < MAX_ROLLBACKS and latest_checkpoint(ckpt_dir) is not None)


def roll_back(run, step: int, ckpt_dir: Path) -> None:
    """Back to the newest checkpoint, the data moved past the spike's batch for good (see [Note: rolling
    back a spike]); said on the console, the last allowed roll-back with the limit."""
    from lowprec.train.run_state import restore  # run_state imports this module's users

    at_spike = run.data_offset  # the checkpoint's offset may be older: roll-backs since it moved it on
    restore(run, ckpt_dir)
    back_to = run.history[-1]["step"]
    run.data_offset = at_spike + step - back_to
    run.rollbacks += 1
    line = (f"step {step}: loss spike: rolled back to the checkpoint of step {back_to}, the data moved past "
            f"this step's batch (roll-back {run.rollbacks} of {MAX_ROLLBACKS})")
    if run.rollbacks == MAX_ROLLBACKS:
        line += "; rollback limit reached; further spikes are skipped"
    say(run, line)
