"""``lowprec plan`` and ``lowprec info`` through the command line."""
from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from lowprec.cli import main
from lowprec.plan.layers import count_params
from lowprec.plan.models import PRESETS


def _run(*args: str):
    return CliRunner().invoke(main, list(args))


def test_plan_table_shows_components_fit_and_time():
    r = _run("plan", "--model", "llama-3-70b", "--recipe", "fp8-current", "--gpu", "h200", "--gpus", "64",
             "--tp", "8", "--zero", "3", "--tokens", "15e12", "--price-per-gpu-hour", "2.5")
    assert r.exit_code == 0, r.output
    for text in ("weights (bf16)", "weight casts (fp8-current), one layer at a time", "master weights (fp32)",
                 "optimizer moments (adamw)", "activations: attention", "overhead", "fits:",
                 "fewest GPUs that fit", "tokens/s on 64 GPUs", "days", "cost"):
        assert text in r.output


def test_plan_json_carries_formulas_and_matches_the_textbook():
    r = _run("plan", "--model", "llama-3-70b", "--recipe", "bf16", "--gpu", "h100", "--json")
    assert r.exit_code == 0, r.output
    data = json.loads(r.output)
    parts = {c["name"]: c for c in data["memory"]["components"]}
    p = count_params(PRESETS["llama-3-70b"]).total
    assert parts["weights (bf16)"]["bytes"] == 2 * p and parts["weights (bf16)"]["formula"].startswith("2 B x")
    assert all(c["formula"] for c in data["memory"]["components"] if c["bytes"])
    assert data["memory"]["fits"] is False and data["memory"]["fewest_gpus"] is None  # 1.1 TB, no sharding
    assert data["parallel"]["gpus"] == 1 and data["throughput"]["days"] is None
    assert {f["gemm"] for f in data["flops"]} == {"bf16"}


def test_plan_with_grad_accumulation_holds_every_layers_weight_casts():
    args = ("plan", "--model", "llama-2-7b", "--recipe", "fp8-current", "--gpus", "8", "--seq", "2048", "--json")
    one = {c["name"]: c["bytes"] for c in json.loads(_run(*args).output)["memory"]["components"]}
    data = json.loads(_run(*args, "--grad-accum", "4").output)
    held = {c["name"]: c["bytes"] for c in data["memory"]["components"]}
    # 32 layers of q, k, v, o (4096 x 4096) and gate, up, down (4096 x 11008): 1 byte each + one FP32
    # scale per weight, forward and transposed; without accumulation only the largest weight's pair
    numel = 32 * (4 * 4096 * 4096 + 3 * 4096 * 11008)
    assert held["low-precision weight copy (fp8-current)"] == pytest.approx(numel + 4 * 32 * 7, rel=1e-12)
    assert held["transposed weight copy (fp8-current)"] == pytest.approx(numel + 4 * 32 * 7, rel=1e-12)
    assert one["weight casts (fp8-current), one layer at a time"] == pytest.approx(2 * (4096 * 11008 + 4), rel=1e-12)
    assert data["training"]["grad_accum"] == 4 and data["throughput"]["tokens_per_step"] == 2048 * 8 * 4


def test_plan_defaults_to_the_fewest_gpus_that_fit():
    data = json.loads(_run("plan", "--model", "llama-3-8b", "--gpu", "h100", "--zero", "3", "--json").output)
    assert data["parallel"]["gpus"] == data["memory"]["fewest_gpus"] and data["memory"]["fits"]


def test_plan_reads_a_hugging_face_config(tmp_path):
    cfg = {"hidden_size": 4096, "intermediate_size": 11008, "num_attention_heads": 32, "num_hidden_layers": 32,
           "vocab_size": 32000}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    data = json.loads(_run("plan", "--model", str(tmp_path), "--json").output)
    assert data["model"]["params"] == 6_738_415_616


@pytest.mark.parametrize("args, message", [
    (["--gpu", "h300"], "Error: gpu: expected one of a100"),
    (["--model", "llama-9"], "Error: model: expected one of"),
    (["--tp", "3"], "Error: tp: expected a divisor of the 64 attention heads of llama-3-70b, got 3"),
    (["--tokens", "-1"], "Error: tokens: expected a positive finite number, got -1.0"),
    (["--recipe", "fp3"], "Error: recipe: expected one of"),
    (["--recompute", "half"], "Error: recompute: expected one of 'none', 'selective', 'full', got 'half'"),
    (["--grad-accum", "0"], "Error: grad_accum: expected a positive int, got 0"),
])
def test_plan_bad_input_is_one_clear_line(args, message):
    base = {"--model": "llama-3-70b"}
    for flag, value in zip(args[::2], args[1::2]):
        base[flag] = value
    r = _run("plan", *[x for kv in base.items() for x in kv])
    assert r.exit_code == 1
    assert message in r.output and "Traceback" not in r.output


def test_plan_unknown_recipe_names_the_presets_in_one_line():
    r = _run("plan", "--model", "llama-3-8b", "--recipe", "nosuch")
    assert r.exit_code == 1
    lines = r.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("Error: recipe: expected one of bf16, fp16, ")
    assert "mxfp4" in lines[0] and lines[0].endswith("got 'nosuch'")


def test_plan_lists_gpus_and_models_without_a_model():
    gpus = _run("plan", "--list-gpus")
    assert gpus.exit_code == 0 and "mi355x" in gpus.output and "datasheet" in gpus.output
    models = _run("plan", "--list-models")
    assert models.exit_code == 0 and "deepseek-v3" in models.output and "ref-1b" in models.output


def test_info_lists_the_cpu_and_versions():
    r = _run("info")
    assert r.exit_code == 0, r.output
    assert "none: every format emulated" in r.output and "torch" in r.output
    data = json.loads(_run("info", "--json").output)
    assert data["devices"][0]["device"] == "cpu"
    assert {row["library"] for row in data["libraries"]} >= {"python", "torch", "numpy", "lowprec"}


def test_info_describes_a_cuda_device_and_the_path_each_gemm_takes_there(fake_cuda):
    fake_cuda(("NVIDIA H100 80GB HBM3", (9, 0), 85.0))
    r = _run("info", "--json")
    assert r.exit_code == 0, r.output
    data = json.loads(r.output)
    gpu = data["devices"][1]
    assert (gpu["device"], gpu["capability"], gpu["memory GB"]) == ("cuda:0", "sm90", 85.0)
    assert gpu["native"] == "fp16, bf16, tf32, fp8 per tensor, fp8 per row, fp8 1x128 blocks"
    paths = {(p["device"], p["recipe"]): (p["fprop"], p["dgrad"], p["wgrad"]) for p in data["recipe paths"]}
    # Hopper: FP8 (per tensor, per row, DeepSeek blocks) on its tensor cores; MX folded to row scales on them;
    # NVFP4 emulated through BF16 GEMMs; the CPU emulates all, in FP32
    assert paths["cuda:0", "fp8-blockwise"] == ("native",) * 3
    assert paths["cuda:0", "mxfp8"] == ("folded (fp8, unchecked)",) * 3  # its first-use check has not run
    assert paths["cuda:0", "nvfp4"] == ("emulated (bf16)",) * 3
    assert paths["cpu", "fp8-current"] == ("emulated (fp32)",) * 3 and paths["cuda:0", "bf16"] == ("hp",) * 3


def test_info_says_whether_a_self_checking_path_passed_its_check_on_each_gpu(fake_cuda, monkeypatch):
    from lowprec.kernels import blackwell as BW
    from lowprec.kernels import fold as FD
    from lowprec.kernels import grouped_gemm as GG

    fake_cuda(("NVIDIA H100 80GB HBM3", (9, 0), 85.0), ("NVIDIA B200", (10, 0), 180.0))
    monkeypatch.setattr(FD.CHECK, "_done", {})
    monkeypatch.setattr(BW.CHECK, "_done", {})
    monkeypatch.setattr(GG, "_CHECKED", {})  # --check runs the experts' checks too: none kept past this test

    def paths():
        data = json.loads(_run("info", "--json").output)
        return {(p["device"], p["recipe"]): (p["fprop"], p["dgrad"]) for p in data["recipe paths"]}

    before = paths()
    assert before["cuda:0", "mxfp8"] == ("folded (fp8, unchecked)",) * 2
    assert before["cuda:1", "nvfp4"] == ("native (unchecked)",) * 2
    assert before["cuda:0", "fp8-current"] == ("native",) * 2 and before["cpu", "mxfp8"] == ("emulated (fp32)",) * 2
    monkeypatch.setattr(FD.CHECK, "run", lambda device, gemm, emulated: True)
    monkeypatch.setattr(BW.CHECK, "run", lambda device, gemm, emulated: device.index != 1)
    monkeypatch.setattr("lowprec.kernels.grouped_gemm._self_check", lambda kind, device, on_torch: True)
    monkeypatch.setattr("lowprec.kernels.grouped_gemm._self_check_blocked", lambda kind, device: True)
    assert _run("info", "--check").exit_code == 0
    after = paths()
    assert after["cuda:0", "mxfp4"] == ("folded (fp8, checked on this device)",) * 2
    assert after["cuda:1", "mxfp8"] == ("native (failed its check)",) * 2


def test_the_cost_is_in_dollars_at_the_price_per_gpu_hour():
    args = ["plan", "--model", "llama-3-8b", "--gpu", "h100", "--gpus", "8", "--zero", "3", "--tokens", "1e12",
            "--price-per-gpu-hour", "2.5"]
    data = json.loads(_run(*args, "--json").output)["throughput"]
    assert data["currency"] == "USD" and data["price_per_gpu_hour"] == 2.5
    assert data["cost"] == pytest.approx(data["gpu_hours"] * 2.5, rel=1e-12)
    last = _run(*args).output.strip().splitlines()[-1]
    assert last.endswith(f", {data['gpu_hours']:,.0f} GPU-hours, cost ${data['cost']:,.0f} (at $2.50 per GPU-hour)")
    no_price = _run(*args[:-2]).output.strip().splitlines()[-1]
    assert no_price.endswith("GPU-hours") and "$" not in no_price


def test_info_lists_the_experts_grouped_gemms_and_their_checks(fake_cuda, monkeypatch):
    """Each GPU of sm90 or newer lists PyTorch's grouped kernel (E4M3 pairs), lowprec's Triton one (E5M2
    gradients) and lowprec's blocked one (fp8-blockwise), each kind unchecked until ``--check`` runs the
    first-use checks; an older GPU and the CPU say the experts' GEMMs run one per expert."""
    from lowprec.kernels import grouped_gemm as GG

    fake_cuda(("NVIDIA H100 80GB HBM3", (9, 0), 85.0), ("NVIDIA A100", (8, 0), 80.0))
    monkeypatch.setattr(GG, "_CHECKED", {})
    monkeypatch.setattr(GG, "_triton_runs", lambda device: True)

    def rows():
        data = json.loads(_run("info", "--json").output)
        return {(r["device"], r["grouped kernel"], r["kind"]): r["state"] for r in data["expert GEMMs"]}

    before = rows()
    assert before == {("cpu", "none: one GEMM per expert", "-"): "-", ("cuda:1", "none: one GEMM per expert", "-"): "-",
                      **{("cuda:0", k, kind): "unchecked" for k in ("torch._scaled_grouped_mm", "lowprec Triton",
                                                                    "lowprec Triton, block scales")
                         for kind in ("rows", "features")}}
    from lowprec.kernels import blackwell as BW
    from lowprec.kernels import fold as FD

    for check in (FD.CHECK, BW.CHECK):  # the dense paths' own checks, covered above
        monkeypatch.setattr(check, "_done", {})
        monkeypatch.setattr(check, "run", lambda device, gemm, emulated: True)
    ran = []
    monkeypatch.setattr(GG, "_self_check", lambda kind, device, on_torch: ran.append((kind, on_torch)) or
                        not (kind == "features" and not on_torch))
    monkeypatch.setattr(GG, "_self_check_blocked", lambda kind, device: ran.append((kind, "blocked")) or kind == "rows")
    assert _run("info", "--check").exit_code == 0
    after = rows()
    assert sorted(ran, key=str) == sorted([(k, d) for d in (True, False, "blocked") for k in ("rows", "features")],
                                          key=str)
    assert after["cuda:0", "lowprec Triton, block scales", "rows"] == "checked on this device"
    assert after["cuda:0", "lowprec Triton, block scales", "features"] == "failed its check"
    assert after["cuda:0", "lowprec Triton", "features"] == "failed its check"
    assert after["cuda:0", "torch._scaled_grouped_mm", "rows"] == "checked on this device"


def test_info_lists_the_experts_nvfp4_cast_and_its_check(fake_cuda, monkeypatch):
    """A GPU that runs Triton casts NVFP4 experts in one Triton pass, unchecked until ``--check`` (or first use)
    runs its check; the CPU says the reference's operations."""
    pytest.importorskip("triton")
    from lowprec.kernels import capability as cap
    from lowprec.kernels import triton_quant

    fake_cuda(("NVIDIA H100 80GB HBM3", (9, 0), 85.0))
    monkeypatch.setattr(triton_quant, "_LINES_CHECKED", {})
    monkeypatch.setattr(cap, "triton_available", lambda: True, raising=False)

    def rows():
        data = json.loads(_run("info", "--json").output)
        return {r["device"]: (r["kernel"], r["state"]) for r in data["expert casts"]}

    before = rows()
    assert before["cpu"] == ("reference operations", "-")
    if before["cuda:0"][0] == "reference operations":
        pytest.skip("the fake GPU does not run Triton here")
    assert before["cuda:0"] == ("lowprec Triton, a global scale per expert", "unchecked")
    from lowprec.cli import info_cmd
    from lowprec.kernels import grouped_gemm as GG

    monkeypatch.setattr(info_cmd, "check_paths", lambda dev: None)  # the GEMM paths' checks: tested above
    monkeypatch.setattr(GG, "check_kernels", lambda dev: None)
    ran = []
    monkeypatch.setattr(triton_quant, "_check_lines", lambda device: ran.append(device) or False)
    assert _run("info", "--check").exit_code == 0
    assert [str(d) for d in ran] == ["cuda:0"]
    assert rows()["cuda:0"] == ("lowprec Triton, a global scale per expert", "failed its check")


def test_plan_sets_several_recipes_side_by_side():
    """``--recipe a,b,c``: each recipe planned in the same layout, its memory and speed against the first's,
    the same figures as planning each alone."""
    args = ["plan", "--model", "llama-3-8b", "--gpu", "h200", "--gpus", "8", "--zero", "1", "--tokens", "1e12"]
    r = _run(*args, "--recipe", "bf16,fp8-current,mxfp8")
    assert r.exit_code == 0, r.output
    rows = {line.split()[0]: line.split() for line in r.output.splitlines()
            if line.split() and line.split()[0] in ("bf16", "fp8-current", "mxfp8")}
    assert set(rows) == {"bf16", "fp8-current", "mxfp8"} and rows["bf16"][2] == "1.00x"
    alone = {name: json.loads(_run(*args, "--recipe", name, "--json").output)["throughput"]["tokens_per_s"]
             for name in rows}
    for name, row in rows.items():
        assert row[5] == f"{alone[name]:,.0f}"
        assert row[6] == f"{alone[name] / alone['bf16']:.2f}x"
    assert "measured on the H200" in r.output
    many = json.loads(_run(*args, "--recipe", "bf16,fp8-current", "--json").output)
    assert [p["recipe"]["name"] for p in many] == ["bf16", "fp8-current"]
    bad = _run(*args, "--recipe", "bf16,fp3")
    assert bad.exit_code != 0 and "recipe: expected one of bf16" in bad.output
