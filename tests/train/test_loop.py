import math
from dataclasses import replace

import numpy as np
import pytest
import torch

from lowprec.train.checkpoint import read_meta
from lowprec.train.config import TrainConfig
from lowprec.train.data import load_data
from lowprec.train.logs import read_log
from lowprec.train.loop import train
from lowprec.train.model import ModelConfig, build_model
from tests.train.runs import Stop, stop_at

MICRO = ModelConfig(dim=64, n_layers=2, n_heads=2, n_kv_heads=1, ffn_dim=128, max_seq_len=64)
CFG = TrainConfig(steps=6, batch_size=4, seq_len=32, eval_every=3, val_batches=1, warmup_steps=2, lr=3e-3,
                  tensorboard=False, progress=False)




def _run(data, cfg=CFG, **kw):
    return train(build_model(MICRO, seed=cfg.seed), data, cfg, **kw)


def _curve(result):
    return [(r["step"], r["loss"], r["grad_norm"], r["val_loss"], r["lr"]) for r in result.history]


def test_same_seed_same_curve_bit_for_bit(data):
    a, b = _run(data), _run(data)
    assert _curve(a) == _curve(b)
    assert len(a.history) == 6 and [r["step"] for r in a.history if r["val_loss"] is not None] == [3, 6]
    c = _run(data, replace(CFG, seed=1))
    assert _curve(c) != _curve(a)


def test_it_learns(data):
    result = _run(data, replace(CFG, steps=30, eval_every=30, warmup_steps=3, lr=1e-2))
    assert result.final_val_loss < math.log(256) - 2.0  # far below a uniform guess over bytes
    assert result.skipped_steps == 0 and not result.diverged and result.tokens_per_s > 0



@pytest.mark.parametrize(("recipe", "hp_start_steps"), [("bf16", 0), ("nvfp4", 0), ("fp8-delayed", 0),
                                                        ("fp8-delayed", 2)])
def test_resume_after_an_interruption_repeats_the_curve_bit_for_bit(data, tmp_path, recipe, hp_start_steps):
    # nvfp4 draws random bits (its gradients' stochastic rounding); fp8-delayed carries amax histories, which with a
    # high-precision start the BF16 steps recorded: the resumed step 3 is the first delayed one
    cfg = replace(CFG, recipe=recipe, save_every=2, hp_start_steps=hp_start_steps)
    whole = _run(data, cfg, out_dir=tmp_path / "whole")
    with pytest.raises(Stop):
        _run(data, cfg, out_dir=tmp_path / "cut", on_step=stop_at(3))  # stopped after step 3, saved at 2
    assert [r["step"] for r in read_log(tmp_path / "cut" / "log.csv")] == ["1", "2", "3"]
    resumed = _run(data, cfg, out_dir=tmp_path / "cut", resume=True)
    assert _curve(resumed) == _curve(whole)
    rows = read_log(tmp_path / "cut" / "log.csv")
    assert [(r["step"], r["loss"], r["val_loss"]) for r in rows] == \
        [(r["step"], r["loss"], r["val_loss"]) for r in read_log(tmp_path / "whole" / "log.csv")]


def test_high_precision_start_runs_bf16_first(data):
    mixed = _run(data, replace(CFG, recipe="mxfp8", hp_start_steps=3, steps=5))
    bf16 = _run(data, replace(CFG, recipe="bf16", steps=5))
    assert [r["recipe"] for r in mixed.history] == ["bf16"] * 3 + ["mxfp8"] * 2
    # same start, same data: the first three steps are the BF16 run's, then the recipe takes over
    assert _curve(mixed)[:3] == _curve(bf16)[:3]
    assert _curve(mixed)[3][1] != _curve(bf16)[3][1]


def _delayed_counts(model) -> list[list[int]]:
    return [m.delayed_state.recorded for m in model.modules() if getattr(m, "delayed_state", None) is not None]


def test_the_high_precision_start_records_the_delayed_histories(data):
    # lazy scale initialisation: the BF16 steps fill the histories the first fp8-delayed step scales from
    model = build_model(MICRO, seed=0)
    mixed = train(model, data, replace(CFG, recipe="fp8-delayed", hp_start_steps=2, steps=3))
    bf16 = _run(data, replace(CFG, recipe="bf16", steps=3))
    assert [r["recipe"] for r in mixed.history] == ["bf16", "bf16", "fp8-delayed"]
    assert _curve(mixed)[:2] == _curve(bf16)[:2]  # recording changes nothing the BF16 steps compute
    counts = _delayed_counts(model)
    assert len(counts) == 2 * 7 and all(c == [3, 3, 3] for c in counts)  # 2 recorded steps + 1 delayed
    with_grad_accum = build_model(MICRO, seed=0)
    train(with_grad_accum, data, replace(CFG, recipe="fp8-delayed", hp_start_steps=2, steps=2, grad_accum=2))
    assert all(c == [4, 4, 4] for c in _delayed_counts(with_grad_accum))  # one amax per micro-batch


def test_lowprec_train_with_a_high_precision_start_saves_the_recorded_histories(tmp_path):
    from click.testing import CliRunner

    from lowprec.cli import main
    from lowprec.train.checkpoint import load_checkpoint

    args = ["train", "--model", "tiny", "--recipe", "fp8-delayed", "--hp-start-steps", "2", "--steps", "2",
            "--batch-size", "2", "--seq-len", "32", "--val-batches", "1", "--quiet", "--no-tensorboard"]
    result = CliRunner().invoke(main, [*args, "--out", str(tmp_path)])
    assert result.exit_code == 0, result.output
    _, state = load_checkpoint(tmp_path / "checkpoints")
    histories = {k: v for k, v in state["model"].items() if k.endswith("_extra_state")}
    # header rows (version, counts, outliers), then the history: two BF16 steps, two amaxes per role
    assert histories and all(h[1].tolist() == [2.0, 2.0, 2.0] for h in histories.values())
    assert all(h[3:5].amin() > 0 and not h[5:].any() for h in histories.values())


def _histories_after_a_high_precision_start(out) -> None:
    import torch.distributed as dist

    from tests.distributed.launch_helpers import MICRO_CFG

    model = build_model(MICRO, seed=0)  # converted in place, then wrapped
    train(model, load_data(), replace(MICRO_CFG, recipe="fp8-delayed", hp_start_steps=2, steps=2, eval_every=2,
                                      parallel="ddp"))
    states = {k: v for k, v in model.state_dict().items() if k.endswith("_extra_state")}
    torch.save(states, out / f"histories_{dist.get_rank()}.pt")


def test_under_ddp_the_ranks_record_the_high_precision_start_alike(tmp_path):
    # each rank records the amaxes of its own rows: the BF16 steps reduce them as delayed steps do, so
    # the first delayed step scales alike on every rank
    from tests.distributed.launch_helpers import forked

    forked(_histories_after_a_high_precision_start, tmp_path, store=tmp_path / "store")
    ranks = [torch.load(tmp_path / f"histories_{r}.pt") for r in (0, 1)]
    assert len(ranks[0]) == 2 * 7 and ranks[0].keys() == ranks[1].keys()
    assert all(torch.equal(ranks[0][k], ranks[1][k]) for k in ranks[0])
    assert all(h[1].tolist() == [2.0, 2.0, 2.0] and h[3:5].amin() > 0 for h in ranks[0].values())


def test_gradient_accumulation_matches_one_big_batch(data):
    # the same 8 windows per step, as 2 micro-batches of 4 or one batch of 8
    big = _run(data, replace(CFG, batch_size=8, steps=4))
    accum = _run(data, replace(CFG, batch_size=4, grad_accum=2, steps=4))
    # bf16 GEMMs round differently for other shapes: close, not equal. A wrong accumulation (gradients
    # not averaged, a micro-batch lost) is off by far more, in the gradient norm at least.
    for key in ("loss", "grad_norm"):
        np.testing.assert_allclose(accum.history[0][key], big.history[0][key], rtol=1e-5)
        np.testing.assert_allclose([r[key] for r in accum.history], [r[key] for r in big.history], rtol=1e-3)


def test_a_run_of_non_finite_steps_stops_as_diverged(data):
    model = build_model(MICRO)
    with torch.no_grad():
        model.layers[0].attention.wq.weight.fill_(float("nan"))
    result = train(model, data, replace(CFG, max_skips_in_row=3))
    assert result.diverged and result.has_nan and result.steps == 3 and result.skipped_steps == 3
    assert math.isnan(result.final_val_loss)


def test_checkpoint_records_the_run(data, tmp_path):
    _run(data, replace(CFG, recipe="fp8-current", steps=2, eval_every=2), out_dir=tmp_path)
    meta = read_meta(tmp_path / "checkpoints" / "step_00000002.json")
    run = meta["state"]["run"]
    assert run["train_config"]["recipe"] == "fp8-current" and run["data"]["fingerprint"] == data.fingerprint
    assert run["lowprec_version"] and run["torch_version"] == torch.__version__
    assert len(meta["tensors_sha256"]) == 64


def test_refusals_name_the_setting(data, tmp_path):
    _run(data, replace(CFG, steps=2), out_dir=tmp_path)
    with pytest.raises(ValueError, match="out_dir: expected a directory without checkpoints"):
        _run(data, replace(CFG, steps=2), out_dir=tmp_path)
    with pytest.raises(ValueError, match="lr: expected 0.003 as in the checkpoint being resumed, got 0.001"):
        _run(data, replace(CFG, steps=4, lr=1e-3), out_dir=tmp_path, resume=True)
    with pytest.raises(FileNotFoundError, match="resume: expected a checkpoint in"):
        _run(data, CFG, out_dir=tmp_path / "empty", resume=True)
    with pytest.raises(ValueError, match="recipe: expected one of bf16"):
        _run(data, replace(CFG, recipe="fp3"))


def test_a_compiled_run_trains_as_the_eager_one(data):
    """cfg.compile compiles the forward and backward; aot_eager keeps eager's kernels, so the curves agree
    to float32 rounding of a differently ordered graph."""
    cfg = replace(CFG, recipe="fp8-current", steps=3, eval_every=3)
    eager, compiled = _run(data, cfg), _run(data, replace(cfg, compile="aot_eager"))
    for a, b in zip(_curve(eager), _curve(compiled), strict=True):
        assert a[0] == b[0] and a[1] == pytest.approx(b[1], rel=1e-4)
        assert (a[3] is None) == (b[3] is None) and (a[3] is None or a[3] == pytest.approx(b[3], rel=1e-4))


def test_the_policy_of_the_config_decides_the_conversion(data):
    cfg = replace(CFG, recipe="fp8-current", steps=1, eval_every=1)
    kept = _run(data, replace(cfg, policy={"exclude": ["layers.*"]}))
    assert kept.conversion.startswith("recipe fp8-current: 0 of 15 linears converted")
    assert _run(data, cfg).conversion.startswith("recipe fp8-current: 14 of 15 linears converted")
    with pytest.raises(ValueError, match=r"policy: expected fields among .*unknown field\(s\) .bogus."):
        replace(cfg, policy={"bogus": 1})
