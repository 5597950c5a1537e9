"""A converted layer's training step on the CPU told it has FP8 tensor cores (``torch._scaled_mm`` runs there),
so that MX recipes take folded GEMMs: shared by the folded-GEMM and folded-cast tests."""
from __future__ import annotations

import sys
import warnings

import torch


def fp8_cpu(monkeypatch, fp8: bool = True) -> None:
    """The CPU's capability as one with (or without) FP8 tensor cores, for this test."""
    C = sys.modules["lowprec.kernels.capability"]
    cpu = torch.device("cpu")
    monkeypatch.setitem(C._KNOWN, cpu, C.Capability("cpu", "cpu", None, fp8, False, False, False))


def train_once(recipe: str):
    """A 256 -> 128 ``lowprec.nn.Linear`` of ``recipe``: one forward and backward of seeded data; returns its plan
    and (output, input gradient, weight gradient)."""
    import lowprec

    torch.manual_seed(0)
    lin = lowprec.nn.Linear(256, 128, recipe=recipe)
    x = torch.randn(64, 256, requires_grad=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        y = lin(x)
    y.backward(torch.randn(64, 128, generator=torch.Generator().manual_seed(1)))
    return lin.plan(), (y.detach(), x.grad, lin.weight.grad)
