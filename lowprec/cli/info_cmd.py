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
from lowprec.kernels import grouped_gemm as GG
from lowprec.kernels.capability import Capability, capability
from lowprec.kernels.gemm import check_paths, first_use_check
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


_STATES = {None: "unchecked", True: "checked on this device", False: "failed its check"}


def _word(recipe: R.Recipe, gemm: str, p, device: str, cap: Capability) -> str:
    """:func:`path_word`, on a GPU with the outcome of the first-use check its path takes there, if any (see
    [Note: GEMM paths that check themselves]: folded MX GEMMs, Blackwell's block-scaled ones)."""
    word = path_word(p)
    g: R.Gemm = getattr(recipe, gemm)
    check = first_use_check(g.lhs.fmt, g.lhs.granularity, g.rhs.fmt, g.rhs.granularity, cap) if g.low_precision \
        else None
    if check is None or device == "cpu":
        return word
    state = _STATES[check.state(torch.device(device))]
    return word[:-1] + f", {state})" if word.endswith(")") else f"{word} ({state})"


def recipe_rows(device: str, cap: Capability) -> list[tuple[str, ...]]:
    """One row per preset recipe: how its fprop, dgrad and wgrad run on ``cap``'s device."""
    rows = []
    for name in R.names():
        recipe = R.get(name)
        words = (_word(recipe, g, p, device, cap) for g, p in zip(R.GEMMS, gemm_paths(recipe, cap)))
        rows.append((device, name, *words))
    return rows


def gpus() -> list[str]:
    return [f"cuda:{i}" for i in range(torch.cuda.device_count())]


def recipe_paths_section() -> Section:
    """Per recipe and device: the path each GEMM takes (native tensor cores; folded = MX operands on FP8
    tensor cores; emulated = exact quantized values through a high-precision GEMM; hp = no low-precision
    operands), with a self-checking path's outcome on a GPU."""
    devices = ["cpu", *gpus()]
    rows = [row for dev in devices for row in recipe_rows(dev, capability(dev))]
    return Section("recipe paths", ("device", "recipe", *R.GEMMS), tuple(rows))


def expert_gemms_section() -> Section:
    """Per GPU: the grouped FP8 GEMMs a ``GroupedLinear``'s experts run as one launch (PyTorch's for E4M3
    pairs, lowprec's Triton ones for E5M2 gradients and for block scales), each kind with its first-use check's
    outcome; a device with none runs the experts' GEMMs one per expert (see [Note: one grouped GEMM for the
    experts])."""
    rows = []
    for dev in ["cpu", *gpus()]:
        states = GG.kernel_states(dev)
        if not states:
            rows.append((dev, "none: one GEMM per expert", "-", "-", "-"))
        rows += [(dev, name, pair, kind, _STATES[state]) for name, pair, kind, state in states]
    return Section("expert GEMMs", ("device", "grouped kernel", "operands", "kind", "state"), tuple(rows))


def _nvfp4_lines_runs(dev: str) -> bool:
    return dev != "cpu" and capability(torch.device(dev)).triton


def expert_casts_section() -> Section:
    """Per device: how a ``GroupedLinear``'s NVFP4 casts run (every expert under its own global scale): one
    Triton pass on a GPU that runs Triton, with its first-use check's outcome (failed: the reference's
    operations), else the reference's operations."""
    rows = []
    for dev in ["cpu", *gpus()]:
        if not _nvfp4_lines_runs(dev):
            rows.append((dev, "NVFP4", "reference operations", "-"))
            continue
        from lowprec.kernels import triton_quant  # Triton: imported where it runs

        rows.append((dev, "NVFP4", "lowprec Triton, a global scale per expert",
                     _STATES[triton_quant.lines_state(torch.device(dev))]))
    return Section("expert casts", ("device", "format", "kernel", "state"), tuple(rows))


def versions_section() -> Section:
    return Section("libraries", ("library", "version"), tuple(library_versions()))


def info_sections() -> list[Section]:
    return [devices_section(), recipe_paths_section(), expert_gemms_section(), expert_casts_section(),
            versions_section()]


@main.command("info")
@click.option("--json", "as_json", is_flag=True, help="Print JSON instead of tables.")
@click.option("--check", is_flag=True, help="Run the first-use checks of the GEMM paths that check themselves "
                                           "(folded MX, Blackwell's block-scaled, the experts' grouped GEMMs, the "
                                           "experts' NVFP4 casts) on this machine's GPUs first.")
def info_cmd(as_json: bool, check: bool) -> None:
    """This machine's devices, what each runs natively, each recipe's GEMM paths, library versions."""
    if check:
        for dev in gpus():
            check_paths(dev)
            GG.check_kernels(dev)
            if _nvfp4_lines_runs(dev):
                from lowprec.kernels import triton_quant  # Triton: imported where it runs

                triton_quant.nvfp4_lines_checked(torch.device(dev))
    sections = info_sections()
    if as_json:
        data = {s.title: [dict(zip(s.headers, r)) for r in s.rows] for s in sections}
        click.echo(json.dumps(data, indent=2))
        return
    table = lambda s: format_table(s.headers, [["?" if v is None else v for v in r] for r in s.rows])  # noqa: E731
    click.echo("\n\n".join(f"{s.title}\n{table(s)}" for s in sections))
