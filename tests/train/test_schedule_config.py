import math

import pytest

from lowprec.train.config import RESUME_MUST_MATCH, TrainConfig, check_resumable, default_dtype
from lowprec.train.schedule import lr_at


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
