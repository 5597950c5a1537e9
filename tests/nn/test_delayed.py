"""Delayed scaling: each role's amax history, the scale it gives (``max`` or ``most_recent``, times
``2^margin``), current scaling until a role has a history, and the history in ``state_dict``."""
from __future__ import annotations

import warnings
from dataclasses import replace

import pytest
import torch

import lowprec
from lowprec import recipes as R
from lowprec.nn import Linear, cached_weight_casts
from lowprec.nn.delayed import ROLES, amax_outliers
from tests.helpers import SQNR_FLOORS, sqnr
from tests.nn.common import GemmSpy, QuantizeSpy, make_linear, randn

E4M3_MAX, E5M2_MAX = 448.0, 57344.0


def delayed_recipe(history_len: int = 1024, algo: str = "max", margin: int = 0,
                   outlier_bits: int | None = 8) -> R.Recipe:
    return replace(R.fp8_delayed(), name="fp8-delayed-test",
                   delayed=R.DelayedScaling(history_len=history_len, algo=algo, margin=margin,
                                            outlier_bits=outlier_bits))


def with_amax(t: torch.Tensor, amax: float) -> torch.Tensor:
    """``t`` rescaled so that its largest magnitude is exactly ``amax`` (a power of two here)."""
    return t / t.abs().amax() * amax


def _step(lin, x_amax: float, dy_amax: float, seed: int) -> None:
    x = with_amax(randn(32, 128, seed=seed), x_amax).requires_grad_()
    lin(x).backward(with_amax(randn(32, 256, seed=seed + 1), dy_amax))


def _scale(amax: float, margin: int, fmax: float) -> torch.Tensor:
    # the dequantizing scale of [Note: delayed scaling], in float32 as the layer computes it
    return ((torch.tensor(amax) * 2.0**margin) / fmax).reshape(1, 1)


def test_each_role_records_its_own_amax_once_per_cast():
    lin = make_linear("fp8-delayed")
    w_amax = lin.weight.abs().amax().item()
    for i, (xa, dya) in enumerate([(4.0, 0.5), (8.0, 0.25), (2.0, 1.0)]):
        _step(lin, xa, dya, seed=i)
    state = lin.delayed_state
    # every forward casts (and records) the weight as well: no cache outside cached_weight_casts
    assert state.recorded == [3, 3, 3] and ROLES == ("input", "weight", "grad_output")
    assert state.history[:3, 0].tolist() == [4.0, 8.0, 2.0]
    assert state.history[:3, 2].tolist() == [0.5, 0.25, 1.0]
    assert state.history[:3, 1].tolist() == [w_amax] * 3


def test_inside_cached_weight_casts_the_weight_is_cast_once_and_recorded_per_forward(monkeypatch):
    # the same history as without the cache (and as compiled code, which holds no cache)
    lin = make_linear("fp8-delayed")
    w_amax = lin.weight.abs().amax().item()
    spy = QuantizeSpy(monkeypatch)
    with cached_weight_casts(lin):
        for i, (xa, dya) in enumerate([(4.0, 0.5), (8.0, 0.25), (2.0, 1.0)]):
            _step(lin, xa, dya, seed=i)
    assert spy.reads(lin.weight) == 1
    assert lin.delayed_state.recorded == [3, 3, 3]
    assert lin.delayed_state.history[:3, 1].tolist() == [w_amax] * 3


def test_an_evaluation_fill_of_the_cache_is_not_reused_by_training():
    lin = make_linear("fp8-delayed")
    with cached_weight_casts(lin):
        with torch.no_grad():
            lin(randn(8, 128, seed=4))  # casts the weight without recording its amax
        _step(lin, 4.0, 0.5, seed=5)
    assert lin.delayed_state.recorded == [1, 1, 1]
    assert lin.delayed_state.history[0, 1].item() == lin.weight.abs().amax().item()


@pytest.mark.parametrize(("algo", "margin", "x_amaxes", "want"), [
    # history_len 2: step 4 has forgotten step 1's 8.0
    ("max", 0, [8.0, 1.0, 2.0, 0.5], [8.0, None, 8.0, 8.0, 2.0]),
    ("most_recent", 0, [8.0, 1.0, 2.0, 0.5], [8.0, None, 8.0, 1.0, 2.0]),
    ("max", 2, [8.0, 1.0, 2.0, 0.5], [8.0, None, 8.0, 8.0, 2.0]),
], ids=["max", "most_recent", "max-margin2"])
def test_the_input_scale_comes_from_the_history(monkeypatch, algo, margin, x_amaxes, want):
    # want[k] is the amax behind step k's scale (k = 1..4); step 1 has no history: current scaling
    lin = make_linear(delayed_recipe(history_len=2, algo=algo, margin=margin))
    gemms = GemmSpy(monkeypatch)
    for step, xa in enumerate(x_amaxes, start=1):
        gemms.calls.clear()
        _step(lin, xa, 1.0, seed=step)
        fprop_lhs = gemms.calls[0][0]
        expected = _scale(xa, 0, E4M3_MAX) if step == 1 else _scale(want[step], margin, E4M3_MAX)
        assert torch.equal(fprop_lhs.scale, expected), f"step {step}"


def test_grad_output_uses_its_own_history_in_e5m2(monkeypatch):
    lin = make_linear(delayed_recipe(margin=1))
    gemms = GemmSpy(monkeypatch)
    _step(lin, 4.0, 0.5, seed=0)
    gemms.calls.clear()
    _step(lin, 4.0, 0.125, seed=2)
    dgrad_lhs = gemms.calls[1][0]  # forward, dgrad, wgrad
    assert tuple(dgrad_lhs.shape) == (32, 256) and dgrad_lhs.fmt.name == "e5m2"
    assert torch.equal(dgrad_lhs.scale, _scale(0.5, 1, E5M2_MAX))


@pytest.mark.parametrize("delayed_side", ["fprop", "dgrad"])
def test_a_delayed_weight_side_beside_a_current_one_keeps_its_own_scaling(monkeypatch, delayed_side):
    """One format, one side delayed and the other current (a custom recipe): each side is scaled its own
    way, never with the other's scale."""
    base = delayed_recipe()
    gemm = getattr(base, "dgrad" if delayed_side == "fprop" else "fprop")
    current = replace(gemm, rhs=replace(gemm.rhs, scaling=R.Scaling.CURRENT))
    recipe = replace(base, name="fp8-mixed-weight", **{"dgrad" if delayed_side == "fprop" else "fprop": current})
    lin = make_linear(recipe)
    gemms = GemmSpy(monkeypatch)
    _step(lin, 4.0, 1.0, seed=0)  # records the weight's amax a0
    a0 = float(lin.weight.detach().abs().amax())
    with torch.no_grad():
        lin.weight.mul_(2.0)  # now the weight's own amax is 2 * a0
    gemms.calls.clear()
    _step(lin, 4.0, 1.0, seed=2)
    fprop_w, dgrad_w = gemms.calls[0][1], gemms.calls[1][1]  # forward, dgrad, wgrad
    delayed, own = (fprop_w, dgrad_w) if delayed_side == "fprop" else (dgrad_w, fprop_w)
    assert torch.equal(delayed.scale.reshape(1, 1), _scale(a0, 0, E4M3_MAX))
    assert torch.equal(own.scale.reshape(1, 1), _scale(2.0 * a0, 0, E4M3_MAX))


def test_a_value_above_the_delayed_scale_saturates_instead_of_overflowing(monkeypatch):
    lin = make_linear("fp8-delayed")
    gemms = GemmSpy(monkeypatch)
    _step(lin, 1.0, 1.0, seed=0)
    gemms.calls.clear()
    _step(lin, 16.0, 1.0, seed=1)  # 16x the history's amax
    q = gemms.calls[0][0]
    assert torch.isfinite(q.dequantize()).all() and q.dequantize().abs().max().item() == 1.0


def test_a_non_finite_amax_is_recorded_as_zero():
    lin = make_linear("fp8-delayed")
    x = randn(32, 128, seed=0)
    x[3, 7] = float("inf")
    lin(x)
    assert lin.delayed_state.recorded[0] == 1 and lin.delayed_state.history[0, 0].item() == 0.0


def test_evaluation_under_no_grad_leaves_the_input_history_alone():
    lin = make_linear("fp8-delayed")
    lin(randn(32, 128, seed=0))  # a training forward records the input's amax once
    before = lin.delayed_state.history.clone(), list(lin.delayed_state.recorded)
    with torch.no_grad():
        lin(randn(32, 128, seed=1) * 100)
    assert torch.equal(lin.delayed_state.history, before[0]) and lin.delayed_state.recorded == before[1]


@pytest.mark.parametrize("recipe", R.names())
def test_state_dict_has_extra_state_only_for_delayed_recipes(recipe):
    lin = make_linear(recipe)
    _step(lin, 1.0, 1.0, seed=0)
    sd = lin.state_dict()
    if R.get(recipe).uses_delayed_scaling:
        assert list(sd) == ["weight", "bias", "_extra_state"]
        extra = sd["_extra_state"]
        # a header, the counts of amaxes and of outliers per role, then the history
        assert extra.dtype == torch.float32 and extra.shape == (3 + 1024, len(ROLES))
    else:
        assert list(sd) == ["weight", "bias"]


def test_the_history_round_trips_through_state_dict():
    src = make_linear("fp8-delayed")
    for i, xa in enumerate([2.0, 8.0]):
        _step(src, xa, 0.5, seed=i)
    dst = make_linear("fp8-delayed", seed=5)
    dst.load_state_dict(src.state_dict(), strict=True)
    assert dst.delayed_state.recorded == src.delayed_state.recorded
    assert torch.equal(dst.delayed_state.history, src.delayed_state.history)
    x = randn(8, 128, seed=9)
    assert torch.equal(dst(x), src(x))  # same weights, same scales


def test_a_history_of_another_length_is_ignored_with_a_warning():
    src = make_linear("fp8-delayed")
    _step(src, 2.0, 0.5, seed=0)
    dst = make_linear(delayed_recipe(history_len=16))
    with pytest.warns(UserWarning, match=r"delayed-scaling state does not match this recipe \(history_len 16\)"):
        dst.load_state_dict(src.state_dict())
    assert dst.delayed_state.recorded == [0, 0, 0]
    assert torch.equal(dst.weight, src.weight)


def test_a_layer_made_on_the_meta_device_gets_its_state_on_the_real_one():
    with torch.device("meta"):
        lin = Linear(128, 256, recipe="fp8-delayed")
    lin.to_empty(device="cpu")
    with torch.no_grad():
        lin.weight.normal_(0, 0.05)
        lin.bias.zero_()
    _step(lin, 4.0, 0.5, seed=1)
    assert lin.delayed_state.recorded == [1, 1, 1] and lin.delayed_state.history.device.type == "cpu"


def test_a_fresh_delayed_model_has_plain_keys_and_fallback_layers_no_state():
    model = torch.nn.Sequential(torch.nn.Linear(128, 256), torch.nn.ReLU(), torch.nn.Linear(256, 100))
    lowprec.convert(model, "fp8-delayed", lowprec.Policy(keep_head=False, keep_last_blocks=0))
    assert model[2].hp_reason is not None and model[2].delayed_state is None  # 100 is not a multiple of 16
    plain = torch.nn.Sequential(torch.nn.Linear(128, 256), torch.nn.ReLU(), torch.nn.Linear(256, 100))
    plain.load_state_dict(model.state_dict(), strict=True)


# ---- amax outliers (see [Note: amax outliers]) ----------------------------------------------------


def _outlier_x(x_amax: float, seed: int) -> torch.Tensor:
    """Data of amax ``x_amax`` with one finite element of 1e30, as a corrupt sample would bring."""
    x = with_amax(randn(32, 128, seed=seed), x_amax)
    x[3, 7] = 1e30
    return x.requires_grad_()


def _input_cast_after_an_outlier(monkeypatch, outlier_bits: int | None):
    """Clean step (input amax 4), outlier step, clean step: the layer and the last step's input and its cast."""
    lin = make_linear(delayed_recipe(outlier_bits=outlier_bits))
    _step(lin, 4.0, 1.0, seed=0)
    lin(_outlier_x(4.0, seed=1)).backward(randn(32, 256, seed=2))
    gemms = GemmSpy(monkeypatch)
    x = with_amax(randn(32, 128, seed=3), 4.0).requires_grad_()
    lin(x).backward(randn(32, 256, seed=4))
    return lin, x, gemms.calls[0][0]  # fprop's lhs: the input


def test_without_the_guard_one_outlier_quantizes_every_later_input_to_zero(monkeypatch):
    # the failure the guard exists for: 1e30 enters the history and sets the scale of the next steps
    lin, _, q = _input_cast_after_an_outlier(monkeypatch, outlier_bits=None)
    assert lin.delayed_state.history[1, 0] == torch.tensor(1e30) and lin.delayed_state.outliers.tolist() == [0, 0, 0]
    assert torch.equal(q.scale, _scale(1e30, 0, E4M3_MAX)) and not q.dequantize().any()


def test_an_outlier_is_recorded_capped_and_counted_and_later_inputs_quantize_normally(monkeypatch):
    lin, x, q = _input_cast_after_an_outlier(monkeypatch, outlier_bits=8)
    state = lin.delayed_state
    assert state.history[:3, 0].tolist() == [4.0, 4.0 * 2**8, 4.0]  # capped at 2^8 times the history's max
    assert state.outliers.tolist() == [1, 0, 0] and state.recorded == [3, 3, 3]
    assert torch.equal(q.scale, _scale(4.0 * 2**8, 0, E4M3_MAX))  # the max of the capped history
    # eight bits of E4M3's headroom spent, not the whole range: still above the cast's SQNR floor
    assert sqnr(x, q.dequantize()) >= SQNR_FLOORS["fp8_e4m3_cast"]


def test_the_outlier_itself_saturates_at_the_scale_from_before_it(monkeypatch):
    lin = make_linear("fp8-delayed")
    _step(lin, 4.0, 1.0, seed=0)
    gemms = GemmSpy(monkeypatch)
    lin(_outlier_x(4.0, seed=1)).backward(randn(32, 256, seed=2))
    got = gemms.calls[0][0].dequantize()
    assert got[3, 7].item() == 4.0 and torch.isfinite(got).all()  # E4M3's largest, times the scale of amax 4


def test_a_real_jump_of_the_range_is_followed_within_steps():
    lin = make_linear(delayed_recipe(history_len=8, outlier_bits=4))
    amaxes = [1.0, 2.0**10, 2.0**10, 2.0**10, 2.0**10]  # the data grows a thousandfold, and stays
    for i, xa in enumerate(amaxes):
        _step(lin, xa, 1.0, seed=i)
    # each record at most 2^4 times the history's max: 16, 256, then the real 1024
    assert lin.delayed_state.history[:, 0].tolist() == [1.0, 2.0**4, 2.0**8, 2.0**10, 2.0**10, 0.0, 0.0, 0.0]
    assert lin.delayed_state.outliers.tolist() == [2, 0, 0]


def test_amaxes_within_the_bound_and_a_history_of_zeros_are_not_outliers():
    lin = make_linear(delayed_recipe(outlier_bits=2))
    x = torch.zeros(32, 128, requires_grad=True)
    lin(x).backward(randn(32, 256, seed=0))  # amax 0: no bound to judge the next one against
    for i, xa in enumerate([2.0**20, 2.0**22]):  # the second is exactly 2^2 times the first
        _step(lin, xa, 1.0, seed=i)
    assert lin.delayed_state.history[:3, 0].tolist() == [0.0, 2.0**20, 2.0**22]
    assert lin.delayed_state.outliers.tolist() == [0, 0, 0]


def _mlp(recipe: R.Recipe) -> torch.nn.Module:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 32))
    lowprec.convert(model, recipe, lowprec.Policy(keep_head=False, keep_last_blocks=0, skip_small=False))
    return model


def _regression_losses(recipe: R.Recipe, outlier_step: int | None, steps: int = 30) -> list[float]:
    """Validation losses of an MLP fitting a fixed linear teacher, one input element 1e30 at ``outlier_step``."""
    model, teacher = _mlp(recipe), torch.nn.Linear(64, 32)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    x_val = randn(64, 64, seed=999)
    with torch.no_grad():
        y_val = teacher(x_val)
    losses = []
    for step in range(steps):
        x = randn(32, 64, seed=step)
        with torch.no_grad():
            y = teacher(x)
        if step == outlier_step:
            x[5, 7] = 1e30
        loss = torch.nn.functional.mse_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        with torch.no_grad():
            losses.append(torch.nn.functional.mse_loss(model(x_val), y_val).item())
    return losses


def test_training_recovers_from_an_outlier_batch_as_if_it_had_not_been_there():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "GEMMs are emulated on cpu"
        clean = _regression_losses(delayed_recipe(), None)
        guarded = _regression_losses(delayed_recipe(), 10)
        unguarded = _regression_losses(delayed_recipe(outlier_bits=None), 10)
    assert guarded[:10] == clean[:10]
    # guarded: within 1% of the run without the outlier at every later step
    assert max(abs(g - c) / c for g, c in zip(guarded[10:], clean[10:])) < 0.01
    # unguarded: the first layer's output is its bias alone, and the loss parts from the clean run by
    # several times the guarded run's bound
    assert min(abs(u - c) / c for u, c in zip(unguarded[11:], clean[11:])) > 0.05


def test_amax_outliers_counts_every_layer_and_warns_once_per_layer_naming_it():
    model = _mlp(delayed_recipe())
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model(randn(32, 64, seed=0) * 4).sum().backward()
        assert amax_outliers(model) == 0
        x = randn(32, 64, seed=1) * 4
        x[0, 0] = 1e30
        model(x).sum().backward()
    with pytest.warns(UserWarning, match=r"lowprec: 0: an input amax over 2\^8 times its delayed-scaling "
                                         r"history's largest was capped \(1 so far\)") as seen:
        assert amax_outliers(model) == 1
    # layer 2 reads layer 0's output, made from the saturated input: no outlier there
    assert len([w for w in seen if "amax over" in str(w.message)]) == 1
    model(x).sum().backward()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no second warning for the same layer
        assert amax_outliers(model) == 2  # 1e30 again: capped again, counted, no second warning
    assert model[0].delayed_state.outliers.tolist() == [2, 0, 0]
    assert amax_outliers(torch.nn.Linear(4, 4)) == 0


def test_the_outlier_counts_round_trip_and_a_version_1_state_loads():
    src = make_linear("fp8-delayed")
    _step(src, 4.0, 1.0, seed=0)
    src(_outlier_x(4.0, seed=1)).backward(randn(32, 256, seed=2))
    dst = make_linear("fp8-delayed", seed=5)
    dst.load_state_dict(src.state_dict())
    assert dst.delayed_state.outliers.tolist() == [1, 0, 0] and dst.delayed_state.recorded == [2, 2, 2]
    assert torch.equal(dst.delayed_state.history, src.delayed_state.history)
    # version 1 (before outliers were counted): header [1, L, 0], counts, history
    v1 = torch.cat([torch.tensor([[1.0, 1024.0, 0.0], [2.0, 2.0, 2.0]]), src.delayed_state.history])
    old = make_linear("fp8-delayed", seed=6)
    old.load_state_dict({**src.state_dict(), "_extra_state": v1})
    assert old.delayed_state.outliers.tolist() == [0, 0, 0] and old.delayed_state.recorded == [2, 2, 2]
    assert torch.equal(old.delayed_state.history, src.delayed_state.history)


def test_the_outlier_guard_compiles_into_one_graph_and_follows_eager():
    torch._dynamo.reset()
    eager, comp = make_linear(delayed_recipe(history_len=4)), make_linear(delayed_recipe(history_len=4))
    compiled = torch.compile(comp, fullgraph=True, backend="aot_eager")
    for step, xa in enumerate([4.0, None, 4.0]):  # None: the outlier batch
        x = _outlier_x(4.0, seed=step).detach() if xa is None else with_amax(randn(32, 128, seed=step), xa)
        dy = randn(32, 256, seed=10 + step)
        eager(x.clone().requires_grad_()).backward(dy)
        with torch._dynamo.config.patch(error_on_recompile=step > 0):
            yc = compiled(x.clone().requires_grad_())
        yc.backward(dy)
        assert torch.equal(comp.delayed_state.history, eager.delayed_state.history), f"step {step}"
    assert comp.delayed_state.outliers.tolist() == eager.delayed_state.outliers.tolist() == [1, 0, 0]


@pytest.mark.parametrize("bits", [0, 65, True, 2.0, "8"])
def test_outlier_bits_is_checked(bits):
    with pytest.raises(ValueError, match=r"outlier_bits: expected an int in \[1, 64\]"):
        R.DelayedScaling(outlier_bits=bits)
