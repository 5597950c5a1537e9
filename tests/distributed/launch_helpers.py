"""Two CPU processes on gloo for tests: torchrun itself, or the test process forked.

torchrun starts fresh interpreters (its agent and each rank import torch, its compiler and DCP:
seconds each on a busy machine), so one test launches it for real; the others fork the test
process, whose imports the ranks inherit. Forked ranks meet through a file store, or, to run the
command line as torchrun would start it, through the environment torchrun gives its workers.
"""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import warnings
from collections.abc import Callable
from pathlib import Path

# DCP and FSDP are imported by the first distributed run: once here, not once in every forked rank
import torch
import torch.distributed as dist
import torch.distributed.checkpoint
import torch.distributed.fsdp
import torch.multiprocessing as mp
from click.testing import CliRunner

from lowprec.cli import app, main
from lowprec.train.config import TrainConfig
from lowprec.train.model import ModelConfig

ROOT = Path(__file__).resolve().parents[2]
MICRO = ModelConfig(dim=64, n_layers=2, n_heads=2, n_kv_heads=1, ffn_dim=128, max_seq_len=64)
"""A two-block model: enough for FSDP2 to shard blocks and root, small enough to train in a second."""
MICRO_CFG = TrainConfig(steps=6, batch_size=4, seq_len=32, eval_every=3, val_batches=2, warmup_steps=2, lr=3e-3,
                        tensorboard=False, progress=False)
TIMEOUT_S = 180
TIGHT = 1e-3
"""Relative difference of each step's train and validation loss between N ranks and one process on the same
global batch, bf16 recipe, FP32 parameters: rounding alone (the mean of per-rank means, sums reordered)."""
REORDERED = 2e-5
"""Relative difference of one loss computed from the same FP32 weights on the same global batch of 128 tokens
(4 x 32), by N ranks (the mean of per-rank means) or by one process (one mean). The two sums of the token losses
run in different orders (the ranks', and how the CPU's kernels vectorise: PyTorch's dispatch level changes it),
and a float32 sum of n positive terms is within (n - 1) * 2^-24 of exact, relative: 7.6e-6 each side for 128 tokens,
1.5e-5 apart; the GEMMs before the loss, at per-rank shapes, reorder their sums too (a few ulps of each logit).
Measured: equal at PyTorch's AVX2 and default levels of one CPU, 1 ulp of the loss (8.6e-8) on an AVX-512 CPU."""


def torchrun(*args: str, nproc: int = 2) -> subprocess.CompletedProcess:
    """``torchrun --standalone --nproc-per-node nproc *args`` (a free port of its own), output captured."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}", *args]
    return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=TIMEOUT_S)


def cli_ok(*args: str) -> None:
    """``lowprec <args>`` in this process, which must succeed."""
    from click.testing import CliRunner

    from lowprec.cli import main

    result = CliRunner().invoke(main, list(args))
    assert result.exit_code == 0, result.output


def log_losses(out: Path) -> list[tuple[float, str]]:
    """(loss, validation loss or "") of every step in ``out``'s log."""
    from lowprec.train.logs import read_log

    return [(float(r["loss"]), r["val_loss"]) for r in read_log(out / "log.csv")]


def split_then_one(tmp_path: Path, run: tuple[str, ...], *split: str) -> tuple[list, list]:
    """``run`` two steps on two forked ranks with the ``split`` arguments, resumed to four by one process, and
    one process's own four (two, then grown by a resume alike): the losses of each, split run's first."""
    one = tmp_path / "one"
    cli_ok(*run, "--steps", "2", "--out", str(one))
    cli_ok(*run, "--steps", "4", "--out", str(one), "--resume")
    out = tmp_path / "split"
    ranks = forked_cli(*run, "--steps", "2", *split, "--out", str(out), out=tmp_path / "ranks")
    assert [r["exit_code"] for r in ranks] == [0, 0], ranks
    cli_ok(*run, "--steps", "4", "--out", str(out), "--resume")  # split parameters saved as shards, loaded whole
    return log_losses(out), log_losses(one)


def _rank_main(rank: int, fn: Callable, world_size: int, store: str, args: tuple) -> None:
    warnings.simplefilter("ignore")  # "emulated on cpu" is expected
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world_size)
    try:
        fn(*args)
    finally:
        dist.destroy_process_group()


def _cli_rank_main(rank: int, args: list[str], world_size: int, port: int, out: Path) -> None:
    # what torchrun sets for each worker: lowprec sees a torchrun launch, torch's env:// rendezvous the rest
    os.environ.update({"TORCHELASTIC_RUN_ID": "test", "RANK": str(rank), "LOCAL_RANK": str(rank),
                       "WORLD_SIZE": str(world_size), "LOCAL_WORLD_SIZE": str(world_size),
                       "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)})
    torch.set_num_threads(1)
    # after bad input a rank other than 0 waits for torchrun to stop it (app's [Note: one error line under
    # torchrun]); no torchrun stops these ranks, so they would each wait the whole 20 s for nothing
    app.OTHER_RANK_WAIT_S = 0.5
    result = CliRunner().invoke(main, args)
    error = None if result.exception is None or isinstance(result.exception, SystemExit) else repr(result.exception)
    (out / f"cli_{rank}.json").write_text(json.dumps({"exit_code": result.exit_code, "stdout": result.stdout,
                                                      "stderr": result.stderr, "error": error}))


def _import_before_forking() -> None:
    # the first model built imports torch's compiler (seconds): once in this process, not in every rank.
    # Not at this module's import: the compiler imports Triton, which must come after tests/kernels/conftest.py
    # has chosen Triton's interpreter (while tests are collected)
    import torch._dynamo  # noqa: F401


def forked_cli(*args: str, out: Path, world_size: int = 2) -> list[dict]:
    """``lowprec *args`` on ``world_size`` forked ranks set up as torchrun sets up its workers; each rank's
    exit code, stdout, stderr and unexpected exception (as from ``CliRunner``), in rank order."""
    _import_before_forking()
    with socket.socket() as s:  # a free port for rank 0's store (another process could take it; unlikely)
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out.mkdir(parents=True, exist_ok=True)
    mp.start_processes(_cli_rank_main, args=(list(args), world_size, port, out), nprocs=world_size, join=True,
                       start_method="fork")
    return [json.loads((out / f"cli_{r}.json").read_text()) for r in range(world_size)]


def forked(fn: Callable, *args, store: Path, world_size: int = 2) -> None:
    """Run ``fn(*args)`` on ``world_size`` forked ranks in a gloo process group; raises if a rank fails
    (the others are then terminated). ``store``: a file path of this test, unused so far."""
    _import_before_forking()
    mp.start_processes(_rank_main, args=(fn, world_size, str(store), args), nprocs=world_size, join=True,
                       start_method="fork")


def explain(proc: subprocess.CompletedProcess) -> str:
    """The end of a failed launch's output, for an assertion message."""
    return f"exit {proc.returncode}\n--- stdout\n{proc.stdout[-3000:]}\n--- stderr\n{proc.stderr[-6000:]}"


def checkpoint_parts(out: Path) -> dict[str, int]:
    """How many parts each tensor of the first distributed checkpoint in ``out`` was saved in (one per
    rank holding a distinct piece: a weight split over the ranks in two, a replicated one whole)."""
    from lowprec.distributed.safe_metadata import read_metadata
    from lowprec.state.files import is_distributed_checkpoint, list_checkpoints

    json_path = next(p for _, p in list_checkpoints(out / "checkpoints") if is_distributed_checkpoint(p))
    meta = read_metadata(json_path.with_suffix("") / ".metadata")
    return {k: len(v.chunks) for k, v in meta.state_dict_metadata.items() if hasattr(v, "chunks")}


def run_curve(path: Path) -> list[tuple]:
    """(loss, validation loss, gradient norm, skipped) of every step in ``path``'s log, as logged (strings)."""
    from lowprec.train.logs import read_log

    return [(r["loss"], r["val_loss"], r["grad_norm"], r["skipped"]) for r in read_log(path / "log.csv")]


def ranks_ok(ranks: list[dict]) -> None:
    """Every rank of a :func:`forked_cli` run exited 0 without an exception."""
    assert [(r["exit_code"], r["error"]) for r in ranks] == [(0, None)] * len(ranks), ranks


def fp8_weights_train_as_bf16(tmp_path: Path, train: tuple[str, ...], steps: int, resume: bool = True) -> list:
    """``lowprec train`` with ``--fp8-weights`` on two forked ranks trains bit for bit as without (BF16 weights,
    FP32 masters); with ``resume``, the run cut at its last checkpoint but one resumes onto the same curve, bit
    for bit. Returns the curve."""
    import shutil

    fp8, bf16 = tmp_path / "fp8", tmp_path / "bf16"
    ranks_ok(forked_cli(*train, "--fp8-weights", "--out", str(fp8), out=tmp_path / "r1"))
    ranks_ok(forked_cli(*train, "--out", str(bf16), out=tmp_path / "r2"))
    assert run_curve(fp8) == run_curve(bf16) and len(run_curve(fp8)) == steps
    if not resume:
        return run_curve(fp8)
    cut = tmp_path / "cut"
    shutil.copytree(fp8, cut)
    sorted((cut / "checkpoints").glob("step_*.json"))[-1].unlink()
    ranks_ok(forked_cli(*train, "--fp8-weights", "--out", str(cut), "--resume", out=tmp_path / "r3"))
    assert run_curve(cut) == run_curve(fp8)
    return run_curve(fp8)
