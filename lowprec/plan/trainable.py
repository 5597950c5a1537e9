"""What ``lowprec train`` cannot run of a planned layout: one line per option.

The planner plans layouts any trainer could run (tensor and pipeline parallelism, ZeRO stages,
recomputation); lowprec's own trainer runs one process, DDP (every weight on every rank: ZeRO-0) or
FSDP2 (everything sharded: ZeRO-3), each with every recompute mode, and refuses some storage options
under DDP/FSDP2 by the rule of ``lowprec.distributed.supported``, which its configuration applies too.
"""
from __future__ import annotations

from lowprec.distributed.supported import Unsupported, unsupported
from lowprec.plan.memory import Parallel, Training

_FLAGS = {"fp8_weights": "--fp8-weights", "optim_states": "--optim-states", "master_weights": "--no-master-weights"}


def trainer_parallel(par: Parallel) -> str:
    """The ``--parallel`` ``lowprec train`` would run the layout's GPUs with (with ``--tp``, over the
    tensor-parallel groups): ``none`` on one GPU, ``ddp`` without ZeRO, else ``fsdp2``."""
    if par.gpus == 1:
        return "none"
    return "ddp" if par.zero == 0 else "fsdp2"


def _flag(u: Unsupported, train: Training) -> str:
    return _FLAGS[u.option] + (f" {train.optim_states}" if u.option == "optim_states" else "")


def trainer_refusals(par: Parallel, train: Training) -> tuple[str, ...]:
    """One line per option ``lowprec train`` cannot run in this layout; empty when it can run it all."""
    out = []
    if par.tp > 1 and train.optim_states not in ("fp32", "bf16"):
        out.append(f"--optim-states {train.optim_states}: lowprec train expects fp32 or bf16 with tp {par.tp} (FP8 "
                   "and 8-bit moments group the rows of shards split along dim 0)")
    if par.tp > 1 and train.fp8_weights:
        out.append(f"--fp8-weights: lowprec train expects False with tp {par.tp} (FP8 primary weights are not "
                   "split by tensor parallelism yet)")
    if par.pp > 1:
        out.append(f"--pp {par.pp}: lowprec train has no pipeline parallelism")
    if par.ep > 1 and par.tp > 1:
        out.append(f"--ep {par.ep} with --tp {par.tp}: lowprec train splits experts or splits layers, not both")
    if par.gpus > par.tp * par.pp and par.zero in (1, 2):  # data-parallel ranks to shard over
        out.append(f"--zero {par.zero}: lowprec train shards nothing (--parallel ddp, as --zero 0) or everything "
                   "(--parallel fsdp2, as --zero 3)")
    parallel = trainer_parallel(par)
    where = f"--parallel {parallel} on {par.gpus} GPUs" if parallel != "none" else "one process"
    for u in unsupported(parallel, fp8_weights=train.fp8_weights, optim_states=train.optim_states,
                         master_weights=train.master_weights):
        out.append(f"{_flag(u, train)}: lowprec train expects {u.expected}, got {u.received} ({where})")
    return tuple(out)
