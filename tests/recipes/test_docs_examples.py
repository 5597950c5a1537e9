"""The code blocks of ``docs/recipes.md`` run, in order, in one namespace: the page stays true."""
from __future__ import annotations

import re
import warnings
from pathlib import Path

import torch

PAGE = Path(__file__).resolve().parents[2] / "docs" / "recipes.md"


def test_the_recipes_page_runs():
    blocks = re.findall(r"```python\n(.*?)```", PAGE.read_text(encoding="utf-8"), flags=re.S)
    assert len(blocks) >= 4
    namespace: dict = {}
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # emulation on the CPU is reported by a warning
        for i, block in enumerate(blocks):
            exec(compile(block, f"{PAGE.name} block {i}", "exec"), namespace)
    assert namespace["forward_only"].name == "fp8-forward-only"
    assert not torch.equal(namespace["reference"], namespace["trial"])
