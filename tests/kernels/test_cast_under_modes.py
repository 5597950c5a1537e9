"""Under a Python dispatch mode (selective checkpointing's, a FLOP counter's, fake tensors') the Triton casts
run as their operators: the mode sees one ``lowprec::tile_amax`` and one ``lowprec::tile_cast`` per cast rather
than each of their allocations, with the bits of the direct call; fake tensors get the operators' shapes."""
from __future__ import annotations

from collections import Counter

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode

pytest.importorskip("triton")

import lowprec
from lowprec.kernels import triton_quant as TQ
from lowprec.quant import rowwise, tensorwise
from tests.kernels.test_triton_quant import assert_same, special


class Seen(TorchDispatchMode):
    """Counts the operators that reach the mode."""

    def __init__(self):
        super().__init__()
        self.ops = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops[str(func)] += 1
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("g", [tensorwise(), rowwise()])
def test_a_cast_under_a_mode_is_two_operators_with_the_same_bits(g):
    x = special(48, 160)
    assert not TQ.as_operators()
    direct = TQ.quantize_pair(x, "e4m3", g, "e4m3", g)
    with Seen() as seen:
        assert TQ.as_operators()
        under = TQ.quantize_pair(x, "e4m3", g, "e4m3", g)
    assert seen.ops["lowprec.tile_amax.default"] == 1 and seen.ops["lowprec.tile_cast.default"] == 1
    assert not any(name.startswith(("aten.new_empty", "aten.zeros", "aten.empty")) for name in seen.ops), seen.ops
    for q, r in zip(under[:2], direct[:2], strict=True):
        assert_same(q, r)


def test_a_converted_linear_runs_under_fake_tensors(triton_cpu):
    layer = lowprec.nn.Linear(64, 32, bias=False, recipe="fp8-current")
    with FakeTensorMode(allow_non_fake_inputs=True) as fake:
        x = fake.from_tensor(torch.randn(8, 64))
        y = layer(x)
    assert y.shape == (8, 32) and y.dtype == torch.float32
