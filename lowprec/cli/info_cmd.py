"""``lowprec info``: this machine's devices, the formats each runs natively, the path each recipe's
GEMMs take on each device, and library versions.

The output is a list of :class:`Section`; :func:`info_sections` builds it, so adding a section is
one more call there.
"""
from __future__ import annotations

import json
from dataclasses import dataclass

import click
import torch

from lowprec._table import format_table
from lowprec.cli.app import main
from lowprec.plan.devices import library_versions, local_devices


@dataclass(frozen=True, slots=True)
class Section:
    title: str
    headers: tuple[str, ...]
    rows: tuple[tuple, ...]
    """Cells: strings or numbers (JSON keeps them as they are; the table formats them)."""


def devices_section() -> Section:
    rows = []
    for d in local_devices():
        if d.native is None:
            native = "unknown (not in the accelerator table)"
        else:
            native = " ".join(d.native) or "none: every format emulated"
        memory = round(d.memory_gb, 1) if d.memory_gb is not None else None
        rows.append((d.device, d.name, d.capability, memory, native))
    return Section("devices", ("device", "name", "capability", "memory GB", "native formats"), tuple(rows))


def versions_section() -> Section:
    return Section("libraries", ("library", "version"), tuple(library_versions()))


def recipe_paths_section() -> Section:
    """Per recipe and device: the path each GEMM takes (cublas = native tensor cores, emulated =
    exact quantized values through a high-precision GEMM, hp = no low-precision operands)."""
    from lowprec import recipes as R
    from lowprec.convert import recipe_paths

    devices = ["cpu"] + [f"cuda:{i}" for i in range(torch.cuda.device_count())]
    rows = []
    for dev in devices:
        for name in R.names():
            p = recipe_paths(R.get(name), dev)
            rows.append((dev, name, p["fprop"], p["dgrad"], p["wgrad"]))
    return Section("recipe paths", ("device", "recipe", "fprop", "dgrad", "wgrad"), tuple(rows))


def info_sections() -> list[Section]:
    return [devices_section(), recipe_paths_section(), versions_section()]


@main.command("info")
@click.option("--json", "as_json", is_flag=True, help="Print JSON instead of tables.")
def info_cmd(as_json: bool) -> None:
    """This machine's devices, their native formats, and library versions."""
    sections = info_sections()
    if as_json:
        data = {s.title: [dict(zip(s.headers, r)) for r in s.rows] for s in sections}
        click.echo(json.dumps(data, indent=2))
        return
    table = lambda s: format_table(s.headers, [["?" if v is None else v for v in r] for r in s.rows])  # noqa: E731
    click.echo("\n\n".join(f"{s.title}\n{table(s)}" for s in sections))
