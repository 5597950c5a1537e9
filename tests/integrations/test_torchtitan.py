"""LowprecConverter against torchtitan (0.3.0) itself: its llama3 debug model built from the converted config
holds the layers lowprec.convert makes of the plain one, and a block built from it trains as the plain
block converted by lowprec.convert, bit for bit.

torchtitan is not one of lowprec's extras (it needs tyro, spmd_types, torchdata and torch_checkpointing
besides), so this skips where it is absent. Its attention backends (flex, varlen) have no backward on the
CPU and compile their forward (tens of seconds), so the model is checked built, and a feed-forward block,
which holds three of the converted Linears, is trained."""
from __future__ import annotations

import copy
import math
import warnings

import pytest
import torch

pytest.importorskip("torchtitan.components.quantization", reason="torchtitan (0.3.0) is not installed")
from torchtitan.models.common.linear import Linear as TitanLinear
from torchtitan.models.llama3 import model_registry

import lowprec
from lowprec.integrations.conversion import NothingConvertedWarning
from lowprec.integrations.torchtitan import LowprecConverter, LowprecLinear
from tests.integrations.common import assert_same_tensors


def _converted(recipe: str, **config):
    plain = model_registry("debugmodel").model
    converter = LowprecConverter(LowprecConverter.Config(recipe=recipe, **config))
    return plain, converter.convert(copy.deepcopy(plain)), converter


@pytest.fixture(autouse=True)
def _quiet():
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*emulated.*")
        yield


def test_the_converted_model_holds_what_lowprec_convert_makes():
    plain, config, converter = _converted("fp8-current")
    model = config.build()
    report = lowprec.convert(plain.build(), "fp8-current")
    assert sorted(converter.converted) == sorted(lr.name for lr in report.converted)
    assert converter.kept == {"lm_head": "LM head / final projection (kept by policy)"}
    for name in converter.converted:
        layer = model.get_submodule(name)
        assert isinstance(layer, LowprecLinear) and layer.recipe.name == "fp8-current"
    assert type(model.get_submodule("lm_head")) is TitanLinear
    model.verify_module_protocol()  # what torchtitan's trainer checks after building


def test_nvfp4_keeps_its_last_blocks_and_fqns_choose():
    _, config, converter = _converted("nvfp4")
    n_layers = len(config.layers)
    last = math.ceil(lowprec.recipes.get("nvfp4").hp_last_fraction * n_layers)
    kept_blocks = {int(name.split(".")[1]) for name in converter.kept if name.startswith("layers.")}
    assert kept_blocks == set(range(n_layers - last, n_layers))
    _, _, only_ffn = _converted("mxfp8", fqns=["feed_forward"])
    assert only_ffn.converted and all("feed_forward" in name for name in only_ffn.converted)
    with pytest.warns(NothingConvertedWarning, match="converted none"):
        _converted("mxfp8", fqns=["no_such_layer"])
    with pytest.raises(ValueError, match="delayed scaling"):
        LowprecConverter(LowprecConverter.Config(recipe="fp8-delayed"))


def test_a_block_built_from_the_converted_config_trains_as_lowprec_convert():
    plain, config, _ = _converted("mxfp8")
    torch.manual_seed(0)
    reference = plain.layers[0].feed_forward.build()
    reference.init_states()
    block = config.layers[0].feed_forward.build()
    block.load_state_dict(reference.state_dict())
    lowprec.convert(reference, "mxfp8")
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(2, 8, reference.w1.in_features, generator=gen)  # (B, T, dim)
    target = torch.randn(2, 8, reference.w1.in_features, generator=gen) * 0.1  # (B, T, dim)
    losses = {}
    for name, module in (("converter", block), ("convert", reference)):
        opt = torch.optim.AdamW(module.parameters(), lr=1e-4)
        losses[name] = []
        for _ in range(3):
            loss = (module(x) - target).square().mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses[name].append(loss.item())
    assert losses["converter"] == losses["convert"] and losses["converter"][-1] < losses["converter"][0]
    assert_same_tensors(block.state_dict(), reference.state_dict())
