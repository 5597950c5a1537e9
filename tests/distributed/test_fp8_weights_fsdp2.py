"""FP8 primary weights under FSDP2 (two gloo ranks): each rank stores its rows of every converted weight as E4M3
codes with the whole weight's scale and the ranks all-gather the codes, so the run with ``--fp8-weights`` trains bit
for bit as FSDP2 with BF16 weights, FP32 masters and the FP8 all-gather of per-tensor weights (the codes are the cast
that run makes of its gathered weights); it resumes from its checkpoint onto the same curve, bit for bit; with 8-bit
moments it trains as the BF16-weight run with them does; and a recipe storing 128x128 blocks is refused by name."""
from __future__ import annotations

import contextlib
import shutil

import pytest

from tests.distributed.launch_helpers import (
    cli_ok,
    forked,
    fp8_weights_train_as_bf16,
    run_curve,
)

RUN = ("--model", "tiny", "--steps", "4", "--batch-size", "4", "--seq-len", "32", "--val-batches", "2",
       "--eval-every", "2", "--dtype", "bfloat16", "--parallel", "fsdp2", "--no-tensorboard", "--quiet")


@pytest.mark.parametrize("recipe", ["fp8-current", "fp8-delayed"])
def test_fsdp2_with_fp8_weights_trains_and_resumes_as_bf16_weights_gathered_in_fp8(tmp_path, recipe):
    train = ("train", "--recipe", recipe, "--save-every", "2", *RUN)
    fp8_weights_train_as_bf16(tmp_path, train, steps=4)
    if recipe == "fp8-delayed":
        return  # in one process a BF16 weight takes its delayed scale, an FP8 weight its current one
    # each run's step-2 checkpoint (two ranks' shards) resumed by one process: still the same curve
    for name, extra in (("fp8", ("--fp8-weights",)), ("bf16", ())):
        one = tmp_path / f"one_{name}"
        shutil.copytree(tmp_path / name, one)
        (one / "checkpoints" / "step_00000004.json").unlink()
        cli_ok(*train, *extra, "--parallel", "none", "--out", str(one), "--resume")
    assert run_curve(tmp_path / "one_fp8") == run_curve(tmp_path / "one_bf16")
    assert run_curve(tmp_path / "one_fp8")[:2] == run_curve(tmp_path / "fp8")[:2]


def _compiled_curves(fp8_weights: bool, out: str):
    from dataclasses import replace

    from lowprec.train.data import load_data
    from lowprec.train.loop import train
    from lowprec.train.model import build_model
    from tests.distributed.launch_helpers import MICRO, MICRO_CFG

    # inductor's min-cut partitioner without its C++ (which does not build at every CPU dispatch level)
    cfg = replace(MICRO_CFG, recipe="fp8-current", dtype="bfloat16", parallel="fsdp2", fp8_weights=fp8_weights,
                  compile="aot_eager_decomp_partition", steps=4, eval_every=2)
    train(build_model(MICRO, seed=0), load_data(), cfg, out_dir=out, checkpoints=False)


def test_compiled_fsdp2_with_fp8_weights_trains_as_bf16_weights_gathered_in_fp8(tmp_path):
    """Compiled blocks take the gathered codes as the eager ones do, in training and in validation (whose
    forward once failed to compile: Dynamo cannot pass a layer's plan into a method of the gathered weight)."""
    for name, fp8 in (("fp8", True), ("bf16", False)):
        forked(_compiled_curves, fp8, str(tmp_path / name), store=tmp_path / f"store_{name}")
    curve = run_curve(tmp_path / "fp8")
    assert curve == run_curve(tmp_path / "bf16") and len(curve) == 4
    assert sum(r[1] != "" for r in curve) == 2  # validated twice


def test_fsdp2_with_fp8_weights_and_8bit_moments_trains_as_bf16_weights_with_them(tmp_path):
    fp8_weights_train_as_bf16(tmp_path, ("train", "--recipe", "fp8-current", "--optim-states", "int8", *RUN), steps=4,
                              resume=False)


def _sharded_as_codes():
    import torch
    import torch.distributed as dist

    import lowprec
    from lowprec.distributed.fp8_weight_shards import FP8WeightShard, sharded_fp8_weights
    from lowprec.distributed.launch import wrap

    torch.manual_seed(0)  # every rank the same model, as FSDP2 expects
    m = torch.nn.Sequential(torch.nn.Linear(64, 96), torch.nn.Linear(96, 48)).to(torch.bfloat16)
    whole = [lin.weight.detach().clone() for lin in m]
    lowprec.convert(m, "fp8-current", lowprec.Policy(skip_small=False), fp8_weights=True)
    codes = [lin.weight.quantized() for lin in m]  # the whole weights' codes, one process
    wrap(m, "fsdp2")
    shards = sharded_fp8_weights(m)
    assert len(shards) == 2 and all(type(s) is FP8WeightShard for s in shards)
    r = dist.get_rank()
    for s, q, w in zip(shards, codes, whole):
        rows = w.shape[0] // 2
        assert s.shape == (rows, w.shape[1]) and s._data.dtype == torch.float8_e4m3fn  # 1 byte per element
        assert torch.equal(s._data.view(torch.uint8), q.data[r * rows:(r + 1) * rows].view(torch.uint8))
        assert torch.equal(s._scale, q.scale.reshape(s._scale.shape))  # the whole weight's scale on each rank
        assert torch.equal(s.initial, w[r * rows:(r + 1) * rows])  # what the optimizer's master starts from
    out = m(torch.randn(4, 64, dtype=torch.bfloat16))
    assert out.shape == (4, 48)


def test_each_rank_holds_its_rows_as_the_whole_weights_codes(tmp_path):
    forked(_sharded_as_codes, store=tmp_path / "store")


class _Stack(__import__("torch").nn.Module):
    """Linears in a ModuleList: ``wrap`` makes each its own FSDP2 unit, and all but the last free their gathered
    weights after forward and gather them again for backward."""

    def __init__(self, widths):
        import torch

        super().__init__()
        self.layers = torch.nn.ModuleList(torch.nn.Linear(i, o) for i, o in zip(widths, widths[1:]))

    def forward(self, x):
        import torch.nn.functional as F

        for i, layer in enumerate(self.layers):
            x = layer(x) if i == len(self.layers) - 1 else F.gelu(layer(x))
        return x


def _split_trains_as_one_process(recipe: str, widths: tuple[int, int, int], rows: list, reduced: list,
                                 compiled: bool = False):
    """A two-layer model with FP8 weights under FSDP2 against one process: every rank trains on the same batch
    (the mean of equal gradients), so the outputs match bit for bit at every step. ``rows``: each rank's shard
    shapes; ``reduced``: the sizes all-reduced in a step of the split run; ``compiled``: each layer compiled."""
    import torch
    import torch.distributed as dist

    import lowprec
    from lowprec.distributed.fp8_weight_shards import sharded_fp8_weights
    from lowprec.distributed.launch import reshard, wrap
    from lowprec.optim import Optimizer

    def model():
        torch.manual_seed(0)
        m = _Stack(widths)
        lowprec.convert(m.to(torch.bfloat16), recipe, lowprec.Policy(skip_small=False), fp8_weights=True)
        return m

    a = widths[0]

    one, split = model(), model()
    if compiled:  # each layer in place, before wrapping (a compiled backward keeps the gathered scales it reads)
        for m in (one, split):
            for layer in m.layers:
                layer.compile(backend="aot_eager_decomp_partition")  # inductor's min-cut partitioner
    wrap(split, "fsdp2")
    assert [tuple(s.shape) for s in sharded_fp8_weights(split)] == rows[dist.get_rank()]
    with torch.no_grad():  # a forward before the optimizer: FSDP2's lazy init pads an uneven rank's shard again
        assert torch.equal(one(torch.ones(2, a, dtype=torch.bfloat16)), split(torch.ones(2, a, dtype=torch.bfloat16)))
    reshard(split)  # the root keeps its gathered weights after a forward without backward
    opts = [Optimizer(m.parameters(), torch.optim.AdamW, lr=1e-2) for m in (one, split)]
    torch.manual_seed(1)
    for _ in range(3):
        x = torch.randn(8, a, dtype=torch.bfloat16)
        outs = [m(x) for m in (one, split)]
        assert torch.equal(outs[0], outs[1])  # the same codes and scales as the whole weights', every step
        for out, opt in zip(outs, opts):
            out.float().pow(2).mean().backward()
            with _all_reduces() as sizes:
                opt.step()
            opt.zero_grad()
        assert sizes == reduced, sizes


def test_uneven_shards_over_three_ranks_compute_as_one_process(tmp_path):
    """64 and 32 rows over 3 ranks: FSDP2 gives the last rank fewer, and pads its all-gather input; a step
    all-reduces the guard's four numbers and both weights' amaxes at once (one MAX)."""
    rows = [[(22, 64), (11, 64)]] * 2 + [[(20, 64), (10, 64)]]
    forked(_split_trains_as_one_process, "fp8-current", (64, 64, 32), rows, [4, 2], store=tmp_path / "store",
           world_size=3)


@pytest.mark.parametrize("recipe, world, compiled", [("fp8-blockwise", 2, False), ("mxfp8", 2, False),
                                                     ("fp8-blockwise", 1, False), ("fp8-blockwise", 2, True)])
def test_weights_stored_in_blocks_shard_on_block_edges_and_compute_as_one_process(tmp_path, recipe, world,
                                                                                  compiled):
    """128x128 blocks (fp8-blockwise reads them; mxfp8 decodes and casts them again): each rank holds whole
    blocks of rows with their scales, the codes and the scales are gathered (packed as one input: FSDP2 at one
    rank copies only the first), and no amax is exchanged (one rank: no exchange at all). Compiled, the first
    layer's gather for backward refills what its forward saved, as FSDP2 refills its own buffers."""
    rows = [[(256 // world, 256), (512 // world, 256)]] * world
    forked(_split_trains_as_one_process, recipe, (256, 256, 512), rows, [4] if world > 1 else [], compiled,
           store=tmp_path / "store", world_size=world)


@contextlib.contextmanager
def _all_reduces():
    """The sizes of the tensors all-reduced inside the block, in order."""
    import torch.distributed as dist

    sizes, original = [], dist.all_reduce

    def counted(tensor, *args, **kwargs):
        sizes.append(tensor.numel())
        return original(tensor, *args, **kwargs)

    dist.all_reduce = counted
    try:
        yield sizes
    finally:
        dist.all_reduce = original



def test_a_shard_with_no_rows_keeps_the_agreed_scale():
    """A rank may hold no rows of a small weight (16 rows over 7 ranks: 3 each, the last none): its
    all-gather still sends its scale, so it takes the agreed one on every write (no exchange here: the
    agreement stands in for the other ranks' maximum)."""
    import torch

    from lowprec import formats
    from lowprec.distributed.fp8_weight_shards import FP8WeightShard
    from lowprec.nn.fp8_requantize import requantize_all
    from lowprec.quant import quantize, tensorwise
    from lowprec.quant.scales import amax_scale

    E4M3 = formats.get("e4m3")

    others = torch.tensor(3.0)
    empty = FP8WeightShard(torch.zeros(0, 32, dtype=torch.float8_e4m3fn), torch.ones(1, 1), None, tensorwise(),
                           torch.Size((0, 32)), torch.bfloat16)
    empty.agreement = lambda amaxes: amaxes.clamp_(min=others)
    full = FP8WeightShard(torch.zeros(4, 32, dtype=torch.float8_e4m3fn), torch.ones(1, 1), None, tensorwise(),
                          torch.Size((4, 32)), torch.bfloat16)
    full.agreement = empty.agreement
    agreed = amax_scale(others, E4M3)
    for write in (lambda w, v: w.share_initial_(v), lambda w, v: w.copy_(v), lambda w, v: w.requantize_(v)):
        empty._scale.fill_(1.0)
        write(empty, torch.zeros(0, 32))
        assert torch.equal(empty._scale, agreed.reshape(1, 1))
    empty._scale.fill_(1.0)
    requantize_all([empty, full], [torch.zeros(0, 32), torch.full((4, 32), 0.5)])  # one exchange for both
    assert torch.equal(empty._scale, agreed.reshape(1, 1)) and torch.equal(full._scale, agreed.reshape(1, 1))
    # the rows cast with the whole weight's scale (the other ranks' amax, 3), not their own (0.5)
    expected = quantize(torch.full((4, 32), 0.5, dtype=torch.bfloat16), E4M3, tensorwise(), scale=agreed)
    assert torch.equal(full._data.view(torch.uint8), expected.data.view(torch.uint8))


def test_blocks_cut_by_the_split_and_meshes_of_two_dimensions_are_refused_before_anything_changes():
    import types

    import torch

    import lowprec
    from lowprec.distributed.fp8_weight_shards import shard_fp8_weights
    from lowprec.nn.fp8_weight import FP8Weight

    def converted(recipe):
        m = torch.nn.Sequential(torch.nn.Linear(128, 128)).to(torch.bfloat16)
        lowprec.convert(m, recipe, lowprec.Policy(skip_small=False), fp8_weights=True)
        return m

    m = converted("fp8-blockwise")  # 128 rows over 2 ranks: half blocks
    with pytest.raises(ValueError, match=r"^fp8_weights: expected out_features a multiple of 128 x 2 ranks for FP8 "
                                         r"weights stored in 128x128 blocks under FSDP2 .* got 128 in '0' "
                                         r"\(fp8-blockwise\)"):
        shard_fp8_weights(m, types.SimpleNamespace(ndim=1, size=lambda: 2))
    assert type(m[0].weight) is FP8Weight  # untouched
    m = converted("fp8-current")
    with pytest.raises(ValueError, match="^mesh: expected a 1-D FSDP2 mesh for FP8 primary weights, got 2 dimensions"):
        shard_fp8_weights(m, types.SimpleNamespace(ndim=2))
    assert type(m[0].weight) is FP8Weight  # untouched


def _block_shard(rows: int):
    import torch

    from lowprec.distributed.fp8_weight_shards import FP8WeightShard
    from lowprec.nn.fp8_weight import FP8Weight
    from lowprec.quant import blockwise

    values = torch.randn(rows, 256, dtype=torch.bfloat16) * torch.arange(1, rows + 1)[:, None]  # rows scaled apart
    w = FP8Weight.of(values, blockwise(128, 128))
    return FP8WeightShard(w._data, w._scale, None, w.granularity, w.shape, w.dtype)


def test_rows_of_a_block_stored_shard_take_their_blocks_scales():
    import torch

    shard = _block_shard(512)  # four row blocks, each its own scales (rows scaled apart)
    for i, piece in enumerate(torch.chunk(shard, 2)):  # FSDP2's split
        assert torch.equal(piece._scale, shard._scale[2 * i:2 * i + 2])
        assert torch.equal(piece.dequantize(), shard.dequantize()[256 * i:256 * (i + 1)])
    assert torch.equal(shard[-128:]._scale, shard._scale[3:])  # a negative start counts from the end
    with pytest.raises(ValueError, match="^weight: expected contiguous rows of an FP8 weight stored in blocks"):
        shard[0:512:2]
    with pytest.raises(ValueError, match="^weight: expected rows of an FP8 weight stored in 128x128 blocks taken on "
                                         "block edges, got rows 64 to 192"):
        shard[64:192]


@pytest.mark.parametrize("ranks", [1, 2])
def test_a_gathered_block_stored_weight_views_fsdp2s_buffers(ranks):
    """The gathered weight holds no copy: views of FSDP2's all-gather outputs (one packed buffer at one rank,
    codes and scales apart at more), so FSDP2's refill for backward (in place, versions kept: a compiled
    backward may have saved them, as on the H200) is what the layer reads, and nothing else stays allocated."""
    import types

    import torch

    shard = _block_shard(256)
    mesh = types.SimpleNamespace(size=lambda: ranks)
    inputs, meta = shard.fsdp_pre_all_gather(mesh, shard.shape, shard.stride(), None, None)
    assert len(inputs) == (1 if ranks == 1 else 2)
    buffers = [torch.cat([t] * ranks) for t in inputs]  # every rank's rows alike, as an all-gather lays them out
    gathered, inner = shard.fsdp_post_all_gather(tuple(buffers), meta, torch.bfloat16)
    assert inner == () and gathered.shape == (256 * ranks, 256)
    assert torch.equal(gathered.dequantize(), torch.cat([shard.dequantize()] * ranks))
    shard.requantize_(torch.randn(256, 256) * 3)  # the optimizer's step, then FSDP2's next gather into the same buffers
    inputs, _ = shard.fsdp_pre_all_gather(mesh, shard.shape, shard.stride(), None, None)
    for buffer, t in zip(buffers, inputs):
        buffer.copy_(torch.cat([t] * ranks))
    assert shard.fsdp_post_all_gather(tuple(buffers), meta, torch.bfloat16, out=gathered) is None
    assert torch.equal(gathered.dequantize(), torch.cat([shard.dequantize()] * ranks))
