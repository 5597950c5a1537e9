"""``lowprec compare``: train one model in several recipes from one start, report each against BF16."""
from __future__ import annotations

import json
import statistics
import sys
from typing import Any

import click
from tqdm import tqdm

from lowprec.cli.app import main
from lowprec.cli.train_cmd import Defaults, config_from_options, launched, training_options
from lowprec.distributed.launch import Ranks
from lowprec.train.compare import Progress, compare, compare_runs, parse_recipes
from lowprec.train.data import load_data
from lowprec.train.lock import run_directory_lock
from lowprec.train.models import check_model_spec
from lowprec.train.report import overall
from lowprec.train.result import RunResult

DEFAULT_RECIPES = "bf16,fp8-current,mxfp8,mxfp4,nvfp4"
COMPARE_DEFAULTS = Defaults(steps=120, batch_size=4, seq_len=64, val_batches=8)
"""The default recipes on the tiny model finish in about four minutes on two CPU cores (emulated GEMMs)."""


class ProgressLines:
    """A line on stderr every tenth of a recipe's steps: which recipe of how many, the steps done over all
    recipes, the loss and the recipe's median tokens/s so far (written through tqdm, so a progress
    bar on a terminal is redrawn below it)."""

    def __init__(self, n_recipes: int, steps: int) -> None:
        self.n_recipes, self.every = n_recipes, max(1, steps // 10)
        self.index, self.rates = 0, []

    def prefix(self, recipe: str) -> str:
        return f"[{self.index + 1}/{self.n_recipes}] {recipe}"

    def step(self, p: Progress) -> None:
        if p.index != self.index:
            self.index, self.rates = p.index, []
        self.rates.append(p.row["tokens_per_s"])
        step = p.row["step"]
        if step % self.every and step != p.steps:
            return
        loss = p.row["loss"]
        tqdm.write(f"{self.prefix(p.recipe)} step {step}/{p.steps} ({p.done / p.total:.0%} of the comparison): "
                   f"loss {loss:.4f}, {statistics.median(self.rates):,.0f} tokens/s", file=sys.stderr)


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
    # the whole of --out is this comparison's (each recipe's run locks its own runs/<recipe> too)
    with launched(opts, "compare") as (device, main), run_directory_lock(out, Ranks.of(opts["parallel"])):
        cfg = config_from_options(names[0], opts, device=device)
        data = load_data(opts["data"], token_dtype=opts["token_dtype"], vocab_size=opts["vocab_size"])
        chatty = main and not opts["quiet"] and not opts["as_json"]
        watch = ProgressLines(len(compare_runs(names, cfg)), cfg.steps)

        def finished(r: RunResult) -> None:
            if chatty:
                click.echo(f"{watch.prefix(r.recipe)}: val loss {r.final_val_loss:.4f}, "
                           f"{r.tokens_per_s:,.0f} tokens/s", err=True)

        if chatty:
            click.echo(f"{opts['model']} model, {cfg.steps} steps per recipe on {cfg.device} ({cfg.dtype}"
                       f"{', ' + cfg.parallel if cfg.parallel != 'none' else ''}): "
                       + ", ".join(label for label, _ in compare_runs(names, cfg))
                       + f"; data: {data.source}", err=True)
        report = compare(opts["model"], names, cfg, data, out_dir=out, on_result=finished,
                         on_step=watch.step if chatty else None)
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
