"""Run checks on two gloo ranks in one spawn, and hand each test the results of both ranks.

[Note: one spawn for the whole directory]
Starting two Python processes that import torch costs several seconds on the CI's two cores, more
than all the checks together. So every check of ``tests/distributed`` runs in one spawn: each rank
runs the checks in order, each returning a dict of plain values and tensors, and saves them; a
check that raises records its traceback instead (and the test reading it fails with it), so the
ranks carry on with the next check. A collective left waiting by a rank that raised ends at the
process group's timeout. The tests assert in the parent process, against references they compute
there, never inside the workers (``session.dist_results`` is the fixture that hands them out).
"""
from __future__ import annotations

import os
import time
import traceback
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

WORLD = 2
TIMEOUT_S = 180  # the whole spawn (about 20 s alone on two cores); one check takes a second or a few
COLLECTIVE_TIMEOUT = timedelta(seconds=30)


class CheckFailed(Exception):
    """A check raised on a rank; the message is the rank's traceback."""


def _worker(rank: int, world: int, init_file: str, out_dir: str, names: list[str]) -> None:
    from tests.distributed import checks  # imported here: the parent need not import the checks

    torch.set_num_threads(1)  # two ranks on two cores
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world,
                            timeout=COLLECTIVE_TIMEOUT)
    results: dict = {}
    try:
        for name in names:
            start = time.perf_counter()
            try:
                results[name] = checks.CHECKS[name](rank, world)
            except Exception:  # reported to the test that reads this check
                results[name] = CheckFailed(f"rank {rank}, check {name}:\n{traceback.format_exc()}")
            dist.barrier()
            results[name + ":seconds"] = time.perf_counter() - start
    finally:
        torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))
        dist.destroy_process_group()


def run_checks(names: list[str], work_dir: str) -> dict[str, list]:
    """Run the named checks on ``WORLD`` gloo ranks; ``{name: [rank 0's result, rank 1's, ...]}``."""
    os.makedirs(work_dir, exist_ok=True)
    init_file = os.path.join(work_dir, "init")
    if os.path.exists(init_file):  # a FileStore must start from a fresh file
        os.remove(init_file)
    ctx = mp.start_processes(_worker, args=(WORLD, init_file, work_dir, names), nprocs=WORLD, join=False,
                             start_method="spawn")
    deadline = time.monotonic() + TIMEOUT_S
    while not ctx.join(timeout=max(deadline - time.monotonic(), 0.1)):
        if time.monotonic() > deadline:
            for p in ctx.processes:
                p.kill()
            raise TimeoutError(f"distributed checks did not finish in {TIMEOUT_S} s")
    per_rank = [torch.load(os.path.join(work_dir, f"rank{r}.pt"), weights_only=False) for r in range(WORLD)]
    return {name: [per_rank[r].get(name) for r in range(WORLD)] for name in names}


def result(results: dict[str, list], name: str) -> list:
    """Both ranks' results of check ``name``; raises with a rank's traceback if the check failed there."""
    per_rank = results[name]
    for r in per_rank:
        if isinstance(r, CheckFailed):
            raise r
    return per_rank

