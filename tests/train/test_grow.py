"""Growing a run: resumed with more steps, its learning rate goes on without a jump and its clock goes on."""
import math
from dataclasses import replace

import pytest

from lowprec.train.logs import read_log
from tests.train.runs import CFG, Stop, run, stop_at


def _cosine(progress, lr=CFG.lr, floor_ratio=CFG.min_lr_ratio):
    return lr * floor_ratio + lr * (1 - floor_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


def test_a_finished_run_grown_stays_at_the_floor_and_its_clock_goes_on(data, tmp_path):
    cfg = replace(CFG, steps=3, eval_every=3, warmup_steps=1)
    first = run(data, cfg, out_dir=tmp_path)
    grown = run(data, replace(cfg, steps=5), out_dir=tmp_path, resume=True)
    assert list(grown.history[:3]) == list(first.history)
    rates = [r["lr"] for r in grown.history]
    assert rates[2] == pytest.approx(CFG.lr * CFG.min_lr_ratio, rel=1e-12)
    assert rates[3] == rates[4] == rates[2]  # not back up the cosine of a 5-step run
    elapsed = [r["elapsed_s"] for r in grown.history]
    assert all(a < b for a, b in zip(elapsed, elapsed[1:]))  # the resumed steps add to the first run's time
    assert elapsed[3] - elapsed[2] < 60  # the time of one step, not a clock started again elsewhere
    logged = read_log(tmp_path / "log.csv")
    assert [float(r["elapsed_s"]) for r in logged] == elapsed


def test_an_interrupted_run_grown_decays_from_where_it_was_to_the_new_end(data, tmp_path):
    cfg = replace(CFG, steps=6, eval_every=3, warmup_steps=1, save_every=3)
    with pytest.raises(Stop):
        run(data, cfg, out_dir=tmp_path, on_step=stop_at(3))  # saved after step 3, of a 6-step run
    grown = run(data, replace(cfg, steps=9), out_dir=tmp_path, resume=True)
    rates = [r["lr"] for r in grown.history]
    # steps 1..3 as the 6-step schedule gave them; then the rest of its cosine (40% done at step 3)
    # stretched over steps 4..9
    assert rates[:3] == [CFG.lr * 1.0, _cosine(1 / 5), _cosine(2 / 5)]
    expected = [_cosine(0.4 + 0.6 * (s - 3) / 6) for s in range(4, 10)]
    assert rates[3:] == pytest.approx(expected, rel=1e-12)
    assert rates[8] == pytest.approx(CFG.lr * CFG.min_lr_ratio, rel=1e-12)
    assert all(a > b for a, b in zip(rates[2:], rates[3:]))  # decaying through the resume point
