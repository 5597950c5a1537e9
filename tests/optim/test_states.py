"""Moments in BF16, FP8 with range expansion and blockwise 8 bits, against references written apart
(NumPy in float64 and ml_dtypes' E4M3 cast for FP8, NumPy in float32 for 8 bits)."""
from __future__ import annotations

import math

import ml_dtypes
import numpy as np
import pytest
import torch

from lowprec.optim.states import (
    E4M3_MAX,
    FP8_GROUP,
    INT8_BLOCK,
    K_MAX,
    K_MIN,
    Moment,
    StateFormat,
    fp8_encode,
    load,
    state_bytes,
    store,
)

R_E4M3 = 448.0 / 2.0**-6  # E4M3 from its smallest normal value to its largest
U_E4M3 = 2.0**-4  # E4M3's largest relative rounding error on normal values


def moments(shape=(37, 100), seed=0) -> dict[Moment, torch.Tensor]:
    """Moment-like values: a first moment of mixed signs and a second (its square, scaled) spanning decades."""
    g = torch.Generator().manual_seed(seed)
    m = torch.randn(shape, generator=g) * 1e-3 * torch.exp(torch.randn(shape, generator=g))
    v = (torch.randn(shape, generator=g) * 1e-3).square() + 1e-12
    return {Moment.FIRST: m, Moment.SECOND: v}


def _ref_groups(x: torch.Tensor, size: int) -> np.ndarray:
    flat = x.double().reshape(-1).numpy()
    return np.concatenate([flat, np.zeros(-flat.size % size)]).reshape(-1, size)


def _ref_expansion(groups: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    mag = np.abs(groups)
    a = mag.max(axis=1)
    b = np.where(mag > 0, mag, np.inf).min(axis=1)
    with np.errstate(divide="ignore", invalid="ignore"):
        k = np.log(R_E4M3) / np.log(a / b)
    k = np.where(np.isnan(k), 1.0, np.where(np.isinf(k), K_MAX, k))
    return a, np.clip(k, K_MIN, K_MAX)


@pytest.mark.parametrize("moment", list(Moment))
def test_fp8_codes_scales_and_exponents_equal_the_reference(moment):
    x = moments()[moment]
    st = store(x, StateFormat.FP8, moment)
    key = moment.value
    groups = _ref_groups(x, FP8_GROUP)
    a, k = _ref_expansion(groups)
    assert st[key].dtype == torch.uint8 and st[key].shape == x.shape
    np.testing.assert_array_equal(st[key + "_scale"].numpy(), a.astype(np.float32))  # a max: exact
    np.testing.assert_allclose(st[key + "_expansion"].numpy(), k, rtol=1e-6)
    # given the stored exponent, each code is the E4M3 rounding of the expanded value
    k32 = st[key + "_expansion"].double().numpy()[:, None]
    expanded = np.sign(groups) * (np.abs(groups) / np.where(a > 0, a, 1)[:, None]) ** k32 * E4M3_MAX
    want = expanded.astype(np.float32).astype(ml_dtypes.float8_e4m3fn).view(np.uint8).reshape(-1)[:x.numel()]
    np.testing.assert_array_equal(st[key].reshape(-1).numpy(), want)
    # decoding inverts the expansion
    decoded = want.view(ml_dtypes.float8_e4m3fn).astype(np.float64)
    decoded = np.concatenate([decoded, np.zeros(-decoded.size % FP8_GROUP)]).reshape(-1, FP8_GROUP)
    ref = np.sign(decoded) * (np.abs(decoded) / E4M3_MAX) ** (1 / k32) * a[:, None]
    np.testing.assert_allclose(load(st, StateFormat.FP8, moment).double().numpy(),
                               ref.reshape(-1)[:x.numel()].reshape(x.shape), rtol=2e-6, atol=0)


@pytest.mark.parametrize("moment", list(Moment))
def test_fp8_relative_error_is_e4m3s_divided_by_the_expansion(moment):
    x = moments(seed=1)[moment]
    st = store(x, StateFormat.FP8, moment)
    k = st[moment.value + "_expansion"].double()
    k = k.repeat_interleave(FP8_GROUP)[:x.numel()].view(x.shape)  # each value's group's exponent
    bound = torch.maximum((1 + U_E4M3) ** (1 / k) - 1, 1 - (1 - U_E4M3) ** (1 / k))
    rel = (load(st, StateFormat.FP8, moment).double() - x.double()).abs() / x.double().abs()
    assert bool((rel <= bound * (1 + 1e-4) + 1e-6).all())
    assert rel.max() > 0  # not stored exactly: the bound is not vacuous


@pytest.mark.parametrize(("sigma", "ratio"), [(0.5, 0.6), (1.5, 0.4)])
def test_fp8_expansion_beats_a_plain_per_group_scale(sigma, ratio):
    """A group spanning less than E4M3's range gains precision (k > 1); one spanning more keeps its small
    values off the subnormals and zero (k < 1), where a plain absmax scale loses them."""
    g = torch.Generator().manual_seed(2)
    x = (1e-3 * torch.exp(sigma * torch.randn(37, FP8_GROUP, generator=g))).square()  # (groups, 128)
    ref = x.double().numpy()
    a = ref.max(axis=1, keepdims=True)
    plain = (ref / a * E4M3_MAX).astype(np.float32).astype(ml_dtypes.float8_e4m3fn).astype(np.float64)
    plain = plain / E4M3_MAX * a
    expanded = load(store(x, StateFormat.FP8, Moment.SECOND), StateFormat.FP8, Moment.SECOND).double().numpy()
    assert (np.abs(expanded - ref) / ref).mean() < ratio * (np.abs(plain - ref) / ref).mean()


def test_fp8_special_groups():
    x = torch.zeros(3 * FP8_GROUP + 5)
    x[FP8_GROUP:2 * FP8_GROUP] = 3e-7  # one magnitude: any exponent is exact, the largest is kept
    x[2 * FP8_GROUP:] = torch.linspace(-1, 1, FP8_GROUP + 5)  # a partial last group
    st = store(x, StateFormat.FP8, Moment.FIRST)
    assert st["exp_avg_scale"].tolist()[:2] == [0.0, pytest.approx(3e-7)]
    assert st["exp_avg_expansion"].tolist()[1] == K_MAX
    y = load(st, StateFormat.FP8, Moment.FIRST)
    assert torch.equal(y[:FP8_GROUP], x[:FP8_GROUP])  # all-zero group: zeros
    torch.testing.assert_close(y[FP8_GROUP:2 * FP8_GROUP], x[FP8_GROUP:2 * FP8_GROUP], rtol=1e-6, atol=0)
    assert y[-1] == 1.0 and y.shape == x.shape


@pytest.mark.parametrize("moment", list(Moment))
def test_int8_codes_equal_the_reference(moment):
    x = moments(shape=(3, 1500), seed=3)[moment]
    st = store(x, StateFormat.INT8, moment)
    flat = x.reshape(-1).numpy()
    groups = np.concatenate([flat, np.zeros(-flat.size % INT8_BLOCK, np.float32)]).reshape(-1, INT8_BLOCK)
    a = np.abs(groups).max(axis=1)
    if moment is Moment.FIRST:
        want = np.round(groups / a[:, None] * np.float32(127)).astype(np.int8)
    else:
        want = np.round(np.sqrt(groups / a[:, None]) * np.float32(255))
        want = np.where(groups > 0, np.maximum(want, 1), want).astype(np.uint8)
    np.testing.assert_array_equal(st[moment.value + "_scale"].numpy(), a)
    np.testing.assert_array_equal(st[moment.value].reshape(-1).numpy(), want.reshape(-1)[:flat.size])


def test_int8_error_bounds_and_no_second_moment_flushed_to_zero():
    x = moments(shape=(4, 2048), seed=4)
    m, v = x[Moment.FIRST], x[Moment.SECOND]
    st = {**store(m, StateFormat.INT8, Moment.FIRST), **store(v, StateFormat.INT8, Moment.SECOND)}
    a_m = st["exp_avg_scale"].repeat_interleave(INT8_BLOCK).view(m.shape)
    a_v = st["exp_avg_sq_scale"].repeat_interleave(INT8_BLOCK).view(v.shape)
    m2, v2 = load(st, StateFormat.INT8, Moment.FIRST), load(st, StateFormat.INT8, Moment.SECOND)
    assert bool(((m2 - m).abs() <= a_m / 254 * (1 + 1e-5)).all())
    root_err = (v2.sqrt() - v.sqrt()).abs()
    floor = v.sqrt() < a_v.sqrt() / 510  # rounded up to code 1, not to 0
    assert bool((root_err[~floor] <= a_v.sqrt()[~floor] / 510 * (1 + 1e-5)).all())
    assert floor.any()
    torch.testing.assert_close(v2[floor], a_v[floor] / 255**2, rtol=1e-6, atol=0)
    assert bool((v2 > 0).all())


@pytest.mark.parametrize("fmt", [StateFormat.FP32, StateFormat.BF16])
def test_fp32_and_bf16_round_to_nearest(fmt):
    x = moments(seed=5)[Moment.FIRST]
    st = store(x, fmt, Moment.FIRST)
    assert st["exp_avg"].dtype == {StateFormat.FP32: torch.float32, StateFormat.BF16: torch.bfloat16}[fmt]
    assert torch.equal(load(st, fmt, Moment.FIRST), x.to(st["exp_avg"].dtype).float())


@pytest.mark.parametrize("fmt", list(StateFormat))
@pytest.mark.parametrize("numel", [1, 127, 128, 4096, 5000])
def test_state_bytes_counts_what_is_stored(fmt, numel):
    x = torch.rand(numel)
    held = sum(t.numel() * t.element_size() for t in store(x, fmt, Moment.SECOND).values())
    assert state_bytes(numel, fmt) == held
    if numel % (fmt.group or 1) == 0:
        assert held == numel * fmt.bytes_per_value
    assert fmt.bytes_per_value == {"fp32": 4, "bf16": 2, "fp8": 1 + 8 / 128, "int8": 1 + 4 / 2048}[fmt.value]


def test_unknown_format_is_refused():
    with pytest.raises(ValueError, match=r"optim_states: expected one of 'fp32', 'bf16', 'fp8', 'int8', got 'fp4'"):
        StateFormat.parse("fp4")


def test_expansion_never_leaves_float32_range():
    # raised to k before normalising, a second moment of 1e-12 would underflow; normalised it does not
    x = torch.full((FP8_GROUP,), 1e-30)
    x[0] = 2e-30
    codes, a, k = fp8_encode(x.view(1, -1))
    assert math.isclose(k.item(), math.log(R_E4M3) / math.log(2), rel_tol=1e-6)
    y = load({"exp_avg_sq": codes.view(-1), "exp_avg_sq_scale": a, "exp_avg_sq_expansion": k}, StateFormat.FP8,
             Moment.SECOND)
    torch.testing.assert_close(y, x, rtol=U_E4M3 / k.item() * 1.01, atol=0)


@pytest.mark.parametrize("fmt", [StateFormat.FP8, StateFormat.INT8])
@pytest.mark.parametrize("moment", list(Moment))
@pytest.mark.parametrize("shape", [(5, 3, 100), (4, 2048), (3, 2500), (0, 300)], ids=str)
def test_groups_inside_rows_are_each_row_stored_alone(fmt, moment, shape):
    """FSDP2's layout (``rows=True``): row i's codes and per-group tensors are those of row i stored by itself,
    so a shard of whole rows holds whole groups; loading inverts it as for the flattened layout."""
    x = moments(shape=shape, seed=5)[moment] if shape[0] else torch.zeros(shape)
    st = store(x, fmt, moment, rows=True)
    per_row = math.ceil(math.prod(shape[1:]) / fmt.group)
    assert all(st[moment.value + s].shape == (shape[0], per_row) for s in fmt.group_keys)
    assert st[moment.value].shape == x.shape and st[moment.value].dtype == store(x, fmt, moment)[moment.value].dtype
    for i in range(shape[0]):
        alone = store(x[i].reshape(-1), fmt, moment)
        assert torch.equal(st[moment.value][i].reshape(-1), alone[moment.value])
        for s in fmt.group_keys:
            assert torch.equal(st[moment.value + s][i], alone[moment.value + s])
        assert torch.equal(load(st, fmt, moment, rows=True)[i].reshape(-1), load(alone, fmt, moment))
    if math.prod(shape[1:]) % fmt.group == 0:  # rows of whole groups: the flattened layout's groups
        flat = store(x, fmt, moment)
        assert all(torch.equal(st[k].reshape(-1), flat[k].reshape(-1)) for k in st)
