"""``lowprec check``: validate a recipe on a model, forward only, before training it."""
from __future__ import annotations

import json
from typing import Any

import click
import torch

from lowprec import recipes
from lowprec._checks import check_positive_int
from lowprec._files import check_writable
from lowprec.cli.app import check_device, main
from lowprec.policy_file import load_policy, policy_to_dict, save_policy
from lowprec.telemetry.check import DEFAULT_FLOOR_DB, check
from lowprec.train.config import default_device
from lowprec.train.data import load_data
from lowprec.train.models import load_model


@main.command("check")
@click.option("--model", default="tiny", show_default=True,
              help="A preset (tiny, small, 125m, 350m, 1b, moe-tiny, moe-1b) or a Hugging Face config file or "
                   "directory.")
@click.option("--recipe", required=True, help="One of: " + ", ".join(recipes.names()) + ".")
@click.option("--data", default=None,
              help="A text file or directory, or a .npy/.bin token file. Default: the embedded corpus.")
@click.option("--token-dtype", default="uint16", show_default=True, help="Element type of a .bin token file.")
@click.option("--vocab-size", type=int, default=None, help="The model's vocabulary (default: from the data).")
@click.option("--batches", type=int, default=4, show_default=True, help="Validation batches to run.")
@click.option("--batch-size", type=int, default=8, show_default=True)
@click.option("--seq-len", type=int, default=128, show_default=True)
@click.option("--floor", "floor_db", type=float, default=DEFAULT_FLOOR_DB, show_default=True,
              help="Flag layers whose output SQNR against BF16 is under this many dB.")
@click.option("--policy", "policy_file", default=None, help="Check under this policy file (default policy if not).")
@click.option("--write-policy", default=None,
              help="Write the suggested policy (flagged layers excluded) to this file, for train/compare --policy.")
@click.option("--seed", type=int, default=0, show_default=True, help="Initialisation of a preset model.")
@click.option("--device", default=None, help="Default: cuda if available, else cpu.")
@click.option("--json", "as_json", is_flag=True, help="Print the result as JSON.")
def check_cmd(model: str, recipe: str, data: str | None, token_dtype: str, vocab_size: int | None, batches: int,
              batch_size: int, seq_len: int, floor_db: float, policy_file: str | None, write_policy: str | None,
              seed: int, device: str | None, as_json: bool) -> None:
    """Per-layer output SQNR of RECIPE against BF16 on a few batches, forward only: layers under --floor
    are flagged and a policy keeping them in high precision is suggested."""
    recipes.get(recipe)
    check_device(device)
    for name, value in (("--batches", batches), ("--batch-size", batch_size), ("--seq-len", seq_len)):
        check_positive_int(name, value)
    if write_policy is not None:  # before the model is built and checked, not after
        check_writable("--write-policy", write_policy, directory=False)
    policy = load_policy(policy_file) if policy_file is not None else None
    tokens = load_data(data, token_dtype=token_dtype, vocab_size=vocab_size)
    net, _ = load_model(model, vocab_size=tokens.vocab_size, seed=seed)
    dev = torch.device(device or default_device())
    net.to(dev)
    val = [(x.to(dev), y.to(dev)) for x, y in tokens.val_batches(batches, batch_size, seq_len)]
    report = check(net, recipe, val, policy=policy, floor_db=floor_db)
    suggested = policy_to_dict(report.policy)
    if write_policy is not None:
        save_policy(report.policy, write_policy)
    if as_json:
        click.echo(json.dumps(_as_dict(report, suggested), indent=1))
        return
    click.echo(str(report.to_table()) + "\n")
    click.echo(report.summary())
    click.echo("suggested policy: " + json.dumps(suggested))
    if write_policy is not None:
        click.echo(f"written to {write_policy} (lowprec train --policy {write_policy})")


def _finite(x: float) -> float | None:
    return x if x == x and abs(x) != float("inf") else None


def _as_dict(report, suggested: dict[str, Any]) -> dict[str, Any]:
    return {"recipe": report.recipe, "floor_db": report.floor_db, "batches": report.batches,
            "logits_sqnr_db": _finite(report.logits_sqnr_db), "loss_bf16": report.loss_bf16,
            "loss_recipe": report.loss_recipe, "flagged": report.flagged,
            "coverage": report.coverage.to_dict() if report.coverage is not None else None,
            "layers": [{"name": lc.name, "shape": lc.shape, "sqnr_db": _finite(lc.sqnr_db), "flagged": lc.flagged}
                       for lc in report.layers],
            "suggested_policy": suggested}
