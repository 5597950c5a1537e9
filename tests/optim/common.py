"""Small models and data shared by the optimizer tests."""
from __future__ import annotations

import copy

import torch


def mlp(dtype: torch.dtype = torch.float32, seed: int = 0) -> torch.nn.Module:
    """A two-layer MLP, 8 -> 16 -> 4, initialised from ``seed`` then cast to ``dtype``."""
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))
    return model.to(dtype)


def batch(step: int, dtype: torch.dtype = torch.float32, n: int = 32) -> tuple[torch.Tensor, torch.Tensor]:
    """The inputs and targets of step ``step``: the same on every call."""
    g = torch.Generator().manual_seed(1000 + step)
    x = torch.randn(n, 8, generator=g)  # (n, 8)
    y = torch.randn(n, 4, generator=g)  # (n, 4)
    return x.to(dtype), y


def mse(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return (model(x).float() - y).pow(2).mean()  # loss in float32 whatever the model's dtype


def bits(t: torch.Tensor) -> torch.Tensor:
    """The bytes of ``t``: equal bits means equal values, NaNs included."""
    return t.detach().contiguous().reshape(-1).view(torch.uint8)


def clone_state(sd):
    """A deep copy of an optimizer state_dict whose tensors are cloned (so later steps cannot alter it)."""
    return copy.deepcopy(sd)


def assert_same_state(a, b, path: str = "state") -> None:
    """``a`` and ``b`` (nested dicts/lists/tensors/numbers) are equal, tensors bit for bit (dtype too)."""
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape, path
        assert torch.equal(bits(a), bits(b)), path
    elif isinstance(a, dict):
        assert isinstance(b, dict) and set(a) == set(b), path
        for k in a:
            assert_same_state(a[k], b[k], f"{path}[{k!r}]")
    elif isinstance(a, (list, tuple)):
        assert isinstance(b, (list, tuple)) and len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b)):
            assert_same_state(x, y, f"{path}[{i}]")
    else:
        assert a == b, f"{path}: {a!r} != {b!r}"
