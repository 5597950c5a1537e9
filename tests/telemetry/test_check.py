"""``lowprec check``'s measure: each converted layer's output against the same layer in BF16 fed the same
input, checked against a hand computation on a small model, flagging, the suggested policy and its file."""
from __future__ import annotations

import json
import math

import pytest
import torch
import torch.nn.functional as nnf
from click.testing import CliRunner
from torch import nn

import lowprec
from lowprec.cli import main
from lowprec.nn import Linear
from lowprec.policy import Policy, quality_policy
from lowprec.policy_file import load_policy
from lowprec.telemetry.check import check
from tests.small_rule import native_small_rule  # noqa: F401 (a fixture)

VOCAB = 32


class Toy(nn.Module):
    """tokens -> embedding -> up -> relu -> down -> head: two layers the default policy converts."""

    def __init__(self) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.embed = nn.Embedding(VOCAB, 64)
        self.up, self.down, self.head = nn.Linear(64, 128), nn.Linear(128, 64), nn.Linear(64, VOCAB)
        with torch.no_grad():
            for p in self.parameters():
                p.copy_(torch.randn(p.shape, generator=g) * 0.2)
            # one outlier weight, on an input channel relu keeps at 0: it adds nothing to the output, but
            # per-tensor FP8 scales the whole weight by it and flushes the rest
            self.up.weight[5].zero_()
            self.up.bias[5] = -1.0
            self.down.weight[3, 5] = 1e6

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(self.down(torch.relu(self.up(self.embed(tokens)))))  # (B, T, vocab)


def _batches(n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [(torch.randint(0, VOCAB, (2, 8), generator=g), torch.randint(0, VOCAB, (2, 8), generator=g))
            for _ in range(n)]


def _sqnr(ref: list[torch.Tensor], out: list[torch.Tensor]) -> float:
    signal = sum(r.double().square().sum().item() for r in ref)
    noise = sum((r.double() - o.double()).square().sum().item() for r, o in zip(ref, out))
    return 10 * math.log10(signal / noise)


def _layer(src: nn.Linear, recipe: str) -> Linear:
    lin = Linear(src.in_features, src.out_features, recipe=recipe)
    lin.load_state_dict(src.state_dict())
    return lin.eval()


@torch.no_grad()
def test_each_layer_is_measured_on_the_converted_models_input_against_bf16():
    model, batches = Toy(), _batches(2)
    report = check(model, "fp8-current", batches, floor_db=20.0)
    up_lp, up_bf16 = _layer(model.up, "fp8-current"), _layer(model.up, "bf16")
    down_lp, down_bf16 = _layer(model.down, "fp8-current"), _layer(model.down, "bf16")
    ref = {"up": [], "down": []}
    out = {"up": [], "down": []}
    logits_lp, logits_bf16, loss_lp, loss_bf16 = [], [], 0.0, 0.0
    for tokens, targets in batches:
        x = model.embed(tokens)
        h = up_lp(x)
        ref["up"].append(up_bf16(x)), out["up"].append(h)
        ref["down"].append(down_bf16(torch.relu(h))), out["down"].append(down_lp(torch.relu(h)))
        lp = model.head(out["down"][-1])
        bf = model.head(down_bf16(torch.relu(up_bf16(x))))
        logits_lp.append(lp), logits_bf16.append(bf)
        loss_lp += nnf.cross_entropy(lp.flatten(0, 1), targets.flatten()).item() / 2
        loss_bf16 += nnf.cross_entropy(bf.flatten(0, 1), targets.flatten()).item() / 2
    got = {lc.name: lc for lc in report.layers}
    assert set(got) == {"up", "down"}  # the head stays in high precision and is not measured
    for name in ("up", "down"):
        assert got[name].sqnr_db == pytest.approx(_sqnr(ref[name], out[name]), rel=1e-9, abs=0)
    assert report.logits_sqnr_db == pytest.approx(_sqnr(logits_bf16, logits_lp), rel=1e-9, abs=0)
    assert report.loss_recipe == pytest.approx(loss_lp, rel=1e-9)
    assert report.loss_bf16 == pytest.approx(loss_bf16, rel=1e-9)
    # the outlier costs the down projection its other weights; up keeps FP8's ~30 dB
    assert got["down"].sqnr_db < 20.0 <= got["up"].sqnr_db
    assert report.flagged == ["down"] and report.policy.exclude == ("down",)
    assert model.up.__class__ is nn.Linear  # the model itself is left as it was


def test_the_suggested_policy_keeps_the_flagged_layers_in_high_precision():
    model, batches = Toy(), _batches(1)
    report = check(model, "fp8-current", batches, floor_db=20.0)
    conv = lowprec.convert(Toy(), "fp8-current", report.policy)
    assert [lr.name for lr in conv.converted] == ["up"]
    assert check(Toy(), "fp8-current", batches, policy=report.policy, floor_db=20.0).flagged == []


def test_check_cli_prints_the_table_and_writes_a_policy_file_train_reads(tmp_path):
    path = tmp_path / "policy.json"
    args = ["check", "--recipe", "nvfp4", "--batches", "1", "--batch-size", "2", "--seq-len", "16",
            "--floor", "99", "--write-policy", str(path), "--json"]
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 0, result.output
    out = json.loads(result.output[result.output.index("{"):])
    assert out["flagged"] and len(out["flagged"]) == len(out["layers"])  # every layer under 99 dB
    assert list(load_policy(path).exclude) == out["flagged"] == out["suggested_policy"]["exclude"]


def test_check_refuses_a_non_finite_floor():
    with pytest.raises(ValueError, match="^floor_db: expected a finite number of dB"):
        check(Toy(), "fp8-current", _batches(1), floor_db=math.nan)


@pytest.mark.parametrize("batch", ["tokens", "one", "float targets", "short targets"])
def test_check_refuses_a_batch_that_is_not_a_pair_of_token_tensors(batch):
    tokens, targets = _batches(1)[0]
    bad = {"tokens": tokens, "one": (tokens,), "float targets": (tokens, targets.float()),
           "short targets": (tokens, targets[:, :-1])}[batch]
    # a bare (2, T) tensor of tokens used to unpack into two rows taken for (tokens, targets)
    with pytest.raises(TypeError, match=r"^batches\[1\]: expected a pair \(tokens, targets\) of integer tensors"):
        check(Toy(), "fp8-current", [(tokens, targets), bad])


@pytest.mark.usefixtures("native_small_rule")
def test_check_measures_the_small_layers_a_native_device_keeps_for_speed():
    # where fp8-current runs natively the default policy keeps both 64/128-wide layers in BF16: the check
    # measured nothing and flagged nothing
    assert lowprec.convert(Toy(), "fp8-current").coverage().converted == 0
    report = check(Toy(), "fp8-current", _batches(1), floor_db=0.0)
    assert [lc.name for lc in report.layers] == ["up", "down"]
    # up and down hold 8,320 + 8,256 of the 18,656 parameters (the head, 2,080, is kept by the policy)
    assert str(report.coverage) == "2 of 3 linears converted (88% of linear parameters)"
    assert "2 of 3 linears converted (88% of linear parameters); 0 of 2 converted layers" in report.summary()
    # the suggestion is for training: the policy given (the default), which keeps the GPU's speed rule
    assert report.policy == Policy()
    # a policy's own skip_small wins
    assert check(Toy(), "fp8-current", _batches(1), policy=Policy(skip_small=True)).layers == []


def test_moe_experts_are_measured_whole_on_their_routed_rows():
    """A ``GroupedLinear``'s figure: all its experts' outputs on the rows the converted model routed to
    them, against the BF16 experts fed the same rows and offsets (a hand computation with hooks)."""
    from lowprec.nn import GroupedLinear
    from lowprec.train.model import PRESETS, build_model

    model = build_model(PRESETS["moe-tiny"], seed=1)
    tokens = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(9))
    report = check(model, "fp8-current", [(tokens, torch.zeros_like(tokens))])
    rows = {lc.name: lc for lc in report.layers}
    name = "layers.1.feed_forward.experts.w2"
    assert rows[name].shape == "8 experts x 128x128"
    # by hand: the converted experts' input and offsets, and the BF16 experts run on them
    converted = build_model(PRESETS["moe-tiny"], seed=1).eval()
    lowprec.convert(converted, "fp8-current", quality_policy(Policy()))
    caught = []
    layer = dict(converted.named_modules())[name]
    handle = layer.register_forward_hook(lambda m, args, out: caught.append((args, out)))
    with torch.no_grad():
        converted(tokens)
    handle.remove()
    (x, offsets), out = caught[0]
    ref = GroupedLinear(8, 128, 128, recipe="bf16")
    with torch.no_grad():
        ref.weight.copy_(layer.weight)
        want = ref.eval()(x, offsets)
    assert rows[name].sqnr_db == pytest.approx(_sqnr([want], [out]), abs=1e-9)
    assert 20 < rows[name].sqnr_db < 40  # FP8's range
