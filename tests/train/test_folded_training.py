"""Training through the folded MX GEMMs (``kernels.fold``) against the emulation: the micro model, the same
initialisation and batches, six steps of ``mxfp8`` and ``mxfp4`` on the CPU told it has FP8 tensor cores
(``torch._scaled_mm`` runs there), so every GEMM takes the folded path. The fold rounds only elements under
2^-13 of their row's largest, and two GEMMs sum the same products in other orders: the first steps' losses
stay within ``FIRST`` of the emulated run's, all six within ``GAP`` (measured, relative: equal at the first two
steps; over six at most 9e-8 on one CPU, 2.2e-5 on another whose kernels sum in another order, which AdamW's
first steps amplify)."""
from __future__ import annotations

import dataclasses
import math
import sys

import pytest
import torch

from lowprec.kernels.gemm import GemmPath
from lowprec.nn import Linear
from lowprec.nn.plan import layer_plan
from lowprec.train.model import build_model
from tests.train.runs import CFG, MICRO, run

FIRST = 1e-6
GAP = 1e-3


def _losses(data, recipe: str, fp8: bool, monkeypatch) -> tuple[list[float], set]:
    C = sys.modules["lowprec.kernels.capability"]
    monkeypatch.setitem(C._KNOWN, torch.device("cpu"), C.Capability("cpu", "cpu", None, fp8, False, False, False))
    layer_plan.cache_clear()
    try:
        cfg = dataclasses.replace(CFG, recipe=recipe, steps=6, policy={"skip_small": False})
        model = build_model(MICRO, seed=cfg.seed)
        result = run(data, cfg, model=model)  # converted in place
        plans = [m.plan() for m in model.modules() if isinstance(m, Linear)]
        paths = {(p.fprop.path, p.dgrad.path, p.wgrad.path) for p in plans if p is not None and p.scaled}
    finally:
        layer_plan.cache_clear()
    return [row["loss"] for row in result.history], paths


@pytest.mark.parametrize("recipe", ["mxfp8", "mxfp4"])
def test_folded_gemms_train_as_the_emulated_ones(data, recipe, monkeypatch):
    folded, paths = _losses(data, recipe, True, monkeypatch)
    assert paths == {(GemmPath.FOLDED,) * 3}
    emulated, paths = _losses(data, recipe, False, monkeypatch)
    assert paths == {(GemmPath.EMULATED,) * 3}
    assert len(folded) == 6 and all(math.isfinite(v) for v in folded)
    for step, (a, b) in enumerate(zip(folded, emulated, strict=True), 1):
        assert abs(a - b) <= (FIRST if step <= 2 else GAP) * abs(b), (folded, emulated)
