"""``lowprec compare``: train one model in several recipes from one start, report each against BF16."""
from __future__ import annotations

import json
from typing import Any

import click

from lowprec.cli.app import main
from lowprec.cli.train_cmd import Defaults, config_from_options, launched, training_options
from lowprec.train.compare import compare, parse_recipes
from lowprec.train.data import load_data
from lowprec.train.models import check_model_spec
from lowprec.train.report import overall
from lowprec.train.result import RunResult

DEFAULT_RECIPES = "bf16,fp8-current,mxfp8,mxfp4,nvfp4"
COMPARE_DEFAULTS = Defaults(steps=120, batch_size=4, seq_len=64, val_batches=8)
"""The default recipes on the tiny model finish in about four minutes on two CPU cores (emulated GEMMs)."""


@main.command("compare")
@click.option("--recipes", "recipe_list", default=DEFAULT_RECIPES, show_default=True,
              help="Comma-separated recipes; bf16 (the baseline) is added if missing.")
@click.option("--out", default="runs/compare", show_default=True,
              help="Directory for report.md, report.html, report.json, loss_curves.png and per-recipe logs.")
@click.option("--fail-on", type=click.Choice(["never", "warn", "fail"]), default="never", show_default=True,
              help="Exit with status 2 when a verdict is at least this bad.")
@training_options(COMPARE_DEFAULTS)
def compare_cmd(recipe_list: str, out: str, fail_on: str, **opts: Any) -> None:
    """Every recipe on identical data and initialisation; loss curves and a verdict per recipe against BF16."""
    names = parse_recipes(recipe_list)  # unknown recipes and models are refused before anything is built
    check_model_spec(opts["model"])
    with launched(opts, "compare") as (device, main):
        cfg = config_from_options(names[0], opts, device=device)
        data = load_data(opts["data"], token_dtype=opts["token_dtype"], vocab_size=opts["vocab_size"])
        chatty = main and not opts["quiet"] and not opts["as_json"]

        def progress(r: RunResult) -> None:
            if chatty:
                click.echo(f"{r.recipe}: val loss {r.final_val_loss:.4f}, {r.tokens_per_s:,.0f} tokens/s", err=True)

        if chatty:
            click.echo(f"{opts['model']} model, {cfg.steps} steps per recipe on {cfg.device} ({cfg.dtype}"
                       f"{', ' + cfg.parallel if cfg.parallel != 'none' else ''}): " + ", ".join(names)
                       + f"; data: {data.source}", err=True)
        report = compare(opts["model"], names, cfg, data, out_dir=out, on_result=progress)
    if not main:
        return
    rows = report.rows()
    if opts["as_json"]:
        click.echo(json.dumps(report.to_json(), indent=1))
    else:
        click.echo(report.table())
        click.echo(f"\nreport: {out}/report.html (also report.md, report.json, loss_curves.png)")
    worst = overall(rows)
    if (fail_on == "warn" and worst != "PASS") or (fail_on == "fail" and worst == "FAIL"):
        raise SystemExit(2)
