"""``lowprec inspect RUN_DIR``: the HTML report of a run's telemetry (see ``lowprec.telemetry.report``)."""
from __future__ import annotations

from pathlib import Path

import click

from lowprec import recipes
from lowprec._checks import fail
from lowprec._files import check_writable
from lowprec.cli.app import main
from lowprec.policy_file import CONVERT_SMALL
from lowprec.telemetry.records import FILENAME, read_records
from lowprec.telemetry.trouble import TROUBLE_THRESHOLD, LayerTrouble

REPORT = "inspect.html"
LISTED = 10
"""Flagged layers named on the console (the report lists them all)."""


@main.command("inspect")
@click.argument("run_dir")
@click.option("--out", default=None, help=f"The HTML file to write. Default: RUN_DIR/{REPORT}.")
def inspect_cmd(run_dir: str, out: str | None) -> None:
    """Heatmaps of a run's telemetry (worst SQNR, underflow, saturation per layer and sampled step), its
    layers ranked by trouble, and a suggested policy file keeping the flagged ones in high precision.
    A layer is flagged when a figure crosses its format's floor (docs/telemetry.md); each flag is shown
    beside its floor."""
    from lowprec.telemetry.report import write_report  # matplotlib: only this command pays for it

    directory = Path(run_dir)
    if out is not None:
        check_writable("--out", out, directory=False)
    if not directory.is_dir():
        fail("RUN_DIR", "a run directory of lowprec train", f"{run_dir!r} (not a directory)")
    path = Path(out) if out is not None else directory / REPORT
    if out is None:  # the report goes into the run directory (--out writes it elsewhere)
        check_writable("RUN_DIR", path, directory=False)
    if not (directory / FILENAME).is_file() and (directory / "log.csv").is_file():
        click.echo(f"{run_dir}: no {FILENAME}, nothing to inspect: {_why_no_telemetry(directory)}")
        return
    records = read_records(directory / FILENAME, "RUN_DIR")
    if not records:
        fail("RUN_DIR", f"a {FILENAME} holding sampled steps", f"an empty {FILENAME} in {run_dir!r}")
    policy_path, ranked = write_report(records, path, f"lowprec inspect: {directory.name}")
    flagged = [t for t in ranked if t.score >= TROUBLE_THRESHOLD]
    click.echo(f"{path}: {len(ranked)} layers, {len(flagged)} flagged")
    for t in flagged[:LISTED]:
        click.echo(f"  {_flag_line(t)}")
    if len(flagged) > LISTED:
        click.echo(f"  ... and {len(flagged) - LISTED} more (see the report)")
    if not flagged and ranked:
        click.echo(f"  closest to a flag: {_flag_line(ranked[0])}")
    click.echo(f"suggested policy: {policy_path}")


def _flag_line(t: LayerTrouble) -> str:
    """A layer's worst record and the figure that scored it, beside its floor."""
    return f"{t.layer}: {t.worst}: {t.flag}"


def _why_no_telemetry(directory: Path) -> str:
    """Why a run directory (it has a log.csv) holds no telemetry, read from its newest checkpoint's
    settings and its log; with the option that changes it."""
    from lowprec.train.logs import read_log
    from lowprec.train.run_state import saved_train_config

    rows = read_log(directory / "log.csv")
    last = int(rows[-1]["step"]) if rows else 0
    cfg = saved_train_config(directory / "checkpoints")
    if cfg is None:
        return ("the run sampled no operand, and it left no checkpoint to say why (telemetry off, no sampled "
                "step, or no layer converted)")
    every = cfg.get("telemetry_every", 0)
    if every == 0:
        return "the run had telemetry off (--telemetry-every 0); train with --telemetry-every N to sample every N steps"
    if last < every:
        return (f"the run ended at step {last}, before its first sampled step ({every}: --telemetry-every "
                f"{every}); a smaller --telemetry-every samples it")
    name = cfg.get("recipe")
    if isinstance(name, str) and name in recipes.names() and not recipes.get(name).low_precision:
        return f"recipe {name} casts nothing to low precision, so there is nothing to sample"
    return (f"no layer of the run was converted to {name} (every linear ran in high precision: the conversion "
            "line train printed says why), so there was nothing to sample; a policy file holding "
            f"{CONVERT_SMALL} (train --policy FILE) converts layers kept as too small to gain")
