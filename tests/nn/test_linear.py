"""``lowprec.nn.Linear`` as a drop-in ``torch.nn.Linear``: shapes, dtypes, bias, inputs without grad,
inference, layers the GEMMs cannot take, and bad input."""
from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as nnf

from lowprec import recipes as R
from lowprec.nn import Linear
from tests.nn.common import LOW_PRECISION, QuantizeSpy, make_linear, plain_copy, randn

ALL = tuple(R.names())


def test_without_a_recipe_it_is_torch_linear_bit_for_bit():
    torch.manual_seed(3)
    lin = Linear(24, 40)
    torch.manual_seed(3)
    ref = nn.Linear(24, 40)  # same seed, same initialisation
    assert torch.equal(lin.weight, ref.weight) and torch.equal(lin.bias, ref.bias)
    assert list(lin.state_dict()) == list(ref.state_dict()) == ["weight", "bias"]
    x = randn(5, 24, seed=1, dtype=torch.bfloat16)
    assert torch.equal(lin.to(torch.bfloat16)(x), ref.to(torch.bfloat16)(x))


@pytest.mark.parametrize("recipe", ALL)
@pytest.mark.parametrize("shape", [(128,), (48, 128), (2, 3, 8, 128)], ids=["1d", "2d", "4d"])
def test_any_number_of_leading_dims_gives_the_same_rows(recipe, shape):
    # every row of the output and of dx is what the same rows give as one flat (M, K) batch
    lin = make_linear(recipe)
    x = randn(*shape, seed=2)
    flat = x.reshape(-1, 128)
    torch.manual_seed(0)  # nvfp4 rounds its gradients stochastically
    xg = x.clone().requires_grad_()
    y = lin(xg)
    dy = randn(*y.shape, seed=3)
    y.backward(dy)
    dw, lin.weight.grad = lin.weight.grad, None
    torch.manual_seed(0)
    fg = flat.clone().requires_grad_()
    y_flat = lin(fg)
    y_flat.backward(dy.reshape(-1, 256))
    assert y.shape == (*shape[:-1], 256) and xg.grad.shape == x.shape
    assert torch.equal(y.reshape(-1, 256), y_flat)
    assert torch.equal(xg.grad.reshape(-1, 128), fg.grad)
    assert torch.equal(dw, lin.weight.grad)


@pytest.mark.parametrize("recipe", ALL)
def test_output_dtype_follows_the_input_and_gradients_follow_their_tensors(recipe):
    lin = make_linear(recipe)  # float32 weights
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        x = randn(16, 128, seed=4, dtype=dtype).requires_grad_()
        y = lin(x)
        assert y.dtype == dtype, f"{recipe}: {dtype} in, {y.dtype} out"
        y.float().sum().backward()
        assert x.grad.dtype == dtype and lin.weight.grad.dtype == torch.float32
        assert lin.bias.grad.dtype == torch.float32
        lin.zero_grad()


@pytest.mark.parametrize("recipe", ALL)
def test_output_dtype_follows_torch_autocast(recipe):
    lin = make_linear(recipe)
    x = randn(16, 128, seed=5).requires_grad_()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = lin(x)
    assert y.dtype == torch.bfloat16
    y.float().sum().backward()
    assert x.grad.dtype == torch.float32 and lin.weight.grad.dtype == torch.float32


@pytest.mark.parametrize("recipe", LOW_PRECISION)
def test_bias_is_added_in_high_precision_and_its_gradient_is_the_sum_of_dy(recipe):
    with_bias, no_bias = make_linear(recipe, seed=6), make_linear(recipe, bias=False, seed=6)
    assert no_bias.bias is None and "bias" not in no_bias.state_dict()
    x, dy = randn(32, 128, seed=7), randn(32, 256, seed=8)
    torch.manual_seed(0)
    y = with_bias(x)
    y.backward(dy)
    torch.manual_seed(0)
    y0 = no_bias(x)
    y0.backward(dy)
    assert torch.equal(y, y0 + with_bias.bias)
    assert torch.equal(with_bias.weight.grad, no_bias.weight.grad)
    torch.testing.assert_close(with_bias.bias.grad, dy.sum(0), rtol=1e-6, atol=1e-5)


@pytest.mark.parametrize("recipe", LOW_PRECISION)
def test_an_input_without_grad_gets_no_dgrad_and_no_transposed_weight_cast(recipe, monkeypatch):
    lin = make_linear(recipe)
    spy = QuantizeSpy(monkeypatch)
    lin(randn(32, 128, seed=9)).sum().backward()
    assert lin.weight.grad is not None and lin.bias.grad is not None
    assert (128, 256) not in spy.shapes(), "weight.T cast although no input gradient is needed"


@pytest.mark.parametrize("recipe", LOW_PRECISION)
def test_frozen_weights_get_no_wgrad_casts(recipe, monkeypatch):
    lin = make_linear(recipe).requires_grad_(False)
    spy = QuantizeSpy(monkeypatch)
    x = randn(32, 128, seed=10).requires_grad_()
    lin(x).sum().backward()
    assert x.grad is not None and lin.weight.grad is None
    shapes = spy.shapes()
    assert (128, 32) not in shapes and (256, 32) not in shapes, f"x.T / dy.T cast for no wgrad: {shapes}"


@pytest.mark.parametrize("recipe", LOW_PRECISION)
def test_inference_under_no_grad_casts_the_input_once_and_no_weight_transpose(recipe, monkeypatch):
    lin = make_linear(recipe)
    spy = QuantizeSpy(monkeypatch)
    with torch.no_grad():
        y = lin(randn(32, 128, seed=11))
    assert y.shape == (32, 256) and not y.requires_grad
    casts = spy.shapes()
    assert casts.count((32, 128)) == 1 and casts.count((256, 128)) == 1, casts
    assert (128, 256) not in casts, "weight.T cast under no_grad"


@pytest.mark.parametrize("recipe", ["fp8-rowwise", "mxfp8", "nvfp4"])
def test_inference_under_no_grad_makes_no_transposed_input_cast(recipe, monkeypatch):
    lin = make_linear(recipe)
    spy = QuantizeSpy(monkeypatch)
    with torch.no_grad():
        lin(randn(32, 128, seed=11))
    assert (128, 32) not in spy.shapes()


@pytest.mark.parametrize("recipe", ["fp8-current", "mxfp8", "fp8-blockwise", "nvfp4"])
def test_a_layer_the_gemms_cannot_take_runs_plain_linear_with_one_warning(recipe):
    m = R.get(recipe).required_multiple()
    lin = make_linear(recipe, in_features=m + 8, out_features=m)  # in_features not a multiple
    ref = plain_copy(lin)
    x = randn(4, m + 8, seed=12)
    with pytest.warns(UserWarning, match=f"in_features={m + 8} not a multiple of {m}"):
        y = lin(x)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once per layer and reason, not every call
        y2 = lin(x)
    assert torch.equal(y, ref(x)) and torch.equal(y2, y)


@pytest.mark.parametrize("recipe", ["bf16", "fp16"])
def test_unscaled_recipes_are_linear_on_operands_cast_to_their_dtype(recipe):
    # like torch.autocast: input, weight and bias cast, the product rounded to the 16-bit dtype
    lin = make_linear(recipe, seed=6)
    dtype = R.get(recipe).hp_dtype
    x = randn(32, 128, seed=7)
    want = nnf.linear(x.to(dtype), lin.weight.to(dtype), lin.bias.to(dtype)).float()
    assert torch.equal(lin(x), want)


def test_required_multiples_are_those_of_the_blocks():
    assert {n: R.get(n).required_multiple() for n in R.names()} == {
        "bf16": 1, "fp16": 1, "fp8-delayed": 16, "fp8-current": 16, "fp8-rowwise": 16,
        "fp8-blockwise": 128, "mxfp8": 32, "mxfp4": 32, "nvfp4": 16}


# ---- bad input ----------------------------------------------------------------------------------


def test_an_unknown_recipe_name_is_refused_with_the_presets():
    with pytest.raises(ValueError, match=r"recipe: expected one of bf16, fp16, .*nvfp4.* got 'fp9'"):
        Linear(16, 16, recipe="fp9")
    with pytest.raises(TypeError, match=r"recipe: expected a recipe name or lowprec.recipes.Recipe, got 8"):
        Linear(16, 16, recipe=8)


@pytest.mark.parametrize("recipe", LOW_PRECISION)
def test_an_integer_input_is_refused_naming_it(recipe):
    with pytest.raises(TypeError, match=r"input: expected a float32, bfloat16 or float16 tensor, got a torch.int64"):
        make_linear(recipe)(torch.ones(4, 128, dtype=torch.int64))


@pytest.mark.parametrize("recipe", ["bf16", "fp16"])
def test_an_integer_input_is_refused_by_unscaled_recipes(recipe):
    with pytest.raises(TypeError, match="float"):
        make_linear(recipe)(torch.ones(4, 128, dtype=torch.int64))


@pytest.mark.parametrize("recipe", ["fp8-current", "mxfp8"])
def test_a_wrong_last_dimension_is_refused_naming_in_features(recipe):
    with pytest.raises(ValueError, match=r"in_features.*128.*got.*100"):
        make_linear(recipe)(randn(4, 100, seed=13))


@pytest.mark.parametrize("recipe", ["fp8-delayed", "fp8-current", "fp8-rowwise", "fp8-blockwise", "mxfp8", "nvfp4"])
def test_an_empty_batch_gives_empty_outputs_and_zero_weight_gradients(recipe):
    lin = make_linear(recipe)
    x = torch.zeros(0, 128, requires_grad=True)
    y = lin(x)
    y.sum().backward()
    assert y.shape == (0, 256) and x.grad.shape == (0, 128)
    assert torch.equal(lin.weight.grad, torch.zeros(256, 128))


@pytest.mark.parametrize("recipe", ["bf16", "fp16"])
def test_an_empty_batch_works_with_unscaled_recipes(recipe):
    lin = make_linear(recipe)
    x = torch.zeros(0, 128, requires_grad=True)
    lin(x).sum().backward()
    assert x.grad.shape == (0, 128) and torch.equal(lin.weight.grad, torch.zeros(256, 128))


def test_extra_repr_names_the_recipe():
    assert "recipe=mxfp8" in repr(make_linear("mxfp8")) and "recipe=None" in repr(Linear(4, 4))


def test_from_linear_shares_the_parameters():
    ref = nn.Linear(32, 64)
    lin = Linear.from_linear(ref.eval(), "fp8-current")
    assert lin.weight is ref.weight and lin.bias is ref.bias and not lin.training
    assert torch.equal(nnf.linear(torch.zeros(1, 32), lin.weight, lin.bias), lin.bias[None])
