"""Layers, data and spies shared by the tests of ``lowprec.nn.Linear``.

[Note: telling the three GEMMs apart]
The spies identify a GEMM by its operands' shapes, so the tests use M tokens, K in-features and N
out-features that are all different: fprop multiplies ``(M, K) @ (N, K).T``, dgrad
``(M, N) @ (K, N).T`` and wgrad ``(N, M) @ (K, M).T``.
"""
from __future__ import annotations

import torch
import torch.nn as nn

from lowprec import kernels as K
from lowprec import recipes as R
from lowprec.kernels import routed
from lowprec.nn import Linear
from lowprec.quant import QuantizedTensor

UNSCALED = ("bf16", "fp16")
"""Presets that only cast operands to a 16-bit dtype (no scaled GEMM)."""
LOW_PRECISION = tuple(n for n in R.names() if n not in UNSCALED)
"""Presets whose three GEMMs run on scaled low-precision operands."""


def randn(*shape: int, seed: int, scale: float = 1.0, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Normal data from its own generator, so a test's numbers do not depend on the tests before it."""
    return (torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * scale).to(dtype)


def make_linear(recipe: str | R.Recipe | None, in_features: int = 128, out_features: int = 256, *,
                bias: bool = True, seed: int = 0, dtype: torch.dtype = torch.float32) -> Linear:
    """A ``lowprec.nn.Linear`` with weights ~ N(0, 1/in_features) and a small bias, from ``seed``."""
    lin = Linear(in_features, out_features, bias=bias, dtype=dtype, recipe=recipe)
    with torch.no_grad():
        lin.weight.copy_(randn(out_features, in_features, seed=seed, scale=in_features**-0.5))
        if bias:
            lin.bias.copy_(randn(out_features, seed=seed + 1, scale=0.1))
    return lin


def plain_copy(lin: nn.Linear) -> nn.Linear:
    """A ``torch.nn.Linear`` with copies of ``lin``'s parameters."""
    out = nn.Linear(lin.in_features, lin.out_features, bias=lin.bias is not None, dtype=lin.weight.dtype)
    out.load_state_dict({k: v for k, v in lin.state_dict().items() if k in ("weight", "bias")})
    return out


def bits(t: torch.Tensor) -> torch.Tensor:
    """The bytes of ``t`` (float8 included): equal bits means equal values."""
    return t.detach().contiguous().reshape(-1).view(torch.uint8)


def assert_same_quantized(got: QuantizedTensor, want: QuantizedTensor, what: str) -> None:
    """Same format, granularity and shape; data, scales and global scale equal bit for bit."""
    assert got.fmt.name == want.fmt.name, f"{what}: format {got.fmt.name} != {want.fmt.name}"
    assert got.granularity == want.granularity, f"{what}: granularity {got.granularity} != {want.granularity}"
    assert tuple(got.shape) == tuple(want.shape), f"{what}: shape {tuple(got.shape)} != {tuple(want.shape)}"
    assert got.data.dtype == want.data.dtype and got.data.shape == want.data.shape, f"{what}: data layout"
    assert torch.equal(bits(got.data), bits(want.data)), f"{what}: data differs"
    assert torch.equal(bits(got.scale), bits(want.scale)), f"{what}: scales differ"
    assert (got.global_scale is None) == (want.global_scale is None), f"{what}: global scale presence"
    if want.global_scale is not None:
        assert torch.equal(bits(got.global_scale), bits(want.global_scale)), f"{what}: global scale differs"


def gemm_name(a: QuantizedTensor, m: int, k: int, n: int) -> str:
    """Which GEMM takes ``a`` as its left operand (see [Note: telling the three GEMMs apart])."""
    names = {(m, k): "fprop", (m, n): "dgrad", (n, m): "wgrad"}
    return names[tuple(a.shape)]


class GemmSpy:
    """Records the operands of every ``lowprec.kernels.scaled_mm`` call, then runs it."""

    def __init__(self, monkeypatch) -> None:
        self.calls: list[tuple[QuantizedTensor, QuantizedTensor]] = []
        original = K.scaled_mm

        def spy(a, b, *args, **kwargs):
            self.calls.append((a, b))
            return original(a, b, *args, **kwargs)

        monkeypatch.setattr(K, "scaled_mm", spy)

    def by_gemm(self, m: int, k: int, n: int) -> dict[str, tuple[QuantizedTensor, QuantizedTensor]]:
        out = {gemm_name(a, m, k, n): (a, b) for a, b in self.calls}
        assert len(out) == len(self.calls), "a GEMM ran more than once"
        return out


class QuantizeSpy:
    """Records every ``lowprec.kernels.quantize`` call: its input, its result and torch's RNG state
    before it (stochastic rounding draws from it, so the call can be replayed bit for bit)."""

    def __init__(self, monkeypatch) -> None:
        self.calls: list[tuple[torch.Tensor, QuantizedTensor, torch.Tensor]] = []
        original = K.quantize

        def spy(x, *args, **kwargs):
            state = torch.get_rng_state()
            q = original(x, *args, **kwargs)
            self.calls.append((x, q, state))
            return q

        monkeypatch.setattr(K, "quantize", spy)
        monkeypatch.setattr(routed, "quantize", spy)  # what kernels.cast and requantize_many call

    def rng_state_of(self, q: QuantizedTensor) -> torch.Tensor:
        for _, result, state in self.calls:
            if result is q:
                return state
        raise AssertionError("this operand was not made by lowprec.kernels.quantize")

    def reads(self, t: torch.Tensor) -> int:
        """How many calls quantized (a view of) ``t``'s storage."""
        ptr = t.untyped_storage().data_ptr()
        return sum(x.untyped_storage().data_ptr() == ptr for x, _, _ in self.calls)

    def shapes(self) -> list[tuple[int, ...]]:
        return [tuple(x.shape) for x, _, _ in self.calls]


def saved_for_backward(fn) -> tuple[int, list[torch.Tensor]]:
    """The tensors autograd saves for backward while ``fn()`` runs, and the bytes of their distinct
    storages."""
    kept: list[torch.Tensor] = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        kept.append(t)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn()
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in kept}
    return sum(storages.values()), kept


def partitioned_graphs(model: nn.Module, x: torch.Tensor) -> dict[str, torch.fx.GraphModule]:
    """The forward and backward graphs ``torch.compile`` hands inductor (its decompositions, its min-cut
    partitioner) for one step of ``model`` on ``x``: {"forward": ..., "backward": ...}."""
    from torch._decomp import core_aten_decompositions
    from torch._functorch.aot_autograd import aot_module_simplified
    from torch._functorch.partitioners import min_cut_rematerialization_partition

    graphs = {}

    def keep(name):
        def compiler(gm, _):
            graphs[name] = gm
            return gm.forward
        return compiler

    def backend(gm, example):
        return aot_module_simplified(gm, example, fw_compiler=keep("forward"), bw_compiler=keep("backward"),
                                     partition_fn=min_cut_rematerialization_partition,
                                     decompositions=core_aten_decompositions())

    torch._dynamo.reset()
    torch.compile(model, backend=backend, fullgraph=True)(x).sum().backward()
    return graphs


def calls(gm: torch.fx.GraphModule, op) -> int:
    """How many nodes of ``gm`` call ``op``."""
    return sum(n.target is op for n in gm.graph.nodes)
