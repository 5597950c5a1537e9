"""Which storage options a run can combine with each way of spreading a model over ranks.

One rule, for the two places that need it: a training run's configuration refuses what it cannot
run (``TrainConfig`` raises the first of :func:`unsupported`), and ``lowprec plan`` says, per option, what
``lowprec train`` would refuse in a planned layout.
Each :class:`Unsupported` carries the argument, what was expected and what was received, so a caller
raises it as every lowprec error reads (``"<argument>: expected <what>, got <what>"``).
"""
from __future__ import annotations

from dataclasses import dataclass

from lowprec import formats as F
from lowprec import recipes as R
from lowprec._checks import check_choice

PARALLEL = ("none", "ddp", "fsdp2")
"""``lowprec.distributed.launch.Parallel``'s values."""


@dataclass(frozen=True, slots=True)
class Unsupported:
    option: str
    """The ``TrainConfig`` field refused."""
    expected: str
    received: str


def _block_weights(recipe) -> bool:
    """Whether ``recipe`` stores FP8 primary weights in 128x128 blocks: it casts weights, but not both
    casts E4M3 per tensor (``lowprec.nn.fp8_convert.storage_for``). A recipe casting no weight makes no FP8
    weights (``convert`` refuses it, in any layout)."""
    sides = R.get(recipe).sides(R.Role.WEIGHT)
    return sides[0].quantized and not all(
        c.fmt is F.get("e4m3") and c.granularity is not None and c.granularity.per_tensor and not c.stochastic
        and not c.hadamard for c in sides)


def unsupported(parallel: str, *, fp8_weights: bool, optim_states: str, master_weights: bool,
                recipe=None) -> tuple[Unsupported, ...]:
    """Every combination a run spread as ``parallel`` cannot take, in the order a configuration checks them.
    Every ``optim_states`` runs under each (FSDP2's FP8 and 8-bit moments group inside rows:
    ``lowprec.optim.states``). ``recipe`` (a name or a ``Recipe``; None: not checked) decides whether FP8
    primary weights shard under FSDP2 (``lowprec.distributed.fp8_weight_shards``)."""
    check_choice("parallel", parallel, PARALLEL)
    out = []
    if fp8_weights and not master_weights:
        out.append(Unsupported("fp8_weights", "master_weights True (FP8 weights train through their FP32 masters)",
                               "master_weights False"))
    if fp8_weights and parallel == "fsdp2" and recipe is not None and _block_weights(recipe):
        out.append(Unsupported("fp8_weights", "a recipe storing FP8 weights per tensor under parallel 'fsdp2' "
                               "(fp8-current, fp8-delayed: FSDP2 splits rows where 128x128 blocks would need block "
                               "edges), or parallel 'none' or 'ddp'", repr(R.get(recipe).name)))
    if not master_weights and parallel != "none":
        out.append(Unsupported("master_weights", "True under ddp/fsdp2 (stochastic rounding swaps param.data)",
                               "False"))
    return tuple(out)
