"""``accelerate launch`` runs two CPU processes that train a model converted before ``accelerator.prepare``:
both ranks end with the same weights and the same delayed-scaling state, and the weights moved.

accelerate 1.15's ``--cpu`` starts one process unless an MPI host file is given; ``--multi_gpu`` starts the
ranks through torchrun, and the script's ``Accelerator(cpu=True)`` keeps them on the CPU (gloo)."""
from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("accelerate", reason="the integrations extra (accelerate) is not installed")

from tests.integrations.common import tiny_model

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = Path(__file__).with_name("accelerate_script.py")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_accelerate_launch_trains_a_converted_model_on_two_ranks(tmp_path):
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2",
           "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no",
           "--main_process_port", str(_free_port()), str(SCRIPT), str(tmp_path)]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
           "OMP_NUM_THREADS": "1"}
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    rank0, rank1 = (torch.load(tmp_path / f"rank{i}.pt", weights_only=True) for i in (0, 1))
    assert set(rank0) == set(rank1) and any(k.endswith("_extra_state") for k in rank0)
    for key in rank0:
        assert torch.equal(rank0[key], rank1[key]), key
    start = tiny_model().state_dict()
    assert not torch.equal(rank0["layers.0.attention.wq.weight"], start["layers.0.attention.wq.weight"])
