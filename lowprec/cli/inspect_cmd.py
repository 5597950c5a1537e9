"""``lowprec inspect RUN_DIR``: the HTML report of a run's telemetry (see ``lowprec.telemetry.report``)."""
from __future__ import annotations

from pathlib import Path

import click

from lowprec._checks import fail
from lowprec.cli.app import main
from lowprec.telemetry.records import FILENAME, read_records
from lowprec.telemetry.trouble import TROUBLE_THRESHOLD

REPORT = "inspect.html"


@main.command("inspect")
@click.argument("run_dir")
@click.option("--out", default=None, help=f"The HTML file to write. Default: RUN_DIR/{REPORT}.")
def inspect_cmd(run_dir: str, out: str | None) -> None:
    """Heatmaps of a run's telemetry (worst SQNR, underflow, saturation per layer and sampled step), its
    layers ranked by trouble, and a suggested policy file keeping the troubled ones in high precision."""
    from lowprec.telemetry.report import write_report  # matplotlib: only this command pays for it

    directory = Path(run_dir)
    if not directory.is_dir():
        fail("RUN_DIR", "a run directory of lowprec train", f"{run_dir!r} (not a directory)")
    records = read_records(directory / FILENAME, "RUN_DIR")
    if not records:
        fail("RUN_DIR", f"a {FILENAME} holding sampled steps", f"an empty {FILENAME} in {run_dir!r}")
    path = Path(out) if out is not None else directory / REPORT
    policy_path, ranked = write_report(records, path, f"lowprec inspect: {directory.name}")
    troubled = [t for t in ranked if t.score >= TROUBLE_THRESHOLD]
    click.echo(f"{path}: {len(ranked)} layers, {len(troubled)} in trouble"
               + (f" (worst: {ranked[0].layer}, {ranked[0].worst})" if troubled else ""))
    click.echo(f"suggested policy: {policy_path}")
