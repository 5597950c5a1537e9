"""The state of :class:`lowprec.optim.Optimizer` keyed by parameter name, for checkpoints that outlive a layout.

``Optimizer.state_dict()`` is positional, as torch optimizers' are: the state of the i-th parameter
given to the optimizer. Positions depend on how the param groups were formed and say nothing about
which tensor is which once a model is wrapped or sharded differently. Keyed by each parameter's
name (its FQN without wrapper prefixes), the same state loads into an optimizer over the same model
whatever the order of its groups, under DDP, FSDP2 or in one process.
"""
from __future__ import annotations

from typing import Any

import torch
from torch import nn

from lowprec._checks import fail
from lowprec.distributed.launch import reshard, unwrap
from lowprec.optim import Optimizer
from lowprec.state.files import CheckpointError


def param_names(model: nn.Module, opt: Optimizer) -> list[str]:
    """The name (FQN, without wrapper prefixes) of each of ``opt``'s parameters, in its order."""
    reshard(model)
    names = {id(p): n for n, p in unwrap(model).named_parameters()}
    missing = [i for i, p in enumerate(opt.params) if id(p) not in names]
    if missing:
        fail("opt", "an optimizer over the model's own parameters", f"parameter {missing[0]} not in the model")
    return [names[id(p)] for p in opt.params]


def optimizer_state_by_name(model: nn.Module, opt: Optimizer, state: dict[str, Any] | None = None,
                            where: str = "the checkpoint") -> dict[str, Any]:
    """``opt.state_dict()`` with every per-parameter entry keyed by the parameter's name, not its position.

    ``state``: a positional state of an optimizer over the same parameters in the same order (a
    single-process checkpoint of this model, ``where``) instead of ``opt``'s own; a position it names
    that ``opt`` lacks is a :class:`CheckpointError`.
    """
    names = param_names(model, opt)
    sd = opt.state_dict() if state is None else state
    if state is not None:
        _check_positions(state, len(names), where)
    inner = sd["optimizer"]
    return {**sd,
            "optimizer": {"state": {names[i]: s for i, s in inner["state"].items()},
                          "param_groups": [{**g, "params": [names[i] for i in g["params"]]}
                                           for g in inner["param_groups"]]},
            "master_weights": dict(zip(names, sd["master_weights"]))}


def _check_positions(state: Any, n_params: int, where: str) -> None:
    """A positional state names positions ``0..n_params-1`` alone, and has one master entry per parameter."""
    try:
        inner, masters = state["optimizer"], state["master_weights"]
        positions = [*inner["state"], *(i for g in inner["param_groups"] for i in g["params"])]
        count = len(masters)
    except (KeyError, TypeError) as e:
        raise CheckpointError(f"checkpoint: expected the state of lowprec.optim.Optimizer in {where}, "
                              f"got {e!r}") from e
    bad = [i for i in positions if isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < n_params]
    if bad or count != n_params:
        got = f"parameter {bad[0]!r}" if bad else f"{count} master-weight entries"
        fail("checkpoint", f"optimizer state of this model's {n_params} parameters in {where}", got,
             CheckpointError)


def optimizer_state_by_position(model: nn.Module, opt: Optimizer, state: dict[str, Any]) -> dict[str, Any]:
    """The inverse of :func:`optimizer_state_by_name` for ``opt`` (what ``opt.load_state_dict`` takes).

    Each of ``opt``'s param groups takes the settings of the saved group holding the same parameters,
    whatever the order of the groups and of the parameters in them.
    """
    names = param_names(model, opt)
    index = {n: i for i, n in enumerate(names)}
    inner, masters = state["optimizer"], state["master_weights"]
    unknown = sorted((set(inner["state"]) | set(masters)) - set(index))
    if unknown:
        fail("checkpoint", "optimizer state for this model's parameters", f"state for {unknown[0]!r}",
             CheckpointError)
    saved_groups = {frozenset(g["params"]): g for g in inner["param_groups"]}
    groups, start = [], 0
    for group in opt.param_groups:
        members = names[start:start + len(group["params"])]
        start += len(members)
        saved = saved_groups.get(frozenset(members))
        if saved is None:
            fail("checkpoint", "a saved param group holding the same parameters as each of the optimizer's",
                 f"none holding {members[0]!r} and the {len(members) - 1} others of its group", CheckpointError)
        groups.append({**saved, "params": [index[n] for n in members]})
    return {**state,
            "optimizer": {"state": {index[n]: s for n, s in inner["state"].items()}, "param_groups": groups},
            "master_weights": [masters.get(n) for n in names]}


def optimizer_targets(model: nn.Module, opt: Optimizer) -> dict[str, torch.Tensor]:
    """What the inner optimizer updates for each parameter name: its FP32 master, or the parameter."""
    return {n: m if m is not None else p for n, p, m in zip(param_names(model, opt), opt.params, opt.master_weights)}
