"""Telemetry per expert of a ``GroupedLinear`` (see [Note: telemetry per expert] in
``lowprec.telemetry.experts``): each expert's casts under a name of its own, its own figures, the
experts x layers heatmap, and a suggested policy that names the grouped layer."""
from __future__ import annotations

import math

import torch
from click.testing import CliRunner

import lowprec
from lowprec import telemetry as T
from lowprec.cli import main
from lowprec.policy_file import load_policy
from lowprec.quant import quantize, tensorwise
from lowprec.telemetry.experts import expert_name, split_expert
from lowprec.telemetry.report import expert_grid, grid
from lowprec.telemetry.trouble import rank_layers, suggest_policy
from tests.nn.common import randn
from tests.telemetry.test_inspect import _rec, _write

E, IN, OUT = 3, 64, 32
COUNTS = (5, 0, 11)  # the second expert gets no token


class _Experts(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.experts = lowprec.nn.GroupedLinear(E, IN, OUT, recipe="fp8-current")

    def forward(self, x, offsets):
        return self.experts(x, offsets)


def test_names_split_back_and_never_read_as_a_glob():
    assert expert_name("layers.0.moe.w1", 12) == "layers.0.moe.w1#expert12"
    assert split_expert("layers.0.moe.w1#expert12") == ("layers.0.moe.w1", 12)
    assert split_expert("layers.0.attn.q") == ("layers.0.attn.q", None)
    assert split_expert("odd#expertX") == ("odd#expertX", None)


def test_each_expert_with_tokens_reports_its_own_operands_figures():
    torch.manual_seed(0)
    model = _Experts()
    x = randn(sum(COUNTS), IN, seed=1, scale=2.0).requires_grad_()
    offsets = torch.tensor(COUNTS).cumsum(0)
    dy = randn(sum(COUNTS), OUT, seed=2, scale=1e-3)
    with T.sample(model, step=4) as t:
        model(x, offsets).backward(dy)
    got = {(r.layer, r.gemm, r.operand): r for r in t.records}
    names = {expert_name("experts", e) for e in (0, 2)}
    assert {layer for layer, *_ in got} == names  # the expert without tokens cast nothing
    start = 0
    for e, n in enumerate(COUNTS):
        if n == 0:
            continue
        rows = slice(start, start + n)
        start += n
        w = model.experts.weight[e].detach()
        want = {("fprop", "input"): (x[rows].detach(), "e4m3"), ("wgrad", "input"): (x[rows].detach().t(), "e4m3"),
                ("fprop", "weight"): (w, "e4m3"), ("dgrad", "weight"): (w.t(), "e4m3"),
                ("dgrad", "grad_output"): (dy[rows], "e5m2"), ("wgrad", "grad_output"): (dy[rows].t(), "e5m2")}
        for (gemm, operand), (hp, fmt) in want.items():
            name = expert_name("experts", e)
            ref = T.operand_stats(hp, quantize(hp, fmt, tensorwise()), layer=name, gemm=gemm, operand=operand, step=4)
            assert got[(name, gemm, operand)] == ref


def test_inspect_draws_experts_by_layer_and_suggests_the_grouped_layer(tmp_path):
    records = [_rec("attn", 1, 30.0), _rec(expert_name("moe.w1", 0), 1, 29.0),
               _rec(expert_name("moe.w1", 1), 1, 27.0, saturation=0.2), _rec(expert_name("moe.w1", 1), 2, 25.0),
               _rec(expert_name("moe.w2", 0), 2, math.inf)]
    layers, steps, rows = grid(records, "sqnr_db", min)
    assert (layers, steps) == (["attn", "moe.w1", "moe.w2"], [1, 2])
    assert rows[1] == [27.0, 25.0]  # the experts' worst at each step
    layers, experts, rows = expert_grid(records, "sqnr_db", min)
    assert (layers, experts) == (["moe.w1", "moe.w2"], [0, 1])
    assert rows[0] == [29.0, 25.0] and math.isnan(rows[1][0]) and math.isnan(rows[1][1])  # exact; no record
    ranked = rank_layers(records)
    assert ranked[0].layer == expert_name("moe.w1", 1)  # ranked as its own layer
    assert suggest_policy(ranked).exclude == ("moe.w1",)  # the policy keeps the GroupedLinear whole
    _write(tmp_path, records)
    result = CliRunner().invoke(main, ["inspect", str(tmp_path)])
    assert result.exit_code == 0, result.output
    page = (tmp_path / "inspect.html").read_text()
    assert "Experts x layers" in page and (tmp_path / "inspect_experts_sqnr.png").read_bytes()[:4] == b"\x89PNG"
    assert load_policy(tmp_path / "suggested_policy.json").exclude == ("moe.w1",)
