"""Stochastic rounding of BF16/FP16 weights updated without float32 master copies.

[Note: stochastic rounding of weights]
Without masters a weight update smaller than half the spacing of BF16 numbers is lost when
rounded to nearest. Rounded stochastically -- up with probability equal to the distance from the
lower neighbour, in units of the spacing -- it is kept on average: ``E[round(w + u)] = w + u``, so
many small updates add up as they would in float32, at the cost of noise of at most one spacing.

For the step the low-precision parameters are widened in place to float32 (``param.data`` is
swapped for a float32 copy), any torch optimizer updates them and creates its state in float32,
and the result is rounded stochastically back into the parameter's own dtype. So float32 copies
exist only during ``step``, when activations are gone, never during forward and backward.
The random bits come from a seeded generator per device, saved in the optimizer's state_dict.
"""
from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch

from lowprec import formats
from lowprec._checks import describe, fail

_FORMAT = {torch.bfloat16: "bf16", torch.float16: "fp16"}


def stochastic_round(x: torch.Tensor, dtype: torch.dtype, generator: torch.Generator | None = None) -> torch.Tensor:
    """``x`` rounded stochastically onto the grid of ``dtype`` (bfloat16 or float16), as a ``dtype`` tensor."""
    if dtype not in _FORMAT:
        fail("dtype", "torch.bfloat16 or torch.float16", describe(dtype))
    on_grid = formats.round_to(x, _FORMAT[dtype], rounding="stochastic", generator=generator)  # float32
    return on_grid.to(dtype)  # exact: already on the grid


class StochasticRounding:
    """Seeded random bits, one generator per device, and the widen-then-round-back of a step."""

    def __init__(self, seed: int) -> None:
        if isinstance(seed, bool) or not isinstance(seed, int):
            fail("seed", "an int", describe(seed), TypeError)
        self.seed = seed
        self._generators: dict[str, torch.Generator] = {}

    def generator(self, device: torch.device) -> torch.Generator:
        key = str(device)
        if key not in self._generators:
            self._generators[key] = torch.Generator(device=device).manual_seed(self.seed)
        return self._generators[key]

    @contextmanager
    def widened(self, params: list[torch.Tensor], stochastic: bool = True) -> Iterator[None]:
        """Low-precision ``params`` are float32 inside; on leaving they are rounded back into their dtype.

        ``stochastic=False`` rounds to nearest, which is exact when the values were not changed
        (used to load optimizer state in float32). If the body raises, parameters are rounded to
        nearest and their gradients dropped, so the model keeps its dtype.
        """
        widened = [(p, p.dtype) for p in params if p.dtype in _FORMAT]
        for p, _ in widened:
            p.data = p.data.float()
        done = False
        try:
            yield
            done = True
        finally:
            for p, dtype in widened:
                p.grad = None  # a float32 grad cannot stay on a parameter going back to bf16/fp16
                hp = p.data
                if done and stochastic:
                    p.data = stochastic_round(hp, dtype, self.generator(hp.device))
                else:
                    p.data = hp.to(dtype)

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {device: g.get_state() for device, g in self._generators.items()}

    def load_state_dict(self, state: Any) -> None:
        name = "state_dict['stochastic_rounding']"
        if not isinstance(state, dict):
            fail(name, "a dict of device -> generator state", describe(state))
        for device, s in state.items():
            if not isinstance(s, torch.Tensor) or s.dtype != torch.uint8:
                fail(f"{name}[{device!r}]", "a uint8 generator state tensor", describe(s))
            self.generator(torch.device(device)).set_state(s)
