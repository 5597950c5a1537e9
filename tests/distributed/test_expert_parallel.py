"""Expert parallelism on two gloo ranks (see [Note: expert parallelism] in
``lowprec.distributed.expert_parallel``): the exchange of rows, training like one process, and a NaN on one
rank skipping the step on both."""
from __future__ import annotations

import math

import pytest
import torch

from lowprec.distributed.expert_parallel import pack_rows, unpack_rows
from lowprec.distributed.fp8_comm import PACKED_ROW
from tests.distributed import ep_common as EP
from tests.distributed import session
from tests.distributed.harness import result

dist_results = session.dist_results


def _destination_scale(counts: torch.Tensor) -> torch.Tensor:
    """Each row's expert's multiplier (expert e multiplies by e + 1)."""
    return (EP.expert_of_rows(counts) + 1).unsqueeze(1)


@pytest.mark.parametrize("case", list(EP.EXCHANGES))
@pytest.mark.parametrize("fp8", [False, True])
def test_rows_reach_their_experts_and_come_back(dist_results, case, fp8):
    for rank, r in enumerate(result(dist_results, "ep_exchange")):
        x, counts = EP.exchange_rows(rank, case)
        got = r[case, fp8]
        sent = unpack_rows(pack_rows(x), EP.D, x.dtype) if fp8 else x
        assert torch.equal(got["y"], sent * _destination_scale(counts).to(x.dtype))
        # backward sends the gradient back in its own dtype, untouched: (rank + 2) times the multiplier
        assert torch.equal(got["grad"], ((rank + 2) * _destination_scale(counts)).to(x.dtype).expand_as(x))
        # spread: rank 0 holds experts 0, 1: rank 0 sent them 3 and 0 rows, rank 1 sent 2 and 4; rank 1
        # holds experts 2, 3: 5 + 1 rows and none (no rank routed a row to expert 3). One rank idle: rank 0's
        # experts take all 10 rows, rank 1's none
        assert got["offsets"] == {"spread": [[[5, 9]], [[6, 6]]], "one rank idle": [[[4, 10]], [[0, 0]]]}[case][rank]


def test_fp8_rows_are_within_e4m3_of_the_rows():
    """Each row's FP8 copy misses it by at most half an E4M3 step (2^-4 relative) above 2^-6 of its
    128-block's amax (E4M3's normal range under a scale of amax / 448), by at most 2^-9 times the block
    amax below: the rows are quantized block by block along themselves, never across rows."""
    x, _ = EP.exchange_rows(1)
    x = x.float()
    back = unpack_rows(pack_rows(x), EP.D, torch.float32)
    for start in range(0, EP.D, 128):
        block = x[:, start:start + 128]
        amax = block.abs().amax(dim=1, keepdim=True)
        err = (back[:, start:start + 128] - block).abs()
        assert (err <= torch.maximum(block.abs() * 2.0 ** -4, amax * 2.0 ** -9 / 448 * 2 ** 7)).all()


def test_fp8_dispatch_counts_its_bytes(dist_results):
    for rank, r in enumerate(result(dist_results, "ep_exchange")):
        _, counts = EP.exchange_rows(rank)
        rows = int(counts.sum())
        blocks = math.ceil(EP.D / 128)
        r = {fp8: r["spread", fp8] for fp8 in (False, True)}
        assert r[True]["bytes"]["all_to_all:ep_dispatch"] == rows * blocks * PACKED_ROW
        assert r[False]["bytes"]["all_to_all:ep_dispatch"] == rows * EP.D * 2  # BF16
        received = [9, 6][rank]  # the rows this rank's experts ran (see the test above)
        for fp8 in (False, True):  # the combine and both gradients go in BF16
            b = r[fp8]["bytes"]
            assert b["all_to_all:ep_combine"] == b["all_to_all:ep_dispatch_grad"] == received * EP.D * 2
            assert b["all_to_all:ep_combine_grad"] == rows * EP.D * 2
            assert b["all_to_all:ep_counts"] == EP.E * 8
    # rows a multiple of 128 wide: 132 bytes per 128 values against 256 in BF16
    assert PACKED_ROW / 256 < 0.55


class _RoundTrip(torch.autograd.Function):
    """The FP8 dispatch's rounding in one process: rows to their FP8 bytes and back; the gradient as is."""

    @staticmethod
    def forward(ctx, x):
        return unpack_rows(pack_rows(x), x.shape[1], x.dtype)

    @staticmethod
    def backward(ctx, grad):
        return grad


class _FP8DispatchHere:
    """Stands in for an ``ExpertParallel`` in one process: every expert local, the rows rounded as the FP8
    dispatch rounds them (block by block along each row, so the split of the batch does not matter)."""

    @staticmethod
    def run(experts, x, counts):
        return experts(_RoundTrip.apply(x), counts.cumsum(0))


def _one_process(recipe: str | None, fp8_dispatch: bool = False) -> tuple[list[float], dict[str, torch.Tensor]]:
    model = EP.moe(recipe)
    if fp8_dispatch:
        for block in model.layers:
            block.feed_forward.ep = _FP8DispatchHere
    losses = EP.train(model, EP.sgd(model.parameters()))
    return losses, {n: p.detach().clone() for n, p in model.named_parameters()}


@pytest.fixture(scope="module")
def references() -> dict:
    out = {recipe: _one_process(recipe) for recipe in (None, "fp8-blockwise", "fp8-current")}
    out["fp8 dispatch"] = _one_process(None, fp8_dispatch=True)
    return out


def _distance(a: dict, b: dict) -> float:
    return math.sqrt(sum((a[n].float() - b[n].float()).pow(2).sum().item() for n in a))


RUNS = [(None, "fsdp2", False), (None, "ddp", True), ("fp8-blockwise", "fsdp2", True), ("fp8-current", "ddp", True)]


@pytest.mark.parametrize("run", RUNS, ids=lambda r: f"{r[0]}-{r[1]}-{'fp8' if r[2] else 'hp'}")
def test_experts_split_over_ranks_train_like_one_process(dist_results, references, run):
    """Every rank ends with the same weights, close to one process's on the whole batch. Without a recipe
    the one-process run rounds the experts' rows as the FP8 dispatch does (or not), and the two match to
    float rounding (within 1e-3 of the update: measured below 1e-5 on most CPUs, 8.8e-5 at
    ATEN_CPU_CAPABILITY=default on one with AMX, where a last bit moves a row's E4M3 code; without the 1/W of
    the experts' gradients they miss by 0.1 of it). Recipes miss by at most twice what quantization itself
    moves the one-process run (see [Note: how close a data-parallel run must be] in tests.distributed.common)."""
    recipe, _, fp8 = run
    ranks = [r[run] for r in result(dist_results, "ep_train")]
    assert ranks[0]["layers"] == 2
    for name, w in ranks[0]["weights"].items():
        assert torch.equal(w, ranks[1]["weights"][name]), name
    losses, weights = references["fp8 dispatch" if recipe is None and fp8 else recipe]
    start = {n: p.detach() for n, p in EP.moe(None).named_parameters()}
    update = _distance(weights, start)
    miss = _distance(ranks[0]["weights"], weights)
    if recipe is None:
        assert miss <= 1e-3 * update
        for step, loss in enumerate(losses):
            assert math.isclose((ranks[0]["losses"][step] + ranks[1]["losses"][step]) / 2, loss, rel_tol=1e-5)
        return
    tol = 2 * _distance(references["fp8-blockwise" if recipe is None else recipe][1], references[None][1])
    assert tol < update / 4
    assert miss <= tol


def test_fp8_blockwise_forward_is_one_process_bit_for_bit(dist_results):
    """fp8-blockwise casts activations in 1x128 E4M3 blocks along each row, as the FP8 dispatch does, so
    the experts' recast is exact: each rank's first loss equals one process's on the same rows."""
    torch.set_num_threads(1)  # as the ranks
    try:
        model = EP.moe("fp8-blockwise")
        expected = [EP.lm_loss(model, *EP.tokens(0, r, 2)).item() for r in range(2)]
    finally:
        torch.set_num_threads(torch.get_num_threads())
    got = [r["fp8-blockwise", "fsdp2", True]["losses"][0] for r in result(dist_results, "ep_train")]
    assert got == expected


def test_experts_are_shards_of_the_whole(dist_results):
    for rank, r in enumerate(result(dist_results, "ep_train")):
        for run in RUNS:
            kind, placements, local_shape, shape = r[run]["expert"]
            assert (kind, placements, local_shape, shape) == ("DTensor", "(Shard(dim=0),)", (4, 128, 128),
                                                              (8, 128, 128))
            whole = r[run]["weights"]["layers.0.feed_forward.experts.w1.weight"]
            assert torch.equal(r[run]["local"], whole[rank * 4:(rank + 1) * 4])


def test_a_nan_in_one_ranks_experts_skips_the_step_on_both(dist_results):
    for r in result(dist_results, "ep_nan"):
        assert r["skipped"] and r["unchanged"]


def test_loss_free_balancing_moves_every_ranks_bias_by_the_summed_counts(dist_results):
    """Each rank counts its own tokens; the biases move by the counts summed over the ranks, so both ranks
    hold the same biases, which at least one rank's own counts would not have given."""
    ranks = result(dist_results, "ep_balance")
    total = ranks[0]["local"] + ranks[1]["local"]
    want = 0.01 * torch.sign(total.mean() - total)
    for r in ranks:
        assert torch.equal(r["bias"], want)
    own = [0.01 * torch.sign(r["local"].mean() - r["local"]) for r in ranks]
    assert any(not torch.equal(o, want) for o in own)


def test_compiled_expert_parallel_compiles_once_and_trains_as_eager(dist_results):
    """The experts and their all-to-all run outside the compiled graph ([Note: experts under torch.compile]
    in ``lowprec.nn.routing``): later steps, routed anew, compile nothing, and the losses are eager's."""
    for r in result(dist_results, "ep_compiled"):
        first, later = r[True]["graphs"]
        assert first > 0 and later == first
        assert r[True]["breaks"] == []
        for got, want in zip(r[True]["losses"], r[False]["losses"]):
            assert math.isclose(got, want, rel_tol=5e-4), (r[True]["losses"], r[False]["losses"])
