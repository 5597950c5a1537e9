"""``lowprec.autocast``: override or disable the bound recipe in a region; the state nests, is
restored on exit (also when the region raises) and is private to each thread."""
from __future__ import annotations

import threading

import pytest
import torch
import torch.nn.functional as nnf

import lowprec
from lowprec import recipes as R
from lowprec.autocast import resolve
from tests.nn.common import make_linear, randn

X = randn(16, 128, seed=1)


def plain(lin) -> torch.Tensor:
    return nnf.linear(X, lin.weight, lin.bias)


def under(recipe: str) -> torch.Tensor:
    """What a fresh layer with the same weights bound to ``recipe`` outputs."""
    return make_linear(recipe)(X)


def test_disabled_is_plain_linear_bit_for_bit():
    lin = make_linear("mxfp8")
    with lowprec.autocast(enabled=False):
        y = lin(X)
    assert torch.equal(y, plain(lin))
    assert not torch.equal(lin(X), y)  # outside, the recipe again


def test_disabled_also_turns_off_unscaled_recipes_and_backward():
    lin = make_linear("bf16")
    x = X.clone().requires_grad_()
    with lowprec.autocast(enabled=False):
        y = lin(x)
    y.sum().backward()
    assert y.dtype == torch.float32 and torch.equal(y, plain(lin))
    torch.testing.assert_close(x.grad, lin.weight.sum(0).expand_as(x), rtol=0, atol=1e-5)


def test_another_recipe_overrides_the_bound_one():
    lin = make_linear("fp8-current")
    with lowprec.autocast("mxfp8"):
        y = lin(X)
    assert torch.equal(y, under("mxfp8")) and not torch.equal(y, under("fp8-current"))
    assert lin.recipe.name == "fp8-current"  # the binding itself is unchanged


def test_a_user_recipe_object_is_accepted():
    mine = R.Recipe(name="rowwise-fwd-only", fprop=R.fp8_rowwise().fprop, dgrad=R.bf16().dgrad, wgrad=R.bf16().wgrad)
    with lowprec.autocast(mine):
        assert resolve(R.get("mxfp8")) is mine


def test_torch_linears_are_unaffected():
    lin = torch.nn.Linear(128, 256)
    with lowprec.autocast("fp8-current"):
        assert torch.equal(lin(X), nnf.linear(X, lin.weight, lin.bias))


def test_a_layer_a_policy_keeps_stays_high_precision_under_an_override():
    model = torch.nn.Sequential(torch.nn.Linear(128, 128), torch.nn.Linear(128, 256))
    with pytest.warns(UserWarning):
        lowprec.convert(model, "fp8-current")
        lowprec.convert(model, "fp8-current", lowprec.Policy(exclude=("1",)))  # layer 1 back to hp
    x = randn(4, 128, seed=3)
    with lowprec.autocast("mxfp8"):
        y = model[1](x)
    assert torch.equal(y, nnf.linear(x, model[1].weight, model[1].bias))


def test_regions_nest_and_restore_the_outer_state():
    lin = make_linear("fp8-current")
    with lowprec.autocast("mxfp8"):
        with lowprec.autocast(enabled=False):
            assert torch.equal(lin(X), plain(lin))
            with lowprec.autocast("nvfp4"):
                assert torch.equal(lin(X), under("nvfp4"))
            assert torch.equal(lin(X), plain(lin))
        assert torch.equal(lin(X), under("mxfp8"))
    assert torch.equal(lin(X), under("fp8-current"))


def test_enabled_without_a_recipe_keeps_the_bound_one_inside_a_disabled_region():
    lin = make_linear("fp8-current")
    with lowprec.autocast(enabled=False), lowprec.autocast():
        assert torch.equal(lin(X), under("fp8-current"))


def test_an_exception_in_the_region_restores_the_state():
    lin = make_linear("fp8-current")
    with pytest.raises(RuntimeError, match="boom"):
        with lowprec.autocast(enabled=False):
            raise RuntimeError("boom")
    assert torch.equal(lin(X), under("fp8-current"))


def test_an_unknown_recipe_is_refused_and_leaves_no_state():
    lin = make_linear("fp8-current")
    with pytest.raises(ValueError, match=r"recipe: expected one of bf16, .*got 'fp9'"):
        with lowprec.autocast("fp9"):
            pass
    assert resolve(lin.recipe) is lin.recipe


def test_a_recipe_the_layer_cannot_take_runs_plain_with_a_warning():
    lin = make_linear("fp8-current", in_features=128, out_features=64 + 16)  # 80: not a multiple of 128
    x = randn(4, 128, seed=2)
    with lowprec.autocast("fp8-blockwise"), pytest.warns(UserWarning, match="not a multiple of 128"):
        y = lin(x)
    assert torch.equal(y, nnf.linear(x, lin.weight, lin.bias))


def test_each_thread_sees_its_own_context():
    lin = make_linear("fp8-current")
    inside, entered, checked = {}, threading.Event(), threading.Event()

    def worker():
        with lowprec.autocast("mxfp8"):
            entered.set()
            checked.wait(timeout=30)  # the main thread checks while this region is open
            inside["worker"] = lin(X)

    t = threading.Thread(target=worker)
    with lowprec.autocast(enabled=False):
        t.start()
        assert entered.wait(timeout=30)
        inside["main"] = lin(X)
        checked.set()
        t.join(timeout=30)
    assert torch.equal(inside["main"], plain(lin))
    assert torch.equal(inside["worker"], under("mxfp8"))


def test_a_new_thread_does_not_inherit_the_region():
    lin = make_linear("fp8-current")
    seen = {}
    with lowprec.autocast(enabled=False):
        t = threading.Thread(target=lambda: seen.update(y=lin(X)))
        t.start()
        t.join(timeout=30)
    assert torch.equal(seen["y"], under("fp8-current"))


def test_record_amax_is_a_flag_of_the_region_and_ends_with_it():
    from lowprec.autocast import records_amax

    assert not records_amax()
    with lowprec.autocast("bf16", record_amax=True):
        assert records_amax()
        with lowprec.autocast(enabled=False):  # an inner region without it does not record
            assert not records_amax()
        with lowprec.autocast(enabled=False, record_amax=True), pytest.raises(RuntimeError, match="boom"):
            raise RuntimeError("boom")
        assert records_amax() and resolve(R.get("fp8-delayed")).name == "bf16"
    assert not records_amax()


@pytest.mark.parametrize(("kw", "got"), [(dict(recipe="fp8-current"), "recipe='fp8-current'"),
                                         (dict(recipe="mxfp8"), "recipe='mxfp8'"), (dict(), "recipe=None")])
def test_record_amax_needs_a_high_precision_region(kw, got):
    # recording is for steps that compute in high precision (a delayed override records through its own casts)
    with pytest.raises(ValueError, match=rf"record_amax: expected a region in high precision .*got {got}"):
        with lowprec.autocast(**kw, record_amax=True):
            pass


def test_record_amax_must_be_a_bool():
    with pytest.raises(TypeError, match=r"record_amax: expected a bool, got 1 \(int\)"):
        with lowprec.autocast("bf16", record_amax=1):
            pass
