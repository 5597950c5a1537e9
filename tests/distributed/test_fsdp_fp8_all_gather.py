"""FSDP2 all-gathers per-tensor FP8 weights in E4M3 (``lowprec.distributed.fp8_all_gather``): the layers
get the gathered codes as their operands, training equals all-gathering in BF16 bit for bit for
fp8-current, and the all-gather carries about half of BF16's bytes."""
from __future__ import annotations

import torch

from tests.distributed import common as C
from tests.distributed import session
from tests.distributed.checks import STEPS
from tests.distributed.harness import result

dist_results = session.dist_results


def _runs(dist_results):
    return result(dist_results, "fsdp_fp8_all_gather")


def test_fp8_current_trains_bit_for_bit_as_with_a_bf16_all_gather(dist_results):
    for r in _runs(dist_results):
        bf16, fp8 = r["fp8-current", "bf16"], r["fp8-current", "fp8"]
        assert fp8["names"] == ["0", "2"] and fp8["seen"] == ["GatheredFP8Weight"] and bf16["seen"] == ["Parameter"]
        # the scale of a shard's cast is the whole weight's current one: the same codes as casting the
        # gathered BF16 weight, so the same model after every step
        assert torch.equal(C.bits(fp8["weights"]), C.bits(bf16["weights"]))
        assert fp8["losses"] == bf16["losses"]
        own = r["fp8-current", "fp8-own-scales"]  # scales not precomputed: each weight's own all-reduce
        assert torch.equal(C.bits(own["weights"]), C.bits(bf16["weights"]))


def test_the_all_gather_carries_about_half_of_bf16s_bytes(dist_results):
    r = _runs(dist_results)[0]
    for recipe in ("fp8-current", "fp8-delayed"):
        ratio = r[recipe, "fp8"]["all_gather"] / r[recipe, "bf16"]["all_gather"]
        # weights 1 byte instead of 2; the biases (192 of 16576 elements) stay BF16
        assert abs(ratio - (2 * 8192 + 2 * 192) / (4 * 8192 + 2 * 192)) < 1e-9, ratio


def test_scales_for_all_weights_take_one_all_reduce_per_step(dist_results):
    r = _runs(dist_results)[0]
    assert r["fp8-current", "fp8"]["scale_reduces"] == [1] * STEPS


def test_fp8_delayed_takes_the_current_weight_scale_and_ranks_agree(dist_results):
    ranks = _runs(dist_results)
    a, b = (r["fp8-delayed", "fp8"] for r in ranks)
    assert torch.equal(C.bits(a["weights"]), C.bits(b["weights"]))
    bf16 = ranks[0]["fp8-delayed", "bf16"]
    # the weight cast with its current scale instead of the history's: a quantization-sized change
    tol, update = C.tolerance("fp8-delayed", torch.bfloat16, master_weights=True)
    assert (a["weights"] - bf16["weights"]).norm().item() <= tol < update / 4
    assert a["losses"] == b["losses"]  # every rank logs the group's loss


def test_only_per_tensor_e4m3_weights_are_gathered_in_fp8_and_state_dicts_stay_plain(dist_results):
    r = _runs(dist_results)[0]
    assert r["mxfp8", "fp8"]["names"] == []  # MX scales run along K for W, along N for W.T
    assert r["fp8-current", "fp8"]["state_dict_types"] == ["Tensor"]
