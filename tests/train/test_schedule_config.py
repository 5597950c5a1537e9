import json
import math

import pytest

from lowprec.train.config import RESUME_MUST_MATCH, TrainConfig, check_resumable, default_dtype
from lowprec.train.schedule import Schedule, lr_at


def test_warmup_then_cosine_to_the_floor():
    kw = dict(lr=1.0, warmup_steps=10, total_steps=110, min_lr_ratio=0.1)
    assert [lr_at(s, **kw) for s in (1, 5, 10)] == [0.1, 0.5, 1.0]
    assert lr_at(60, **kw) == pytest.approx(0.55)  # half way through the cosine: mean of peak and floor
    assert lr_at(110, **kw) == pytest.approx(0.1)
    assert lr_at(500, **kw) == pytest.approx(0.1)  # a run extended past its schedule stays at the floor
    after = [lr_at(s, **kw) for s in range(10, 111)]
    assert all(a >= b for a, b in zip(after, after[1:]))
    # hand-computed: step 35 is a quarter through, cos(pi/4)
    assert lr_at(35, **kw) == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi / 4)))


def test_no_warmup_starts_at_the_peak():
    expected = 2.0 * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi / 100)))
    assert lr_at(1, lr=2.0, warmup_steps=0, total_steps=100) == pytest.approx(expected)


@pytest.mark.parametrize("field, value, match", [
    ("steps", 0, "steps: expected a positive int, got 0"),
    ("steps", -5, "steps: expected a positive int"),
    ("lr", float("nan"), "lr: expected a positive finite number"),
    ("min_lr_ratio", 2.0, "min_lr_ratio: expected a number in \\[0, 1\\]"),
    ("dtype", "float8", "dtype: expected one of 'float32', 'bfloat16', 'float16', got 'float8'"),
    ("device", "gpu7", "device: expected a torch device"),
    ("hp_start_steps", -1, "hp_start_steps: expected a non-negative int"),
])
def test_bad_settings_are_named(field, value, match):
    with pytest.raises(ValueError, match=match):
        TrainConfig(**{field: value})


def test_cpu_trains_fp32_and_cuda_bf16():
    assert default_dtype("cpu") == "float32" and default_dtype("cuda") == "bfloat16"
    assert TrainConfig(batch_size=4, seq_len=8, grad_accum=3).tokens_per_step == 96


def test_resume_allows_more_steps_but_not_other_numerics():
    saved = TrainConfig(steps=100, lr=1e-3).to_dict()
    check_resumable(saved, TrainConfig(steps=200, lr=1e-3, progress=False, device="cpu"))
    with pytest.raises(ValueError, match="lr: expected 0.001 as in the checkpoint being resumed, got 0.002"):
        check_resumable(saved, TrainConfig(steps=100, lr=2e-3))
    assert "steps" not in RESUME_MUST_MATCH and {"recipe", "seed", "batch_size"} <= set(RESUME_MUST_MATCH)


def _cosine(lr, floor_ratio, progress):
    floor = lr * floor_ratio
    return floor + (lr - floor) * 0.5 * (1 + math.cos(math.pi * progress))


def test_a_schedule_that_never_grew_is_lr_at_bit_for_bit():
    kw = dict(lr=3e-3, warmup_steps=7, total_steps=50, min_lr_ratio=0.1)
    schedule = Schedule.of(**kw)
    assert [schedule.lr_at(s) for s in range(1, 80)] == [lr_at(s, **kw) for s in range(1, 80)]
    # resumed with the same length: the same object, so an interrupted run resumes bit for bit
    assert schedule.grown(20, 50) is schedule
    assert Schedule.from_dict(json.loads(json.dumps(schedule.to_dict()))) == schedule


def test_growing_mid_decay_stretches_what_is_left_of_the_cosine():
    schedule = Schedule.of(lr=1.0, warmup_steps=10, total_steps=110, min_lr_ratio=0.1)
    grown = schedule.grown(60, 210)
    assert [grown.lr_at(s) for s in range(1, 61)] == [schedule.lr_at(s) for s in range(1, 61)]
    # half way through the first cosine at step 60; the other half now spans steps 60..210
    for s in (61, 100, 135, 209, 210, 300):
        expected = _cosine(1.0, 0.1, 0.5 + 0.5 * min(1.0, (s - 60) / 150))
        assert grown.lr_at(s) == pytest.approx(expected, rel=1e-12)
    steps = range(55, 211)
    rates = [grown.lr_at(s) for s in steps]
    assert all(a >= b for a, b in zip(rates, rates[1:]))  # still decaying, no jump up at step 61
    largest_drop = max(schedule.lr_at(s) - schedule.lr_at(s + 1) for s in range(10, 110))
    assert 0 <= grown.lr_at(60) - grown.lr_at(61) <= largest_drop


def test_growing_again_keeps_every_earlier_step_and_a_finished_run_stays_at_the_floor():
    first = Schedule.of(lr=2.0, warmup_steps=4, total_steps=40, min_lr_ratio=0.1)
    second = first.grown(30, 60)
    third = second.grown(45, 100)
    assert [third.lr_at(s) for s in range(1, 46)] == [second.lr_at(s) for s in range(1, 46)]
    assert [second.lr_at(s) for s in range(1, 31)] == [first.lr_at(s) for s in range(1, 31)]
    p30 = (30 - 4) / 36
    p45 = p30 + (1 - p30) * 15 / 30
    assert third.lr_at(46) == pytest.approx(_cosine(2.0, 0.1, p45 + (1 - p45) / 55), rel=1e-12)
    assert third.lr_at(100) == pytest.approx(0.2, rel=1e-12)
    # grown after it ended: the floor, not a jump back up the cosine
    done = first.grown(40, 80)
    assert {done.lr_at(s) for s in range(40, 81)} == {first.lr_at(40)}
    # grown during warmup: warmup as it was, then the whole cosine of the new length
    early = first.grown(2, 80)
    assert early == Schedule.of(lr=2.0, warmup_steps=4, total_steps=80, min_lr_ratio=0.1)
