"""Hugging Face MoE models with fused 3-D experts (GPT-OSS, Mixtral), converted by ``lowprec.convert`` and trained
two steps: each fused parameter is exported as one weight under its own name, in the format's 3-D form where
transformers reads one (GPT-OSS mxfp4, fp8) and in BF16 with the reason otherwise, and transformers loads it."""
from __future__ import annotations

import json
import warnings

import pytest
import torch

import lowprec
from lowprec.export import AS_TRAINED, KEPT, export
from lowprec.export.fp8 import FP8Layout
from lowprec.quant import blockwise, quantize
from tests.export.hf_load import load_causal_lm
from tests.export.layout_helpers import safetensors_of

transformers = pytest.importorskip("transformers", reason="transformers (the export extra) is not installed")

VOCAB, E = 64, 4
EXPERTS = "model.layers.0.mlp.experts"
_MODELS: dict[tuple[str, str], torch.nn.Module] = {}


def _gpt_oss() -> torch.nn.Module:
    cfg = transformers.GptOssConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=64, num_hidden_layers=1,
                                    num_attention_heads=2, num_key_value_heads=1, head_dim=32, num_local_experts=E,
                                    num_experts_per_tok=2, max_position_embeddings=64,
                                    layer_types=["full_attention"],
                                    rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    return transformers.GptOssForCausalLM(cfg)


def _mixtral() -> torch.nn.Module:
    """128 wide: every projection in whole 128x128 blocks (transformers' FP8 dequantization needs them)."""
    cfg = transformers.MixtralConfig(vocab_size=VOCAB, hidden_size=128, intermediate_size=128, num_hidden_layers=1,
                                     num_attention_heads=2, num_key_value_heads=1, head_dim=64,
                                     num_local_experts=E, num_experts_per_tok=2, max_position_embeddings=64)
    return transformers.MixtralForCausalLM(cfg)


def tokens() -> torch.Tensor:
    return torch.randint(0, VOCAB, (2, 16), generator=torch.Generator().manual_seed(0))


def trained(arch: str, recipe: str) -> torch.nn.Module:
    """``arch`` converted to ``recipe`` and trained two AdamW steps on one batch, once per process."""
    if (arch, recipe) not in _MODELS:
        torch.manual_seed(0)
        model = {"gpt-oss": _gpt_oss, "mixtral": _mixtral}[arch]()
        with torch.no_grad():
            for p in model.parameters():
                p.normal_(0, 0.05)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # emulated on cpu; the router lowprec cannot see into
            lowprec.convert(model, lowprec.recipes.get(recipe))
            opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
            for _ in range(2):
                model(input_ids=tokens(), labels=tokens()).loss.backward()
                opt.step()
                opt.zero_grad()
        _MODELS[(arch, recipe)] = model.eval()
    return _MODELS[(arch, recipe)]


def _load(path) -> torch.nn.Module:
    return load_causal_lm(path, torch.float32)


def _sqnr(x: torch.Tensor, ref: torch.Tensor) -> float:
    return float(10 * torch.log10(ref.pow(2).mean() / (x - ref).pow(2).mean()))


@torch.no_grad()
def _logits(model: torch.nn.Module) -> torch.Tensor:
    return model(input_ids=tokens()).logits.float()


def _rows(report) -> dict[str, object]:
    return {r.name: r for r in report.layers}


def _expert_casts(model: torch.nn.Module, proj: str) -> list:
    experts = model.get_submodule(EXPERTS)
    g = dict(zip((p.weight for p in experts.projections), experts.grouped()))[proj]
    return list(lowprec.export.trained.trained(g).weights)


def test_gpt_oss_mxfp4_experts_are_written_as_trained_and_load_exactly(tmp_path):
    model = trained("gpt-oss", "mxfp4")
    report = export(model, tmp_path / "m", "mxfp4")
    rows = _rows(report)
    t = safetensors_of(tmp_path / "m")
    loaded = _load(tmp_path / "m")
    for proj in ("gate_up_proj", "down_proj"):
        assert rows[f"{EXPERTS}.{proj}"].how == AS_TRAINED
        assert t[f"{EXPERTS}.{proj}_blocks"].dtype == torch.uint8 and f"{EXPERTS}.{proj}" not in t
        ours = torch.stack([q.dequantize(torch.float32) for q in _expert_casts(model, proj)])  # (E, out, in)
        assert torch.equal(getattr(loaded.get_submodule(EXPERTS), proj), ours.transpose(1, 2))
    assert {r.how for n, r in rows.items() if "experts" not in n} == {KEPT}
    assert _sqnr(_logits(loaded), _logits(model)) >= 20  # dense layers BF16 there, FP4 in lowprec's forward


def test_gpt_oss_hf_writes_fused_experts_in_their_own_storage_order(tmp_path):
    model = trained("gpt-oss", "mxfp4")
    export(model, tmp_path / "m", "hf")
    loaded = _load(tmp_path / "m")
    for name, p in model.named_parameters():
        assert torch.equal(loaded.get_parameter(name), p.detach().to(torch.bfloat16).float()), name


def test_mixtral_fp8_experts_per_expert_blocks_in_transformers_fp8_experts_form(tmp_path):
    from transformers.integrations.finegrained_fp8 import replace_with_fp8_linear

    model = trained("mixtral", "fp8-current")
    report = export(model, tmp_path / "m", "fp8")
    assert FP8Layout.fused_note in report.notes
    t = safetensors_of(tmp_path / "m")
    for proj in ("gate_up_proj", "down_proj"):
        master = model.get_parameter(f"{EXPERTS}.{proj}").detach().float()
        for e in range(E):  # each expert in its own 128x128 blocks, from the master (per-tensor casts do not fit)
            q = quantize(master[e], lowprec.formats.get("e4m3"), blockwise(128, 128))
            assert torch.equal(t[f"{EXPERTS}.{proj}"][e], q.data)
            assert torch.equal(t[f"{EXPERTS}.{proj}_scale_inv"][e], q.scale)
    # the names, shapes and dtypes transformers' FP8 experts hold (built on the meta device, as its loader does)
    config = json.loads((tmp_path / "m" / "config.json").read_text())
    qc = transformers.FineGrainedFP8Config(**{k: config["quantization_config"][k] for k in
                                              ("weight_block_size", "activation_scheme", "modules_to_not_convert")})
    with torch.device("meta"):
        skeleton = _mixtral()
    replace_with_fp8_linear(skeleton, qc.modules_to_not_convert, qc)
    theirs = {k: (p.dtype, tuple(p.shape)) for k, p in skeleton.named_parameters() if k.startswith(EXPERTS)}
    assert theirs == {k: (v.dtype, tuple(v.shape)) for k, v in t.items() if k.startswith(EXPERTS)}


@pytest.mark.skip(reason="transformers 5.24 dequantizing FP8 on a CPU (no FP8 GPU) loads fused experts' weights "
                         "without their <proj>_scale_inv (checked: the loaded down_proj equals the raw E4M3 codes)")
def test_mixtral_fp8_loads_on_the_cpu(tmp_path):
    model = trained("mixtral", "fp8-current")
    export(model, tmp_path / "m", "fp8")
    assert _sqnr(_logits(_load(tmp_path / "m")), _logits(model)) >= 20


@pytest.mark.parametrize("fmt, scheme, why", [
    ("compressed-tensors", "fp8-dynamic", "no compressed-tensors form of fused 3-D experts"),
    ("mxfp4", None, "into GptOssExperts only"),
    ("hf", None, None),
])
def test_mixtral_experts_without_a_3d_form_are_bf16_with_the_reason(fmt, scheme, why, tmp_path):
    model = trained("mixtral", "fp8-current")
    report = export(model, tmp_path / "m", fmt, scheme)
    rows = _rows(report)
    t = safetensors_of(tmp_path / "m")
    for proj in ("gate_up_proj", "down_proj"):
        name = f"{EXPERTS}.{proj}"
        assert t[name].dtype == torch.bfloat16
        if why is not None:
            assert rows[name].how == KEPT and why in rows[name].reason
    assert _sqnr(_logits(_load(tmp_path / "m")), _logits(model)) >= 25  # FP8 forward against BF16 / FP8 weights
