"""The precision controller under DDP: ranks whose telemetry differs reduce it in one all-reduce and
make the same switches, each from the worst figure any rank saw."""
from __future__ import annotations

from tests.distributed import session
from tests.distributed.harness import result

dist_results = session.dist_results


def test_every_rank_widens_the_gemms_any_rank_saw_in_trouble(dist_results):
    ranks = result(dist_results, "control_agrees")
    want = [("0", "fprop", "nvfp4", "mxfp8"), ("2", "dgrad", "nvfp4", "mxfp8")]
    assert [r["switches"] for r in ranks] == [want, want]
    assert [r["all_reduces"] for r in ranks] == [1, 1]
    assert [r["recipes"] for r in ranks] == [["nvfp4+fprop:mxfp8", "nvfp4+dgrad:mxfp8"]] * 2
