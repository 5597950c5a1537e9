"""A checkpoint whose checksums hold but that does not fit the run is refused in one line before it is loaded."""
import shutil
from dataclasses import replace
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from lowprec.distributed import checkpoint as dist_checkpoint
from lowprec.distributed.launch import Ranks
from lowprec.optim import Optimizer
from lowprec.train.checkpoint import CheckpointError
from lowprec.train.data import load_data
from lowprec.train.model import ModelConfig, build_model
from tests.distributed.launch_helpers import forked
from tests.train.runs import CFG, MICRO, nan_model, resave, run


@pytest.fixture(scope="module")
def saved_run(data, tmp_path_factory):
    out = tmp_path_factory.mktemp("run")
    run(data, out_dir=out)
    return out


def _optim_state(state, position=0):
    return state["optimizer"]["optimizer"]["state"][position]


def _garbage_rng(state):
    state["rng"]["cpu"] = torch.randint(0, 256, state["rng"]["cpu"].shape, dtype=torch.uint8,
                                        generator=torch.Generator().manual_seed(0))


CHANGES = {
    "missing model key": (lambda s: s["model"].pop("norm.weight"), "the state of this model in .*got no 'norm.weight'"),
    "extra model key": (lambda s: s["model"].update({"head.bias": torch.zeros(4)}),
                        "got 'head.bias', which the model does not have"),
    "extra state of no module": (lambda s: s["model"].update({"nowhere._extra_state": torch.zeros(4)}),
                                 "got 'nowhere._extra_state', which the model does not have"),
    "wrong-shaped tensor": (lambda s: s["model"].update({"norm.weight": torch.ones(32)}),
                            r"'norm.weight' of shape \(64,\) as in this model, got shape \(32,\) in"),
    "wrong-shaped optimizer state": (lambda s: _optim_state(s).update({"exp_avg": torch.zeros(3)}),
                                     r"optimizer state 'exp_avg' of 'tok_embeddings.weight' of shape \(256, 64\), "
                                     r"got shape \(3,\)"),
    "optimizer state of no parameter": (lambda s: s["optimizer"]["optimizer"]["state"].update({99: {}}),
                                        "optimizer state of this model's 21 parameters in .*got parameter 99"),
    "garbage generator state": (_garbage_rng, "a valid CPU generator state in .*one torch refuses"),
    "short generator state": (lambda s: s["rng"].update({"cpu": torch.zeros(10, dtype=torch.uint8)}),
                              "a valid CPU generator state in .*one torch refuses"),
    "non-finite optimizer state": (lambda s: _optim_state(s, 3)["exp_avg_sq"].view(-1).__setitem__(7, float("inf")),
                                   "finite weights and optimizer state in .*got NaN or inf in optimizer state "
                                   "'exp_avg_sq' of 'layers.0.attention.wv.weight'"),
}


@pytest.mark.parametrize("change", list(CHANGES))
def test_a_checkpoint_that_does_not_fit_is_refused_in_one_line(data, saved_run, tmp_path, change):
    out = tmp_path / "run"
    shutil.copytree(saved_run, out)
    edit, message = CHANGES[change]
    resave(out / "checkpoints", edit)
    with pytest.raises(CheckpointError, match=message) as caught:
        run(data, replace(CFG, steps=3), out_dir=out, resume=True)
    assert len(str(caught.value).splitlines()) == 1 and "step_00000002.json" in str(caught.value)


def test_weights_holding_a_nan_are_refused_at_load(data, tmp_path):
    cfg = replace(CFG, steps=2)
    result = run(data, cfg, model=nan_model(cfg), out_dir=tmp_path)  # saved with its NaN, checksums and all
    assert result.skipped_steps == 2
    with pytest.raises(CheckpointError, match=r"checkpoint: expected finite weights and optimizer state in "
                                              r"'.*step_00000002\.json', got NaN or inf in weight "
                                              r"'layers.0.attention.wq.weight'"):
        run(data, replace(cfg, steps=4), out_dir=tmp_path, resume=True)


# -- distributed checkpoints: the same checks, from DCP's metadata ---------------------------------------------
def _stepped(config: ModelConfig = MICRO):
    model = build_model(config, seed=0)
    opt = Optimizer(model.parameters(), torch.optim.AdamW, lr=1e-3, master_weights=False)
    x = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(0))
    opt.backward(model(x).float().logsumexp(-1).mean())
    assert not opt.step().skipped
    return model, opt


def _dcp_save(directory: Path, model, opt, rng=None) -> Path:
    rng = rng if rng is not None else dist_checkpoint.rank_rng_state(torch.device("cpu"))
    return dist_checkpoint.save(directory, 1, model, opt, Ranks(), state={}, rng=rng)


def _dcp_load(path: Path, config: ModelConfig = MICRO):
    model, opt = _stepped(config)
    return dist_checkpoint.load(path, dist_checkpoint.read(path, Ranks()), model, opt, Ranks())


def test_a_distributed_checkpoint_of_another_shape_is_refused(tmp_path):
    path = _dcp_save(tmp_path, *_stepped(replace(MICRO, ffn_dim=96)))
    with pytest.raises(CheckpointError, match=r"'layers.0.feed_forward.w1.weight' of shape \(128, 64\) as in this "
                                              r"model, got shape \(96, 64\) in '.*step_00000001.json'"):
        _dcp_load(path)


def test_a_distributed_checkpoint_with_wrong_shaped_optimizer_state_is_refused(tmp_path):
    model, opt = _stepped()
    opt.state[dict(model.named_parameters())["layers.0.attention.wq.weight"]]["exp_avg"] = torch.zeros(5)
    path = _dcp_save(tmp_path, model, opt)
    with pytest.raises(CheckpointError, match=r"optimizer state 'exp_avg' of 'layers.0.attention.wq.weight' of "
                                              r"shape \(64, 64\), got shape \(5,\) in '.*step_00000001.json'"):
        _dcp_load(path)


def test_a_distributed_checkpoint_with_garbage_generator_state_is_refused(tmp_path):
    path = _dcp_save(tmp_path, *_stepped(), rng={"cpu": torch.full((5056,), 7, dtype=torch.uint8)})
    rng = _dcp_load(path)
    with pytest.raises(CheckpointError, match="a valid CPU generator state in 'here', got one torch refuses"):
        dist_checkpoint.set_rank_rng_state(rng, torch.device("cpu"), "'here'")


def _train_nan_then_resume(out: Path) -> None:
    cfg = replace(CFG, parallel="ddp")
    run(load_data(), cfg, model=nan_model(cfg), out_dir=out)
    try:
        run(load_data(), replace(cfg, steps=4), out_dir=out, resume=True)
    except CheckpointError as e:
        (out / f"error_{dist.get_rank()}.txt").write_text(str(e))


def test_a_distributed_checkpoint_holding_a_nan_is_refused_on_every_rank_and_in_one_process(data, tmp_path):
    forked(_train_nan_then_resume, tmp_path, store=tmp_path / "store")
    messages = [(tmp_path / f"error_{r}.txt").read_text() for r in (0, 1)]
    assert messages[0] == messages[1]
    assert "got NaN or inf in weight 'layers.0.attention.wq.weight'" in messages[0]
    with pytest.raises(CheckpointError, match="got NaN or inf in weight 'layers.0.attention.wq.weight'"):
        run(data, replace(CFG, steps=4), out_dir=tmp_path, resume=True)
