"""Benchmark 6: the accuracy table: every preset recipe's final validation loss against BF16's seed band.

    python benchmarks/bench_accuracy.py --out results/acc [--model 125m] [--tokens 50e6] [--bf16-seeds 2]
        [--recipes fp8-current,...] [--deadline 540] [--cuda-graphs | --eager]
    python benchmarks/bench_accuracy.py --report results/acc results/accuracy-125m.json --out results/all
        [--plot curves.png]   # the table of earlier runs (result directories, merged tables) into --out/accuracy.json
    python benchmarks/bench_accuracy.py --dry-run --out /tmp/acc              # tiny model, CPU, seconds

Each run is ``lowprec.train.train`` as ``lowprec train`` runs it (AdamW, warmup + cosine, BF16
parameters with FP32 masters on CUDA), compiled (``--compile``; ``--eager`` leaves it out), with a
policy that converts every linear but the LM head (``skip_small=False``: the table is about the recipe's
numerics, so layers the default policy would keep in BF16 for speed are converted; NVFP4 keeps its last
blocks as the recipe says). BF16 trains with ``--bf16-seeds`` seeds (0, 1, ..), each recipe with
``--recipe-seeds`` (seed 0 by default); a recipe's seed s has the initialisation and data order of
BF16's seed s. One process per visible GPU takes the runs in turn; a run that could not end by
``--deadline`` seconds (judged by the longest so far) is left for a later call
(``--recipes``/``--bf16-seeds`` name what to run; ``--report`` merges several calls' results).

The data: every UTF-8 ``.py`` file of this Python installation (standard library and installed
packages, sorted by path, at most ``--corpus-mb``), as bytes. It needs no download and is the same
bytes for every run of one call (its sha256 is in each result); the last 10% is the validation split.

Prints, per run: final validation loss, gap to BF16's seed mean, BF16's seed band (mean, spread,
two standard errors), gap to BF16's run of the same seed, tokens/s and peak memory, each with its ratio
to BF16; then per recipe over its seeds: the gap of its mean, that mean's noise and its mean paired gap.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import sysconfig
import tempfile
import time
from pathlib import Path

import torch
from _common import environment, print_table

from lowprec import recipes
from lowprec.train.config import TrainConfig
from lowprec.train.data import load_data
from lowprec.train.loop import train
from lowprec.train.models import load_model
from lowprec.train.verdict import SeedBand, paired_gap

ALL_RECIPES = ("fp8-current", "fp8-delayed", "fp8-rowwise", "fp8-blockwise", "mxfp8", "mxfp4", "nvfp4")
CONVERT_ALL = {"skip_small": False}


def build_corpus(path: Path, limit_bytes: int) -> Path:
    """Concatenate the installation's UTF-8 ``.py`` files (sorted) into one text file."""
    roots = sorted({sysconfig.get_paths()[k] for k in ("stdlib", "purelib", "platlib")})
    seen, size = set(), 0
    with open(path, "wb") as out:
        for root in roots:
            for f in sorted(Path(root).rglob("*.py")):
                if f in seen or not f.is_file() or "__pycache__" in f.parts:
                    continue
                seen.add(f)
                raw = f.read_bytes()
                try:
                    raw.decode("utf-8")
                except UnicodeDecodeError:
                    continue
                out.write(raw + b"\n\n")
                size += len(raw) + 2
                if size >= limit_bytes:
                    return path
    return path


def jobs(args) -> list[tuple[str, int]]:
    """(recipe, seed) to run: BF16 with each of its seeds first, then each recipe with each of its seeds
    (``--seed-start``, ``--seed-start`` + 1, ...)."""
    bf16 = range(args.seed_start, args.seed_start + args.bf16_seeds)
    seeds = range(args.seed_start, args.seed_start + args.recipe_seeds)
    return [("bf16", s) for s in bf16] + [(r, s) for r in args.recipes if r != "bf16" for s in seeds]


def run_one(args, recipe: str, seed: int) -> dict:
    data = load_data(args.data)
    steps = max(1, math.ceil(args.tokens / (args.batch_size * args.seq_len)))
    cfg = TrainConfig(recipe=recipe, steps=steps, batch_size=args.batch_size, seq_len=args.seq_len, lr=args.lr,
                      warmup_steps=max(1, steps // 20), eval_every=max(1, steps // 8), val_batches=args.val_batches,
                      seed=seed, device="cuda" if torch.cuda.is_available() else "cpu",
                      dtype="bfloat16" if torch.cuda.is_available() else "float32", policy=CONVERT_ALL,
                      compile=None if args.dry_run or args.eager else "inductor",
                      cuda_graphs=args.cuda_graphs and not (args.dry_run or args.eager),
                      tensorboard=False, progress=False)
    model, spec = load_model(args.model, vocab_size=data.vocab_size, seed=seed)
    out = Path(args.out) / f"{recipe}-seed{seed}"
    start = time.perf_counter()
    result = train(model, data, cfg, out_dir=out, checkpoints=False)
    return {"recipe": recipe, "seed": seed, "model": spec.name, "params": spec.n_params, "steps": steps,
            "tokens": steps * cfg.tokens_per_step, "final_val_loss": result.final_val_loss,
            "final_train_loss": result.final_train_loss, "tokens_per_s": result.tokens_per_s,
            "peak_memory_gib": (result.peak_memory_bytes or 0) / 2**30, "skipped": result.skipped_steps,
            "diverged": result.diverged, "first_step_s": result.history[0]["elapsed_s"],
            "compiled": cfg.compile is not None, "cuda_graphs": cfg.cuda_graphs,
            "wall_s": time.perf_counter() - start, "data": _source(data.source, args.data),
            "conversion": result.conversion.split("\n")[0],
            "val_curve": [(r["step"], r["val_loss"]) for r in result.history if r.get("val_loss") is not None]}


def _source(source: str, path: str | None) -> str:
    """The data's description without the folder the corpus was written to (a temporary one)."""
    return source if path is None else source.replace(str(Path(path).parent) + os.sep, "")


def worker(args) -> None:
    """Run ``--only recipe:seed`` and write its JSON (the parent process schedules the workers)."""
    recipe, seed = args.only.rsplit(":", 1)
    row = run_one(args, recipe, int(seed))
    (Path(args.out) / f"{recipe}-seed{seed}.json").write_text(json.dumps(row, indent=1))


def schedule(args, argv: list[str], todo: list[tuple[str, int]]) -> None:
    """One worker process per GPU, each taking the next run when its last ends, until the deadline."""
    n_gpus = max(1, torch.cuda.device_count())
    started = time.monotonic()
    running: dict[int, tuple[subprocess.Popen, str, float]] = {}
    queue = list(todo)
    base = [sys.executable, __file__, *argv] + (["--data", args.data] if args.data else [])
    longest = 0.0  # the longest run so far: a run that could not end by the deadline is not started
    while queue or running:
        for gpu in range(n_gpus):
            if gpu in running or not queue:
                continue
            if time.monotonic() - started + longest > args.deadline:
                print(f"deadline: left for a later call: {', '.join(f'{r}:{s}' for r, s in queue)}", flush=True)
                queue = []
                break
            recipe, seed = queue.pop(0)
            visible = os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",")  # the GPUs this process was given
            device = visible[gpu] if len(visible) == n_gpus and visible[0] else str(gpu)
            env = dict(os.environ, CUDA_VISIBLE_DEVICES=device) if torch.cuda.is_available() else None
            log = open(Path(args.out) / f"{recipe}-seed{seed}.log", "w")
            proc = subprocess.Popen([*base, "--only", f"{recipe}:{seed}"], env=env, stdout=log, stderr=log)
            running[gpu] = (proc, f"{recipe}:{seed}", time.monotonic())
            print(f"[{time.monotonic() - started:6.0f} s] gpu {gpu}: {recipe} seed {seed}", flush=True)
        for gpu, (proc, label, t0) in list(running.items()):
            if proc.poll() is not None:
                longest = max(longest, time.monotonic() - t0)
                print(f"[{time.monotonic() - started:6.0f} s] gpu {gpu}: {label} exit {proc.returncode}: "
                      f"{_summary(Path(args.out), label)}", flush=True)
                del running[gpu]
        time.sleep(1.0)


def _summary(out: Path, label: str) -> str:
    path = out / (label.replace(":", "-seed") + ".json")
    if not path.exists():
        return "no result (see its .log)"
    r = json.loads(path.read_text())
    return (f"val {r['final_val_loss']:.4f}, {r['tokens_per_s']:,.0f} tokens/s, {r['peak_memory_gib']:.1f} GiB, "
            f"first step {r['first_step_s']:.0f} s, {r['wall_s']:.0f} s")


def mode(run: dict) -> str:
    """How a run was trained: "eager" (``--eager``) or "compiled" (with or without CUDA graphs, which replay
    the same kernels; a run written before ``--eager`` existed was compiled)."""
    return "eager" if run.get("compiled") is False else "compiled"


def load_results(paths: list[str]) -> list[dict]:
    """The runs of result directories (one JSON per run) and of merged tables (``accuracy.json``); a run
    (recipe, seed, model, tokens, mode) found twice is taken once, from the later path, so that merging a
    table with the directory it came from does not count its BF16 seeds twice and narrow the band. Runs of
    one seed in two modes are two runs: neither replaces the other."""
    runs: dict[tuple, dict] = {}
    for d in paths:
        if Path(d).is_file():
            found = json.loads(Path(d).read_text())["rows"]
        else:
            found = [json.loads(p.read_text()) for p in sorted(Path(d).glob("*-seed*.json"))]
        for r in found:
            runs[(r["recipe"], r["seed"], r["model"], r["tokens"], mode(r))] = r
    return list(runs.values())


def _band_mode(bf16: list[dict]) -> str:
    """The mode of BF16's seed band: the one most of BF16's runs took (compiled on a tie), so that the band
    holds one run per seed."""
    n = {m: sum(mode(r) == m for r in bf16) for m in ("compiled", "eager")}
    return "eager" if n["eager"] > n["compiled"] else "compiled"


def table(rows: list[dict]) -> dict:
    finished = [r for r in rows if r["recipe"] == "bf16" and math.isfinite(r["final_val_loss"])]
    if not finished:
        print("no finished BF16 run: no table")
        return {}
    band_mode = _band_mode(finished)
    base = [r for r in finished if mode(r) == band_mode]
    if len(base) < len(finished):
        print(f"BF16's band: its {band_mode} runs; its {len(finished) - len(base)} other run(s) are rows, "
              f"and the baseline of the same seed for runs of their mode")
    vals = [r["final_val_loss"] for r in base]
    mean = statistics.fmean(vals)
    spread = statistics.stdev(vals) if len(vals) > 1 else math.nan
    # two standard errors of a one-seed recipe's difference to the mean of K BF16 seeds
    noise = 2 * spread * math.sqrt(1 + 1 / len(vals)) / mean if len(vals) > 1 else math.nan
    # speed and memory against BF16's runs of the same mode (compiled and eager steps differ), else the band's
    of_mode = {m: [r for r in finished if mode(r) == m] or base for m in ("compiled", "eager")}
    tps = {m: statistics.fmean(r["tokens_per_s"] for r in runs) for m, runs in of_mode.items()}
    mem = {m: statistics.fmean(r["peak_memory_gib"] for r in runs) for m, runs in of_mode.items()}
    print(f"BF16 over {len(vals)} seeds: val loss {mean:.4f} (seeds: {', '.join(f'{v:.4f}' for v in vals)}; "
          f"spread {spread:.4f}, two standard errors of a one-seed gap {100 * noise:.2f}%)")
    paired = same_seed_baselines(finished, band_mode)  # BF16's run of the same seed: same init, same data
    out = []
    for r in sorted(rows, key=lambda r: (r["recipe"] != "bf16", r["recipe"], r["seed"], mode(r))):
        gap = (r["final_val_loss"] - mean) / mean
        same = paired[mode(r)].get(r["seed"])
        out.append([r["recipe"], str(r["seed"]), mode(r), f"{r['final_val_loss']:.4f}", f"{100 * gap:+.2f}%",
                    "yes" if abs(gap) <= noise else "no",
                    "-" if same is None else f"{100 * (r['final_val_loss'] - same) / same:+.2f}%",
                    f"{r['tokens_per_s']:,.0f}",
                    f"{r['tokens_per_s'] / tps[mode(r)]:.2f}x", f"{r['peak_memory_gib']:.1f}",
                    f"{r['peak_memory_gib'] / mem[mode(r)]:.2f}x", f"{r['tokens'] / 1e6:.1f}M", str(r["skipped"])])
    print_table(f"{base[0]['model']}: final validation loss against BF16's seeds",
                ["recipe", "seed", "mode", "val loss", "gap", "in noise", "gap to the same seed", "tokens/s", "vs bf16",
                 "peak GiB", "vs bf16", "tokens", "skipped"], out)
    recipes_ = summary(rows, mean, spread, len(vals), paired)
    if recipes_:
        print_table("each recipe over its seeds", ["recipe", "seeds", "mean gap", "noise of that mean",
                                                    "mean gap to the same seeds"],
                    [[name, str(v["seeds"]) + (f" ({v['diverged']} diverged)" if v["diverged"] else ""),
                      _pct(v["gap"], "+"), "-" if v["noise"] is None else "±" + _pct(v["noise"], ""),
                      _pct(v["paired_gap"], "+")] for name, v in recipes_.items()])
    return {"bf16_mean": mean, "bf16_spread": spread, "noise_rel": noise, "bf16_band_mode": band_mode,
            "recipes": recipes_, "rows": rows}


def same_seed_baselines(bf16: list[dict], band_mode: str) -> dict[str, dict[int, float]]:
    """Per mode, BF16's final loss by seed for the runs of that mode to pair with: its run of that mode where
    there is one, else the band's run of that seed."""
    band = {r["seed"]: r["final_val_loss"] for r in bf16 if mode(r) == band_mode}
    return {m: band | {r["seed"]: r["final_val_loss"] for r in bf16 if mode(r) == m} for m in ("compiled", "eager")}


def _pct(x: float | None, sign: str) -> str:
    return "-" if x is None else f"{100 * x:{sign}.2f}%"


def summary(rows: list[dict], mean: float, spread: float, n_bf16: int, paired: dict[str, dict[int, float]]) -> dict:
    """Per recipe (BF16 aside): its seeds, the gap of their mean loss to BF16's mean, two standard
    errors of that gap (BF16's spread standing for both: ``2 s sqrt(1/k + 1/n) / mean``), and the mean
    of its gaps to BF16's run of the same seed (same initialisation and data order: the difference the
    seed does not move). A figure that cannot be had is None: every gap where a run of the recipe did
    not finish with a finite loss (``diverged`` counts them), the noise with one BF16 seed, the paired
    gap where BF16 has no run of one of the seeds. ``paired``: BF16's loss by mode and seed
    (:func:`same_seed_baselines`); a run pairs with BF16's of its own mode."""
    out, bands = {}, {m: SeedBand(tuple(by_seed), tuple(by_seed.values())) for m, by_seed in paired.items()}
    for name in sorted({r["recipe"] for r in rows} - {"bf16"}):
        runs = [r for r in rows if r["recipe"] == name]
        k, bad = len(runs), sum(not math.isfinite(r["final_val_loss"]) for r in runs)
        # each run against BF16's of its own mode; NaN (no paired gap) where one lacks its seed
        pg = statistics.fmean(paired_gap(SeedBand((r["seed"],), (r["final_val_loss"],)), bands[mode(r)])
                              for r in runs)
        out[name] = {"seeds": k, "diverged": bad,
                     "gap": None if bad else (statistics.fmean(r["final_val_loss"] for r in runs) - mean) / mean,
                     "noise": 2 * spread * math.sqrt(1 / k + 1 / n_bf16) / mean if n_bf16 > 1 else None,
                     "paired_gap": None if math.isnan(pg) else pg}
    return out


def plot(result: dict, path: str) -> None:
    """Every run's validation curve, BF16's seeds dashed (matplotlib, imported here: only this needs it)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (whole, end) = plt.subplots(1, 2, figsize=(12, 4.5))
    for r in sorted(result["rows"], key=lambda r: (r["recipe"] != "bf16", r["recipe"], r["seed"])):
        if not r.get("val_curve") or not math.isfinite(r["final_val_loss"]):
            continue
        steps, losses = zip(*r["val_curve"])
        style = {"linestyle": "--", "color": "black"} if r["recipe"] == "bf16" else {}
        for ax in (whole, end):
            ax.plot(steps, losses, label=f"{r['recipe']} (seed {r['seed']})", **style)
    half = max(s for r in result["rows"] if r.get("val_curve") for s, _ in r["val_curve"]) // 2
    end.set_xlim(left=half)
    end.set_ylim(result["bf16_mean"] * 0.97, result["bf16_mean"] * 1.05)
    whole.set_title("validation loss")
    end.set_title("second half, BF16's mean +5% / -3%")
    for ax in (whole, end):
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    end.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def parse_args(argv):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="results/accuracy")
    ap.add_argument("--model", default="125m")
    ap.add_argument("--tokens", type=float, default=50e6)
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--seq-len", type=int, default=1024)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--val-batches", type=int, default=16)
    ap.add_argument("--bf16-seeds", type=int, default=2)
    ap.add_argument("--recipe-seeds", type=int, default=1, help="Seeds per recipe (BF16's seed s pairs with seed s).")
    ap.add_argument("--seed-start", type=int, default=0, help="The first seed of both (to add seeds in a later call).")
    ap.add_argument("--recipes", default=",".join(ALL_RECIPES))
    ap.add_argument("--deadline", type=float, default=math.inf, help="Seconds after which no run starts.")
    ap.add_argument("--data", default=None, help="Default: the installation's Python sources (see above).")
    ap.add_argument("--corpus-mb", type=float, default=150)
    ap.add_argument("--report", nargs="+", default=None,
                    help="Only the table of these result directories and merged tables (into --out/accuracy.json).")
    ap.add_argument("--plot", default=None, help="With --report: the validation curves into this PNG.")
    ap.add_argument("--dry-run", action="store_true", help="The tiny model for a few steps on the CPU, eagerly.")
    ap.add_argument("--cuda-graphs", action="store_true",
                    help="Replay the compiled steps as CUDA graphs (lowprec train --cuda-graphs): the same kernels, "
                         "so the same numbers, without the host's launches; FP8 experts of moe-1b train at about "
                         "0.9x BF16's speed so, 0.4-0.6x without.")
    ap.add_argument("--eager", action="store_true",
                    help="Train without torch.compile: the same numbers up to the compiler's fusions, without its "
                         "minutes of compilation (moe-1b's FP8 experts compile for 5-8 minutes).")
    ap.add_argument("--only", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.eager and args.cuda_graphs:
        ap.error("--cuda-graphs: replays compiled steps; expected it without --eager, got both")
    args.recipes = [r.strip() for r in args.recipes.split(",") if r.strip()]
    for r in args.recipes:
        recipes.get(r)
    if args.dry_run:
        args.model, args.tokens, args.batch_size, args.seq_len, args.val_batches = "tiny", 4 * 4 * 64, 4, 64, 1
    return args


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    Path(args.out).mkdir(parents=True, exist_ok=True)
    if args.report:
        result = table(load_results(args.report))
        (Path(args.out) / "accuracy.json").write_text(json.dumps(result, indent=1, default=str))
        if args.plot and result:
            plot(result, args.plot)
        return result
    if args.only is not None:
        worker(args)
        return {}
    print(json.dumps(environment()))
    with tempfile.TemporaryDirectory() as tmp:  # the corpus stays out of --out: results only there
        if args.data is None and not args.dry_run:  # a dry run reads the embedded corpus
            args.data = str(build_corpus(Path(tmp) / "corpus.txt", int(args.corpus_mb * 1e6)))
        schedule(args, list(argv if argv is not None else sys.argv[1:]), jobs(args))
    result = table(load_results([args.out]))
    (Path(args.out) / "accuracy.json").write_text(json.dumps(result, indent=1, default=str))
    return result


if __name__ == "__main__":
    main()
