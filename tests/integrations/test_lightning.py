"""LowprecPrecision in Lightning's Trainer: it converts, steps as lowprec's own loop does, skips a non-finite
step without touching anything, and a Trainer checkpoint resumes bit for bit."""
from __future__ import annotations

import copy
import warnings

import pytest
import torch

pytest.importorskip("lightning", reason="the integrations extra (lightning) is not installed")
import lightning as L
from torch.utils.data import DataLoader

import lowprec
from lowprec.integrations.conversion import NothingConvertedWarning
from lowprec.integrations.lightning import LowprecPrecision
from tests.integrations.common import (
    BLOCK_LINEARS,
    LR,
    POLICY,
    assert_same_tensors,
    batches,
    hand_loop,
    lm_loss,
    tiny_model,
)


class TinyLM(L.LightningModule):
    """The reference decoder as a LightningModule; ``nan_at``: the step whose loss is made NaN."""

    def __init__(self, nan_at: int | None = None) -> None:
        super().__init__()
        self.net = tiny_model()
        self.nan_at = nan_at
        self.losses: list[float] = []

    def training_step(self, batch, batch_idx):
        loss = lm_loss(self.net, *batch)
        self.losses.append(loss.item())
        return loss * float("nan") if self.global_step == self.nan_at else loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=LR)


def _loader(data) -> DataLoader:
    return DataLoader(data, batch_size=None, shuffle=False)


def _trainer(plugin, **kwargs) -> L.Trainer:
    return L.Trainer(accelerator="cpu", devices=1, plugins=[plugin], logger=False, enable_checkpointing=False,
                     enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0, **kwargs)


def _fit(module, plugin, data, ckpt_path=None, **kwargs) -> L.Trainer:
    trainer = _trainer(plugin, **kwargs)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*(num_workers|emulated|does not have many workers).*")
        trainer.fit(module, _loader(data), ckpt_path=ckpt_path)
    return trainer


def test_trainer_converts_and_steps_as_the_hand_loop():
    # delayed scaling: its banks fold although training_step never calls the LightningModule's forward
    data = batches(1) * 4  # one batch again and again: its loss falls
    settings = {"dtype": torch.bfloat16, "master_weights": True}
    module, plugin = TinyLM(), LowprecPrecision("fp8-delayed", POLICY, **settings)
    _fit(module, plugin, data, max_steps=len(data))
    linears = [m for m in module.net.modules() if isinstance(m, lowprec.nn.Linear)]
    assert len(linears) == BLOCK_LINEARS and all(m.recipe.name == "fp8-delayed" for m in linears)
    assert len(plugin.report.converted) == BLOCK_LINEARS
    model, opt, losses = hand_loop("fp8-delayed", data, **settings)
    assert module.losses == losses  # the same steps, bit for bit
    assert module.losses[-1] < module.losses[0]
    assert_same_tensors(module.net.state_dict(), model.state_dict())
    assert_same_tensors(plugin.state_dict()["optimizers"][0]["master_weights"], opt.master_weights)
    assert plugin.last_step is not None and not plugin.last_step.skipped


def test_a_non_finite_loss_skips_the_step_and_touches_nothing():
    data = batches(4)
    seen = {}

    class Snapshot(L.Callback):
        def on_train_batch_start(self, trainer, module, batch, batch_idx):
            if module.global_step == 2:
                seen["before"] = _state(module, trainer)

        def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
            if batch_idx == 2:
                seen["after"] = _state(module, trainer)
                seen["step"] = trainer.precision_plugin.last_step

    module = TinyLM(nan_at=2)
    plugin = LowprecPrecision("fp8-current", POLICY, dtype=torch.bfloat16, master_weights=True)
    with pytest.warns(UserWarning, match="step 3 skipped \\(non-finite loss\\)"):
        _fit(module, plugin, data, max_steps=len(data), callbacks=[Snapshot()])
    assert seen["step"].skipped and seen["step"].reason == lowprec.optim.NONFINITE_LOSS
    assert_same_tensors(seen["before"], seen["after"])
    guard = plugin.state_dict()["optimizers"][0]["guard"]
    assert guard["steps"] == 4 and guard["skipped_steps"] == 1
    assert plugin.last_step is not None and not plugin.last_step.skipped  # the step after it is taken


def _state(module, trainer) -> dict:
    """The weights, the optimizer's state and the masters (the guard's counts are meant to change)."""
    opt = trainer.optimizers[0]
    masters = trainer.precision_plugin.state_dict()["optimizers"][0]["master_weights"]
    return copy.deepcopy({"weights": module.state_dict(), "optimizer": opt.state_dict(), "masters": masters})


def test_a_trainer_checkpoint_resumes_bit_for_bit(tmp_path):
    data = batches(2)

    def plugin():
        return LowprecPrecision("fp8-delayed", POLICY, dtype=torch.bfloat16, master_weights=True)

    whole, whole_plugin = TinyLM(), plugin()
    whole_trainer = _fit(whole, whole_plugin, data, max_epochs=2)
    first = _fit(TinyLM(), plugin(), data, max_epochs=1)
    path = tmp_path / "half.ckpt"
    first.save_checkpoint(path)

    saved = torch.load(path, weights_only=True)
    entry = saved[LowprecPrecision.__qualname__]
    assert entry["delayed"] and not any(k.endswith("_extra_state") for k in saved["state_dict"])
    TinyLM().load_state_dict(saved["state_dict"])  # the unconverted module takes its weights, strictly

    resumed, resumed_plugin = TinyLM(), plugin()
    resumed_trainer = _fit(resumed, resumed_plugin, data, max_epochs=2, ckpt_path=path)
    assert resumed.losses == whole.losses[len(data):]
    assert_same_tensors(resumed.state_dict(), whole.state_dict(), "weights")
    assert_same_tensors(resumed_trainer.optimizers[0].state_dict(), whole_trainer.optimizers[0].state_dict(),
                        "optimizer")
    assert_same_tensors(resumed_plugin.state_dict(), whole_plugin.state_dict(), "plugin")


def test_the_trainer_clip_value_and_nothing_converted_are_said():
    with pytest.raises(ValueError, match="gradient_clip_val.*max_grad_norm"):
        _fit(TinyLM(), LowprecPrecision("fp8-current", POLICY), batches(1), max_steps=1, gradient_clip_val=1.0)
    with pytest.warns(NothingConvertedWarning, match="converted none of the model's linears"):
        _fit(TinyLM(), LowprecPrecision("fp8-current", lowprec.Policy(exclude=("*",))), batches(1), max_steps=1)
    with pytest.raises(ValueError, match="step_guard: expected True for master_weights"):
        LowprecPrecision("fp8-current", step_guard=False, master_weights=True)
