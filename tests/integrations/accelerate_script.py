"""Trained by ``accelerate launch`` from test_accelerate.py: the model converted before ``accelerator.prepare``
(mixed_precision "no"), two steps on each rank's own batch, each rank's weights and delayed-scaling state
saved to OUT_DIR/rank{i}.pt. Usage: accelerate launch ... accelerate_script.py OUT_DIR"""
from __future__ import annotations

import sys
import warnings

import torch
from accelerate import Accelerator

import lowprec
from lowprec.distributed.amax import sync_amaxes
from tests.integrations.common import LR, POLICY, batches, lm_loss, tiny_model

STEPS = 2


def main(out_dir: str) -> None:
    torch.set_num_threads(1)
    accelerator = Accelerator(cpu=True)
    model = tiny_model()  # the same weights on every rank (its own seeded generator)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*emulated.*")
        report = lowprec.convert(model, "fp8-delayed", POLICY)
    assert report.converted, report
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    model, opt = accelerator.prepare(model, opt)
    data = batches(STEPS * accelerator.num_processes)
    for step in range(STEPS):
        x, y = data[step * accelerator.num_processes + accelerator.process_index]  # this rank's batch
        loss = lm_loss(model, x, y)
        accelerator.backward(loss)
        sync_amaxes(model)  # the ranks' delayed scales agree: one all-reduce per step
        opt.step()
        opt.zero_grad()
    state = accelerator.unwrap_model(model).state_dict()
    torch.save({k: v.detach().clone() for k, v in state.items()}, f"{out_dir}/rank{accelerator.process_index}.pt")


if __name__ == "__main__":
    main(sys.argv[1])
