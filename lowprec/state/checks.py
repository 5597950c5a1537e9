"""Does a checkpoint's state fit the run resuming it? Checked before it is loaded, for both kinds of checkpoint.

Checksums say a checkpoint is as it was saved, not that it fits: one saved from another model (a
key missing or extra, a tensor of another shape), with optimizer state of other shapes (which torch
would take, then fail at the first step), generator states torch refuses, or non-finite weights
(every step would be skipped) is refused here in one line naming the checkpoint and the first entry
at fault. The single-process checkpoints of :mod:`lowprec.train.checkpoint` and the distributed ones
of :mod:`lowprec.distributed.checkpoint` go through the same checks: the functions take shapes, so a
distributed checkpoint is checked from its metadata before its shards are read.
"""
from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import torch

from lowprec._checks import fail
from lowprec.optim.states import PER_GROUP_KEYS
from lowprec.state.files import CheckpointError

EXTRA_STATE = "_extra_state"
"""The state-dict suffix of a layer's extra state (delayed-scaling histories): saved only once recorded."""

Shape = tuple[int, ...]


def _module(key: str) -> str:
    return key.rsplit(".", 1)[0] if "." in key else ""


def check_model_state(expected: Mapping[str, Sequence[int]], saved: Mapping[str, Sequence[int]], where: str) -> None:
    """``expected``: the state-dict keys of the model being resumed and their (global) shapes; ``saved``: the
    checkpoint's. Extra state may be on either side alone (a layer that has not recorded yet), but only on a
    module of the model; every other key must be on both sides, with one shape."""
    for key in expected:
        if key not in saved and not key.endswith(EXTRA_STATE):
            fail("checkpoint", f"the state of this model in {where}", f"no {key!r} in it", CheckpointError)
    modules = {_module(k) for k in expected}
    for key in saved:
        if key not in expected and not (key.endswith(EXTRA_STATE) and _module(key) in modules):
            fail("checkpoint", f"the state of this model in {where}", f"{key!r}, which the model does not have",
                 CheckpointError)
    for key, shape in saved.items():
        if key in expected and not key.endswith(EXTRA_STATE) and tuple(shape) != tuple(expected[key]):
            fail("checkpoint", f"{key!r} of shape {tuple(expected[key])} as in this model",
                 f"shape {tuple(shape)} in {where}", CheckpointError)


def check_optimizer_shapes(by_name: Mapping[str, Any], targets: Mapping[str, Sequence[int]],
                           shape_of: Callable[[Any], Shape | None], where: str) -> None:
    """The optimizer state of a checkpoint, keyed by parameter name (see
    :func:`lowprec.distributed.named_state.optimizer_state_by_name`), against ``targets``: the (global)
    shape of what the optimizer updates for each name. A per-parameter state tensor is a scalar (a step
    count), one value per group (the scales of low-precision moments, which ``AdamWLP`` checks) or shaped
    like its target; a master weight is shaped like it. ``shape_of``: the shape of a saved value, None if
    it is not a tensor."""
    try:
        states, masters = by_name["optimizer"]["state"], by_name["master_weights"]
        entries = [(name, key, value) for name, entry in states.items() for key, value in entry.items()]
        entries += [(name, "master weight", value) for name, value in masters.items() if value is not None]
    except (KeyError, TypeError, AttributeError) as e:
        raise CheckpointError(f"checkpoint: expected optimizer state of lowprec.optim.Optimizer in {where}, "
                              f"got {e!r}") from e
    for name, key, value in entries:
        if name not in targets:
            fail("checkpoint", f"optimizer state for this model's parameters in {where}", f"state for {name!r}",
                 CheckpointError)
        shape = shape_of(value)
        if shape is None or (key != "master weight" and len(shape) == 0) or key in PER_GROUP_KEYS:
            continue  # per-group scales of low-precision moments: AdamWLP's load checks them
        if tuple(shape) != tuple(targets[name]):
            fail("checkpoint", f"optimizer state {key!r} of {name!r} of shape {tuple(targets[name])}",
                 f"shape {tuple(shape)} in {where}", CheckpointError)


def tensor_shape(value: Any) -> Shape | None:
    """:func:`check_optimizer_shapes`'s ``shape_of`` for state holding tensors."""
    return tuple(value.shape) if isinstance(value, torch.Tensor) else None


def check_rng_state(state: Any, what: str, where: str) -> torch.Tensor:
    """``state`` if a CPU generator takes it (tried on a fresh generator, not the global one)."""
    try:
        torch.Generator().set_state(state)
    except (RuntimeError, TypeError) as e:
        fail("checkpoint", f"a valid {what} generator state in {where}", f"one torch refuses ({_first_line(e)})",
             CheckpointError)
    return state


def set_cuda_rng_state(set_state: Callable[[], None], where: str) -> None:
    """Run ``set_state`` (setting CUDA generators from a checkpoint), refusing a state torch refuses in one line."""
    try:
        set_state()
    except (RuntimeError, TypeError) as e:
        fail("checkpoint", f"valid CUDA generator states in {where}", f"ones torch refuses ({_first_line(e)})",
             CheckpointError)


def _first_line(e: Exception) -> str:
    return str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__


def first_nonfinite(named: Iterable[tuple[str, torch.Tensor]]) -> str | None:
    """The name of the first floating-point tensor holding a NaN or an infinity, or None."""
    for name, t in named:
        if isinstance(t, torch.Tensor) and t.is_floating_point() and not bool(torch.isfinite(t).all()):
            return name
    return None


def refuse_nonfinite(found: str | None, where: str) -> None:
    if found is not None:
        fail("checkpoint", f"finite weights and optimizer state in {where}", f"NaN or inf in {found}",
             CheckpointError)
