"""FP8 saved activations in a model: ``convert`` with ``Policy.saved_activations`` sets them on the
reference model's norms and SwiGLU and swaps a ``torch.nn.RMSNorm``; the bytes a block of the tiny
model saves for backward drop by what FP8 spares on those inputs; the model compiles."""
from __future__ import annotations

import math

import pytest
import torch
import torch.nn as nn

import lowprec
from lowprec.nn import RMSNorm, SwiGLU, fp8_activations
from lowprec.train.model import ModelConfig, build_model, preset, rope_tables
from tests.nn.common import randn, saved_for_backward

pytestmark = pytest.mark.filterwarnings("ignore:lowprec.*emulated:UserWarning")
B, T = 2, 16


def _block_saved_bytes(name: str | None) -> tuple[int, lowprec.ConversionReport]:
    """Bytes block 0 of the tiny model (FP32, linears unconverted) saves for backward, parameters aside."""
    model = build_model(preset("tiny"), seed=0)
    policy = lowprec.Policy(saved_activations=fp8_activations(name) if name else None, include=("none",))
    report = lowprec.convert(model, "bf16", policy)
    block, cfg = model.layers[0], model.config
    cos, sin = rope_tables(T, cfg.head_dim, cfg.rope_theta, torch.device("cpu"))
    h = randn(B, T, cfg.dim, seed=0).requires_grad_()
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    _, kept = saved_for_backward(lambda: block(h, cos, sin))
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in kept
                if t.untyped_storage().data_ptr() not in params}
    return sum(storages.values()), report


def _fp8_row_bytes(k: int, block: int | None) -> int:
    """Bytes of one row of ``k`` elements in E4M3: padded to whole blocks, one FP32 scale per block."""
    if block is None:
        return k
    n = math.ceil(k / block)
    return n * block + 4 * n


@pytest.mark.parametrize("name, block", [("1x128", 128), ("1x64", 64), ("tensor", None)])
def test_a_tiny_block_saves_fewer_bytes_by_what_fp8_spares(name, block):
    """The block's norms save their FP32 inputs (dim wide), SwiGLU its gate and up (ffn wide): 4 B an
    element become the E4M3 row bytes; everything else the block saves is unchanged."""
    cfg = preset("tiny")
    hp, _ = _block_saved_bytes(None)
    fp8, report = _block_saved_bytes(name)
    tokens = B * T
    inputs_hp = tokens * 4 * (2 * cfg.dim + 2 * cfg.ffn_dim)
    inputs_fp8 = tokens * (2 * _fp8_row_bytes(cfg.dim, block) + 2 * _fp8_row_bytes(cfg.ffn_dim, block))
    per_tensor_scales = 4 * 4 if block is None else 0  # two norms, gate and up
    assert hp - fp8 == inputs_hp - inputs_fp8 - per_tensor_scales
    assert len(report.saved_activations) == 3 * cfg.n_layers + 1  # norms, SwiGLUs, final norm


def test_convert_sets_resets_and_reports_the_saved_activations():
    model = build_model(preset("tiny"), seed=0)
    report = lowprec.convert(model, "fp8-current", lowprec.Policy(saved_activations=fp8_activations()))
    mods = [m for m in model.modules() if isinstance(m, (RMSNorm, SwiGLU))]
    assert mods and all(m.saved == fp8_activations() for m in mods)
    assert "save their inputs for backward as e4m3 block1x128" in str(report)
    assert report.to_dict()["activations"] == "e4m3 block1x128"
    report = lowprec.convert(model, "fp8-current")  # the default policy: back to the model's dtype
    assert all(m.saved is None for m in mods) and report.saved_activations == []


def test_a_torch_rms_norm_is_swapped_and_keeps_its_gradients():
    torch_norm = nn.RMSNorm(64, eps=1e-6)
    with torch.no_grad():
        torch_norm.weight.copy_(1 + 0.1 * randn(64, seed=1))
    model = nn.Sequential(torch_norm, nn.Linear(64, 64))
    x = randn(8, 64, seed=2)
    lowprec.convert(model, "bf16", lowprec.Policy(saved_activations=fp8_activations("1x32")))
    assert isinstance(model[0], RMSNorm) and model[0].weight is torch_norm.weight
    xq = lowprec.quant.fake_quantize(x, "e4m3", lowprec.quant.blockwise(1, 32))
    got = torch.autograd.grad(model[0](x.requires_grad_()).sum(), x)[0]
    want = torch.autograd.grad(torch_norm(xq.requires_grad_()).sum(), xq)[0]
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    kept = nn.Sequential(nn.RMSNorm((4, 64)))  # not over the last dimension alone: left as it is
    lowprec.convert(kept, "bf16", lowprec.Policy(saved_activations=fp8_activations()))
    assert type(kept[0]) is nn.RMSNorm


def test_bad_policy_is_refused():
    with pytest.raises(TypeError, match="saved_activations: expected None or a lowprec.nn.SavedActivations"):
        lowprec.Policy(saved_activations="1x128")


@pytest.mark.slow
def test_a_model_with_fp8_activations_compiles_like_eager():
    """aot_eager (see [Note: why aot_eager] in test_compile): the same losses, no graph break."""
    cfg = ModelConfig(vocab_size=64, dim=128, n_layers=1, n_heads=4, n_kv_heads=4, ffn_dim=256, max_seq_len=16)
    torch._dynamo.reset()
    breaks = torch._dynamo.utils.counters["graph_break"]
    breaks.clear()
    runs = []
    for compiled in (False, True):
        model = build_model(cfg, seed=0)
        lowprec.convert(model, "fp8-current", lowprec.Policy(keep_last_blocks=0, saved_activations=fp8_activations()))
        fwd = torch.compile(model, backend="aot_eager") if compiled else model
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        g = torch.Generator().manual_seed(5)
        losses = []
        for _ in range(3):
            tokens = torch.randint(0, cfg.vocab_size, (2, 16), generator=g)
            logits = fwd(tokens[:, :-1])
            loss = nn.functional.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
        runs.append(losses)
    torch.testing.assert_close(torch.tensor(runs[1]), torch.tensor(runs[0]), rtol=2e-3, atol=0)
    assert sum(breaks.values()) == 0, dict(breaks)
