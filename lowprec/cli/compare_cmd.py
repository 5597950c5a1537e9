"""``lowprec compare``: train one model in several recipes from one start, report each against BF16."""
from __future__ import annotations

import json
import statistics
import sys
from typing import Any

import click
from tqdm import tqdm

from lowprec._files import check_writable
from lowprec.cli.app import main
from lowprec.cli.train_cmd import Defaults, config_from_options, launched, training_options
from lowprec.distributed.launch import Ranks
from lowprec.train.compare import Progress, check_seeds, compare, compare_plan, parse_recipes
from lowprec.train.data import load_data, repetition_warning
from lowprec.train.lock import run_directory_lock
from lowprec.train.models import check_model_spec
from lowprec.train.report import overall
from lowprec.train.result import RunResult

DEFAULT_RECIPES = "bf16,fp8-current,mxfp8,mxfp4,nvfp4"
COMPARE_DEFAULTS = Defaults(steps=100, batch_size=4, seq_len=64, val_batches=8)
"""Seven runs (bf16 over three seeds, four recipes over one) of the tiny model: under five minutes on two
CPU cores, four of the five recipes emulated."""
DEFAULT_SEEDS, DEFAULT_RECIPE_SEEDS = 3, 1
"""The baseline's seeds give the noise; one seed per other recipe keeps the default comparison short."""


class ProgressLines:
    """A line on stderr every tenth of a run's steps: which run of how many (its recipe, and its seed when
    there are several), the steps done over all runs, the loss and the run's median tokens/s so far
    (written through tqdm, so a progress bar on a terminal is redrawn below it)."""

    def __init__(self, n_runs: int, steps: int, seeds: int = 1) -> None:
        self.n_runs, self.every, self.seeds = n_runs, max(1, steps // 10), seeds
        self.index, self.seed, self.rates = 0, 0, []

    def prefix(self, recipe: str) -> str:
        seed = f" seed {self.seed}" if self.seeds > 1 else ""
        return f"[{self.index + 1}/{self.n_runs}] {recipe}{seed}"

    def step(self, p: Progress) -> None:
        if p.index != self.index:
            self.index, self.rates = p.index, []
        self.seed = p.seed
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
              help="Exit with status 2 when a verdict is at least this bad (warn: also NOT TESTED).")
@click.option("--seeds", type=int, default=DEFAULT_SEEDS, show_default=True,
              help="Seeds the baseline trains with (--seed and the next ones): their spread is the noise "
                   "each gap is judged beside.")
@click.option("--recipe-seeds", type=int, default=DEFAULT_RECIPE_SEEDS, show_default=True,
              help="Seeds every other recipe trains with: the first of the baseline's (at most --seeds).")
@training_options(COMPARE_DEFAULTS)
def compare_cmd(recipe_list: str, out: str, fail_on: str, seeds: int, recipe_seeds: int, **opts: Any) -> None:
    """Every recipe on identical data and initialisation; loss curves and a noise-aware verdict per recipe
    against BF16."""
    check_seeds(seeds, recipe_seeds)
    names = parse_recipes(recipe_list)  # unknown recipes and models are refused before anything is built
    check_model_spec(opts["model"])
    check_writable("--out", out, directory=True)  # before five recipes train, not at the report's first write
    # the whole of --out is this comparison's (each recipe's run locks its own runs/<recipe> too)
    with launched(opts, "compare") as (device, main), run_directory_lock(out, Ranks.of(opts["parallel"])):
        cfg = config_from_options(names[0], opts, device=device)
        data = load_data(opts["data"], token_dtype=opts["token_dtype"], vocab_size=opts["vocab_size"],
                         tokenizer=opts["tokenizer"], text_field=opts["text_field"])
        chatty = main and not opts["quiet"] and not opts["as_json"]
        plan, _ = compare_plan(names, cfg, seeds, recipe_seeds)
        n_runs = plan.n_runs
        watch = ProgressLines(n_runs, cfg.steps, seeds)

        def finished(r: RunResult) -> None:
            if chatty:
                click.echo(f"{watch.prefix(r.recipe)}: val loss {r.final_val_loss:.4f}, "
                           f"{r.tokens_per_s:,.0f} tokens/s", err=True)

        if chatty:
            runs = f"{seeds} seeds of {names[0]}, {recipe_seeds} of each other recipe" if seeds > 1 else ""
            click.echo(f"{opts['model']} model, {cfg.steps} steps per run on {cfg.device} ({cfg.dtype}"
                       f"{', ' + cfg.parallel if cfg.parallel != 'none' else ''}): " + ", ".join(plan.entries)
                       + (f" ({runs}: {n_runs} runs)" if runs else "") + f"; data: {data.source}", err=True)
        repeats = repetition_warning(data, cfg.steps, cfg.batch_size, cfg.seq_len, cfg.grad_accum)
        if main and repeats:
            click.echo(repeats, err=True)
        report = compare(opts["model"], names, cfg, data, seeds=seeds, recipe_seeds=recipe_seeds, out_dir=out,
                         on_result=finished, on_step=watch.step if chatty else None)
    # every rank holds the same report (its losses are reduced across the ranks), so every rank gates alike
    worst = overall(report.rows())
    gate = (fail_on == "warn" and worst != "PASS") or (fail_on == "fail" and worst == "FAIL")
    if main and opts["as_json"]:
        click.echo(json.dumps(report.to_json(), indent=1))
    elif main:
        click.echo(report.table())
        plain = [line.replace("`", "").replace("*", "") for line in report.legend()]
        click.echo("\n" + "\n".join([*plain, "", report.band_line().replace("`", ""), *report.reasons()]))
        click.echo(f"\nreport: {out}/report.html (also report.md, report.json, loss_curves.png)")
    if gate:
        raise SystemExit(2)
