"""The expert-parallel checks (see [Note: one spawn for the whole directory] in ``harness``), registered
in ``checks.CHECKS`` when ``checks`` imports this module."""
from __future__ import annotations

import torch
from torch.nn.parallel import DistributedDataParallel as DDP

from lowprec.distributed import local
from lowprec.distributed.expert_parallel import expert_parallel
from lowprec.distributed.launch import wrap
from lowprec.distributed.traffic import count_traffic
from lowprec.train.moe_model import parallelize_experts
from tests.distributed import ep_common as EP
from tests.distributed.checks import check


@check
def ep_exchange(rank: int, world: int) -> dict:
    """Rows to experts split over the ranks and back, the experts scaling each row by a number of their
    own: with and without FP8 on the wire, forward and backward, with the offsets each rank's experts saw."""
    out = {}
    for case in EP.EXCHANGES:
        x, counts = EP.exchange_rows(rank, case)
        for fp8 in (False, True):
            out[case, fp8] = _exchange(x, counts, fp8, rank, world)
    return out


def _exchange(x, counts, fp8: bool, rank: int, world: int) -> dict:
    ep = expert_parallel(world, fp8)
    seen: list = []

    def experts(rows, offsets):
        seen.append(offsets.tolist())
        return EP.scaled_by_expert(rows, offsets, rank * EP.E // world)

    xg = x.clone().requires_grad_()
    with count_traffic() as traffic:
        y = ep.run(experts, xg, counts)
        y.backward(torch.ones_like(y) * (rank + 2))
    return {"y": y.detach(), "grad": xg.grad, "offsets": seen, "bytes": dict(traffic)}


def _ep_model(recipe: str | None, parallel: str, fp8: bool):
    model = EP.moe(recipe)
    layers = parallelize_experts(model, expert_parallel(2, fp8))
    return wrap(model, parallel), layers


@check
def ep_train(rank: int, world: int) -> dict:
    """moe-tiny trained with its experts split over the two ranks, under FSDP2 and DDP, each rank on its
    half of every batch: losses, the whole weights after training, what the experts' parameters are."""
    out = {}
    for recipe, parallel, fp8 in ((None, "fsdp2", False), (None, "ddp", True), ("fp8-blockwise", "fsdp2", True),
                                  ("fp8-current", "ddp", True)):
        model, layers = _ep_model(recipe, parallel, fp8)
        inner = model.module if isinstance(model, DDP) else model
        opt = EP.sgd(model.parameters())
        losses = EP.train(model, opt, rank, world)
        w1 = inner.layers[0].feed_forward.experts.w1.weight
        out[recipe, parallel, fp8] = {
            "losses": losses, "layers": layers,
            "weights": {n: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone()
                        for n, p in inner.named_parameters()},
            "expert": (type(w1).__name__, str(w1.placements), tuple(local(w1).shape), tuple(w1.shape)),
            "local": local(w1).detach().clone(),
        }
    return out


_EXPECTED_BREAKS = ("lowprec.nn.routing", "DistributedDataParallel", "set_runtime_stats_and_log")
"""The graph breaks of a compiled DDP model with experts: lowprec's experts region, and DDP's own forward (its
logger and its ``_inside_ddp_forward``, which Dynamo does not trace)."""


@check
def ep_compiled(rank: int, world: int) -> dict:
    """moe-tiny under ``torch.compile`` with its experts split over the two ranks (fp8-current, FP8 dispatch,
    DDP): the experts and their all-to-all run outside the graph (see [Note: experts under torch.compile] in
    ``lowprec.nn.routing``); losses and graphs compiled after the first step, beside the same run eagerly."""
    from torch._dynamo.utils import counters

    out = {}
    for compiled in (False, True):
        torch._dynamo.reset()
        counters.clear()
        model, _ = _ep_model("fp8-current", "ddp", True)
        opt = EP.sgd(model.parameters())
        if compiled:
            model = torch.compile(model, backend="aot_eager")
        losses = EP.train(model, opt, rank, world)
        graphs = counters["stats"]["unique_graphs"]
        EP.train(model, opt, rank, world)  # three more steps, routed anew
        out[compiled] = {"losses": losses, "graphs": (graphs, counters["stats"]["unique_graphs"]),
                         "breaks": sorted(r.split("\n")[0] for r in counters["graph_break"]
                                          if not any(k in r for k in _EXPECTED_BREAKS))}
    return out


@check
def ep_nan(rank: int, world: int) -> dict:
    """A NaN in the gradient of one expert that only rank 1 holds: both ranks skip the step."""
    model, _ = _ep_model("fp8-current", "fsdp2", True)
    opt = EP.sgd(model.parameters())
    EP.train(model, opt, rank, world)
    before = [local(p).detach().clone() for p in model.parameters()]
    opt.zero_grad()
    x, y = EP.tokens(7, rank, world)
    loss = EP.lm_loss(model, x, y)
    opt.backward(loss)
    if rank == 1:
        local(model.layers[1].feed_forward.experts.w2.weight.grad)[0, 0, 0] = float("nan")
    result = opt.step(loss=loss)
    after = [local(p).detach().clone() for p in model.parameters()]
    return {"skipped": result.skipped, "reason": result.reason,
            "unchanged": all(torch.equal(a, b) for a, b in zip(before, after))}


@check
def ep_balance(rank: int, world: int) -> dict:
    """Loss-free balancing on two ranks that route different tokens: each rank's own counts, and the bias
    every rank holds after one step."""
    import dataclasses

    from lowprec.train.model import PRESETS, build_model
    from lowprec.train.moe_model import balance_experts

    cfg = dataclasses.replace(PRESETS["moe-tiny"], moe=dataclasses.replace(PRESETS["moe-tiny"].moe,
                                                                           balance_rate=0.01))
    model = build_model(cfg, seed=0)
    ff = model.layers[0].feed_forward
    x = torch.randn(2, 16, cfg.dim, generator=torch.Generator().manual_seed(60 + rank))
    model.train()
    ff(x)
    local = ff.expert_load.clone()
    balance_experts(model)
    return {"local": local, "bias": ff.expert_bias.clone()}


__all__ = ["ep_balance", "ep_exchange", "ep_nan", "ep_train"]
