"""``lowprec formats``: the table of element formats."""
from __future__ import annotations

import json

import click

from lowprec import formats as F
from lowprec._table import format_table
from lowprec.cli.app import main


def _row(f: F.Format) -> dict:
    return {
        "format": f.name, "bits": f.bits, "exp": f.exp_bits, "man": f.man_bits, "bias": f.bias,
        "max": f.max, "min_normal": f.min_normal, "min_subnormal": f.min_subnormal,
        "binades": round(f.binades, 2), "inf": f.has_inf, "nan": f.has_nan, "about": f.doc,
    }


@main.command("formats")
@click.option("--json", "as_json", is_flag=True, help="Print JSON instead of a table.")
def formats_cmd(as_json: bool) -> None:
    """The element formats: bits, bias, range, inf/NaN."""
    rows = [_row(f) for f in F.FORMATS.values()]
    if as_json:
        click.echo(json.dumps(rows, indent=2))
        return
    headers = list(rows[0])
    click.echo(format_table(headers, [[r[h] if not isinstance(r[h], bool) else ("yes" if r[h] else "no")
                                      for h in headers] for r in rows]))
