"""Every code block of ``docs/integrations.md`` runs as it stands, each in a namespace of its own: the page
stays true. The torchtitan block runs where torchtitan is installed."""
from __future__ import annotations

import importlib.util
import re
import warnings
from pathlib import Path

import pytest
import torch

pytest.importorskip("lightning", reason="the integrations extra (lightning) is not installed")
pytest.importorskip("transformers", reason="the integrations extra (transformers) is not installed")
pytest.importorskip("accelerate", reason="the integrations extra (accelerate) is not installed")

from lowprec.telemetry.records import read_records

PAGE = Path(__file__).resolve().parents[2] / "docs" / "integrations.md"
BLOCKS = re.findall(r"```python\n(.*?)```", PAGE.read_text(encoding="utf-8"), flags=re.S)


def _block(marker: str) -> str:
    found = [b for b in BLOCKS if marker in b]
    assert len(found) == 1, f"one block of {PAGE.name} holding {marker!r}"
    return found[0]


def _run(marker: str, where: Path, monkeypatch) -> dict:
    monkeypatch.chdir(where)
    namespace: dict = {"__name__": "__main__"}
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # emulation on the CPU is reported by a warning
        exec(compile(_block(marker), f"{PAGE.name}: {marker}", "exec"), namespace)
    return namespace


def test_every_block_is_one_of_the_paths():
    assert len(BLOCKS) == 5


def test_the_lightning_trainer_example_runs(tmp_path, monkeypatch):
    ns = _run("LowprecPrecision(", tmp_path, monkeypatch)
    assert ns["plugin"].report.converted and ns["plugin"].last_step is not None
    assert ns["trainer"].global_step == 4


def test_the_fabric_example_runs(tmp_path, monkeypatch):
    ns = _run("LowprecFabricPrecision(", tmp_path, monkeypatch)
    assert ns["plugin"].report.converted and (tmp_path / "fabric.ckpt").exists()


def test_the_hf_trainer_example_runs(tmp_path, monkeypatch):
    ns = _run("TelemetryCallback(", tmp_path, monkeypatch)
    assert ns["report"].converted
    assert {r.step for r in read_records(tmp_path / "hf-run" / "telemetry.csv")} == {2, 4}


def test_the_accelerate_example_runs_in_one_process(tmp_path, monkeypatch):
    from accelerate.state import AcceleratorState

    try:
        ns = _run("Accelerator()", tmp_path, monkeypatch)
    finally:
        AcceleratorState._reset_state(reset_partial_state=True)  # the next Accelerator starts afresh
    assert ns["loss"].isfinite()


@pytest.mark.skipif(importlib.util.find_spec("torchtitan") is None, reason="torchtitan (0.3.0) is not installed")
def test_the_torchtitan_example_runs(tmp_path, monkeypatch):
    ns = _run("LowprecConverter.Config(", tmp_path, monkeypatch)
    assert ns["spec"].model is not None
