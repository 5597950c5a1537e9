"""FP8 primary weights: codes follow the FP32 masters, training equals BF16 weights with masters bit for
bit where the codes are the recipe's casts, state_dict, torch.compile, bad input and the bytes held."""
from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn as nn

import lowprec
from lowprec import recipes as R
from lowprec.nn import Linear
from lowprec.nn.fp8_weight import FP8Weight
from lowprec.optim import Optimizer
from lowprec.quant import blockwise, quantize, tensorwise
from tests.nn.common import randn

BF16 = torch.bfloat16
DIRECT = {"fp8-current": tensorwise(), "fp8-blockwise": blockwise(128, 128)}


@pytest.fixture(autouse=True)
def _quiet():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "emulated on cpu" is expected here
        yield


def _model(recipe: str, fp8: bool, seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(128, 256), nn.ReLU(), nn.Linear(256, 128)).to(BF16)
    lowprec.convert(model, recipe, fp8_weights=fp8)
    return model


def _train(model: nn.Module, steps: int, check=None) -> list[float]:
    opt = Optimizer(model.parameters(), torch.optim.AdamW, lr=1e-2)
    losses = []
    for step in range(steps):
        x = randn(8, 128, seed=100 + step, dtype=BF16)
        loss = model(x).float().pow(2).mean()
        opt.backward(loss)
        opt.step(loss)
        losses.append(loss.item())
        if check is not None:
            check(model, opt)
    return losses


def _codes(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8)


@pytest.mark.parametrize("recipe", list(DIRECT))
def test_codes_are_the_quantized_masters_and_training_equals_bf16_weights_bit_for_bit(recipe):
    gran = DIRECT[recipe]

    def check(model, opt):
        for lin, master in zip((model[0], model[2]), opt.master_weights[0::2]):
            w = lin.weight
            assert isinstance(w, FP8Weight) and master.dtype == torch.float32
            # the master rounded to the parameter's dtype, then quantized: what a BF16 weight's forward casts
            ref = quantize(master.to(BF16), "e4m3", gran)
            assert torch.equal(_codes(w._data), _codes(ref.data)) and torch.equal(w._scale, ref.scale)

    fp8 = _train(_model(recipe, True), 4, check)
    assert fp8 == _train(_model(recipe, False), 4)


def test_delayed_weights_take_the_current_scale_and_record_their_amax():
    def check(model, opt):
        w, master = model[0].weight, opt.master_weights[0]
        hp = master.to(BF16)
        assert torch.equal(w._scale, quantize(hp, "e4m3", tensorwise()).scale)  # current, not from the history
        assert torch.equal(w.amax, hp.abs().amax().float())
        model(randn(8, 128, seed=9, dtype=BF16)).float().sum()  # a training forward records the stored amax
        assert torch.equal(model[0].delayed_state.last(R.Role.WEIGHT), w.amax)

    _train(_model("fp8-delayed", True), 2, check)


def test_recipes_that_cast_weights_otherwise_decode_the_codes_and_say_so():
    with pytest.warns(UserWarning, match="decodes them and casts them again"):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(128, 256)).to(BF16)
        report = lowprec.convert(model, "mxfp8", fp8_weights=True)
    assert report.fp8_decoded == ["0"] and model[0].weight.granularity == blockwise(128, 128)
    x = randn(8, 128, seed=1, dtype=BF16)
    ref = Linear(128, 256, dtype=BF16, recipe="mxfp8")  # the decoded weight as a BF16 parameter
    with torch.no_grad():
        ref.weight.copy_(model[0].weight.dequantize())
        ref.bias.copy_(model[0].bias)
    assert torch.equal(model(x), ref(x))


def test_the_model_stores_one_byte_per_weight_and_the_optimizer_the_masters():
    bf16, fp8 = _model("fp8-current", False), _model("fp8-current", True)
    n = sum(m.weight.numel() for m in (fp8[0], fp8[2]))

    def held(model, opt):  # bytes of every tensor the weights of the two linears hold, masters included
        params = sum(w.nbytes_held if isinstance(w, FP8Weight) else w.numel() * w.element_size()
                     for w in (model[0].weight, model[2].weight))
        return params + sum(m.numel() * m.element_size() for m in opt.master_weights[0::2])

    opt_bf16 = Optimizer(bf16.parameters(), torch.optim.AdamW)
    opt_fp8 = Optimizer(fp8.parameters(), torch.optim.AdamW)  # takes the BF16 initial values as masters
    assert all(w._initial is None for w in (fp8[0].weight, fp8[2].weight))
    assert held(bf16, opt_bf16) == 6 * n
    assert held(fp8, opt_fp8) == 5 * n + 2 * 4  # codes, masters, one FP32 scale per tensor
    assert torch.equal(opt_fp8.master_weights[0], opt_bf16.master_weights[0])  # not the FP8 rounding


def test_state_dict_holds_the_decoded_weight_and_loading_quantizes_it():
    model = _model("fp8-current", True)
    state = model.state_dict()
    w = model[0].weight
    assert type(state["0.weight"]) is torch.Tensor and torch.equal(state["0.weight"], w.dequantize())
    plain = nn.Sequential(nn.Linear(128, 256), nn.ReLU(), nn.Linear(256, 128)).to(BF16)
    plain.load_state_dict(state)  # a plain model takes it
    new = randn(256, 128, seed=7, dtype=BF16)
    model.load_state_dict({**state, "0.weight": new})
    ref = quantize(new, "e4m3", tensorwise())
    assert torch.equal(_codes(w._data), _codes(ref.data)) and torch.equal(w._scale, ref.scale)


def test_a_copy_through_any_alias_drops_the_initial_value_for_all_unless_it_changes_nothing():
    w = _model("fp8-current", True)[0].weight
    initial = w.initial.clone()
    alias = w.detach()  # DDP's broadcast writes through such an alias
    alias.copy_(w.dequantize())  # the weight's own value: the same codes, the initial value kept
    assert w.initial is not None and torch.equal(w.initial, initial)
    alias.copy_(randn(256, 128, seed=3, dtype=BF16))  # another value: new codes, no stale initial anywhere
    assert w.initial is None and alias.initial is None
    assert torch.equal(_codes(w._data), _codes(quantize(randn(256, 128, seed=3, dtype=BF16), "e4m3",
                                                       tensorwise()).data))
    w.share_initial_(initial)  # another rank's initial value: held, and its codes stored
    assert torch.equal(w.take_initial(), initial) and w.initial is None
    assert torch.equal(_codes(w._data), _codes(quantize(initial, "e4m3", tensorwise()).data))


def test_a_compiled_layer_with_an_fp8_weight_equals_eager():
    # one graph: the plan says the codes serve, and the layer hands them over as plain tensors
    torch._dynamo.reset()
    model = _model("fp8-current", True)
    lin = model[0]
    x, dy = randn(16, 128, seed=1, dtype=BF16), randn(16, 256, seed=2, dtype=BF16)
    results = []
    for layer in (torch.compile(lin, backend="aot_eager", fullgraph=True), lin):
        xi = x.clone().requires_grad_()
        layer(xi).backward(dy)
        results.append((layer(xi).detach(), xi.grad, lin.weight.grad))
        lin.weight.grad = None
    for compiled, eager in zip(*results):
        assert torch.equal(compiled, eager)


def test_bad_input_is_refused_in_one_line():
    model = nn.Sequential(nn.Linear(128, 256)).to(BF16)
    with pytest.raises(ValueError, match="^fp8_weights: expected a recipe that casts weights .* got bf16"):
        lowprec.convert(model, "bf16", fp8_weights=True)
    with pytest.raises(ValueError, match="^fp8_weights: expected bfloat16 or float16 parameters .* float32"):
        lowprec.convert(nn.Sequential(nn.Linear(128, 256)), "fp8-current", fp8_weights=True)
    fp8 = _model("fp8-current", True)
    with pytest.raises(ValueError, match="^master_weights: expected True for FP8 weights"):
        Optimizer(fp8.parameters(), torch.optim.AdamW, master_weights=False)
    with pytest.raises(ValueError, match="^weight: expected no in-place write into an FP8 weight"), torch.no_grad():
        fp8[0].weight.add_(1.0)  # what a plain torch optimizer would do
