"""The golden training runs: a few steps of the micro model in every recipe and kind of weight, reduced to
the bits of each step's loss, of the validation loss, and of every tensor of the model's state after the last step.

[Note: golden runs]
A refactor of the layers' casts and save plans must change no number. This module trains each variant
and writes what it saw to ``golden.json``; ``test_golden.py`` trains them again and asserts every bit is
the same. Bits are comparable across machines only where the arithmetic is pinned, so each run happens in
a child process whose environment fixes it: PyTorch's own kernels at their ``default`` dispatch level
(no AVX2/AVX-512 variants), MKL in its conditional-numerical-reproducibility mode (``MKL_CBWR``), oneDNN
at its lowest instruction set, and one thread (no reduction split across threads). A CPU with AMX tiles
computes other bits under the same pins (seen on one: most final weights differ in their last bits, the
losses of the FP32 variants not, fp16's too; which kernel takes another path there is not pinned down), so
the bits are recorded per class of CPU: ``golden.json`` for x86-64 without AMX, ``golden_amx.json`` with
it. Any x86-64 machine of a class then computes that class's bits with the same torch; another torch
version records its own files.

Regenerate after a change that is meant to move numbers (say why in the commit), on a machine of each
class: ``python -m tests.golden.run --write`` (it writes its own class's file).
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

GOLDEN_FILES = {"x86-64": Path(__file__).with_name("golden.json"),
                "x86-64 with AMX": Path(__file__).with_name("golden_amx.json")}
"""The recorded bits by class of CPU (see [Note: golden runs])."""


def cpu_class() -> str:
    import torch

    return "x86-64 with AMX" if torch.cpu._is_amx_tile_supported() else "x86-64"


def golden_file() -> Path:
    """This machine's class's file."""
    return GOLDEN_FILES[cpu_class()]
PINNED_ENV = {"ATEN_CPU_CAPABILITY": "default", "MKL_CBWR": "COMPATIBLE", "ONEDNN_MAX_CPU_ISA": "SSE41",
              "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
STEPS = 4


def variants() -> dict[str, dict]:
    """Name -> TrainConfig fields: every preset with plain FP32 weights, then the other kinds of weight the
    layers' plans tell apart (cached casts under gradient accumulation, FP8 primary weights in and out of the
    recipe's format, FP8 saved activations)."""
    from lowprec import recipes

    out = {name: {"recipe": name} for name in recipes.names()}
    for name in ("fp8-current", "fp8-delayed", "mxfp8", "nvfp4"):
        out[f"{name}+accum"] = {"recipe": name, "grad_accum": 2}
    for name in ("fp8-current", "fp8-delayed", "fp8-rowwise"):
        out[f"{name}+fp8w"] = {"recipe": name, "dtype": "bfloat16", "fp8_weights": True}
    out["fp8-current+fp8act"] = {"recipe": "fp8-current", "fp8_activations": "tensor"}
    return out


def _tensors(prefix: str, obj, out: dict[str, str]) -> None:
    """Every tensor inside ``obj`` (dicts, lists, tensors) as name -> digest of its bytes."""
    import torch

    if isinstance(obj, torch.Tensor):
        out[prefix] = f"{tuple(obj.shape)} {obj.dtype} " + hashlib.sha256(
            obj.detach().contiguous().cpu().reshape(-1).view(torch.uint8).numpy().tobytes()).hexdigest()[:16]
    elif isinstance(obj, dict):
        for k, v in obj.items():
            _tensors(f"{prefix}.{k}" if prefix else str(k), v, out)
    elif isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            _tensors(f"{prefix}.{i}", v, out)


def run_variant(fields: dict) -> dict:
    """Train the micro model ``STEPS`` steps on the embedded corpus; the losses' bits and the state's digests."""
    import torch

    from lowprec.train.config import TrainConfig
    from lowprec.train.data import load_data
    from lowprec.train.loop import train
    from lowprec.train.model import build_model
    from tests.train.runs import MICRO

    cfg = replace(TrainConfig(steps=STEPS, batch_size=4, seq_len=32, eval_every=STEPS, val_batches=1,
                              warmup_steps=1, lr=3e-3, tensorboard=False, progress=False, telemetry_every=0,
                              policy={"skip_small": False}), **fields)
    model = build_model(MICRO, seed=cfg.seed)
    result = train(model, load_data(), cfg)
    state: dict[str, str] = {}
    _tensors("model", model.state_dict(), state)
    return {"losses": [float(r["loss"]).hex() for r in result.history],
            "val_loss": float(result.final_val_loss).hex(), "state": state, "torch": torch.__version__}


def _child(names: list[str]) -> None:
    table = variants()
    print(json.dumps({n: run_variant(table[n]) for n in names}))


def run_pinned(names: list[str]) -> dict:
    """``run_variant`` of each name in a child process with the pinned environment (see [Note: golden runs])."""
    env = {**os.environ, **PINNED_ENV}
    root = Path(__file__).resolve().parents[2]
    out = subprocess.run([sys.executable, "-m", "tests.golden.run", "--child", *names], cwd=root, env=env,
                         capture_output=True, text=True, check=False)
    if out.returncode != 0:
        raise RuntimeError(f"golden child failed ({out.returncode}):\n{out.stderr[-4000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--child", nargs="*")
    p.add_argument("--write", action="store_true", help="write this CPU class's file from this tree's code")
    args = p.parse_args()
    if args.child is not None:
        _child(args.child)
        return
    got = run_pinned(list(variants()))
    if args.write:
        golden_file().write_text(json.dumps(got, indent=1, sort_keys=True) + "\n")
        print(f"wrote {len(got)} variants to {golden_file()} ({cpu_class()})")


if __name__ == "__main__":
    main()
