"""LowprecFabricPrecision in Lightning Fabric: the optimizer, shown to the plugin only at its first step (after
that step's backward), still steps as lowprec's own loop does; a non-finite step is skipped; ``fabric.save``
/ ``fabric.load`` of the plugin with the model and optimizer resume bit for bit."""
from __future__ import annotations

import copy
import warnings

import pytest
import torch

pytest.importorskip("lightning", reason="the integrations extra (lightning) is not installed")
import lightning as L

import lowprec
from lowprec.integrations.lightning import LowprecFabricPrecision
from tests.integrations.common import LR, POLICY, assert_same_tensors, batches, hand_loop, lm_loss, tiny_model

SETTINGS = {"dtype": torch.bfloat16, "master_weights": True}
"""BF16 weights with FP32 masters: the first step's gradients must reach lowprec's float32 accumulation."""


def _setup(plugin: LowprecFabricPrecision):
    fabric = L.Fabric(accelerator="cpu", devices=1, plugins=[plugin])
    net = tiny_model()
    opt = torch.optim.AdamW(net.parameters(), lr=LR)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*emulated.*")
        model, opt = fabric.setup(net, opt)
    return fabric, model, opt


def _train(fabric, model, opt, data, scale: float = 1.0) -> list[float]:
    losses = []
    for x, y in data:
        loss = lm_loss(model, x, y)
        fabric.backward(loss * scale)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def test_fabric_steps_as_the_hand_loop_and_skips_a_non_finite_step():
    data = batches(1) * 3
    plugin = LowprecFabricPrecision("fp8-delayed", POLICY, **SETTINGS)
    fabric, model, opt = _setup(plugin)
    losses = _train(fabric, model, opt, data)
    assert sum(isinstance(m, lowprec.nn.Linear) for m in model.modules()) == len(plugin.report.converted) > 0
    net, hand_opt, hand_losses = hand_loop("fp8-delayed", data, **SETTINGS)
    assert losses == hand_losses
    assert_same_tensors(model.state_dict(), net.state_dict())
    assert_same_tensors(plugin.state_dict()["optimizers"][0]["master_weights"], hand_opt.master_weights)

    before = copy.deepcopy(_weights_and_optimizer(model, opt, plugin))
    with pytest.warns(UserWarning, match="skipped \\(non-finite loss\\)"):
        _train(fabric, model, opt, data[:1], scale=float("nan"))
    assert plugin.last_step.skipped and plugin.last_step.reason == lowprec.optim.NONFINITE_LOSS
    assert_same_tensors(before, _weights_and_optimizer(model, opt, plugin))


def _weights_and_optimizer(model, opt, plugin) -> dict:
    """Parameters, optimizer state and masters (a skipped step's forward still records delayed amaxes)."""
    return {"params": dict(model.named_parameters()), "optimizer": opt.state_dict(),
            "masters": plugin.state_dict()["optimizers"][0]["master_weights"]}


def test_fabric_scales_the_loss_from_its_first_backward():
    # fp16 asks for dynamic loss scaling: the first backward, before the optimizer is adopted, is scaled too
    data = batches(1) * 2
    plugin = LowprecFabricPrecision("fp16", POLICY, dtype=torch.float16, master_weights=True)
    fabric, model, opt = _setup(plugin)
    losses = _train(fabric, model, opt, data)
    net, hand_opt, hand_losses = hand_loop("fp16", data, dtype=torch.float16, master_weights=True,
                                           loss_scale="dynamic")
    assert losses == hand_losses
    assert_same_tensors(model.state_dict(), net.state_dict())
    saved = plugin.state_dict()["optimizers"][0]
    assert saved["loss_scale"] == hand_opt.state_dict()["loss_scale"] == {"scale": 2.0**16, "growth_tracker": 2}


def test_fabric_save_and_load_resume_bit_for_bit(tmp_path):
    data = batches(4)

    def plugin():
        return LowprecFabricPrecision("fp8-delayed", POLICY, **SETTINGS)

    whole_plugin = plugin()
    fabric, whole, whole_opt = _setup(whole_plugin)
    whole_losses = _train(fabric, whole, whole_opt, data)

    first_plugin = plugin()
    fabric, first, first_opt = _setup(first_plugin)
    _train(fabric, first, first_opt, data[:2])
    fabric.save(tmp_path / "half.ckpt", {"model": first, "optimizer": first_opt, "lowprec": first_plugin})

    resumed_plugin = plugin()
    fabric, resumed, resumed_opt = _setup(resumed_plugin)
    # loaded before the optimizer's first step: the plugin adopts it then, and loads its state into it
    fabric.load(tmp_path / "half.ckpt", {"model": resumed, "optimizer": resumed_opt, "lowprec": resumed_plugin})
    assert _train(fabric, resumed, resumed_opt, data[2:]) == whole_losses[2:]
    assert_same_tensors(resumed.state_dict(), whole.state_dict(), "weights")
    assert_same_tensors(resumed_opt.state_dict(), whole_opt.state_dict(), "optimizer")
    assert_same_tensors(resumed_plugin.state_dict(), whole_plugin.state_dict(), "plugin")


def test_fabric_refuses_clipping_outside_the_guard():
    fabric, model, opt = _setup(LowprecFabricPrecision("fp8-current", POLICY))
    loss = lm_loss(model, *batches(1)[0])
    fabric.backward(loss)
    with pytest.raises(ValueError, match="clip_gradients.*max_grad_norm"):
        fabric.clip_gradients(model, opt, max_norm=1.0)
