"""Checkpoints move between recipes and plain PyTorch: converted layers keep ``torch.nn.Linear``'s
keys; only delayed scaling adds an ``_extra_state`` entry, which nothing requires."""
from __future__ import annotations

import io

import pytest
import torch
import torch.nn as nn

import lowprec
from tests.nn.common import randn


def mlp(seed: int) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(64, 128), nn.GELU(), nn.Linear(128, 64))


def trained(recipe: str, steps: int = 2) -> nn.Sequential:
    model = mlp(seed=0)
    lowprec.convert(model, recipe)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for step in range(steps):
        model(randn(16, 64, seed=step)).square().mean().backward()
        opt.step()
        opt.zero_grad()
    return model


def through_bytes(sd: dict) -> dict:
    """``sd`` saved with ``torch.save`` and loaded back, as a checkpoint would be."""
    buf = io.BytesIO()
    torch.save(sd, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=True)


def assert_same_weights(a: nn.Module, b: nn.Module) -> None:
    for (na, pa), (nb, pb) in zip(a.named_parameters(), b.named_parameters(), strict=True):
        assert na == nb and torch.equal(pa, pb), na


X = randn(8, 64, seed=99)


@pytest.fixture(scope="module")
def delayed_ckpt():
    model = trained("fp8-delayed")
    return model, through_bytes(model.state_dict())


def test_a_delayed_checkpoint_holds_the_plain_keys_and_one_history_per_layer(delayed_ckpt):
    _, ckpt = delayed_ckpt
    assert list(ckpt) == ["0.weight", "0.bias", "0._extra_state", "2.weight", "2.bias", "2._extra_state"]


def test_a_delayed_checkpoint_loads_into_a_plain_model_with_strict_false(delayed_ckpt):
    model, ckpt = delayed_ckpt
    plain = mlp(seed=1)
    result = plain.load_state_dict(ckpt, strict=False)
    assert result.missing_keys == [] and result.unexpected_keys == ["0._extra_state", "2._extra_state"]
    assert_same_weights(plain, model)


@pytest.mark.parametrize("recipe", ["bf16", "mxfp8", "fp8-current"])
def test_a_delayed_checkpoint_loads_strictly_into_models_converted_to_other_recipes(delayed_ckpt, recipe):
    model, ckpt = delayed_ckpt
    other = mlp(seed=1)
    lowprec.convert(other, recipe)
    other.load_state_dict(ckpt, strict=True)  # the history is read and set aside
    assert_same_weights(other, model)
    fresh = mlp(seed=1)
    lowprec.convert(fresh, recipe)
    fresh.load_state_dict({k: v for k, v in ckpt.items() if not k.endswith("_extra_state")})
    assert torch.equal(other(X), fresh(X))
    assert "0._extra_state" not in other.state_dict()


def test_a_delayed_checkpoint_restores_the_history_of_a_delayed_model(delayed_ckpt):
    model, ckpt = delayed_ckpt
    again = mlp(seed=1)
    lowprec.convert(again, "fp8-delayed")
    again.load_state_dict(ckpt, strict=True)
    for i in (0, 2):
        assert again[i].delayed_state.recorded == model[i].delayed_state.recorded
        assert torch.equal(again[i].delayed_state.history, model[i].delayed_state.history)
    assert torch.equal(again(X), model(X))


def test_a_delayed_checkpoint_loaded_plain_then_converted_trains(delayed_ckpt):
    model, ckpt = delayed_ckpt
    plain = mlp(seed=1)
    plain.load_state_dict(ckpt, strict=False)
    lowprec.convert(plain, "fp8-delayed")
    assert_same_weights(plain, model)
    assert plain[0].delayed_state.recorded == [0, 0, 0]  # the history was not loaded: current scaling first
    y = plain(X)
    y.square().mean().backward()
    assert torch.isfinite(plain[0].weight.grad).all() and plain[0].delayed_state.recorded == [1, 1, 1]


def test_a_plain_checkpoint_loads_strictly_into_a_delayed_model():
    plain = mlp(seed=3)
    ckpt = through_bytes(plain.state_dict())
    delayed = trained("fp8-delayed")
    delayed.load_state_dict(ckpt, strict=True)
    assert_same_weights(delayed, plain)
    assert torch.equal(delayed[0].weight, plain[0].weight)


@pytest.mark.parametrize(("src", "dst"), [("fp8-current", "mxfp8"), ("mxfp8", "nvfp4"), ("nvfp4", "bf16")])
def test_checkpoints_move_between_recipes_with_plain_keys(src, dst):
    model = trained(src)
    ckpt = through_bytes(model.state_dict())
    assert list(ckpt) == list(mlp(seed=0).state_dict())
    other = mlp(seed=1)
    lowprec.convert(other, dst)
    other(X)  # caches casts of its own initial weights
    other.load_state_dict(ckpt, strict=True)
    assert_same_weights(other, model)
    # the loaded layer casts the loaded weight, not the cached cast of its initial one
    reference = mlp(seed=2)
    lowprec.convert(reference, dst)
    reference.load_state_dict(ckpt)
    torch.manual_seed(0)
    y = other(X)
    torch.manual_seed(0)
    assert torch.equal(y, reference(X))
