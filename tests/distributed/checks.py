"""What each rank runs (see [Note: one spawn for the whole directory] in ``harness``): every check takes
``(rank, world)`` and returns plain values and tensors for the tests to judge."""
from __future__ import annotations

import copy
import math
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext

import torch
import torch.distributed as dist
from torch.distributed.fsdp import fully_shard
from torch.nn.parallel import DistributedDataParallel as DDP

import lowprec
from lowprec.distributed import (
    FSDPReduceScatter,
    GradComm,
    GradCommState,
    all_reduce_mean,
    local,
    register_ddp,
    register_fsdp,
    sync_amaxes,
)
from lowprec.distributed.amax import delayed_states
from lowprec.distributed.fp8_weights import fp8_all_gather, precompute_fp8_scales
from lowprec.distributed.traffic import count_traffic
from tests.distributed import common as C

CHECKS: dict[str, Callable[[int, int], dict]] = {}
RECIPES = ("fp8-current", "fp8-delayed", "mxfp8")
STEPS = C.STEPS

warnings.filterwarnings("ignore")  # emulated GEMMs on CPU, FSDP2's notes: the tests read results, not logs


def check(fn):
    CHECKS[fn.__name__] = fn
    return fn


@contextmanager
def counting_all_reduce(calls: list | None = None) -> Iterator[list]:
    """Counts the ``dist.all_reduce`` calls made inside the region: one entry appended to ``calls`` each."""
    calls = [] if calls is None else calls
    real = dist.all_reduce

    def counted(*args, **kw):
        calls.append(1)
        return real(*args, **kw)

    dist.all_reduce = counted
    try:
        yield calls
    finally:
        dist.all_reduce = real


def _plain(obj):
    """``obj`` with every DTensor replaced by a copy of its local shard: the parent has no process group."""
    if isinstance(obj, torch.Tensor):
        return local(obj).detach().clone()
    if isinstance(obj, dict):
        return {k: _plain(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_plain(v) for v in obj)
    return copy.deepcopy(obj)


def _snapshot(model, opt) -> dict:
    return _plain({"params": list(model.parameters()), "masters": opt.master_weights,
                   "inner": opt.optimizer.state_dict(), "scale": opt.loss_scale})


@check
def ddp_recipes(rank: int, world: int) -> dict:
    """Each recipe trained by DDP on half batches; fp8-delayed records its histories around the last sync."""
    out: dict = {}
    for recipe in RECIPES:
        model = C.mlp(recipe)
        ddp = DDP(model)
        opt = C.sgd(ddp.parameters())
        seen: dict = {"collectives": []}

        def before_step(m, seen=seen):
            seen["before"] = [s.history.clone() for s in delayed_states(m)]
            with counting_all_reduce() as calls:
                seen["layers"] = sync_amaxes(m)
            seen["collectives"].append(len(calls))
            seen["after"] = [s.history.clone() for s in delayed_states(m)]
            seen["counts"] = [s.count.clone() for s in delayed_states(m)]

        results = C.train(ddp, opt, range(STEPS), rank, world, before_step=before_step)
        out[recipe] = {"weights": C.flat_weights(model), "skipped": [r.skipped for r in results], **seen}
    return out


@check
def ddp_delayed_experts(rank: int, world: int) -> dict:
    """Experts under fp8-delayed trained by DDP on each rank's own rows (expert 1 routed none): every expert's
    histories around each sync."""
    from lowprec.nn import GroupedLinear

    torch.manual_seed(0)
    layer = GroupedLinear(3, 32, 32, recipe="fp8-delayed")
    ddp = DDP(layer)
    offsets = torch.tensor([6, 6, 16])
    out: dict = {"before": [], "after": [], "experts": None}
    for step in range(STEPS):
        x = torch.randn(16, 32, generator=torch.Generator().manual_seed(100 * step + rank)) * (1 + rank)
        ddp(x, offsets).square().mean().backward()
        out["before"].append([s.history.clone() for s in delayed_states(layer)])
        out["experts"] = sync_amaxes(layer)
        out["after"].append([s.history.clone() for s in delayed_states(layer)])
        layer.zero_grad()
    return out


def _micro_steps(ddp, opt, steps: range, rank: int, world: int, dtype) -> list:
    """Two micro-batches per step, the first under ``no_sync()`` as DDP users accumulate."""
    results = []
    for step in steps:
        opt.zero_grad()
        for micro in range(2):
            x, y = C.batch(10 * step + micro, rank, world, dtype)
            with ddp.no_sync() if micro == 0 else nullcontext():
                opt.backward(C.mse(ddp, x, y) / 2)
        with counting_all_reduce() as calls:
            results.append((opt.step(), len(calls)))
    return results


@check
def ddp_bf16_masters(rank: int, world: int) -> dict:
    """The reported bug: a converted BF16 MLP, masters on, DDP, gradient accumulation with no_sync, in both
    of DDP's gradient layouts; and stochastic rounding, which cannot work under DDP, refused."""
    out = {}
    for variant in ("copy", "bucket-view"):
        model = C.mlp("fp8-current", torch.bfloat16)
        ddp = DDP(model, gradient_as_bucket_view=variant == "bucket-view")
        opt = C.adamw(ddp.parameters(), max_grad_norm=1.0)
        results = _micro_steps(ddp, opt, range(STEPS), rank, world, torch.bfloat16)
        out[variant] = {"norms": [r.grad_norm for r, _ in results], "collectives": [n for _, n in results],
                        "params": [p.detach().clone() for p in model.parameters()],
                        "masters": [m for m in _plain(opt.master_weights) if m is not None]}
    try:
        C.adamw(C.mlp(None, torch.bfloat16).parameters(), master_weights=False, stochastic_rounding=True)
    except ValueError as e:
        out["refused"] = str(e)
    return out


@check
def ddp_nan(rank: int, world: int) -> dict:
    """A NaN loss on rank 1 alone, then a NaN gradient from rank 1's input: both ranks skip both."""
    model = C.mlp("fp8-current", torch.bfloat16)
    ddp = DDP(model)
    opt = C.adamw(ddp.parameters(), master_weights=True, loss_scale="dynamic")
    C.train(ddp, opt, range(2), rank, world, torch.bfloat16)
    snaps, results = [_snapshot(model, opt)], []
    for poison in ("loss", "grad"):
        opt.zero_grad()
        x, y = C.batch(7, rank, world, torch.bfloat16)
        if poison == "grad" and rank == 1:
            x[0, 0] = math.nan
        loss = C.mse(ddp, x, y)
        opt.backward(loss)
        if poison == "loss":
            results.append(opt.step(loss=math.nan if rank == 1 else loss))
        else:
            results.append(opt.step())  # no loss: the gradients alone decide
        snaps.append(_snapshot(model, opt))
    results += C.train(ddp, opt, range(2, 3), rank, world, torch.bfloat16)  # and training goes on
    return {"results": [(r.skipped, r.reason, r.loss) for r in results], "snaps": snaps,
            "skipped_steps": opt.skipped_steps}


def _fsdp_mlp(recipe: str | None, dtype=torch.bfloat16):
    model = C.mlp(recipe, dtype)
    for layer in (model[0], model[2]):
        fully_shard(layer)
    fully_shard(model)
    return model


@check
def fsdp_train(rank: int, world: int) -> dict:
    """FSDP2 with lowprec masters on BF16 parameters: every recipe, and fp8-current with FP8 reduce-scatters."""
    out = {}
    for recipe, comm in [(r, "bf16") for r in RECIPES] + [("fp8-current", "fp8")]:
        model = _fsdp_mlp(recipe)
        state = register_fsdp(model, comm)
        opt = C.sgd(model.parameters(), master_weights=True)
        calls: list = []
        results = C.train(model, opt, range(STEPS), rank, world, torch.bfloat16, before_step=sync_amaxes,
                          around_step=lambda calls=calls: counting_all_reduce(calls))
        masters = [(type(m).__name__, str(m.placements), tuple(m.to_local().shape), m.dtype,
                    tuple(p.to_local().shape)) for p, m in zip(model.parameters(), opt.master_weights)]
        momentum = [type(v["momentum_buffer"]).__name__ for v in opt.state.values()]
        out[recipe, comm] = {"weights": C.flat_weights(model), "norms": [r.grad_norm for r in results],
                             "collectives": len(calls),
                             "masters": masters, "momentum": momentum, "bytes": state.take() // STEPS}
    return out


@check
def fsdp_nan_one_shard(rank: int, world: int) -> dict:
    """A NaN that only rank 0's gradient shard receives (row 5 of a Linear sharded by rows), sent there
    by rank 1's reduce-scatter input: both ranks must skip."""
    torch.manual_seed(0)
    model = torch.nn.Linear(C.IN, C.IN).bfloat16()
    fully_shard(model)
    finite_shard: list = []
    model.weight.register_post_accumulate_grad_hook(
        lambda p: finite_shard.append(bool(torch.isfinite(p.grad.to_local()).all())))
    opt = C.adamw(model.parameters(), master_weights=True)
    C.train(model, opt, range(1), rank, world, torch.bfloat16)
    before = _snapshot(model, opt)
    opt.zero_grad()
    x, y = C.batch(5, rank, world, torch.bfloat16)
    out = model(x)
    if rank == 1:
        out.register_hook(lambda g: g.index_fill(1, torch.tensor([5]), math.nan))
    opt.backward((out.float() - y).pow(2).mean())
    result = opt.step()
    after = _snapshot(model, opt)
    return {"skipped": result.skipped, "reason": result.reason, "finite_shard": finite_shard[-1],
            "before": before, "after": after, "master_type": type(opt.master_weights[0]).__name__}


@check
def fsdp_micro_batches(rank: int, world: int) -> dict:
    """Two micro-batches per step under FSDP2, each reduce-scattered (the float32 fold adds reduced shards)
    or the first under ``set_requires_gradient_sync(False)`` (FSDP2 accumulates unsharded gradients)."""
    out = {}
    for mode in ("sync-each", "no-sync-first"):
        model = _fsdp_mlp("fp8-current")
        opt = C.adamw(model.parameters(), master_weights=True)
        x, y = C.batch(0, rank, world, torch.bfloat16)
        half = x.shape[0] // 2
        for micro in range(2):
            model.set_requires_gradient_sync(mode == "sync-each" or micro == 1)
            rows = slice(micro * half, (micro + 1) * half)
            opt.backward(C.mse(model, x[rows], y[rows]) / 2)
        out[mode] = opt.step().grad_norm
    try:
        C.adamw(_fsdp_mlp(None).parameters(), data_parallel=False)
    except ValueError as e:
        out["refused"] = str(e)
    return out


def _comm_input(rank: int, n: int) -> torch.Tensor:
    """Rank ``rank``'s gradient bucket: n values whose magnitudes span 2^-12 .. 2^12 block to block."""
    g = torch.Generator().manual_seed(77 + rank)
    return torch.randn(n, generator=g) * torch.logspace(-12, 12, n, base=2.0)


@check
def grad_comm_direct(rank: int, world: int) -> dict:
    """Each mode's mean of a bucket not a multiple of 128; FSDP2's reduce-scatter; a non-finite block."""
    x = _comm_input(rank, 1000)
    out: dict = {}
    for mode in GradComm:
        state = GradCommState(mode)
        out[mode.value] = (all_reduce_mean(x.clone(), state), state.take())
        out[mode.value + "-bf16"] = all_reduce_mean(x.bfloat16(), GradCommState(mode))
    state = GradCommState(GradComm.FP8)
    shard = torch.empty(500)
    FSDPReduceScatter(state)(shard, x, dist.group.WORLD, dist.ReduceOp.AVG)
    out["fsdp-fp8"] = (shard, state.take())
    bad = x.clone()
    if rank == 1:
        bad[300] = math.inf
    out["nonfinite"] = all_reduce_mean(bad, GradCommState(GradComm.FP8))
    return out


@check
def ddp_grad_comm(rank: int, world: int) -> dict:
    """DDP with each gradient-communication hook on the BF16-masters model: weights, bytes per step."""
    out = {}
    for mode in GradComm:
        model = C.mlp("fp8-current", torch.bfloat16)
        ddp = DDP(model)
        state = register_ddp(ddp, mode)
        opt = C.sgd(ddp.parameters(), master_weights=True)
        sent = []
        for step in range(STEPS):
            C.train(ddp, opt, range(step, step + 1), rank, world, torch.bfloat16)
            sent.append(state.take())
        out[mode.value] = {"weights": C.flat_weights(model), "bytes": sent}
    return out


def _fsdp_fp8_run(recipe: str, fp8: bool, precompute: bool, rank: int, world: int) -> dict:
    model = C.mlp(recipe, torch.bfloat16)
    names = fp8_all_gather(model) if fp8 else []
    for layer in (model[0], model[2]):
        fully_shard(layer)
    fully_shard(model)
    opt = C.sgd(model.parameters(), master_weights=True)
    seen: list[str] = []
    hook = model[0].register_forward_pre_hook(lambda m, a: seen.append(type(m.weight).__name__))
    losses, scale_reduces = [], []
    with count_traffic() as traffic:
        for step in range(STEPS):
            opt.zero_grad()
            x, y = C.batch(step, rank, world, torch.bfloat16)
            loss = C.mse(model, x, y)
            opt.backward(loss)
            sync_amaxes(model)
            losses.append(opt.step(loss).loss)
            if precompute:
                with counting_all_reduce() as calls:
                    precompute_fp8_scales(model)
                scale_reduces.append(len(calls))
    hook.remove()
    return {"names": names, "weights": C.flat_weights(model), "losses": losses, "seen": seen[:1],
            "all_gather": traffic["all_gather"] // STEPS, "scale_reduces": scale_reduces,
            "state_dict_types": sorted({type(local(v)).__name__ for v in model.state_dict().values()})}


@check
def fsdp_fp8_all_gather(rank: int, world: int) -> dict:
    """FSDP2 all-gathering per-tensor FP8 weights in E4M3, against all-gathering them in BF16."""
    out = {}
    for recipe in ("fp8-current", "fp8-delayed"):
        out[recipe, "bf16"] = _fsdp_fp8_run(recipe, False, False, rank, world)
        out[recipe, "fp8"] = _fsdp_fp8_run(recipe, True, True, rank, world)
    out["fp8-current", "fp8-own-scales"] = _fsdp_fp8_run("fp8-current", True, False, rank, world)
    out["mxfp8", "fp8"] = {"names": fp8_all_gather(C.mlp("mxfp8", torch.bfloat16))}
    return out


@check
def every_recipe(rank: int, world: int) -> dict:
    """Every preset trains two steps under DDP and under FSDP2 (a 128 -> 256 -> 128 MLP, so that
    fp8-blockwise's 128-blocks convert every layer); the ranks end with the same weights."""
    from lowprec import recipes

    out = {}
    for recipe in recipes.names():
        for parallel in ("ddp", "fsdp2"):
            torch.manual_seed(0)
            model = torch.nn.Sequential(torch.nn.Linear(128, 256), torch.nn.GELU(), torch.nn.Linear(256, 128))
            model = model.to(torch.bfloat16)
            report = lowprec.convert(model, recipe, lowprec.Policy(keep_last_blocks=0))
            if parallel == "ddp":
                wrapped = DDP(model)
            else:
                for layer in (model[0], model[2]):
                    fully_shard(layer)
                wrapped = fully_shard(model)
            opt = C.adamw(model.parameters(), master_weights=True)
            losses = []
            for step in range(2):
                opt.zero_grad()
                g = torch.Generator().manual_seed(100 + step)
                x = torch.randn(64, 128, generator=g)[rank * 32:(rank + 1) * 32].to(torch.bfloat16)
                loss = wrapped(x).float().pow(2).mean()
                opt.backward(loss)
                sync_amaxes(model)
                losses.append(opt.step(loss).loss)
            out[recipe, parallel] = {"converted": len(report.converted), "losses": losses,
                                     "weights": C.flat_weights(model)}
    return out


@check
def control_agrees(rank: int, world: int) -> dict:
    """The precision controller on two ranks whose telemetry differs: rank 0 sees layer 0's fprop input
    saturate, rank 1 layer 2's dgrad lose SQNR; each reports the switches it made and its all-reduces."""
    from lowprec import recipes
    from lowprec.telemetry import OperandStats
    from lowprec.telemetry.control import ControlConfig, PrecisionController

    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 64))
    lowprec.convert(model, "nvfp4", lowprec.Policy(keep_head=False, keep_last_blocks=0))
    ctl = PrecisionController(model, recipes.get("nvfp4"), ControlConfig(auto=True), 100, dist.group.WORLD)
    bad = {0: ("0", "fprop", "input", 0.0, 0.02, 20.0), 1: ("2", "dgrad", "grad_output", 0.0, 0.0, 2.0)}[rank]
    records = [OperandStats(layer, gemm, "input", 1.0, 1.0, 0.0, 0.0, 20.0, 5)
               for layer in ("0", "2") for gemm in ("fprop", "dgrad", "wgrad")]
    records.append(OperandStats(bad[0], bad[1], bad[2], 1.0, 1.0, *bad[3:], 5))
    with counting_all_reduce() as calls:
        switches = ctl.observe(5, records)
    return {"switches": [(s.layer, s.gemm, s.from_recipe, s.to_recipe) for s in switches],
            "all_reduces": len(calls), "recipes": [model[0].recipe.name, model[2].recipe.name]}


from tests.distributed import checks_ep, checks_tp  # noqa: E402,F401  register the expert- and tensor-parallel checks
