"""The session fixture that hands every test the results of the one spawn (see ``harness``).

The results are kept in a file of the session's temporary directory, which every pytest-xdist worker
shares: the first test to need them runs the spawn under a file lock, the others read the file. It
lives apart from ``harness`` so the spawned ranks, which import ``harness``, do not import pytest.
"""
from __future__ import annotations

import os

import pytest
import torch
from filelock import FileLock

from tests.distributed import harness


@pytest.fixture(scope="session")
def dist_results(tmp_path_factory) -> dict[str, list]:
    """Every check's results on both ranks, from the session's one spawn. Test modules take it with
    ``dist_results = session.dist_results`` (no conftest: the directory's conftest is left to others)."""
    from tests.distributed import checks

    base = tmp_path_factory.getbasetemp()
    shared = base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base
    path = shared / "dist_results.pt"
    with FileLock(str(path) + ".lock"):
        if not path.is_file():
            torch.save(harness.run_checks(list(checks.CHECKS), str(shared / "dist_work")), path)
    return torch.load(path, weights_only=False)
