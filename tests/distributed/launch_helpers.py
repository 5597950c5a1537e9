"""Two CPU processes on gloo for tests: the CLI through torchrun, or a test's function in forked processes.

torchrun starts fresh interpreters (its agent and each rank import torch: seconds each on a busy
machine), so only the tests of the command line use it; the others fork the test process, whose
imports the ranks inherit, and meet through a file store (no port to find).
"""
from __future__ import annotations

import subprocess
import sys
import warnings
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from lowprec.train.config import TrainConfig
from lowprec.train.model import ModelConfig

ROOT = Path(__file__).resolve().parents[2]
MICRO = ModelConfig(dim=64, n_layers=2, n_heads=2, n_kv_heads=1, ffn_dim=128, max_seq_len=64)
"""A two-block model: enough for FSDP2 to shard blocks and root, small enough to train in a second."""
MICRO_CFG = TrainConfig(steps=6, batch_size=4, seq_len=32, eval_every=3, val_batches=2, warmup_steps=2, lr=3e-3,
                        tensorboard=False, progress=False)
TIMEOUT_S = 180


def torchrun(*args: str, nproc: int = 2) -> subprocess.CompletedProcess:
    """``torchrun --standalone --nproc-per-node nproc *args`` (a free port of its own), output captured."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}", *args]
    return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=TIMEOUT_S)


def _rank_main(rank: int, fn: Callable, world_size: int, store: str, args: tuple) -> None:
    warnings.simplefilter("ignore")  # "emulated on cpu" is expected
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world_size)
    try:
        fn(*args)
    finally:
        dist.destroy_process_group()


def forked(fn: Callable, *args, store: Path, world_size: int = 2) -> None:
    """Run ``fn(*args)`` on ``world_size`` forked ranks in a gloo process group; raises if a rank fails
    (the others are then terminated). ``store``: a file path of this test, unused so far."""
    mp.start_processes(_rank_main, args=(fn, world_size, str(store), args), nprocs=world_size, join=True,
                       start_method="fork")


def explain(proc: subprocess.CompletedProcess) -> str:
    """The end of a failed launch's output, for an assertion message."""
    return f"exit {proc.returncode}\n--- stdout\n{proc.stdout[-3000:]}\n--- stderr\n{proc.stderr[-6000:]}"
