"""The test harness's own contracts."""
from __future__ import annotations

import re
from pathlib import Path

from tests.conftest import WARNING_MODULES

ROOT = Path(__file__).resolve().parents[1]


def test_every_module_defining_a_lowprec_warning_is_imported_before_the_workers_report_one():
    defining = set()
    for path in (ROOT / "lowprec").rglob("*.py"):
        if re.search(r"^class \w+\(\w*Warning\)", path.read_text(), re.M):
            defining.add(".".join(path.relative_to(ROOT).with_suffix("").parts))
    assert defining and defining == set(WARNING_MODULES)
