"""Argument checks shared by every layer.

Every error lowprec raises for bad input names the argument, what was expected and what was
received, in one shape: ``"<argument>: expected <what>, got <what>"``.
"""
from __future__ import annotations

import enum
from typing import Any, NoReturn

import torch


def fail(name: str, expected: str, got: Any, exc: type[Exception] = ValueError) -> NoReturn:
    raise exc(f"{name}: expected {expected}, got {got}")


def describe(x: Any) -> str:
    """A short description of a value for an error message."""
    if isinstance(x, torch.Tensor):
        return f"a {x.dtype} tensor of shape {tuple(x.shape)} on {x.device}"
    return f"{x!r} ({type(x).__name__})"


def check_tensor(name: str, x: Any, *, floating: bool = True) -> torch.Tensor:
    """``x`` must be a tensor; with ``floating`` a real floating-point one."""
    if not isinstance(x, torch.Tensor):
        fail(name, "a torch.Tensor", describe(x), TypeError)
    if floating and (not x.dtype.is_floating_point or x.dtype.itemsize < 2):
        # float8 dtypes are floating point but are storage, not values to quantize
        fail(name, "a float32, float16 or bfloat16 tensor", describe(x), TypeError)
    return x


def check_same_device(**tensors: torch.Tensor | None) -> None:
    devices = {n: t.device for n, t in tensors.items() if t is not None}
    if len(set(devices.values())) > 1:
        got = ", ".join(f"{n} on {d}" for n, d in devices.items())
        fail("/".join(devices), "tensors on one device", got)


def check_choice(name: str, value: Any, choices: Any) -> Any:
    if value not in choices:
        fail(name, "one of " + ", ".join(map(repr, choices)), repr(value))
    return value


def check_positive_int(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        fail(name, "a positive int", describe(value))
    return value


class Choice(enum.Enum):
    """An enum of string values a user names (``--grad-comm fp8``, ``optim_states="int8"``)."""

    @classmethod
    def parse(cls, value: Any, name: str) -> Any:
        """``value`` as a member; an unknown one is refused naming the argument ``name``."""
        if isinstance(value, cls):
            return value
        return cls(check_choice(name, value, [m.value for m in cls]))
