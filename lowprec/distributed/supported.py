"""Which storage options a run can combine with each way of spreading a model over ranks.

One rule, for the two places that need it: a training run's configuration refuses what it cannot
run (``TrainConfig`` raises the first of :func:`unsupported`), and ``lowprec plan`` says, per option, what
``lowprec train`` would refuse in a planned layout.
Each :class:`Unsupported` carries the argument, what was expected and what was received, so a caller
raises it as every lowprec error reads (``"<argument>: expected <what>, got <what>"``).
"""
from __future__ import annotations

from dataclasses import dataclass

from lowprec._checks import check_choice

PARALLEL = ("none", "ddp", "fsdp2")
"""``lowprec.distributed.launch.Parallel``'s values."""


@dataclass(frozen=True, slots=True)
class Unsupported:
    option: str
    """The ``TrainConfig`` field refused."""
    expected: str
    received: str


def unsupported(parallel: str, *, fp8_weights: bool, optim_states: str,
                master_weights: bool) -> tuple[Unsupported, ...]:
    """Every combination a run spread as ``parallel`` cannot take, in the order a configuration checks them.
    Every ``optim_states`` runs under each (FSDP2's FP8 and 8-bit moments group inside rows:
    ``lowprec.optim.states``), and FP8 primary weights too (FSDP2 shards them as their codes:
    ``lowprec.distributed.fp8_weight_shards``, which refuses a block-stored weight whose rows do not split on
    block edges, by name)."""
    check_choice("parallel", parallel, PARALLEL)
    out = []
    if fp8_weights and not master_weights:
        out.append(Unsupported("fp8_weights", "master_weights True (FP8 weights train through their FP32 masters)",
                               "master_weights False"))
    if not master_weights and parallel != "none":
        out.append(Unsupported("master_weights", "True under ddp/fsdp2 (stochastic rounding swaps param.data)",
                               "False"))
    return tuple(out)
