import math
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest
import torch

from lowprec.train.checkpoint import (
    CheckpointError,
    latest_checkpoint,
    list_checkpoints,
    load_checkpoint,
    save_checkpoint,
)


def _state():
    return {
        "model": {"w": torch.randn(4, 8), "b": torch.arange(5, dtype=torch.bfloat16)},
        "optim": {"state": {0: {"step": torch.tensor(3.0), "exp_avg": torch.ones(2)}},
                  "param_groups": [{"lr": 1e-3, "betas": (0.9, 0.95), "params": [0]}]},
        "rng": torch.get_rng_state(),
        "step": 7, "recipe": "mxfp4", "scale": math.inf, "nothing": None, "flag": True,
    }


def test_round_trip_keeps_values_types_and_int_keys(tmp_path):
    state = _state()
    path = save_checkpoint(tmp_path, 7, state)
    assert path.name == "step_00000007.json"
    step, back = load_checkpoint(path)
    assert step == 7
    assert torch.equal(back["model"]["w"], state["model"]["w"])
    assert back["model"]["b"].dtype == torch.bfloat16 and torch.equal(back["model"]["b"], state["model"]["b"])
    assert list(back["optim"]["state"]) == [0]  # an int key, as torch optimizers need
    assert back["optim"]["param_groups"][0]["betas"] == (0.9, 0.95)
    assert torch.equal(back["rng"], state["rng"])
    assert back["scale"] == math.inf and back["nothing"] is None and back["flag"] is True
    assert back["recipe"] == "mxfp4" and back["step"] == 7


def test_adamw_resumed_from_a_checkpoint_steps_identically(tmp_path):
    torch.manual_seed(0)
    w = torch.nn.Parameter(torch.randn(8, 8))
    opt = torch.optim.AdamW([w], lr=1e-2)
    for _ in range(3):
        w.grad = torch.randn(8, 8)
        opt.step()
    save_checkpoint(tmp_path, 3, {"w": w, "opt": opt.state_dict()})
    grad = torch.randn(8, 8)
    w.grad = grad
    opt.step()
    _, state = load_checkpoint(tmp_path)
    w2 = torch.nn.Parameter(state["w"])
    opt2 = torch.optim.AdamW([w2], lr=1e-2)
    opt2.load_state_dict(state["opt"])
    w2.grad = grad
    opt2.step()
    assert torch.equal(w2, w)


def test_keeps_the_last_k_and_ignores_incomplete_pairs(tmp_path):
    for step in range(1, 6):
        save_checkpoint(tmp_path, step * 10, {"x": torch.full((2,), float(step))}, keep=2)
    assert [s for s, _ in list_checkpoints(tmp_path)] == [40, 50]
    assert sorted(os.listdir(tmp_path)) == ["step_00000040.json", "step_00000040.safetensors",
                                            "step_00000050.json", "step_00000050.safetensors"]
    # a tensors file whose JSON never arrived, and a temporary file, are not checkpoints
    (tmp_path / "step_00000060.safetensors").write_bytes(b"partial")
    (tmp_path / ".step_00000060.json.tmp-123").write_bytes(b"{")
    assert latest_checkpoint(tmp_path).name == "step_00000050.json"
    assert load_checkpoint(tmp_path)[1]["x"].tolist() == [5.0, 5.0]


@pytest.mark.parametrize("damage", ["truncate", "flip"])
def test_a_damaged_tensors_file_is_named_and_refused(tmp_path, damage):
    save_checkpoint(tmp_path, 1, {"x": torch.zeros(100)})
    path = save_checkpoint(tmp_path, 2, {"x": torch.ones(100)})
    blob = path.with_suffix(".safetensors").read_bytes()
    bad = blob[: len(blob) // 2] if damage == "truncate" else blob[:-1] + bytes([blob[-1] ^ 1])
    path.with_suffix(".safetensors").write_bytes(bad)
    with pytest.raises(CheckpointError, match="step_00000002.safetensors.*corrupt or truncated"):
        load_checkpoint(tmp_path)  # the newest is damaged: refused, not silently replaced by step 1
    assert load_checkpoint(tmp_path / "step_00000001.json")[1]["x"].sum() == 0


def test_a_truncated_json_or_missing_tensors_is_named(tmp_path):
    path = save_checkpoint(tmp_path, 1, {"x": torch.zeros(3)})
    text = path.read_bytes()
    path.write_bytes(text[:20])
    with pytest.raises(CheckpointError, match="corrupt or truncated file '.*step_00000001.json'"):
        load_checkpoint(path)
    path.write_bytes(text)
    path.with_suffix(".safetensors").unlink()
    with pytest.raises(CheckpointError, match="no '.*step_00000001.safetensors'"):
        load_checkpoint(path)
    (tmp_path / "empty").mkdir()
    with pytest.raises(CheckpointError, match="checkpoint: expected a directory holding a complete checkpoint"):
        load_checkpoint(tmp_path / "empty")


def test_unsupported_state_is_refused(tmp_path):
    with pytest.raises(TypeError, match="state: expected tensors, numbers.*got object at '/x'"):
        save_checkpoint(tmp_path / "c", 0, {"x": object()})
    assert not (tmp_path / "c").exists()


_SAVER = textwrap.dedent("""
    import sys, torch
    from lowprec.train.checkpoint import save_checkpoint
    step = 0
    while True:
        step += 1
        # 32 MiB per save, so each save spends a while writing
        save_checkpoint(sys.argv[1], step, {"x": torch.full((8 << 20,), float(step)), "step": step}, keep=2)
""")


def _kill_while_saving(directory) -> bool:
    """Start a saver, SIGKILL it while a third save is being written; True if a partial file was left."""
    proc = subprocess.Popen([sys.executable, "-c", _SAVER, str(directory)])
    try:
        deadline = time.monotonic() + 60
        while not (len(list_checkpoints(directory)) >= 2 and any(".tmp-" in n for n in os.listdir(directory))):
            assert proc.poll() is None and time.monotonic() < deadline
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    return any(".tmp-" in n for n in os.listdir(directory))


@pytest.mark.slow
def test_a_process_killed_while_saving_leaves_the_previous_checkpoint_intact(tmp_path):
    # the rename can win the race against the kill; then try again, so the kill lands mid-write
    for attempt in range(5):
        directory = tmp_path / str(attempt)
        if _kill_while_saving(directory):
            break
    else:
        pytest.fail("five kills all landed between saves")
    step, state = load_checkpoint(directory)
    assert state["step"] == step and torch.equal(state["x"], torch.full((8 << 20,), float(step)))
    # every complete pair is valid; the partial one is not listed
    for s, path in list_checkpoints(directory):
        assert load_checkpoint(path)[0] == s
    # the next save clears the leftovers
    save_checkpoint(directory, step + 100, {"x": torch.zeros(1)})
    assert not any(".tmp-" in n for n in os.listdir(directory))
