"""The tensor-parallel checks (see [Note: one spawn for the whole directory] in ``harness``), registered in
``checks.CHECKS`` when ``checks`` imports this module."""
from __future__ import annotations

import torch

from lowprec import recipes
from lowprec.distributed.tensor_parallel import parallelize
from lowprec.distributed.traffic import count_traffic
from lowprec.kernels import CastSpec
from lowprec.nn.casts import agreed_scale
from lowprec.ranks import local
from tests.distributed import tp_common as TP
from tests.distributed.checks import check


@check
def tp_training(rank: int, world: int) -> dict:
    """The small decoder split over the ranks, trained a few steps in every recipe of ``TP.RECIPES``."""
    out = {}
    for name in TP.RECIPES:
        m = TP.model(name)
        split = parallelize(m)
        out[name] = {"split": (split.linears, split.fp8_gathered), **TP.train(m)}
    return out


@check
def tp_traffic(rank: int, world: int) -> dict:
    """Bytes of one training step's collectives, by kind: fp8-current gathers its regions' inputs as codes, bf16
    in the activations' dtype (float32 here)."""
    out = {}
    for name in ("bf16", "fp8-current"):
        m = TP.model(name)
        parallelize(m)
        with count_traffic() as traffic:
            TP.step(m)
        out[name] = dict(traffic)
    return out


@check
def tp_compiled_gather(rank: int, world: int) -> dict:
    """One fp8-current step of the split decoder, eager and compiled (``aot_eager``: the same kernels): the
    output, the gradients of a colwise and a rowwise weight, and the bytes of each."""
    out = {}
    for mode in ("eager", "compiled"):
        m = TP.model("fp8-current")
        parallelize(m)
        run = torch.compile(m, backend="aot_eager") if mode == "compiled" else m
        toks = TP.tokens()
        with count_traffic() as traffic:
            logits = run(toks[:, :-1])
            logits.float().square().mean().backward()
        grads = {k: local(p.grad).clone() for k, p in m.named_parameters() if k in TP.WATCHED[:2]}
        out[mode] = {"logits": logits.detach(), "grads": grads, "traffic": dict(traffic)}
    return out


@check
def tp_backward_weight_scales(rank: int, world: int) -> dict:
    """How often backward agrees a scale for weight.T's cast made again (``weight_t_again``), in one fp8-current
    step, and the all-reduced bytes of the step: forward's agreed scale is kept for it instead."""
    import lowprec.nn.function as function

    m = TP.model("fp8-current")
    split = parallelize(m)
    real, calls = function.agreed_scale, []
    function.agreed_scale = lambda *a, **k: calls.append(1) or real(*a, **k)
    try:
        with count_traffic() as traffic:
            TP.step(m)
    finally:
        function.agreed_scale = real
    return {"calls": len(calls), "all_reduce": traffic["all_reduce"], "split": split.linears}


@check
def tp_agreed_scale(rank: int, world: int) -> dict:
    """Each rank's half of one tensor: the scale agreed over the ranks, finite and with a NaN in rank 1's half."""
    whole = torch.randn(8, 16, generator=torch.Generator().manual_seed(3)) * 5
    part = whole.chunk(world, 1)[rank].clone()
    spec = CastSpec.of("e4m3", recipes.get("fp8-current").fprop.lhs.granularity)
    finite = agreed_scale(part, spec, torch.distributed.group.WORLD)
    if rank == 1:
        part[0, 0] = float("nan")
    return {"finite": finite, "nan": agreed_scale(part, spec, torch.distributed.group.WORLD),
            "alone": agreed_scale(part, spec, None)}


@check
def tp_refusals(rank: int, world: int) -> dict:
    """What ``parallelize`` refuses, by message: a split that cuts the recipe's blocks; a model split twice."""
    out = {}
    for key, m in (("blocks", TP.model("fp8-blockwise")), ("twice", _split(TP.model("bf16")))):
        before = {n: type(p) for n, p in m.named_parameters()}
        try:
            parallelize(m)
            out[key] = None
        except (ValueError, TypeError) as e:
            out[key] = str(e)
        out[key + ":untouched"] = before == {n: type(p) for n, p in m.named_parameters()}
    return out


@check
def tp_hf_llama(rank: int, world: int) -> dict:
    """A Hugging Face Llama split over the ranks (its blocks take keyword arguments): the losses of a few steps."""
    m = TP.hf_llama("fp8-current")
    split = parallelize(m)
    return {"split": (split.linears, split.fp8_gathered), **TP.train(m, hf=True)}


def _split(m):
    parallelize(m)
    return m
