"""Training is bit-identical to the golden runs for every recipe and kind of weight (see [Note: golden runs]
in :mod:`tests.golden.run`)."""
from __future__ import annotations

import json
import platform

import pytest
import torch

from tests.golden.run import GOLDEN_FILES, cpu_class, golden_file, run_pinned, variants

pytestmark = pytest.mark.slow


def _golden() -> dict:
    if platform.machine().lower() not in ("x86_64", "amd64"):
        pytest.skip(f"the golden bits are pinned for x86-64 (MKL's reproducible mode); this is {platform.machine()}")
    golden = json.loads(golden_file().read_text())
    recorded = {v["torch"] for v in golden.values()}
    if recorded != {torch.__version__}:
        pytest.skip(f"golden runs for {cpu_class()} recorded with torch {sorted(recorded)}, this is "
                    f"{torch.__version__}: regenerate with python -m tests.golden.run --write")
    return golden


@pytest.mark.parametrize("cpu", sorted(GOLDEN_FILES))
def test_the_golden_file_covers_every_variant(cpu):
    assert set(json.loads(GOLDEN_FILES[cpu].read_text())) == set(variants())


def test_training_is_bit_identical_to_the_golden_runs():
    golden = _golden()
    got = run_pinned(sorted(golden))
    for name, want in golden.items():
        have = got[name]
        assert have["losses"] == want["losses"], f"{name}: per-step losses differ"
        assert have["val_loss"] == want["val_loss"], f"{name}: validation loss differs"
        changed = sorted(k for k in want["state"] if have["state"].get(k) != want["state"][k])
        assert set(have["state"]) == set(want["state"]) and not changed, f"{name}: state differs at {changed[:5]}"
