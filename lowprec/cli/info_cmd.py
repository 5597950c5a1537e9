"""``lowprec info``: this machine's devices, what each runs natively, the path each recipe's GEMMs
take on each device, and library versions.

"Native" and "emulated" are the kernels' own words (``lowprec.kernels.native``), the ones the
planner times GEMMs by. The output is a list of :class:`Section`; :func:`info_sections` builds it,
so adding a section is one more call there.
"""
from __future__ import annotations

import json
from dataclasses import dataclass

import click
import torch

from lowprec import recipes as R
from lowprec._table import format_table
from lowprec.cli.app import main
from lowprec.kernels.capability import Capability, capability
from lowprec.plan.devices import library_versions, local_devices
from lowprec.plan.gemm_paths import gemm_paths, path_word


@dataclass(frozen=True, slots=True)
class Section:
    title: str
    headers: tuple[str, ...]
    rows: tuple[tuple, ...]
    """Cells: strings or numbers (JSON keeps them as they are; the table formats them)."""


def devices_section() -> Section:
    rows = []
    for d in local_devices():
        native = ", ".join(d.native) or "none: every format emulated"
        memory = round(d.memory_gb, 1) if d.memory_gb is not None else None
        rows.append((d.device, d.name, d.capability, memory, native))
    return Section("devices", ("device", "name", "capability", "memory GB", "native"), tuple(rows))


def recipe_rows(device: str, cap: Capability) -> list[tuple[str, ...]]:
    """One row per preset recipe: how its fprop, dgrad and wgrad run on ``cap``'s device."""
    return [(device, name, *(path_word(p) for p in gemm_paths(R.get(name), cap))) for name in R.names()]


def recipe_paths_section() -> Section:
    """Per recipe and device: the path each GEMM takes (native tensor cores; emulated = exact quantized
    values through a high-precision GEMM; hp = no low-precision operands)."""
    devices = ["cpu"] + [f"cuda:{i}" for i in range(torch.cuda.device_count())]
    rows = [row for dev in devices for row in recipe_rows(dev, capability(dev))]
    return Section("recipe paths", ("device", "recipe", *R.GEMMS), tuple(rows))


def versions_section() -> Section:
    return Section("libraries", ("library", "version"), tuple(library_versions()))


def info_sections() -> list[Section]:
    return [devices_section(), recipe_paths_section(), versions_section()]


@main.command("info")
@click.option("--json", "as_json", is_flag=True, help="Print JSON instead of tables.")
def info_cmd(as_json: bool) -> None:
    """This machine's devices, what each runs natively, each recipe's GEMM paths, library versions."""
    sections = info_sections()
    if as_json:
        data = {s.title: [dict(zip(s.headers, r)) for r in s.rows] for s in sections}
        click.echo(json.dumps(data, indent=2))
        return
    table = lambda s: format_table(s.headers, [["?" if v is None else v for v in r] for r in s.rows])  # noqa: E731
    click.echo("\n\n".join(f"{s.title}\n{table(s)}" for s in sections))
