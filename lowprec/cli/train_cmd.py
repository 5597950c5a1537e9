"""``lowprec train``: train a model in one recipe, with logs and resumable checkpoints."""
from __future__ import annotations

import contextlib
import json
import math
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import click
import torch

from lowprec import recipes
from lowprec._checks import fail
from lowprec._files import check_writable
from lowprec.cli.app import check_device, main, one_line_warnings
from lowprec.convert import SmallLayersWarning
from lowprec.distributed.grad_comm import GradComm
from lowprec.distributed.launch import Parallel, Ranks, check_launch, process_group
from lowprec.optim.states import StateFormat
from lowprec.policy import unmatched_patterns
from lowprec.policy_file import CONVERT_SMALL, policy_from_dict, read_policy_dict
from lowprec.telemetry.control import ControlConfig
from lowprec.train.config import DTYPES, TrainConfig, default_device, default_dtype
from lowprec.train.data import check_sequence_fits, load_data, repetition_warning
from lowprec.train.loop import train
from lowprec.train.models import load_model
from lowprec.train.recompute import Recompute
from lowprec.train.result import RunResult
from lowprec.train.run_state import saved_train_config


@dataclass(frozen=True, slots=True)
class Defaults:
    """Per-command defaults: ``compare`` trains five recipes, four of them emulated on a CPU, so its
    runs are shorter and its batches smaller than ``train``'s."""

    steps: int
    batch_size: int
    seq_len: int
    val_batches: int
    telemetry_every: int | None = 500
    """None: scaled with ``--steps`` (:func:`default_telemetry_every`). ``compare`` keeps 500, past its runs'
    length, so that five recipes do not each pay for samples nobody asked for."""


TRAIN_DEFAULTS = Defaults(steps=300, batch_size=16, seq_len=128, val_batches=8, telemetry_every=None)
_CONTROL_DEFAULTS = ControlConfig()
TELEMETRY_SAMPLES = 16
"""Telemetry samples a default run records: enough for inspect's per-layer trends."""
TELEMETRY_EVERY_MAX = 500
"""The default interval's ceiling: a sampled step costs about 9 plain ones (the 1B compiled step
on the H200, docs/telemetry.md), so every 500 steps keeps telemetry under 2% of a long run's time."""
FAILED_RUN_STATUS = 3
"""The exit status of a ``train`` that ended but failed: diverged, every step it ran skipped, or a final
validation loss that is not finite."""


def _options(d: Defaults) -> list[Callable]:
    return [
        click.option("--model", default="tiny", show_default=True,
                     help="A preset (tiny, small, 125m, 350m, 1b, moe-tiny, moe-1b) or a Hugging Face config file or "
                          "directory."),
        click.option("--steps", type=int, default=d.steps, show_default=True, help="Optimizer steps."),
        click.option("--data", default=None,
                     help="A text file or directory; a .jsonl, .parquet or .arrow file or directory of one kind; "
                          "hf:PATH of a dataset saved by save_to_disk, or hf:NAME[:CONFIG][:SPLIT] streamed from "
                          "the Hub; or a .npy/.bin token file. Default: the embedded corpus."),
        click.option("--tokenizer", default=None, metavar="NAME_OR_PATH",
                     help="A tokenizer.json, or a directory or model name transformers.AutoTokenizer loads (the "
                          "Hub only when online). Tokens are cached in .lowprec-cache/ beside the data. "
                          "Default: text is bytes (vocabulary 256)."),
        click.option("--text-field", default=None,
                     help="The field (jsonl) or column (parquet, arrow, hf:) holding the text. Default: text."),
        click.option("--token-dtype", default="uint16", show_default=True, help="Element type of a .bin token file."),
        click.option("--vocab-size", type=int, default=None,
                     help="The model's vocabulary; every token id must be below it. Default: 256 for text, the "
                          "--tokenizer's vocabulary rounded up to 32, a token file's largest id + 1 rounded up to 32 "
                          "(at most 262,144)."),
        click.option("--batch-size", type=int, default=d.batch_size, show_default=True),
        click.option("--seq-len", type=int, default=d.seq_len, show_default=True),
        click.option("--grad-accum", type=int, default=1, show_default=True, help="Micro-batches per step."),
        click.option("--lr", type=float, default=2e-3, show_default=True, help="Peak learning rate."),
        click.option("--warmup-steps", type=int, default=None,
                     help="Default: a tenth of --steps (with --resume: the checkpoint's)."),
        click.option("--eval-every", type=int, default=None,
                     help="Default: a sixth of --steps (with --resume: the checkpoint's)."),
        click.option("--val-batches", type=int, default=d.val_batches, show_default=True),
        click.option("--hp-start-steps", type=int, default=0, show_default=True,
                     help="Run the first N steps in BF16 before switching to the recipe (a delayed recipe "
                          "records its amax histories in them)."),
        click.option("--seed", type=int, default=0, show_default=True),
        click.option("--device", default=None, help="Default: cuda if available, else cpu."),
        click.option("--dtype", type=click.Choice(list(DTYPES)), default=None,
                     help="Parameter dtype. Default: bfloat16 on CUDA, float32 on the CPU."),
        click.option("--parallel", type=click.Choice([p.value for p in Parallel]), default="none", show_default=True,
                     help="Under torchrun: ddp (weights replicated) or fsdp2 (weights sharded). --batch-size is "
                          "then the global batch, split across the ranks."),
        click.option("--grad-comm", type=click.Choice([g.value for g in GradComm]), default="fp32",
                     show_default=True, help="Precision of gradient communication under --parallel."),
        click.option("--fp8-all-gather/--no-fp8-all-gather", default=True, show_default=True,
                     help="Under --parallel fsdp2, all-gather the weights of per-tensor FP8 recipes as E4M3 "
                          "(half of BF16's bytes)."),
        click.option("--ep", type=int, default=1, show_default=True,
                     help="Under --parallel ddp|fsdp2: split the routed experts of an MoE model over this many "
                          "ranks (dividing the number of ranks: groups of consecutive ranks, replicas of each other), "
                          "tokens dispatched in FP8 under low-precision recipes."),
        click.option("--tp", type=int, default=1, show_default=True,
                     help="Under --parallel ddp|fsdp2: split every block's attention and feed-forward over groups "
                          "of this many ranks (dividing the number of ranks), the sequence split between them; a "
                          "group's ranks train on the same rows, DDP or FSDP2 runs over the groups."),
        click.option("--optim-states", type=click.Choice([f.value for f in StateFormat]), default="fp32",
                     show_default=True, help="How AdamW stores its moments: fp32, bf16, fp8 (E4M3 per group of "
                     "128, range-expanded) or int8 (blockwise 8 bits). compare also runs each recipe with FP32 "
                     "moments, to show the gap."),
        click.option("--master-weights/--no-master-weights", default=True, show_default=True,
                     help="FP32 master weights for bfloat16/float16 parameters; without, updated weights are "
                          "rounded back stochastically (one process only)."),
        click.option("--policy", "policy_file", default=None,
                     help="A policy JSON file (see lowprec.policy_file; `lowprec check` writes one): which layers "
                          "stay in high precision. Default: the default policy."),
        click.option("--compile", "compiled", is_flag=True,
                     help="torch.compile the model's forward and backward (inductor)."),
        click.option("--cuda-graphs", is_flag=True,
                     help="With --compile: replay the compiled forward and backward as CUDA graphs "
                          "(mode reduce-overhead), for steps whose host work sets the pace, such as FP8 experts. "
                          "One process, a CUDA device, --grad-accum 1."),
        click.option("--telemetry-every", type=int, default=d.telemetry_every,
                     show_default=d.telemetry_every is not None,
                     help="Every N steps, record each converted layer's operand figures (amax, scale, underflow, "
                          "saturation, SQNR) to telemetry.csv for lowprec inspect; 0: off." + (
                              "" if d.telemetry_every is not None else
                              f" Default: --steps / {TELEMETRY_SAMPLES} ({TELEMETRY_SAMPLES} samples a run, enough "
                              f"for inspect; every step under {TELEMETRY_SAMPLES} steps), at most "
                              f"{TELEMETRY_EVERY_MAX} (a sampled step's cost under 2% of a long run's time); with "
                              "--resume, the checkpoint's.")),
        click.option("--auto-precision", is_flag=True,
                     help="Automatic precision control: widen a layer's GEMM (nvfp4/mxfp4 -> mxfp8 -> bf16, "
                          "fp8 -> bf16) when its sampled telemetry crosses a threshold or after repeated loss "
                          "spikes, and back when it settles; each switch goes to switches.csv. Needs "
                          "--telemetry-every > 0."),
        click.option("--auto-sqnr-floor", type=float, default=_CONTROL_DEFAULTS.sqnr_floor_db, show_default=True,
                     metavar="DB", help="With --auto-precision: an operand's SQNR under this is trouble."),
        click.option("--auto-saturation-max", type=float, default=_CONTROL_DEFAULTS.saturation_ceiling,
                     show_default=True, metavar="FRACTION",
                     help="With --auto-precision: a larger fraction of an operand's elements saturated is trouble "
                          "(1 or more: saturation never is)."),
        click.option("--hp-final-fraction", type=float, default=0.0, show_default=True, metavar="F",
                     help="Run the last F of the steps (0 <= F < 1) with every converted layer in BF16."),
        click.option("--on-spike", type=click.Choice(["log", "skip", "rollback"]), default="log", show_default=True,
                     help="A loss spike is logged, skipped (the step not taken), or rolled back to the last "
                          "checkpoint with its data window skipped (train only, with --save-every N > 0)."),
        click.option("--fp8-weights", is_flag=True,
                     help="Store the converted layers' weights in FP8 (E4M3 codes and FP32 scales, no BF16 copy), "
                          "their FP32 masters in the optimizer alone; needs --dtype bfloat16 or float16. Under "
                          "compare, recipes that cast no weights (bf16) keep theirs."),
        click.option("--fp8-activations", is_flag=False, flag_value="1x128", default=None, metavar="[1xB|tensor]",
                     help="Norms and SwiGLU keep their inputs for backward in E4M3 with FP32 scales per 1xB "
                          "block (alone: 1x128) or per tensor. Default: in the parameters' dtype."),
        click.option("--recompute", type=click.Choice([m.value for m in Recompute]), default="none",
                     show_default=True,
                     help="Activation recomputation of the transformer blocks in backward: selective keeps the "
                          "GEMMs' and attention's outputs and recomputes the rest (norms, RoPE, SwiGLU, casts); "
                          "full keeps only each block's input. The same numbers bit for bit, less memory."),
        click.option("--no-tensorboard", is_flag=True, help="Write the CSV log only."),
        click.option("--quiet", is_flag=True, help="No progress bar."),
        click.option("--json", "as_json", is_flag=True, help="Print the result as JSON."),
    ]


def training_options(defaults: Defaults) -> Callable[[Callable], Callable]:
    """The options ``train`` and ``compare`` share, with the command's defaults."""
    def decorate(fn: Callable) -> Callable:
        for option in reversed(_options(defaults)):
            fn = option(fn)
        return fn

    return decorate


def default_telemetry_every(steps: int) -> int:
    """``--telemetry-every``'s default: ``TELEMETRY_SAMPLES`` samples a run, never more often than every step
    nor less often than every ``TELEMETRY_EVERY_MAX`` steps."""
    return min(TELEMETRY_EVERY_MAX, max(1, steps // TELEMETRY_SAMPLES))


def config_from_options(recipe: str, opts: dict[str, Any], device: str | None = None,
                        resumed: dict[str, Any] | None = None, **extra: Any) -> TrainConfig:
    """A :class:`TrainConfig` from the shared options, with the device-dependent defaults filled in.

    ``device``: this rank's device (from :func:`launched`), else ``--device`` or the default one.
    ``resumed``: the settings of the checkpoint being resumed; the defaults that follow ``--steps``
    (warmup, evaluation interval) are then the checkpoint's, so a run can grow (``--steps`` larger).
    """
    _check_rollback(opts["on_spike"], extra.get("save_every"))
    steps = opts["steps"]
    # steps <= 0 is left for TrainConfig to refuse, with its message
    positive = steps > 0
    device = device or opts["device"] or default_device()
    derived = {"warmup_steps": max(1, steps // 10) * positive, "eval_every": max(1, steps // 6),
               "telemetry_every": default_telemetry_every(steps)}
    for name in derived:
        if opts[name] is not None:
            derived[name] = opts[name]
        elif resumed is not None and name in resumed:
            derived[name] = resumed[name]
    return TrainConfig(
        recipe=recipe, steps=steps, batch_size=opts["batch_size"], seq_len=opts["seq_len"],
        grad_accum=opts["grad_accum"], lr=opts["lr"], **derived,
        val_batches=opts["val_batches"], hp_start_steps=opts["hp_start_steps"], seed=opts["seed"],
        device=device, dtype=opts["dtype"] or default_dtype(device.split(":")[0]),
        tensorboard=not opts["no_tensorboard"], progress=not opts["quiet"], parallel=opts["parallel"],
        grad_comm=opts["grad_comm"], fp8_all_gather=opts["fp8_all_gather"], ep=opts["ep"],
        tp=opts["tp"],
        policy=_policy_option(opts["policy_file"]),
        compile="inductor" if opts["compiled"] else None, cuda_graphs=opts["cuda_graphs"],
        fp8_weights=opts["fp8_weights"],
        optim_states=opts["optim_states"], master_weights=opts["master_weights"],
        fp8_activations=opts["fp8_activations"], on_spike=opts["on_spike"], control=_control_option(opts),
        recompute=opts["recompute"], **extra)


def _check_rollback(on_spike: str, save_every: int | None) -> None:
    """``--on-spike rollback`` needs checkpoints to return to: ``train`` with ``--save-every N > 0``; never
    ``compare`` (``save_every`` None), whose runs save none. Refused naming the options as typed."""
    if on_spike != "rollback" or (save_every is not None and save_every != 0):
        return  # a negative --save-every is TrainConfig's to refuse
    if save_every is None:
        fail("--on-spike", "log or skip under compare (its runs save no checkpoints to roll back to)", "rollback")
    fail("--on-spike", "--save-every N > 0 with rollback (a roll-back returns to the newest checkpoint; "
         "--save-every 0 saves only after the last step)", "rollback with --save-every 0")


_CONTROL_OPTIONS = {"sqnr_floor_db": "--auto-sqnr-floor", "saturation_ceiling": "--auto-saturation-max",
                    "hp_final_fraction": "--hp-final-fraction"}
"""The options that set :class:`ControlConfig` fields, so that a refused value is named as typed."""


def _control_option(opts: dict[str, Any]) -> ControlConfig:
    """The precision control the options ask for; a bad value refused naming its option."""
    if opts["auto_precision"] and opts["telemetry_every"] == 0:
        fail("--auto-precision", "--telemetry-every N > 0 (the controller judges the sampled steps' figures)",
             "--telemetry-every 0")
    try:
        return ControlConfig(auto=opts["auto_precision"], sqnr_floor_db=opts["auto_sqnr_floor"],
                             saturation_ceiling=opts["auto_saturation_max"],
                             hp_final_fraction=opts["hp_final_fraction"])
    except ValueError as e:
        field, _, rest = str(e).partition(": ")
        if field not in _CONTROL_OPTIONS:
            raise
        raise ValueError(f"{_CONTROL_OPTIONS[field]}: {rest}") from None


def _policy_option(path: str | None) -> dict[str, Any] | None:
    """The policy of ``--policy``'s file in the config's form; a bad field is named with the file."""
    if path is None:
        return None
    data = read_policy_dict(path)
    policy_from_dict(data, f"policy file {path!r}")
    return data


def _check_out(out: Path, resume: bool) -> None:
    """Refuses an ``--out`` that names a file or cannot be written, or that does not exist with ``--resume``,
    before anything is made."""
    check_writable("--out", out, directory=True)
    if resume and not out.is_dir():
        fail("--resume", "--out naming the directory of the run to continue", f"--out {str(out)!r}, which does "
             "not exist (start without --resume)")


def _check_policy_patterns(cfg: TrainConfig, model: torch.nn.Module) -> None:
    """Refuses a ``--policy`` pattern that names no linear of ``model`` (a typo), before any step: where
    ``lowprec.convert`` warns, a run the command starts is refused."""
    policy = cfg.policy_object()
    names = [n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)]
    unmatched = unmatched_patterns(policy, names, "--policy") if policy is not None else None
    if unmatched is not None:
        raise ValueError(unmatched)


def _small_text(w: SmallLayersWarning, dtype: str) -> str:
    under = w.min_features if w.min_features is not None else "policy.min_features"
    return (f"{w.kept} of {w.linears} linears stay in {dtype} on {w.device}, too small to gain from {w.recipe} "
            f"(a dimension under {under}: their GEMMs would save less time than their casts cost); a --policy "
            f"file holding {CONVERT_SMALL} converts them")


@contextlib.contextmanager
def small_layers_line(dtype: str, said: list[SmallLayersWarning], show_it: bool = True) -> Iterator[None]:
    """The conversion's warning of the layers too small to gain as this command's one line, naming the option
    that converts them, shown where ``show_it`` (rank 0; the others would repeat it); each such warning is kept
    in ``said`` for the run's summary. Other warnings pass on to the display in force
    (:func:`one_line_warnings`)."""
    with warnings.catch_warnings():
        warnings.simplefilter("always", SmallLayersWarning)  # every run says it, not only a process's first
        shown = warnings.showwarning

        def show(message, category, *args, **kw):
            if isinstance(message, SmallLayersWarning):
                said.append(message)
                if not show_it:
                    return
                message = _small_text(message, dtype)
            shown(message, category, *args, **kw)

        warnings.showwarning = show
        yield


@contextlib.contextmanager
def launched(opts: dict[str, Any], command: str) -> Iterator[tuple[str, bool]]:
    """The run's process group under torchrun (see :func:`lowprec.distributed.launch.process_group`).

    Yields this rank's device and whether this rank speaks (rank 0: messages, warnings, results).
    A ``--parallel`` run that torchrun did not start is refused, saying how to launch it.
    """
    check_device(opts["device"])
    check_launch(opts["parallel"], command)
    with process_group(opts["parallel"], opts["device"] or default_device(), command) as device:
        main = Ranks.of(opts["parallel"]).is_main
        with one_line_warnings(show=main):
            yield device, main


def fmt_memory(n: int | None) -> str:
    return "n/a" if n is None else f"{n / (1 << 30):.2f} GiB"


@main.command("train")
@click.option("--recipe", default="bf16", show_default=True, help="One of: " + ", ".join(recipes.names()) + ".")
@click.option("--out", default="runs/train", show_default=True, help="Directory for logs and checkpoints.")
@click.option("--resume", is_flag=True, help="Continue from the newest checkpoint in --out.")
@click.option("--save-every", type=int, default=0, show_default=True,
              help="A checkpoint every N steps (0: only at the end).")
@click.option("--keep", type=int, default=3, show_default=True, help="Checkpoints kept.")
@training_options(TRAIN_DEFAULTS)
def train_cmd(recipe: str, out: str, resume: bool, save_every: int, keep: int, **opts: Any) -> None:
    """Train a model in one recipe; logs and checkpoints go to --out."""
    recipes.get(recipe)  # an unknown recipe is refused before anything is built
    _check_out(Path(out), resume)
    with launched(opts, "train") as (device, main):
        resumed = saved_train_config(Path(out) / "checkpoints") if resume else None
        cfg = config_from_options(recipe, opts, device=device, resumed=resumed, save_every=save_every, keep=keep)
        data = load_data(opts["data"], token_dtype=opts["token_dtype"], vocab_size=opts["vocab_size"],
                         tokenizer=opts["tokenizer"], text_field=opts["text_field"])
        model, spec = load_model(opts["model"], vocab_size=data.vocab_size, seed=cfg.seed)
        _check_policy_patterns(cfg, model)
        check_sequence_fits(data, cfg.seq_len, spec.max_positions, names=("--data", "--seq-len"))
        if main and not opts["quiet"] and not opts["as_json"]:
            ranks = Ranks.of(cfg.parallel)
            where = f" x {ranks.world_size} ranks ({cfg.parallel})" if ranks.distributed else ""
            click.echo(f"{spec.name}: {spec.n_params:,} parameters, recipe {recipe}, {cfg.steps} steps on "
                       f"{cfg.device}{where} ({cfg.dtype}); data: {data.source}", err=True)
        repeats = repetition_warning(data, cfg.steps, cfg.batch_size, cfg.seq_len, cfg.grad_accum)
        if main and repeats:
            click.echo(repeats, err=True)
        skipped: list[bool] = []  # of the steps this command ran (a resumed run's earlier ones are in the history)
        small: list[SmallLayersWarning] = []
        with small_layers_line(cfg.dtype, small, show_it=main):
            result = train(model, data, cfg, out_dir=out, resume=resume,
                           on_step=lambda row: skipped.append(row["skipped"]))
    failure = _failure(result, skipped, cfg)
    if main:
        _print_result(result, out, opts["as_json"], data.fingerprint, [_small_text(w, cfg.dtype) for w in small])
        if failure is not None:
            click.echo(f"Error: {failure}", err=True)
    if failure is not None:
        raise SystemExit(FAILED_RUN_STATUS)


def _print_result(result: RunResult, out: str, as_json: bool, data_sha256: str, notes: list[str]) -> None:
    if as_json:
        summary = {"recipe": result.recipe, "steps": result.steps, "final_train_loss": _finite(result.final_train_loss),
                   "final_val_loss": _finite(result.final_val_loss), "tokens_per_s": _finite(result.tokens_per_s),
                   "peak_memory_bytes": result.peak_memory_bytes, "skipped_steps": result.skipped_steps,
                   "diverged": result.diverged, "data_sha256": data_sha256, "out": out, "notes": notes}
        click.echo(json.dumps(summary, indent=1))
        return
    click.echo(f"step {result.steps}: train loss {result.final_train_loss:.4f}, val loss "
               f"{result.final_val_loss:.4f}, {result.tokens_per_s:,.0f} tokens/s, peak memory "
               f"{fmt_memory(result.peak_memory_bytes)}, {result.skipped_steps} skipped steps"
               + (" -- DIVERGED" if result.diverged else ""))
    for note in notes:  # what the run's start said, again beside its figures
        click.echo(f"note: {note}")
    click.echo(f"log: {out}/log.csv, checkpoints: {out}/checkpoints")


def _failure(result: RunResult, skipped: list[bool], cfg: TrainConfig) -> str | None:
    """Why a run failed, though it ended: it diverged, every step it ran was skipped, or its model's final
    validation loss is not finite (weights gone non-finite in a step that was taken); else None."""
    if result.diverged:
        return (f"the run diverged: {cfg.max_skips_in_row} steps in a row were skipped (non-finite loss or "
                "gradients)")
    if skipped and all(skipped):
        return (f"every step of this run was skipped ({len(skipped)} of {len(skipped)}: non-finite loss or "
                "gradients), so the weights did not change")
    vals = [r["val_loss"] for r in result.history if r.get("val_loss") is not None]
    if vals and not math.isfinite(vals[-1]):
        return (f"the final validation loss is {vals[-1]} (the model's weights or outputs are no longer "
                "finite: lower --lr, or see log.csv for the step where the loss left finite values)")
    return None


def _finite(x: float) -> float | None:
    return x if math.isfinite(x) else None


